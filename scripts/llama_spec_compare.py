"""llama.cpp's own DSpark runs our drafter: accepted per drafted token, llama.cpp against our engine.

The committed DSpark drafter is exported in DeepSpec's layout (`dspark export --format deepspec`),
converted by llama.cpp's `convert_hf_to_gguf.py` (unmodified, `--target-model-dir` the bundled
target's Hugging Face folder), and served by `llama-server` with the bundled target as a GGUF of
the weights we serve (converted by the same script), both files in the dtype of `--dtype`, greedy,
`--spec-type draft-dspark --spec-draft-n-max 7 --spec-draft-p-min 0`. Each prompt goes to the
server as token ids (our tokenizer's chat template, so both sides decode the same ids) with
`return_tokens`; the server's `timings.draft_n` / `draft_n_accepted` are llama.cpp's `n_drafted` /
`n_accept`. Our engine runs the same ids with the same drafter in the same dtype, the whole block of
7 verified every step (`--policy fixed`), greedy; its counters are `num_draft_tokens` /
`num_accepted_tokens`. Reported per benchmark: both ratios and theirs / ours; and, not a target,
how many of llama.cpp's speculative outputs equal its own plain decoding (the same server without
the drafter) and how many equal ours. In fp32 the two sides write the same answers, so the
ratio compares the drafters on the same text; in bf16 their rounding parts the answers.

    make llama-server                       # builds llama.cpp 11434 under the dspark cache
    pip install -e '.[interop]'             # gguf, sentencepiece (the converter)
    python scripts/llama_spec_compare.py --dtype fp32 --json > compare.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_convert import target_hf_folder  # noqa: E402
from llama_cpp_build import default_root, source_dir  # noqa: E402

SPEC_FLAGS = ["--spec-type", "draft-dspark", "--spec-draft-n-max", "7", "--spec-draft-p-min", "0"]


def run_converter(src: Path, folder: Path, out: Path, outtype: str, target_dir: Path | None = None) -> str:
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
           "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    if not out.exists():
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: the converter refused {folder}: "
                             + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]))
    return " ".join(cmd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 600) -> None:
    end = time.time() + limit_s
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the server did not come up in {limit_s:.0f} s; see {log}")


@contextmanager
def server_process(cmd: list[str], url: str, log: Path, env: dict | None = None):
    """A server for the block's length: answering /health on entry, stopped on exit; output to ``log``."""
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        wait_up(url, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def llama_server(bin_dir: Path, model: Path, extra: list[str], threads: int, log: Path):
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    url = f"http://127.0.0.1:{port}"
    log.unlink(missing_ok=True)
    with server_process(cmd, url, log):
        yield url, " ".join(cmd)


def complete(url: str, ids: list[int], max_new_tokens: int) -> dict:
    body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "cache_prompt": False,
            "return_tokens": True, "seed": 0}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    t = out.get("timings", {})
    return {"tokens": list(out.get("tokens") or []), "drafted": int(t.get("draft_n", 0)),
            "accepted": int(t.get("draft_n_accepted", 0))}


