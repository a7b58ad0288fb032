"""``dspark eval``: accepted length tau and per-position acceptance of drafters over benchmarks.

Chain drafting with a fixed block: every round drafts ``block`` tokens (fewer only at the length
limit) and verifies them all, so tau measures the drafter alone. tau = tokens emitted per round,
bonus included = 1 + accepted drafts / rounds. Per position k: unconditional acceptance =
P(tokens 1..k all accepted) (prefix survival), conditional = P(token k accepted | 1..k-1 were).

Each prompt is its own request with its own seed (seed + prompt index), so drafters see the same
prompts and, at temperature 0, produce the same text. Ratios of macro taus (mean over benchmarks)
come with a 95 % bootstrap interval over prompts (paired: the same resampled prompts for both).
Each result keeps its per-prompt counters, so drafters evaluated in separate runs with the same
settings can be compared afterwards (``merge``, ``dspark eval --merge A.json B.json``).
"""

from __future__ import annotations

import random
from typing import Any

from ..api import encode_prompt
from ..data import load_prompts
from ..errors import UsageError
from ..engine import Engine
from ..sampling import SamplingParams
from ..scheduling.policies import FixedPolicy


CONFIDENCE_BINS = 20


class ConfidenceBins(FixedPolicy):
    """The fixed block, recording the drafter's confidences against what the target accepted: per
    draft position k, in ``CONFIDENCE_BINS`` equal-width bins of c_k, how many verified tokens
    reached k (tokens 1..k-1 accepted), how many of those were accepted, and their confidences'
    sum (what `dspark simulate` draws a drafter's proposals from)."""

    def __init__(self, block: int):
        super().__init__(block)
        self.count = [[0] * CONFIDENCE_BINS for _ in range(max(1, block))]
        self.accepted = [[0] * CONFIDENCE_BINS for _ in range(max(1, block))]
        self.total = [[0.0] * CONFIDENCE_BINS for _ in range(max(1, block))]
        self._pending: dict[int, list[float]] = {}      # request id -> this step's verified confidences

    def verify_lengths(self, requests, proposals):
        lengths = super().verify_lengths(requests, proposals)
        for r, p, n in zip(requests, proposals, lengths):
            if n and p.confidences is not None:
                self._pending[r.id] = p.confidences[:n].tolist()
        return lengths

    def observe(self, outcome) -> None:
        for o in outcome.requests:
            conf = self._pending.pop(o.request_id, None)
            if conf is None or o.forced:
                continue
            for k, c in enumerate(conf[:min(len(conf), o.accepted + 1, len(self.count))]):
                b = min(CONFIDENCE_BINS - 1, max(0, int(c * CONFIDENCE_BINS)))
                self.count[k][b] += 1
                self.accepted[k][b] += int(k < o.accepted)
                self.total[k][b] += c

    def to_json(self) -> dict | None:
        """{"count", "accepted", "confidence_sum"}, each [position][bin]; None if nothing was recorded."""
        if not any(any(row) for row in self.count):
            return None
        return {"count": self.count, "accepted": self.accepted, "confidence_sum": self.total}


def run_drafter(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                seed: int, block: int, concurrency: int = 8, exact_seed: bool = False,
                bins: ConfidenceBins | None = None) -> list[dict]:
    """Per-prompt counters: rounds, accepted drafts, drafted tokens, accepted per position; the
    drafter's confidences against the accepted tokens go to ``bins`` where given."""
    max_len = max(len(p) for p in prompts) + max_new_tokens + block + 2
    engine = Engine(target.model, drafter, bins or FixedPolicy(block), max_requests=concurrency, max_len=max_len,
                    block_size=block, eos_ids=target.eos_token_ids)
    reqs = [engine.add_request(p, SamplingParams(temperature=temperature, seed=seed + i), max_new_tokens,
                               exact_seed=exact_seed)
            for i, p in enumerate(prompts)]
    engine.run()
    out = []
    for r in reqs:
        s = r.stats
        per = list(s.accepted_per_position) + [0] * (block - len(s.accepted_per_position))
        out.append({"rounds": s.num_rounds, "accepted": s.num_accepted_tokens, "drafts": s.num_drafts,
                    "per_position": per[:block], "tokens": len(r.output_ids), "output_ids": r.output_ids})
    return out


def summarize(per_prompt: list[dict], block: int) -> dict:
    rounds = sum(p["rounds"] for p in per_prompt)
    acc = sum(p["accepted"] for p in per_prompt)
    drafts = sum(p["drafts"] for p in per_prompt)
    pos = [sum(p["per_position"][k] for p in per_prompt) for k in range(block)]
    uncond = [x / drafts if drafts else 0.0 for x in pos]
    cond = [(pos[k] / (pos[k - 1] if k else drafts)) if (pos[k - 1] if k else drafts) else 0.0
            for k in range(block)]
    return {"tau": 1 + acc / rounds if rounds else 0.0, "rounds": rounds, "drafts": drafts,
            "acceptance_conditional": cond, "acceptance_unconditional": uncond}


def macro_tau(per_bench: dict[str, list[dict]]) -> float:
    """Mean over benchmarks of tau = 1 + accepted drafts / rounds (per-prompt counters summed)."""
    taus = []
    for per in per_bench.values():
        rounds = sum(p["rounds"] for p in per)
        taus.append(1 + sum(p["accepted"] for p in per) / rounds if rounds else 0.0)
    return sum(taus) / len(taus)


