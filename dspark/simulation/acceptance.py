"""What a simulated drafter proposes: per draft position, a confidence and whether the target
accepts the token, drawn so that the acceptance and the confidences' power to tell accepted from
rejected tokens match a drafter's measured (or published) statistics.

Two kinds of source:

- ``dspark eval --json`` (evaluation/acceptance.py): per benchmark, the conditional acceptance per
  position and, for drafters with a confidence head, the confidences in bins with the accepted
  share of each (``ConfidenceBins``). A position's draw picks a bin by its share of the tokens that
  reached the position, the bin's mean confidence, and acceptance at the bin's observed rate.
- a description: the conditional acceptance per position (``rate=``, ``rates=``, or ``tau=`` for a
  constant rate giving that accepted length at the block), and ``auroc=`` for a calibrated
  confidence head of that discriminative power: a token's acceptance probability p is drawn from a
  Beta distribution around the position's rate, the confidence is p (calibrated) and the token is
  accepted with probability p; the Beta's concentration is solved for the AUROC.

Positions are drawn independently (given that the earlier ones were accepted), and each request
draws from its benchmark's statistics (the pooled ones where its benchmark has none).
"""

from __future__ import annotations

import bisect
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError


@dataclass(frozen=True)
class PositionLaw:
    """One draft position, given that the positions before it were accepted: (cumulative weight,
    confidence, acceptance probability) per bin, or a Beta law of the acceptance probability."""

    rate: float                           # acceptance probability (mean)
    cum: tuple[float, ...] = ()           # bins: cumulative weights
    confidence: tuple[float, ...] = ()    # bins: their mean confidence
    accept: tuple[float, ...] = ()        # bins: their acceptance rate
    beta: tuple[float, float] | None = None   # (alpha, beta) of p, the confidence; None with bins

    def draw(self, rng: random.Random) -> tuple[float, bool]:
        if self.cum:
            i = min(bisect.bisect_right(self.cum, rng.random() * self.cum[-1]), len(self.cum) - 1)
            return self.confidence[i], rng.random() < self.accept[i]
        if self.beta is not None:
            p = rng.betavariate(*self.beta)
            return p, rng.random() < p
        return self.rate, rng.random() < self.rate


@dataclass(frozen=True)
class DrafterLaw:
    """A drafter's positions 1..block; ``confidences``: whether its proposals carry them.
    ``mixture``: laws a block is drawn from instead, one picked at random per block (a request of
    no listed benchmark, under laws given per benchmark); ``positions`` then hold their mean rates."""

    positions: tuple[PositionLaw, ...]
    confidences: bool
    mixture: tuple[DrafterLaw, ...] = ()

    def draw(self, length: int, rng: random.Random) -> tuple[list[float] | None, int]:
        """(the confidences of a block of ``length`` drafts or None, how many of its first tokens the
        target accepts if all are verified)."""
        if self.mixture:
            return rng.choice(self.mixture).draw(length, rng)
        conf: list[float] = []
        accepted, alive = 0, True
        for k in range(length):
            law = self.positions[min(k, len(self.positions) - 1)]
            c, ok = law.draw(rng)
            conf.append(c)
            if alive and ok:
                accepted += 1
            else:
                alive = False
        return (conf if self.confidences else None), accepted

    @property
    def tau(self) -> float:
        """Tokens per round with the whole block verified (the bonus token included)."""
        out, a = 1.0, 1.0
        for p in self.positions:
            a *= p.rate
            out += a
        return out