def ours(prompts: dict[str, list[list[int]]], drafter_name: str, max_new_tokens: int, threads: int,
         dtype: str) -> dict:
    """Our engine: the same ids, the whole block verified every step, greedy."""
    import torch

    from dspark.drafters import load_drafter
    from dspark.engine import Engine
    from dspark.runtime.loading import load_target
    from dspark.sampling import SamplingParams
    from dspark.scheduling.policies import make_policy

    torch.set_num_threads(threads)
    target = load_target(None, dtype=dtype)
    drafter = load_drafter(drafter_name, target)
    block = drafter.block_size
    res: dict = {}
    for name, ids_list in prompts.items():
        rows = []
        for ids in ids_list:
            engine = Engine(target.model, drafter, make_policy("fixed", block), max_requests=1,
                            max_len=len(ids) + max_new_tokens + block + 2, block_size=block,
                            eos_ids=target.eos_token_ids)
            drafter.reset()
            r = engine.add_request(ids, SamplingParams(temperature=0.0), max_new_tokens)
            while not r.done:
                engine.step()
            rows.append({"tokens": list(r.output_ids), "drafted": r.stats.num_draft_tokens,
                         "accepted": r.stats.num_accepted_tokens})
        res[name] = rows
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=None, help="llama.cpp's build root (default: make llama-server's)")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="the target on both sides: a BF16 or F32 GGUF for llama.cpp, our runtime's dtype")
    ap.add_argument("--out", type=Path, default=None, help="GGUF files and logs (default: <root>/compare)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from dspark.api import encode_prompt
    from dspark.data import load_prompts
    from dspark.interop.export import export_drafter
    from dspark.runtime.loading import load_target

    root = args.root or default_root()
    src, bin_dir = source_dir(root), root / "build" / "bin"
    if not (bin_dir / "llama-server").exists():
        print(f"no llama-server under {bin_dir}: run `make llama-server`", file=sys.stderr)
        return 2
    out = args.out or root / "compare"
    out.mkdir(parents=True, exist_ok=True)
    hf = target_hf_folder(None)
    outtype = {"bf16": "bf16", "fp32": "f32"}[args.dtype]
    target_gguf = out / f"target-{outtype}.gguf"
    target_cmd = run_converter(src, hf, target_gguf, outtype)
    export_dir = out / f"{args.drafter}-deepspec"
    rep = export_drafter(args.drafter, "deepspec", export_dir)
    # the drafter in the target's dtype on both sides (our engine runs it in the target's dtype)
    draft_gguf = out / f"{args.drafter}-deepspec-{outtype}.gguf"
    if draft_gguf.exists():
        draft_gguf.unlink()
    draft_cmd = run_converter(src, export_dir, draft_gguf, outtype, target_dir=hf)

    tok = load_target(None, dtype=args.dtype).tokenizer
    prompts = {d: [encode_prompt(tok, p, chat=True) for p in load_prompts(d, args.num_prompts)]
               for d in args.datasets.split(",")}
    theirs: dict = {}
    plain: dict = {}
    with llama_server(bin_dir, target_gguf, ["-md", str(draft_gguf), *SPEC_FLAGS], args.threads,
                      out / "llama-server-spec.log") as (url, spec_cmd):
        for d, ids_list in prompts.items():
            theirs[d] = [complete(url, ids, args.max_new_tokens) for ids in ids_list]
    with llama_server(bin_dir, target_gguf, [], args.threads, out / "llama-server-plain.log") as (url, plain_cmd):
        for d, ids_list in prompts.items():
            plain[d] = [complete(url, ids, args.max_new_tokens) for ids in ids_list]
    mine = ours(prompts, args.drafter, args.max_new_tokens, args.threads, args.dtype)

    rows = []
    for d in prompts:
        t_dr, t_ac = sum(r["drafted"] for r in theirs[d]), sum(r["accepted"] for r in theirs[d])
        o_dr, o_ac = sum(r["drafted"] for r in mine[d]), sum(r["accepted"] for r in mine[d])
        lt, lo = t_ac / max(t_dr, 1), o_ac / max(o_dr, 1)
        rows.append({"benchmark": d, "prompts": len(prompts[d]),
                     "llama_cpp": {"n_drafted": t_dr, "n_accept": t_ac, "accept_per_drafted": lt},
                     "ours": {"num_draft_tokens": o_dr, "num_accepted_tokens": o_ac, "accept_per_drafted": lo},
                     "ratio": lt / lo if lo else None,
                     "llama_spec_equals_llama_plain": sum(a["tokens"] == b["tokens"] for a, b in zip(theirs[d], plain[d])),
                     "llama_spec_equals_ours": sum(a["tokens"] == b["tokens"] for a, b in zip(theirs[d], mine[d])),
                     "llama_plain_equals_ours": sum(a["tokens"] == b["tokens"] for a, b in zip(plain[d], mine[d])),
                     # per prompt: (drafted, accepted) on each side, and whether the two outputs are equal
                     "per_prompt": [{"llama_cpp": [a["drafted"], a["accepted"]], "ours": [b["drafted"], b["accepted"]],
                                     "same_output": a["tokens"] == b["tokens"], "tokens": [len(a["tokens"]), len(b["tokens"])]}
                                    for a, b in zip(theirs[d], mine[d])]})
    result = {"drafter": args.drafter, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "export_inexact": rep.inexact, "target_gguf_command": target_cmd, "drafter_gguf_command": draft_cmd,
              "llama_server_spec": spec_cmd, "llama_server_plain": plain_cmd, "rows": rows}
    print(f"{'benchmark':<10} {'llama.cpp':>10} {'ours':>8} {'ratio':>6}  llama spec==plain  ==ours", file=sys.stderr)
    for r in rows:
        print(f"{r['benchmark']:<10} {r['llama_cpp']['accept_per_drafted']:>10.3f} {r['ours']['accept_per_drafted']:>8.3f} "
              f"{r['ratio'] or 0:>6.3f}  {r['llama_spec_equals_llama_plain']}/{r['prompts']}"
              f"{'':>13}{r['llama_spec_equals_ours']}/{r['prompts']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
