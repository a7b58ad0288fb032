"""``dspark bench speed``: batch-1 tokens/s of several systems side by side in one process.

Systems are interleaved per prompt (prompt 1 on every system, then prompt 2, ...), so a noisy
shared machine slows them alike. Every system decodes greedily from the same chat-templated
token ids and stops at the same EOS tokens. Reported per system: tokens/s (new tokens over the
wall time of each call, prefill included), accept length (tokens per target forward after
prefill), and the greedy-identity rate against the plain decoding of the same engine.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from ..api import encode_prompt
from ..data import load_prompts
from ..drafters import NgramDrafter, PlainDrafter, load_drafter
from ..errors import UsageError
from ..generation import generate_ids
from ..runtime.loading import load_hf, target_from_args
from ..sampling import SamplingParams
from ..scheduling.policies import make_policy
from ..scheduling.costs import CostTable, table_key_for

ALL_SYSTEMS = ("hf-plain", "hf-prompt-lookup", "plain", "ngram", "ngram-no-history", "ngram-hf-rule",
               "llama.cpp-plain", "llama.cpp-prompt-lookup")
# trained drafters run on our engine too when named (not in the default set: they need a checkpoint)
TRAINED_SYSTEMS = ("dspark", "dflash", "dflash-5", "eagle3", "dspark-rnn")
# our drafting systems may name their verification policy (ngram@prefix, dspark@async; default: the
# whole block every round)
POLICY_SYSTEMS = ("ngram",) + TRAINED_SYSTEMS
# ngram-hf-rule: our engine with HF's lookup rule (earliest match of a 2-gram, else 1-gram, 10
# tokens), to compare lookup rules on the same text; ngram-no-history: our rule on the request's own
# text only (as HF's), without the history of the prompts served before it
# trained drafters (with any @policy) compare with plain
BASELINE_OF = {"hf-prompt-lookup": "hf-plain", "ngram": "plain", "ngram-hf-rule": "plain",
               "ngram-no-history": "plain", "llama.cpp-prompt-lookup": "llama.cpp-plain"}


def _base(system: str) -> str:
    """The drafter part of a system name: dspark@prefix -> dspark; ngram+dspark (the hybrid of the
    two, see drafters.hybrid) -> dspark."""
    name = system.partition("@")[0]
    return name.partition("+")[2] if name.startswith("ngram+") else name


@dataclass
class SystemResult:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    outputs: list = field(default_factory=list)
    per_dataset: dict = field(default_factory=dict)  # dataset -> [tokens, seconds]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_length(self) -> float:
        return (self.tokens - len(self.outputs)) / self.rounds if self.rounds else 0.0


class _Counter:
    def __init__(self):
        self.n = 0

    def __call__(self, *args, **kwargs):
        self.n += 1


def _hf_system(path, eos, max_new, lookup: int | None, temperature: float = 0.0, seed: int = 0):
    hf, _ = load_hf(path, torch.bfloat16)
    counter = _Counter()
    hf.register_forward_pre_hook(counter)

    def run(ids):
        counter.n = 0
        inp = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new, do_sample=temperature > 0, eos_token_id=list(eos),
                      pad_token_id=eos[0], attention_mask=torch.ones_like(inp))
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(inp, **kwargs)
            dt = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        return new, dt, counter.n - 1
    return run


def _ours_system(target, drafter, max_new, eos, temperature: float = 0.0, seed: int = 0, policy=None):
    """``policy``: a function returning a fresh verification policy per call (default: fixed)."""
    def run(ids):
        params = SamplingParams(temperature=temperature, seed=seed)
        new, stats = generate_ids(target.model, ids, params, max_new, drafter, eos_ids=eos,
                                  policy=policy() if policy else None)
        return new, stats.seconds, stats.num_rounds
    return run


def _policy_factory(name: str, target, drafter):
    """Fresh policies by name; the cost-table policies need this machine's profile of the drafter."""
    table = CostTable.find(table_key_for(target, drafter))
    if name in ("prefix", "async") and table is None:
        raise UsageError(f"policy {name} needs the cost table of {drafter.name}: run "
                         f"`dspark profile --drafter {drafter.name}` first")
    return lambda: make_policy(name, drafter.block_size, cost_table=table)


