"""The CPU allocator settings: applied once on Linux/glibc, left alone on request."""

import subprocess
import sys

import pytest

CODE = "from dspark.runtime.allocator import tune_allocator as t; print(t(), t())"


def _run(env_extra):
    import os
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_applied_once_and_opt_out():
    assert _run({}) == ["True", "True"]
    assert _run({"DSPARK_MALLOC": "default"}) == ["False", "False"]
