"""``dspark simulate``'s command-line flags (kept apart from run.py, so that building the
command line imports nothing heavy)."""

from __future__ import annotations

import argparse


def _rates(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0, got {s!r}")
    return vals


def add_parser(sub, cli) -> None:
    """``dspark simulate``'s flags (``cli``: the cli module, for its argument types)."""
    int_list, positive_int, non_negative_int = cli._int_list, cli._positive_int, cli._non_negative_int
    p = sub.add_parser("simulate", help="predict a deployment's throughput / per-user speed frontier per policy "
                                        "from step costs and a drafter's acceptance (--validate: against this machine)")
    where = p.add_argument_group("step costs (one of)")
    where.add_argument("--cost-table", default=None, help="a `dspark profile` table (JSON)")
    where.add_argument("--hardware", default=None,
                       help="a described accelerator: h100-sxm, h200, a100-80gb, mi300x, or a JSON of its figures "
                            "(memory_bandwidth B/s, peak_flops FLOP/s, step_overhead s, ...): a roofline")
    where.add_argument("--model", default=None, help="with --hardware: the target, a preset (qwen3-32b, qwen3-8b, "
                                                     "llama-3.1-70b) or a Hugging Face config.json / folder")
    where.add_argument("--drafter-layers", type=positive_int, default=2,
                       help="with --hardware: the DSpark drafter's layers (of the target's shape)")
    where.add_argument("--markov-rank", type=non_negative_int, default=256)
    where.add_argument("--drafter-model", default=None, help="with --hardware: the drafter described as --model is")
    where.add_argument("--step-overhead-ms", type=cli._positive_float, default=None,
                       help="with --hardware: a target step's fixed cost (default 1.0)")
    where.add_argument("--drafter-overhead-ms", type=cli._positive_float, default=None,
                       help="with --hardware: a drafter call's fixed cost (default 0.3)")
    where.add_argument("--contexts", type=int_list(1), default="512,1024,2048,4096,8192",
                       help="with --hardware: the context columns of the table the policies price with")
    p.add_argument("--drafter", default="dspark", help="without --cost-table / --hardware: the drafter whose "
                                                        "`dspark profile` table prices the steps")
    p.add_argument("--acceptance", default="paper-qwen3-8b",
                   help="a `dspark eval --json` output (FILE or FILE:DRAFTER), the preset paper-qwen3-8b, or a "
                        "description: rate=0.8 | rates=0.9/0.8/... | tau=4.5, with auroc=0.85 for a calibrated "
                        "confidence head; per benchmark as NAME:...;NAME:...")
    p.add_argument("--mtp1-acceptance", default=None,
                   help="the one-token drafter's acceptance for the mtp1 policy, e.g. rate=0.85 "
                        "(default: the drafter's first position)")
    p.add_argument("--policies", default=None,
                   help="comma list of plain, mtp1, fixed, threshold-X, ema, prefix, async, auto, auto-fresh (default: plain,mtp1,fixed,auto; "
                        "with --validate: plain,fixed,auto)")
    p.add_argument("--num-draft", type=positive_int, default=7, help="drafted tokens per round at most")
    p.add_argument("--block", type=positive_int, dest="num_draft", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int_list(1), default=None,
                   help="closed-loop clients, each keeping one request in flight (default: 1,2,4,...,128; "
                        "with --validate: 1,4,16,32)")
    p.add_argument("--rate", type=_rates, default=None,
                   help="instead: Poisson arrivals, requests per second (comma list)")
    p.add_argument("--max-requests", type=non_negative_int, default=0,
                   help="cache slots (default: the concurrency; 256 for --rate)")
    p.add_argument("--datasets", default="humaneval,gsm8k,mt-bench",
                   help="the workload's prompts (their token counts under --target's tokenizer) and benchmarks")
    p.add_argument("--dataset-prompts", type=positive_int, default=None, help="prompts per dataset (default: all)")
    p.add_argument("--prompt-tokens", type=non_negative_int, default=0,
                   help="instead: every prompt this long (the benchmarks mixed alike)")
    p.add_argument("--output-tokens", type=positive_int, default=None,
                   help="new tokens per request (default 256; with --validate 64)")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests per point (default: 4 x the concurrency, at least 32; with --validate 32)")
    p.add_argument("--sla", type=_rates, default=None,
                   help="per-user tokens/s targets (comma list): per policy, the largest concurrency meeting "
                        "each and the throughput there")
    p.add_argument("--disaggregated-prefill", action="store_true",
                   help="prompts are prefilled on other machines (prefill / decode disaggregation): requests join "
                        "the decoding steps with their cache ready")
    p.add_argument("--no-decisions", action="store_true",
                   help="do not count the policies' decision time (this process's) in the steps")
    p.add_argument("--plot", default=None, help="write the Pareto PNG here")
    p.add_argument("--seed", type=cli._int, default=0)
    p.add_argument("--temperature", type=cli._float, default=0.0,
                   help="with --validate: the requests' sampling temperature (0 = greedy)")
    p.add_argument("--validate", action="store_true",
                   help="measure this machine (`dspark profile`, the drafter's acceptance, `dspark bench "
                        "concurrency`) and compare the simulation with it; the last line is JSON with "
                        "max_relative_error")
    p.add_argument("--json", action="store_true")
    cli._add_model_flags(p)
    p.set_defaults(threads=2)