def _llama_cpp_system(gguf_path, eos, max_new, lookup: int | None):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    kwargs = dict(model_path=str(gguf_path), n_ctx=4096, n_threads=2, n_threads_batch=2,
                  verbose=False, seed=0)
    if lookup:
        kwargs.update(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup), logits_all=True)
    llm = Llama(**kwargs)
    evals = _Counter()
    orig_eval = llm.eval

    def counted_eval(tokens):
        evals.n += 1
        return orig_eval(tokens)
    llm.eval = counted_eval

    def run(ids):
        llm.reset()
        evals.n = 0
        new = []
        t = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            new.append(int(tok))
            if tok in eos or len(new) >= max_new:
                break
        dt = time.perf_counter() - t
        return new, dt, evals.n - 1
    return run


def run_speed_bench(args) -> int:
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    systems = _systems(args.systems)
    target = target_from_args(args)
    tok = target.tokenizer
    prompts = []
    for d in datasets:
        for p in load_prompts(d, args.num_prompts):
            prompts.append((d, encode_prompt(tok, p, chat=True)))
    runners, skipped = _runners(systems, target, args)
    for s, why in skipped.items():
        print(f"skipping {s}: {why}", file=sys.stderr)
    # warm-up on a prompt that is not measured
    warm = tok("Say hello.", add_special_tokens=False)["input_ids"]
    for run in runners.values():
        run(warm)
    results = _measure(runners, prompts)
    report = _report(results, datasets, args, skipped)
    md = _markdown(report)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    if args.json:
        print(json.dumps(report))
    return 0


def _systems(spec: str | None) -> list[str]:
    """The systems named on the command line (all of ALL_SYSTEMS by default), checked before
    anything is loaded."""
    systems = list(ALL_SYSTEMS) if not spec else [s.strip() for s in spec.split(",")]
    unknown = [s for s in systems if _base(s) not in ALL_SYSTEMS + TRAINED_SYSTEMS
               or ("@" in s and _base(s) not in POLICY_SYSTEMS)]
    if unknown:
        raise UsageError(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS + TRAINED_SYSTEMS)} "
                         f"({', '.join(POLICY_SYSTEMS)} may name a verification policy: dspark@prefix; "
                         f"ngram+NAME runs the n-gram / trained hybrid: ngram+dspark)")
    for s in systems:
        if "@" in s:
            make_policy(s.partition("@")[2])   # validates the policy name before loading anything
    return systems


def _runners(systems: list[str], target, args) -> tuple[dict, dict[str, str]]:
    """A ``run(ids) -> (new ids, seconds, target forwards after prefill)`` per system, and the
    systems skipped with why (llama.cpp without a GGUF target or without its package)."""
    temp, seed, max_new, eos = args.temperature, args.seed, args.max_new_tokens, target.eos_token_ids
    runners = {}
    skipped = {}
    for s in systems:
        if s.startswith("hf-"):
            runners[s] = _hf_system(target.path, eos, max_new, 10 if s == "hf-prompt-lookup" else None, temp, seed)
        elif s == "plain":
            runners[s] = _ours_system(target, PlainDrafter(), max_new, eos, temp, seed)
        elif _base(s) in POLICY_SYSTEMS:
            name, _, pol = s.partition("@")
            drafter = (NgramDrafter(block_size=args.num_draft or 10) if name == "ngram"
                       else load_drafter(name, target, num_draft=args.num_draft))
            runners[s] = _ours_system(target, drafter, max_new, eos, temp, seed,
                                      _policy_factory(pol, target, drafter) if pol else None)
        elif s == "ngram-hf-rule":
            hf_rule = NgramDrafter(block_size=10, max_ngram=2, weak_match_tokens=10, rule="first",
                                   history_tokens=0)
            runners[s] = _ours_system(target, hf_rule, max_new, eos, temp, seed)
        elif s == "ngram-no-history":
            own = NgramDrafter(block_size=args.num_draft or 10, history_tokens=0)
            runners[s] = _ours_system(target, own, max_new, eos, temp, seed)
        else:
            if not target.path.is_file():
                skipped[s] = "llama.cpp needs a GGUF target"
                continue
            r = _llama_cpp_system(target.path, eos, max_new, 10 if s.endswith("lookup") else None)
            if r is None:
                skipped[s] = "llama-cpp-python is not installed (pip install 'dspark[llama-cpp]')"
                continue
            runners[s] = r
    return runners, skipped


