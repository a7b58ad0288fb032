"""Step costs learned from the steps the engine runs: what `dspark profile` measures, without the
profile.

An engine step costs the target's forward over its rows (every prefilled token, and each decoding
request's anchor plus the drafts it verifies), the drafter's call (over the requests that drafted
with a forward, so deep), and the rest (verification, sampling, the engine's own work, growing with
the requests). The engine times the forward and the drafter's call of every step; ``LearnedCosts``
keeps recent samples of each part in buckets (rows, requests and depth on a log scale), and prices
any step from them by interpolation, the drafter's call as one fit over requests, depth and the
context rows it took in beyond its requests' last rounds (``CallCost``: a new request's first call
takes in its whole prompt). Each part is learned from every step, prefilling ones included:
the forward's cost depends mostly on its rows, whichever request they serve, so a server whose steps
always admit someone (many short requests) learns as well as one that only decodes. Mostly: a
decoding step of R requests pays per request (R contexts attended, R ragged blocks laid out) what a
prefill of as many rows does not, and a few verified tokens per request cost it more per row than
a prompt's rows (docs/auto.md). So decoding steps are also kept by their load: a decoding
step is priced from the decoding steps seen at about its number of requests, by the tokens it
verified beyond the anchors (fine-grained where they are few: the first verified token of a step
costs it more than the next ones, a block laid out and attended beside the decoding rows), and
beyond the tokens seen there by the all-steps curve's increments.

``table`` turns the learned parts into the ``CostTable`` the load-aware policies price with, and the
samples persist per machine / target / drafter / dtype / threads, so a second run starts priced.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from collections import deque
from itertools import combinations
from pathlib import Path

import numpy as np
import torch

from .base import StepOutcome
from .costs import CostTable, isotonic, table_path

log = logging.getLogger("dspark")

SAMPLES = 8          # recent samples kept per bucket (their lower median is its price)
STEPS_PER_BUCKET = 4 # buckets per doubling (~19 % apart)
# the cost table's verified columns below one token per request (tokens per request): one token in a
# step of 32 requests, and four
FRACTIONS = (1 / 32, 1 / 8)


def machine_id() -> str:
    """What a step's price depends on beyond the models: the CPU model and the threads torch runs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|{torch.get_num_threads()} threads"


def bucket(x: float) -> int:
    return round(STEPS_PER_BUCKET * math.log2(max(x, 1.0)))


def centre(b: int) -> float:
    return 2.0 ** (b / STEPS_PER_BUCKET)


def lower_median(samples) -> float:
    """A bucket's price: the lower median of its samples (a step only ever runs slower than its
    work, when the machine is busy, so the lower half is the better estimate)."""
    s = sorted(samples)
    return s[(len(s) - 1) // 2]


class Curve:
    """Seconds as a non-decreasing function of one size (rows, requests), learned from samples
    kept in log-spaced buckets. Between buckets it is linear in the size (what a CPU's cost per row
    is, past the first few rows); beyond the last it goes on with the slope of a least-squares line
    through the buckets (never negative), so a load never seen is priced from those that were."""

    def __init__(self) -> None:
        self.buckets: dict[int, deque] = {}    # bucket -> recent (size, seconds)
        self._fit: tuple[list[float], list[float], float] | None = None

    def add(self, x: float, seconds: float) -> None:
        self.buckets.setdefault(bucket(x), deque(maxlen=SAMPLES)).append((float(x), float(seconds)))
        self._fit = None

    def count(self, x: float, within: int = 1) -> int:
        """Samples at about ``x``: in its bucket or the next ``within`` either side (1: ~19 %,
        4: a factor of 2)."""
        b = bucket(x)
        return sum(len(self.buckets.get(k, ())) for k in range(b - within, b + within + 1))

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def _points(self) -> tuple[list[float], list[float], float]:
        if self._fit is None:
            keys = sorted(self.buckets)
            xs = [lower_median([x for x, _ in self.buckets[b]]) for b in keys]
            ys = isotonic([lower_median([y for _, y in self.buckets[b]]) for b in keys])
            slope = 0.0
            if len(xs) > 1:
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                var = sum((x - mx) ** 2 for x in xs)
                slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
            self._fit = (xs, ys, slope)
        return self._fit

    def __call__(self, x: float) -> float:
        xs, ys, slope = self._points()
        if not xs:
            return 0.0
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] + slope * (x - xs[-1])
        i = next(i for i in range(1, len(xs)) if xs[i] >= x)
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
        return ys[i - 1] + f * (ys[i] - ys[i - 1])

    def to_json(self) -> dict:
        return {str(b): [list(p) for p in s] for b, s in self.buckets.items()}

    @classmethod
    def from_json(cls, d: dict) -> Curve:
        c = cls()
        for b, s in d.items():
            c.buckets[int(b)] = deque(((float(x), float(y)) for x, y in s), maxlen=SAMPLES)
        return c


