"""The serving table a CPU user looks at: llama.cpp's `llama-server` beside `dspark serve`.

Every server runs alone on the machine (started here, stopped before the next one starts) and
is driven by the same client, `dspark bench serving --endpoint URL` (closed-loop streaming chat
requests, the first prompts of humaneval, gsm8k and mt-bench in turn, greedy). The systems run
in turn, the order reversed every other round, `--rounds` times; each cell is the median over
rounds. Before its timed runs each server answers a few untimed requests (first-request costs:
kernels for new shapes, the auto policy's one-time measurement, which is cached per machine).
Our servers write every engine step to <compare>/serving-logs/<system>-round<N>.steps.jsonl
(`dspark serve --step-log`).

Systems (`--systems`, comma list):
  llama-bf16          llama-server on a BF16 GGUF of the weights we serve (llama.cpp's converter)
  llama-q4_1          llama-server on the bundled Q4_1 GGUF (the file our target is dequantized from)
  llama-bf16+dspark   llama-server BF16 with our DSpark drafter (DeepSpec export, --spec-type draft-dspark)
  dspark-plain        dspark serve --drafter plain
  dspark              dspark serve (the default drafter and policy)
  vllm                vLLM's CPU build (`make vllm`: .venv-vllm) on the bundled target's Hugging Face
                      folder, bf16, plain decoding (its CPU wheel does not run DSpark: scripts/vllm_compare.py)

    make llama-server
    python scripts/llama_spec_compare.py --dtype bf16   # writes the BF16 GGUF files this script reuses
    python scripts/serving_table.py --json > serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import default_root  # noqa: E402
from llama_spec_compare import SPEC_FLAGS, free_port, server_process  # noqa: E402

SYSTEMS = ("llama-bf16", "llama-q4_1", "llama-bf16+dspark", "dspark-plain", "dspark", "vllm")
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def server_command(system: str, port: int, threads: int, compare_dir: Path, bin_dir: Path) -> list[str]:
    if system.startswith("llama-"):
        from dspark.runtime.loading import bundled_gguf
        model = bundled_gguf("smollm2-135m-instruct") if system == "llama-q4_1" else compare_dir / "target-bf16.gguf"
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-np", "16", "-c", "32768",
               "--host", "127.0.0.1", "--port", str(port)]
        if system.endswith("+dspark"):
            cmd += ["-md", str(compare_dir / "dspark-deepspec-bf16.gguf"), *SPEC_FLAGS]
        return cmd
    if system == "vllm":
        from llama_convert import target_hf_folder
        return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_hf_folder(None)),
                "--served-model-name", "smollm2-135m-instruct", "--dtype", "bfloat16", "--max-model-len", "4096",
                "--host", "127.0.0.1", "--port", str(port)]
    dspark = str(Path(sys.executable).parent / "dspark")
    # compiled graphs built before it answers: the table times the server as it runs, not its start-up
    cmd = [dspark, "serve", "--threads", str(threads), "--host", "127.0.0.1", "--port", str(port), "--wait-for-graphs"]
    if system == "dspark-plain":
        cmd += ["--drafter", "plain"]
    return cmd


def bench(url: str, concurrency: str, num_prompts: int, max_new_tokens: int,
          datasets: str = "humaneval,gsm8k,mt-bench") -> list[dict]:
    """`dspark bench serving` against the endpoint: distinct prompts at every level."""
    dspark = str(Path(sys.executable).parent / "dspark")
    cmd = [dspark, "bench", "serving", "--endpoint", url + "/v1", "--concurrency", concurrency, "--datasets", datasets,
           "--num-prompts", str(num_prompts), "--max-new-tokens", str(max_new_tokens), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"]


def run_system(system: str, args, compare_dir: Path, bin_dir: Path, log_dir: Path,
               rnd: int = 0) -> tuple[str, list[dict]]:
    port = free_port()
    cmd = server_command(system, port, args.threads, compare_dir, bin_dir)
    log = log_dir / f"{system}.log"
    if system.startswith("dspark"):     # every engine step, to read what the policy decided
        steps = log_dir / f"{system}-round{rnd + 1}.steps.jsonl"
        steps.unlink(missing_ok=True)
        cmd += ["--step-log", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if system == "vllm":        # its CPU workers bind to these cores; its KV cache in GiB
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, log, env):
        bench(url, "2", 4, 16, datasets="mbpp")     # untimed warm-up, on prompts the table never sends
        return shlex.join(cmd), bench(url, args.concurrency, args.num_prompts, args.max_new_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--root", type=Path, default=None, help="llama.cpp's build root (default: make llama-server's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    root = args.root or default_root()
    bin_dir, compare_dir = root / "build" / "bin", root / "compare"
    if "vllm" in systems and not VLLM_PYTHON.exists():
        print(f"no vLLM at {VLLM_PYTHON}: run `make vllm`", file=sys.stderr)
        return 2
    if any(s.startswith("llama-") for s in systems):
        missing = [p for p in (bin_dir / "llama-server", compare_dir / "target-bf16.gguf",
                               compare_dir / "dspark-deepspec-bf16.gguf") if not p.exists()]
        if missing:
            print(f"missing {missing[0]}: run `make llama-server`, then scripts/llama_spec_compare.py", file=sys.stderr)
            return 2
    log_dir = compare_dir / "serving-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    commands: dict[str, str] = {}
    for rnd in range(args.rounds):
        for s in (systems if rnd % 2 == 0 else systems[::-1]):
            commands[s], res = run_system(s, args, compare_dir, bin_dir, log_dir, rnd)
            runs[s].append(res)
            print(f"round {rnd + 1} {s}: " + ", ".join(f"c={r['concurrency']} {r['total_tokens_per_second']:.1f} tok/s"
                                                       for r in res), file=sys.stderr)
    table = []
    for s in systems:
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            cells = [run[i] for run in runs[s]]
            table.append({"system": s, "concurrency": c,
                          "total_tokens_per_second": statistics.median(r["total_tokens_per_second"] for r in cells),
                          "per_user_tokens_per_second": statistics.median(r["per_user_tokens_per_second"] for r in cells),
                          "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in cells),
                          "runs": [round(r["total_tokens_per_second"], 1) for r in cells]})
    levels = args.concurrency.split(",")
    print("| server | " + " | ".join(f"c={c} tok/s" for c in levels) + f" | TTFT p50 at {levels[-1]} |", file=sys.stderr)
    for s in systems:
        rows = [r for r in table if r["system"] == s]
        print(f"| {s} | " + " | ".join(f"{r['total_tokens_per_second']:.1f}" for r in rows)
              + f" | {rows[-1]['ttft_p50_ms']:.0f} ms |", file=sys.stderr)
    if args.json:
        print(json.dumps({"commands": commands, "table": table, "rounds": args.rounds,
                          "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