class AcceptanceModel:
    """Per benchmark a ``DrafterLaw`` (``pooled``: over all of them, for requests of others)."""

    def __init__(self, laws: dict[str, DrafterLaw], pooled: DrafterLaw, source: str):
        self.laws, self.pooled, self.source = laws, pooled, source

    def law(self, benchmark: str) -> DrafterLaw:
        return self.laws.get(benchmark, self.pooled)

    @property
    def benchmarks(self) -> list[str]:
        return list(self.laws)

    def describe(self) -> dict:
        return {"source": self.source, "tau_pooled": self.pooled.tau,
                "tau": {b: law.tau for b, law in self.laws.items()},
                "conditional": {b: [p.rate for p in law.positions] for b, law in self.laws.items()}}

    # ------------------------------------------------------------------ sources
    @classmethod
    def load(cls, spec: str, block: int | None = None) -> AcceptanceModel:
        """A ``dspark eval --json`` file (``FILE`` or ``FILE:DRAFTER``), a preset, or a description."""
        if spec in PRESETS:
            return cls.describe_spec(PRESETS[spec], block, source=spec)
        path, _, drafter = spec.partition(":")
        if Path(spec).is_file() or Path(path).is_file():
            if Path(spec).is_file():
                path, drafter = spec, ""
            try:
                data = json.loads(Path(path).read_text().strip().splitlines()[-1])
            except (OSError, ValueError, IndexError) as e:
                raise UsageError(f"acceptance {path!r}: not a `dspark eval --json` output ({e})") from None
            return cls.from_eval(data, drafter or None, source=spec)
        return cls.describe_spec(spec, block)

    @classmethod
    def from_eval(cls, data: dict, drafter: str | None = None, source: str = "eval") -> AcceptanceModel:
        rows = data.get("results") if isinstance(data, dict) else None
        if not rows:
            raise UsageError("acceptance: the eval output has no results")
        names = list(dict.fromkeys(r["drafter"] for r in rows))
        name = drafter or names[0]
        rows = [r for r in rows if r["drafter"] == name]
        if not rows:
            raise UsageError(f"acceptance: no drafter {name!r} in the eval output (it has {', '.join(names)})")
        laws = {r["benchmark"]: _from_row(r) for r in rows}
        return cls(laws, _pool(rows), f"{source} ({name})")

    @classmethod
    def describe_spec(cls, spec: str, block: int | None = None, source: str | None = None) -> AcceptanceModel:
        """``rate=0.8``, ``rates=0.9/0.8/0.7``, or ``tau=4.2`` (with ``block=``), each with an optional
        ``auroc=0.85`` (none: no confidences); several benchmarks as ``NAME:...;NAME:...``."""
        laws: dict[str, DrafterLaw] = {}
        for part in [p.strip() for p in spec.split(";") if p.strip()]:
            name, _, desc = part.rpartition(":") if ":" in part else ("all", "", part)
            laws[name.strip() or "all"] = _described(desc, block)
        if not laws:
            raise UsageError("acceptance: empty description")
        pooled = laws.get("all") or _mean_law(list(laws.values()))
        return cls({k: v for k, v in laws.items() if k != "all"}, pooled, source or spec)


# The paper's published accepted lengths (Table 1: DSpark on Qwen3-8B, block 7, temperature 1) per
# benchmark, each as a constant conditional rate, and a confidence head of AUROC 0.86 (the paper's
# calibration reports 0.81 - 0.91).
PAPER_TAU = {"gsm8k": 6.17, "math500": 5.78, "aime25": 5.01, "mbpp": 5.16, "humaneval": 5.52,
             "livecodebench": 5.17, "mt-bench": 3.72, "alpaca": 3.58, "arena-hard": 3.21}
PRESETS = {"paper-qwen3-8b": ";".join(f"{b}:tau={t},block=7,auroc=0.86" for b, t in PAPER_TAU.items())}


def _described(desc: str, block: int | None) -> DrafterLaw:
    kv = {}
    for item in [x.strip() for x in desc.split(",") if x.strip()]:
        k, eq, v = item.partition("=")
        if not eq:
            raise UsageError(f"acceptance: expected key=value, got {item!r} (keys: rate, rates, tau, block, auroc)")
        kv[k.strip()] = v.strip()
    unknown = set(kv) - {"rate", "rates", "tau", "block", "auroc"}
    if unknown:
        raise UsageError(f"acceptance: unknown key(s) {sorted(unknown)} (keys: rate, rates, tau, block, auroc)")
    try:
        n = int(kv.get("block", block or 7))
        if "rates" in kv:
            rates = [float(x) for x in kv["rates"].split("/")]
        elif "rate" in kv:
            rates = [float(kv["rate"])] * n
        elif "tau" in kv:
            rates = [rate_for_tau(float(kv["tau"]), n)] * n
        else:
            raise UsageError("acceptance: give rate=, rates= or tau=")
        auroc = float(kv["auroc"]) if "auroc" in kv else None
    except ValueError as e:
        raise UsageError(f"acceptance {desc!r}: {e}") from None
    if not all(0.0 <= r <= 1.0 for r in rates) or n < 1:
        raise UsageError(f"acceptance {desc!r}: rates must be in [0, 1] and block >= 1")
    if auroc is not None and not 0.5 <= auroc < 1.0:
        raise UsageError(f"acceptance {desc!r}: auroc must be in [0.5, 1)")
    positions = []
    for r in rates:
        beta = None
        if auroc is not None and 0.0 < r < 1.0:
            conc = concentration_for_auroc(r, auroc)
            beta = (r * conc, (1 - r) * conc)
        positions.append(PositionLaw(r, beta=beta))
    return DrafterLaw(tuple(positions), auroc is not None)