class CallCost:
    """The drafter's call, in seconds, as c0 + c1 n + c2 n d + c3 rows for n requests drafting d
    tokens each and ``rows`` context rows taken in beyond their last rounds (a fixed part, a part
    per request, per drafted row, per caught-up row), non-negative, fitted by least squares to the
    last ``keep`` calls (then again without those it fits worst: a call in a slow spell). One fit
    over every shape the policy happened to run, since a policy drafts some depths at few loads
    only, and a curve per depth carried on alone from those misprices the others; the rows part
    keeps a new request's first call, which takes in its whole prompt, from pricing every call of
    its shape as dear."""

    def __init__(self, keep: int = 96) -> None:
        self.calls: deque = deque(maxlen=keep)      # (n, depth, rows, seconds)
        self._coef: tuple[float, ...] | None = None

    def add(self, n: int, depth: int, seconds: float, rows: int = 0) -> None:
        self.calls.append((float(n), float(depth), float(rows), float(seconds)))
        self._coef = None

    def __bool__(self) -> bool:
        return bool(self.calls)

    # the columns in the order a tie goes to (below)
    PREFER = (3, 0, 1, 2)

    @staticmethod
    def _fit(X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Non-negative least squares over the subsets of the columns (few columns: exact). With few
        distinct calls the simplest exact fit wins ties, and among those the one that puts the cost
        on the caught-up rows, then on the fixed part: a steady call takes in few rows, so a first
        call timed with its prompt prices the next ones cheap rather than dear. Cheap is the answer
        that corrects itself: the policy drafts and the call is timed again; priced dear, the call
        would never run again, nor be timed."""
        best, best_err = np.zeros(X.shape[1]), None
        cols = CallCost.PREFER
        for size in range(1, X.shape[1] + 1):
            for sub in combinations(cols, size):
                c, *_ = np.linalg.lstsq(X[:, sub], y, rcond=None)
                if (c < 0).any():
                    continue
                full = np.zeros(X.shape[1])
                full[list(sub)] = c
                err = float(((X @ full - y) ** 2).sum())
                if best_err is None or err < best_err - 1e-9 * (1e-12 + float((y ** 2).sum())):
                    best, best_err = full, err
        return best

    def coef(self) -> tuple[float, ...]:
        if self._coef is None:
            a = np.array(self.calls, dtype=float)
            X = np.stack([np.ones(len(a)), a[:, 0], a[:, 0] * a[:, 1], a[:, 2]], axis=1)
            y = a[:, 3]
            c = self._fit(X, y)
            if len(a) >= 8:         # again without the quarter it fits worst (slow spells)
                r = y - X @ c
                keep = r <= np.quantile(r, 0.75)
                c = self._fit(X[keep], y[keep])
            self._coef = tuple(float(v) for v in c)
        return self._coef

    def __call__(self, n: float, depth: float, rows: float = 0.0) -> float:
        c0, c1, c2, c3 = self.coef()
        return c0 + c1 * n + c2 * n * depth + c3 * rows

    def to_json(self) -> list:
        return [list(c) for c in self.calls]

    @classmethod
    def from_json(cls, d: list) -> CallCost:
        c = cls()
        for n, depth, rows, t in d:
            c.add(int(n), int(depth), float(t), int(rows))
        return c


class LearnedCosts:
    """The three parts of a step's cost, learned from the steps observed (see the module doc)."""

    def __init__(self, key: str, block: int, path: Path | None = None, call_block: int | None = None):
        """``block``: the longest block a step verifies; ``call_block``: the most the drafter's
        call drafts (a hybrid's trained drafter drafts 7 where its lookups propose 10), the depth
        its call is timed at (default ``block``)."""
        self.key = key
        self.block = block
        self.call_block = call_block or block
        self.path = path
        self.forward = Curve()                  # seconds of the target's forward, by rows
        self.decode: dict[int, Curve] = {}      # requests bucket -> the same, decoding steps only,
                                                # by 1 + the tokens verified beyond the anchors
        self.rest = Curve()                     # the step less forward and drafter, by requests
        self.draft = CallCost()                 # seconds of the drafter's call, by requests drafting and depth
        self.timed: dict[int, int] = {}         # requests bucket -> steps the whole block was timed at
        self.observed = 0                       # steps learned from, since made or loaded

    # ------------------------------------------------------------------ learning
    def observe(self, o: StepOutcome) -> bool:
        """Learn from one step the engine timed (``forward_rows`` > 0). True when it was a decoding
        step of a shape seen fewer than ``SAMPLES // 2`` times at its load (the prices it changes
        are worth repricing with at once)."""
        if o.forward_rows <= 0:
            return False
        self.forward.add(o.forward_rows, o.forward_seconds)
        R = len(o.requests)
        new = False
        if R and o.decode_only:
            curve = self.decode.setdefault(bucket(R), Curve())
            x = 1 + max(0, o.forward_rows - R)
            new = curve.count(x, within=0) < SAMPLES // 2
            curve.add(x, o.forward_seconds)
        if R:
            self.rest.add(R, max(0.0, o.seconds - o.forward_seconds - o.draft_seconds))
        calls = [r.drafted for r in o.requests if r.drafted and not r.free and not r.forced]
        if calls and o.draft_seconds > 0:
            depth = round(sum(calls) / len(calls))
            self.draft.add(len(calls), depth, o.draft_seconds, o.draft_rows)
            if depth == self.call_block:    # the numbers of requests the whole block was timed for
                b = bucket(len(calls))
                self.timed[b] = self.timed.get(b, 0) + 1
        self.observed += 1
        return new

    def missing(self, requests: int) -> int | None:
        """A depth to run a step at, every request drafting it, so that the costs can price steps
        at ``requests`` requests; None when they can. The forward is learned from every step
        (plain, prefilling, drafting) and priced between and beyond its samples, so it is never
        missing; the drafter's call is, until it has been timed drafting the whole block for a
        number of requests within a factor of 4 of this one (its price at other depths and loads
        comes from that and from the steps the policy chooses; ``timed`` counts the requests that
        drafted, not the step's load, so a quarter of a load's requests drafting measures it)."""
        b = bucket(requests)
        if sum(n for k, n in self.timed.items() if abs(k - b) <= 8) < 2:
            return self.call_block
        return None

    def _decode_curve(self, requests: int) -> Curve | None:
        """The decoding steps' curve a step of ``requests`` requests is priced from: the nearest
        load within ~40 % (two buckets) that has one."""
        b = bucket(requests)
        near = [k for k in self.decode if abs(k - b) <= 2 and self.decode[k]]
        return self.decode[min(near, key=lambda k: (abs(k - b), -k))] if near else None

    def plain_samples(self, requests: int) -> int:
        """How many plain decoding steps (nothing verified beyond the anchors) are kept for about
        ``requests`` requests. Without one, the decoding curve there starts at the fewest tokens
        seen verified and prices a plain step as dear as that: at a load first met drafting (a cold
        start at full load), drafting would look paying and no step would ever say otherwise."""
        c = self._decode_curve(requests)
        return 0 if c is None else len(c.buckets.get(bucket(1), ()))

    def forward_seconds(self, requests: int, rows: float) -> float:
        """The target's forward in a decoding step of ``requests`` requests over ``rows`` rows: from
        the decoding steps seen at the nearest load within ~40 % (two buckets), by the tokens
        verified beyond the anchors up to the most seen there, plus the all-steps curve's increment
        beyond them; the all-steps curve alone where no decoding step was seen at about that load."""
        c = self._decode_curve(requests)
        if c is None:
            return self.forward(rows)
        x = 1 + max(0.0, rows - requests)
        top = max(size for s in c.buckets.values() for size, _ in s)
        if x <= top:
            return c(x)
        return c(top) + max(0.0, self.forward(rows) - self.forward(requests + top - 1))

    def drafter_seconds(self, requests: int, depth: float) -> float:
        """The drafter's call for ``requests`` requests ``depth`` deep (``CallCost``)."""
        if depth <= 0 or not self.draft:
            return 0.0
        return self.draft(requests, depth)

    def table(self, max_requests: int) -> CostTable | None:
        """The cost table priced from what was learned (None before the first timed step): steps of
        1, 2, 4, ... requests up to ``max_requests``, every request verifying 0, 1, ... tokens."""
        if not self.forward:
            return None
        requests = sorted({2 ** i for i in range(max(1, max_requests).bit_length())} | {max(1, max_requests)})
        # columns at a fraction of a token a request (a few tokens in a step of many requests): the
        # first verified token costs a step more than the next (a block laid out and attended beside
        # the decoding rows), which the integer columns alone would spread over a whole token per
        # request; with 1/8 alone, one token at 32 requests was priced at a quarter of four tokens
        verified = [0, *FRACTIONS] + list(range(1, self.block + 1))
        seconds, draft = [], []
        for R in requests:
            d_row = [self.drafter_seconds(R, max(1, v)) if v else 0.0 for v in verified]
            seconds.append([self.forward_seconds(R, R * (1 + v)) + self.rest(R) + dv for v, dv in zip(verified, d_row)])
            draft.append(d_row)
        return CostTable(self.key, requests, verified, [1], [seconds], machine=machine_id(), draft=[draft])

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict:
        return {"key": self.key, "block": self.block, "call_block": self.call_block, "forward": self.forward.to_json(),
                "decode_verified": {str(b): c.to_json() for b, c in self.decode.items()},
                "rest": self.rest.to_json(), "draft_calls": self.draft.to_json(),
                "timed": {str(b): n for b, n in self.timed.items()}}

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.to_json()))
            os.replace(tmp, self.path)
        except OSError as e:            # a read-only cache costs the next run its learning, not this one
            log.warning("cannot save learned step costs to %s: %s", self.path, e)

    @classmethod
    def load_or_new(cls, key: str, block: int, path: Path | None, call_block: int | None = None) -> LearnedCosts:
        """The costs learned by an earlier run under ``key``, or empty ones; a file that cannot be
        read (corrupted, or from another block size) is set aside and learning starts afresh."""
        costs = cls(key, block, path, call_block)
        if path is None or not path.is_file():
            return costs
        try:
            d = json.loads(path.read_text())
            if d.get("key") != key or int(d.get("block", -1)) != block or \
                    int(d.get("call_block", -1)) != costs.call_block:
                raise ValueError("made for another drafter or block size")
            costs.forward = Curve.from_json(d["forward"])
            # "decode" (by rows) from before the curves were kept by verified tokens is relearned
            costs.decode = {int(k): Curve.from_json(v) for k, v in d.get("decode_verified", {}).items()}
            costs.rest = Curve.from_json(d["rest"])
            # "draft" (curves per depth) from before the call was fitted as one is relearned
            costs.draft = CallCost.from_json(d.get("draft_calls", []))
            costs.timed = {int(k): int(v) for k, v in d["timed"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring learned step costs in %s (%s): learning them again", path, e)
            return cls(key, block, path, call_block)
        return costs


def learned_path(key: str) -> Path:
    """Where the costs learned for a key live: beside `dspark profile`'s table for it."""
    return table_path(key).with_suffix(".learned.json")