def bootstrap_ratio(a: dict[str, list[dict]], b: dict[str, list[dict]], n: int = 1000, seed: int = 0):
    """Ratio of macro taus a / b with a 95 % interval, resampling prompts within each benchmark."""
    rng = random.Random(seed)
    point = macro_tau(a) / macro_tau(b)
    ratios = []
    for _ in range(n):
        ra, rb = {}, {}
        for name in a:
            idx = [rng.randrange(len(a[name])) for _ in a[name]]
            ra[name] = [a[name][i] for i in idx]
            rb[name] = [b[name][i] for i in idx]
        mb = macro_tau(rb)
        ratios.append(macro_tau(ra) / mb if mb else float("nan"))
    ratios.sort()
    return point, ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def evaluate(target, drafters: dict, datasets: list[str], *, num_prompts: int, max_new_tokens: int,
             temperature: float, seed: int, block: int, concurrency: int = 8, log=None,
             exact_seed: bool = False) -> dict:
    prompts = {d: [encode_prompt(target.tokenizer, p, chat=True) for p in load_prompts(d, num_prompts)]
               for d in datasets}
    raw: dict[str, dict[str, list[dict]]] = {name: {} for name in drafters}
    results = []
    for d in datasets:
        for name, drafter in drafters.items():   # drafters side by side on each benchmark
            bins = ConfidenceBins(block)
            per = run_drafter(target, drafter, prompts[d], max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed, block=block, concurrency=concurrency,
                              exact_seed=exact_seed, bins=bins)
            raw[name][d] = per
            row = {"drafter": name, "benchmark": d, "temperature": temperature, **summarize(per, block),
                   "per_prompt": [{"rounds": p["rounds"], "accepted": p["accepted"], "tokens": p["tokens"],
                                   "prompt_tokens": len(q)} for p, q in zip(per, prompts[d])]}
            if bins.to_json() is not None:
                row["confidence_bins"] = bins.to_json()
            results.append(row)
            if log:
                log(f"{d:>14} {name:>12}: tau {row['tau']:.3f}")
    settings = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "seed": seed, "block": block, **({"exact_seed": True} if exact_seed else {})}
    out = {"settings": settings, "results": results, **compare(raw, seed)}
    names = list(drafters)
    if temperature == 0 and len(names) > 1:
        ident = {}
        for name in names[1:]:
            same = sum(p["output_ids"] == q["output_ids"] for d in datasets
                       for p, q in zip(raw[name][d], raw[names[0]][d]))
            ident[name] = same / sum(len(raw[name][d]) for d in datasets)
        out[f"greedy_identity_vs_{names[0]}"] = ident
    return out


def compare(raw: dict[str, dict[str, list[dict]]], seed: int = 0) -> dict:
    """Macro tau per drafter and every pairwise ratio with its bootstrap interval."""
    names = list(raw)
    comps = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for x, y in ((a, b), (b, a)):
                r, lo, hi = bootstrap_ratio(raw[x], raw[y], seed=seed)
                comps.append({"drafter": x, "over": y, "ratio": r, "ci95": [lo, hi]})
    return {"macro_tau": {name: macro_tau(raw[name]) for name in names}, "ratios": comps}


def merge(outs: list[dict]) -> dict:
    """Several ``dspark eval --json`` outputs as one comparison (drafters evaluated in separate runs
    with the same settings and benchmarks); ratios are recomputed from the per-prompt counters."""
    if not outs:
        raise UsageError("nothing to merge")
    settings: Any = outs[0].get("settings")   # a JSON object, checked against every output's below
    raw: dict[str, dict[str, list[dict]]] = {}
    results = []
    for o in outs:
        if "settings" not in o or any("per_prompt" not in r for r in o.get("results", [])):
            raise UsageError("an eval output without settings or per-prompt counters (written by an older "
                             "dspark eval): rerun it")
        if o["settings"] != settings:
            raise UsageError(f"eval outputs with different settings cannot be compared: {o['settings']} "
                             f"vs {settings}")
        for r in o["results"]:
            if r["benchmark"] in raw.get(r["drafter"], {}):
                raise UsageError(f"{r['drafter']} on {r['benchmark']} appears twice")
            raw.setdefault(r["drafter"], {})[r["benchmark"]] = r["per_prompt"]
            results.append(r)
    benches = {name: sorted(v) for name, v in raw.items()}
    first = next(iter(benches.values()))
    for name, b in benches.items():
        if b != first:
            raise UsageError(f"{name} was evaluated on {b}, others on {first}")
    return {"settings": settings, "results": results, **compare(raw, settings["seed"])}


def markdown(out: dict) -> str:
    names = list(out["macro_tau"])
    benches = list(dict.fromkeys(r["benchmark"] for r in out["results"]))
    tau = {(r["drafter"], r["benchmark"]): r["tau"] for r in out["results"]}
    lines = ["| drafter | " + " | ".join(benches) + " | macro |", "|---|" + "---|" * (len(benches) + 1)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{tau[(n, b)]:.2f}" for b in benches) +
                     f" | {out['macro_tau'][n]:.2f} |")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(out["macro_tau"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        rows = [r for r in out["results"] if r["drafter"] == n]
        block = len(rows[0]["acceptance_conditional"])
        mean = [sum(r["acceptance_conditional"][k] for r in rows) / len(rows) for k in range(block)]
        ax.plot(range(1, block + 1), mean, marker="o", label=f"{n} (macro tau {out['macro_tau'][n]:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(token k accepted | 1..k-1 accepted)")
    ax.set_title("Conditional acceptance per position (mean over benchmarks)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