def rate_for_tau(tau: float, block: int) -> float:
    """The constant conditional acceptance a with 1 + a + a^2 + ... + a^block = tau."""
    if not 1.0 <= tau <= block + 1:
        raise UsageError(f"tau must be in [1, {block + 1}] at block {block}, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** k for k in range(block + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _auroc(rate: float, k: float, n: int = 4000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    p = rng.beta(rate * k, (1 - rate) * k, n)
    y = rng.random(n) < p
    pos, neg = p[y], p[~y]
    if not len(pos) or not len(neg):
        return 0.5
    ranks = np.argsort(np.argsort(np.concatenate([pos, neg]))) + 1
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def concentration_for_auroc(rate: float, auroc: float) -> float:
    """The Beta concentration k (p ~ Beta(rate k, (1 - rate) k)) at which p, as a confidence,
    tells accepted tokens (drawn with probability p) from rejected ones with this AUROC (a smaller
    k spreads p further: a sharper head)."""
    lo, hi = np.log(0.05), np.log(2000.0)     # AUROC falls as k grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if _auroc(rate, float(np.exp(mid))) > auroc:
            lo = mid
        else:
            hi = mid
    return float(np.exp((lo + hi) / 2))


def _from_row(row: dict) -> DrafterLaw:
    cond = [float(x) for x in row["acceptance_conditional"]]
    bins = row.get("confidence_bins")
    if not bins:
        return DrafterLaw(tuple(PositionLaw(c) for c in cond), False)
    return DrafterLaw(tuple(_binned(bins, k, c) for k, c in enumerate(cond)), True)


def _binned(bins: dict, k: int, rate: float) -> PositionLaw:
    count, acc, total = bins["count"][k], bins["accepted"][k], bins["confidence_sum"][k]
    keep = [i for i, n in enumerate(count) if n > 0]
    if not keep:
        return PositionLaw(rate)
    cum = np.cumsum([count[i] for i in keep]).tolist()
    return PositionLaw(rate, tuple(float(x) for x in cum), tuple(total[i] / count[i] for i in keep),
                       tuple(acc[i] / count[i] for i in keep))


def _pool(rows: list[dict]) -> DrafterLaw:
    """The benchmarks' statistics summed (their rounds weighting the conditional rates)."""
    block = len(rows[0]["acceptance_conditional"])
    reached = np.zeros(block)
    accepted = np.zeros(block)
    for r in rows:
        drafts = float(r.get("drafts") or r.get("rounds") or 1)
        surv = [1.0] + [float(x) for x in r["acceptance_unconditional"]]
        for k in range(block):
            reached[k] += drafts * surv[k]
            accepted[k] += drafts * surv[k + 1]
    cond = (accepted / np.maximum(reached, 1e-12)).tolist()
    if all("confidence_bins" in r for r in rows):
        merged = {key: np.sum([np.asarray(r["confidence_bins"][key], dtype=float) for r in rows], axis=0).tolist()
                  for key in ("count", "accepted", "confidence_sum")}
        return DrafterLaw(tuple(_binned(merged, k, c) for k, c in enumerate(cond)), True)
    return DrafterLaw(tuple(PositionLaw(c) for c in cond), False)


def _mean_law(laws: list[DrafterLaw]) -> DrafterLaw:
    """The benchmarks' laws mixed alike: each block drawn from one of them, picked at random."""
    width = max(len(law.positions) for law in laws)
    rates = [float(np.mean([law.positions[min(k, len(law.positions) - 1)].rate for law in laws]))
             for k in range(width)]
    return DrafterLaw(tuple(PositionLaw(r) for r in rates), any(law.confidences for law in laws), tuple(laws))