def _measure(runners: dict, prompts: list[tuple[str, list[int]]]) -> dict[str, SystemResult]:
    """Every prompt on every system in turn (interleaved, so that a noisy machine slows all alike)."""
    results = {s: SystemResult(s) for s in runners}
    for i, (d, ids) in enumerate(prompts):
        for s, run in runners.items():
            new, dt, rounds = run(ids)
            r = results[s]
            r.tokens += len(new)
            r.seconds += dt
            r.rounds += rounds
            r.outputs.append(new)
            agg = r.per_dataset.setdefault(d, [0, 0.0])
            agg[0] += len(new)
            agg[1] += dt
        print(f"[{i + 1}/{len(prompts)}] {d}: " + ", ".join(
            f"{s} {results[s].tokens_per_second:.1f}" for s in runners), file=sys.stderr)
    return results


def _report(results, datasets, args, skipped) -> dict:
    rows = []
    for s, r in results.items():
        base = results.get(BASELINE_OF.get(s, "plain" if _base(s) in POLICY_SYSTEMS else s))
        identical = None
        if base is not None and base is not r and args.temperature == 0:
            identical = sum(a == b for a, b in zip(r.outputs, base.outputs)) / len(r.outputs)
        rows.append({
            "system": s,
            "tokens": r.tokens,
            "tokens_per_second": r.tokens_per_second,
            "accept_length": r.accept_length,
            "speedup_vs_own_plain": (r.tokens_per_second / base.tokens_per_second) if base else None,
            "speedup_vs_hf_plain": (r.tokens_per_second / results["hf-plain"].tokens_per_second
                                    if "hf-plain" in results else None),
            "greedy_identity_rate": identical,
            "tokens_per_second_by_dataset": {d: (t / sec if sec else 0.0)
                                             for d, (t, sec) in r.per_dataset.items()},
        })
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "cpu": _cpu_name(),
        "datasets": datasets, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype, "batch_invariant": bool(getattr(args, "batch_invariant", False)),
        "temperature": args.temperature, "skipped": skipped, "results": rows,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _markdown(report) -> str:
    ds = report["datasets"]
    head = ("| system | tokens/s | vs HF plain | vs own plain | accept length | greedy identity | "
            + " | ".join(f"{d} tok/s" for d in ds) + " |")
    sep = "|" + "---|" * (6 + len(ds))
    lines = [head, sep]
    for r in report["results"]:
        def f(x, fmt):
            return "-" if x is None else fmt.format(x)
        lines.append(
            f"| {r['system']} | {r['tokens_per_second']:.1f} | {f(r['speedup_vs_hf_plain'], '{:.2f}x')} | "
            f"{f(r['speedup_vs_own_plain'], '{:.2f}x')} | {r['accept_length']:.2f} | "
            f"{f(r['greedy_identity_rate'], '{:.0%}')} | "
            + " | ".join(f"{r['tokens_per_second_by_dataset'].get(d, 0):.1f}" for d in ds) + " |")
    return "\n".join(lines)
