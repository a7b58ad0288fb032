"""The engine's cost table: seconds per full engine step (drafting + one verification forward)
as a function of the number of requests and of the tokens each verifies, at a few context
lengths, measured on this machine for one (target, drafter, dtype, device); and, of each step,
the seconds of the drafter's call.

``dspark profile`` (evaluation/profile.py) measures and writes it; schedulers read
``step_seconds(requests, verified_tokens, context)`` (steps per second = 1 / that) to weigh a
longer verification against its cost. A step in which only some requests draft is priced as the
target's part of a step (``target_seconds``) plus the drafter's call for those requests
(``drafter_seconds``): a drafter call costs much the same for one token as for several, which an
interpolation of whole steps would price at a fraction. ``CostModel`` is what the policies price
steps with: the table, corrected online by the step times the engine measures.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ..errors import DsparkError
from ..runtime.linear import PackedWeight
from ..runtime.loading import cache_dir

log = logging.getLogger("dspark")


class StaleCostTable(DsparkError):
    """A table written by an older dspark, without the drafter's timings."""


def table_key(target_name: str, drafter_name: str, dtype: str, device: str) -> str:
    return f"{target_name}|{drafter_name}|{dtype}|{device}"


def table_key_for(target, drafter) -> str:
    """The key of a loaded target (runtime.loading.Target) and drafter. A runtime whose products
    run on packed weights (runtime/linear.py) prices its steps differently, so its device is
    keyed apart ("cpu+packed"): a table profiled before packing existed is not found, not misread."""
    device = str(target.model.device)
    layers = getattr(target.model, "layers", None)
    if layers and isinstance(layers[0].qkv, PackedWeight):
        device += "+packed"
    return table_key(target.name, drafter.name, str(target.model.dtype).replace("torch.", ""), device)


def table_path(key: str) -> Path:
    """Where a key's measured table lives (and, beside it, the costs learned while serving):
    ``$DSPARK_PROFILES`` if set, else the user cache's profiles/. Timings belong to the machine
    that took them unshared: the test suite points this elsewhere, so that its steps, run beside
    other tests, never price a user's server."""
    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("DSPARK_PROFILES")
    return (Path(root) if root else cache_dir() / "profiles") / f"{h}.json"


def _segment(axis: list, x: float) -> tuple[int, int, float]:
    """(i, i + 1, fraction) of x between axis[i] and axis[i + 1] (an increasing axis), clamped."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    i = bisect.bisect_right(axis, x) - 1
    return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])


def isotonic(y) -> list[float]:
    """The non-decreasing sequence nearest to ``y`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []          # [sum, count] of pooled runs
    for v in y:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def monotone(grid: np.ndarray, rounds: int = 8) -> np.ndarray:
    """A [requests, verified] grid made non-decreasing along both axes: isotonic fits of each row and
    then each column, alternately, until both hold (a few rounds on these small grids)."""
    g = np.array(grid, dtype=float)
    for _ in range(rounds):
        g = np.array([isotonic(row) for row in g])
        g = np.array([isotonic(col) for col in g.T]).T
        if (np.diff(g, axis=1) >= -1e-12).all():
            break
    return g


@dataclass
class CostTable:
    key: str
    requests: list[int]          # R axis
    verified: list               # drafted tokens verified per request (0 = plain step; a learned
                                 # table also has a fractional column, see scheduling/learned.py)
    contexts: list[int]          # context lengths
    seconds: list                # [context][R][verified] median seconds per engine step
    machine: str = ""
    draft: list | None = None    # [context][R][verified] median seconds of the drafter's call in
                                 # those steps (None: not measured, counted as the target's)
    context_row: float = 0.0     # seconds the drafter takes per context row it catches up on (the
                                 # positions a request verified since it last drafted)
    prefill: list | None = None  # [a, b]: a step prefilling n prompt tokens (and decoding none) takes
                                 # a + b x n seconds (None: not measured, see ``prefill_fit``)

    def __post_init__(self) -> None:
        self._memo: dict = {}    # schedulers ask for the same few points every step
        step = np.asarray(self.seconds, dtype=float)
        draft = np.zeros_like(step) if self.draft is None else np.asarray(self.draft, dtype=float)
        # The prices the policies read: medians of a few steps on a machine that drifts are off by
        # up to 10 % a cell, and a cell priced above its neighbours misleads a search that weighs
        # small differences (a plain step of 2 requests dearer than one verifying a token each).
        # A step over more rows, or a drafter call over more requests or tokens, does not cost
        # less: the target's part and the drafter's call (over the drafting columns) are fitted
        # non-decreasing along requests and verified tokens; ``seconds`` / ``draft`` keep the
        # measurements.
        target = np.stack([monotone(g) for g in step - draft])
        cols = [i for i, v in enumerate(self.verified) if v > 0]
        if self.draft is not None and cols:
            draft = draft.copy()
            draft[:, :, cols] = np.stack([monotone(g[:, cols]) for g in draft])
        self._rows = {name: a.tolist() for name, a in (("step", target + draft), ("draft", draft), ("target", target))}
        # a call's smallest measure (a learned table's fractional column prices verification only)
        self._least_drafted = min((v for v in self.verified if v >= 1), default=1)
        self._mids = [(a + b) / 2 for a, b in zip(self.contexts, self.contexts[1:])]

    def context_column(self, context: float) -> int:
        """The measured context nearest to ``context`` (the lower one on a tie)."""
        return bisect.bisect_left(self._mids, context)

    def _interp(self, grid: str, requests: float, verified: float, context: int) -> float:
        """Bilinear interpolation (clamped at the edges) of a grid at the nearest measured context;
        plain Python on the few numbers involved: policies ask for hundreds of points a step."""
        c = self.context_column(context)
        key = (grid, requests, verified, c)
        out = self._memo.get(key)
        if out is None:
            r0, r1, fr = _segment(self.requests, requests)
            v0, v1, fv = _segment(self.verified, verified)
            g = self._rows[grid][c]
            lo = g[r0][v0] + fv * (g[r0][v1] - g[r0][v0])
            hi = g[r1][v0] + fv * (g[r1][v1] - g[r1][v0])
            out = lo + fr * (hi - lo)
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = out
        return out

    def step_seconds(self, requests: int, verified: float, context: int) -> float:
        """Seconds of one engine step in which every request drafts and verifies ``verified`` tokens."""
        return self._interp("step", requests, verified, context)

    def drafter_seconds(self, requests: int, drafted: float, context: int) -> float:
        """Seconds of one drafter call over ``requests`` requests drafting ``drafted`` tokens each."""
        if self.draft is None or requests <= 0 or drafted <= 0:
            return 0.0
        return self._interp("draft", requests, max(drafted, self._least_drafted), context)

    def target_seconds(self, requests: int, verified: float, context: int) -> float:
        """The rest of such a step: the target's forward over R anchors + R * verified drafted
        tokens, verification and the engine's own work."""
        return self._interp("target", requests, verified, context)

    def target_seconds_many(self, requests: int, verified: np.ndarray, context: int) -> np.ndarray:
        """``target_seconds`` at many verified lengths per request (one R, one context)."""
        c = self.context_column(context)
        r0, r1, fr = _segment(self.requests, requests)
        g = self._rows["target"][c]
        curve = [a + fr * (b - a) for a, b in zip(g[r0], g[r1])]
        return np.interp(verified, self.verified, curve)

    def prefill_fit(self) -> tuple[float, float]:
        """(a, b): a step prefilling n prompt tokens alone takes a + b x n seconds, and b x n beside
        decoding requests. Where the profile did not measure it: a verified row's price at the most
        requests and tokens the table holds (a prompt row costs the forward as much), and a plain
        step of one request for a."""
        if self.prefill:
            return float(self.prefill[0]), float(self.prefill[1])
        R, v = self.requests[-1], self.verified[-1]
        c = self.contexts[0]
        b = (self.target_seconds(R, v, c) - self.target_seconds(R, 0, c)) / max(1, R * v)
        return self.target_seconds(1, 0, c), max(0.0, b)

    def to_json(self) -> dict:
        return {"key": self.key, "requests": self.requests, "verified": self.verified,
                "contexts": self.contexts, "seconds": self.seconds, "draft": self.draft, "machine": self.machine,
                "context_row": self.context_row, "prefill": self.prefill}

    def save(self, path: Path | None = None) -> Path:
        path = Path(path) if path else table_path(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> CostTable:
        try:
            d = json.loads(Path(path).read_text())
            t = cls(d["key"], d["requests"], d["verified"], d["contexts"], d["seconds"], d.get("machine", ""),
                    d.get("draft"), float(d.get("context_row", 0.0)), d.get("prefill"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DsparkError(f"cannot read cost table {str(path)!r}: {e}; run `dspark profile` again") from None
        if t.draft is None:
            raise StaleCostTable(f"cost table {str(path)!r} was made by an older dspark (no drafter timings); "
                              "run `dspark profile` again")
        shape = (len(t.contexts), len(t.requests), len(t.verified))
        increasing = all(all(a < b for a, b in zip(ax, ax[1:])) for ax in (t.requests, t.verified, t.contexts))
        prefill_ok = t.prefill is None or (isinstance(t.prefill, list) and len(t.prefill) == 2
                                           and all(isinstance(x, (int, float)) and x >= 0 for x in t.prefill))
        if (np.asarray(t.seconds).shape != shape or np.asarray(t.draft).shape != shape or not increasing
                or not prefill_ok):
            raise DsparkError(f"cost table {str(path)!r} is malformed; run `dspark profile` again")
        return t

    @classmethod
    def find(cls, key: str, warn: bool = True) -> CostTable | None:
        """The table `dspark profile` measured for ``key``, or None (said where ``warn``)."""
        path = table_path(key)
        if not path.is_file():
            if warn:
                log.warning("no cost table for %s: run `dspark profile`, or use the auto policy (it learns "
                            "the costs while it serves)", key)
            return None
        try:
            return cls.load(path)
        except StaleCostTable as e:     # as if there were none: the policies that need one say so
            log.warning("%s", e)
            return None


class CostModel:
    """Seconds of an engine step, from the cost table, corrected online by the steps the engine
    reports. The table is measured once, on uniform steps, on the machine's state of that day; a
    serving step differs (ragged blocks, other contexts, a busier or quieter machine). A step is
    priced pace x (plain part + rho x hurdle x drafting part) (the hurdle, 1 unless a policy sets
    it, prices verification over its expected cost; see ``hurdle_at`` and ``AutoPolicy``):

    - pace, the machine's speed now: measured / table over the plain steps of the last ``window``
      observed steps (1 before any plain step), against the table in use: where the table is
      replaced (the auto policy rebuilds it from what it learns), a ratio to the old one would
      misprice every step by the old table's error (at a cold start, a table priced from prompt
      prefills can be several times off, and every price with it until the window has passed).
      It scales every price alike, so it never changes a decision
      between drafting and not, but rho is learned from prices divided by it;
    - rho, what drafting really costs relative to the table: from drafting steps, their time over
      the pace, less the plain part, against the table's drafting part (ratio of exponential
      averages, so that a probe's small part weighs little). It is learned only while the pace is
      fresh: a drafting step is compared with plain steps of the same minutes. Without that, a slow
      spell over plain steps followed by drafting steps only reads as drafting being cheap, and the
      policy keeps drafting and never sees a plain step to undo it. ``since_plain`` tells the
      policies how long the pace has gone without a plain step, so that they run one now and then
      while drafting."""

    def __init__(self, cost_table, beta: float = 0.05, window: int = 48):
        self.table = cost_table
        self.beta = beta
        self.window = window
        self.extra_scale = 1.0    # rho
        # what a step's verification part is priced at over its expected cost (see ``AutoPolicy``):
        # ``hurdle`` at ``hurdle_load`` requests and beyond, none at one, in proportion between
        self.hurdle = 1.0
        self.hurdle_load = 32
        self.since_plain = 0      # observed steps since the last plain one
        # (plain part, drafting part, requests, context) predicted for the step being run
        self._pending: tuple[float, float, int, int] | None = None
        self._step = 0            # observed steps so far
        self._plain: deque = deque(maxlen=8)   # (step, seconds, requests, context) of recent plain steps
        self._extra = [0.0, 0.0]  # averages of (measured, predicted) drafting parts

    @property
    def pace(self) -> float | None:
        """measured / table over the fresh plain steps (priced by the table in use); 1 before any or
        without a table; None when all are stale."""
        if not self._plain or self.table is None:
            return 1.0
        fresh = [s / self.table.target_seconds(r, 0, c) for step, s, r, c in self._plain if self._step - step < self.window]
        return sum(fresh) / len(fresh) if fresh else None

    def hurdle_at(self, requests: int) -> float:
        """The factor on a step's verification part at this load: 1 at one request, ``hurdle`` from
        ``hurdle_load`` requests on, in proportion between."""
        share = min(1.0, max(0, requests - 1) / max(1, self.hurdle_load - 1))
        return 1.0 + (self.hurdle - 1.0) * share

    def context_index(self, context: int) -> int:
        """The table's context column a step at this context is priced from (-1 without a table)."""
        if self.table is None:
            return -1
        return self.table.context_column(context)

    def parts(self, requests, extra, context, drafting, depth, rows: int = 0) -> tuple[float, float]:
        """The table's (plain part, drafting part) of a step, uncorrected; ``rows``: context rows
        the drafting requests hand the drafter beyond their steady rounds."""
        t = self.table
        per = max(0.0, extra / max(1, requests))
        base = t.target_seconds(requests, 0, context)
        if drafting is None:
            return base, t.step_seconds(requests, per, context) - base + t.context_row * rows
        return base, t.target_seconds(requests, per, context) - base + self._call(drafting, depth, context, rows)

    def _call(self, drafting: int, depth: float, context: int, rows: int) -> float:
        """The drafter's call: ``drafting`` requests ``depth`` tokens deep, ``rows`` catch-up rows."""
        return self.table.drafter_seconds(drafting, depth, context) + self.table.context_row * rows

    def seconds(self, requests: int, extra: float, context: int, drafting: int | None = None,
                depth: float = 0.0, rows: int = 0) -> float:
        """A step of R requests verifying ``extra`` drafted tokens in all (beyond the R anchors).
        ``drafting``: how many requests drafted, ``depth`` tokens each on average; None = all R,
        ``extra / R`` each (the table's own rows). Without a table every token is free (the
        fixed policy's view): 1 s a step whatever it verifies."""
        if self.table is None:
            return 1.0
        base, more = self.parts(requests, extra, context, drafting, depth, rows)
        return (self.pace or 1.0) * (base + more * self.extra_scale * self.hurdle_at(requests))

    def pricer(self, requests: int, context: int, drafting: int, depth: float, rows: int = 0):
        """``seconds(requests, extra, context, drafting, depth, rows)`` as a function of ``extra``
        alone (a number, or an array of them priced in one vectorised call), with the parts that do
        not depend on it priced once: Algorithm 1 prices one step's candidate prefixes."""
        t = self.table
        if t is None:
            return lambda extra: np.ones_like(extra, dtype=float) if isinstance(extra, np.ndarray) else 1.0
        base = t.target_seconds(requests, 0, context)
        call = self._call(drafting, depth, context, rows)
        pace, scale, n = self.pace or 1.0, self.extra_scale * self.hurdle_at(requests), max(1, requests)

        def seconds(extra):
            if isinstance(extra, np.ndarray):
                target = t.target_seconds_many(requests, np.maximum(extra, 0) / n, context)
            else:
                target = t.target_seconds(requests, max(0.0, extra / n), context)
            return pace * (base + (target - base + call) * scale)
        return seconds

    def seconds_many(self, requests: int, extra: np.ndarray, context: int, depths, rows,
                     drafting: int | None = None) -> np.ndarray:
        """``seconds`` of steps of R requests in which ``drafting`` of them (None: all R) draft d tokens
        with the drafter's forward and ``extra`` drafted tokens are verified in all: ``extra``
        [len(depths), n], row i at depth ``depths[i]`` (0: no call) with ``rows[i]`` catch-up rows.
        A table without the drafter's timings prices every such step as its own row (every drafted
        token verified)."""
        extra = np.asarray(extra, dtype=float)
        t = self.table
        if t is None:
            return np.ones_like(extra)
        if t.draft is None:
            return np.array([[self.seconds(requests, requests * d, context, rows=n)] for d, n in zip(depths, rows)]
                            ) + np.zeros_like(extra)
        base = t.target_seconds(requests, 0, context)
        calls = requests if drafting is None else drafting
        fixed = np.array([[t.drafter_seconds(calls, d, context) + t.context_row * n] for d, n in zip(depths, rows)])
        more = t.target_seconds_many(requests, np.maximum(extra, 0) / max(1, requests), context) - base + fixed
        return (self.pace or 1.0) * (base + more * self.extra_scale * self.hurdle_at(requests))

    def expect(self, requests: int, extra: float, context: int, drafting: int, depth: float,
               rows: int = 0) -> None:
        """The step about to run (what the policy chose), to compare with what it will cost."""
        if self.table is not None and requests:
            self._pending = (*self.parts(requests, extra, context, drafting, depth, rows), requests, context)

    def observe(self, seconds: float, learn: bool = True) -> tuple[float, float] | None:
        """The measured time of the step last expected. Returns a drafting step's (measured,
        predicted) drafting part when the pace is fresh, else None; ``learn=False`` keeps it out of
        rho (steps unlike the ones rho prices, e.g. one-token probes)."""
        if self._pending is None:
            return None
        base, more, requests, context = self._pending
        self._pending = None
        self._step += 1
        if more <= 0:
            self._plain.append((self._step, seconds, requests, context))
            self.since_plain = 0
            return None
        self.since_plain += 1
        pace = self.pace
        if pace is None:        # no plain step of late to tell drift from drafting's price
            return None
        if not learn:
            return seconds / pace - base, more
        m = self._extra
        if not m[1]:            # start from the table's own figure (ratio 1), as one earlier step
            m[0] = m[1] = more
        b = self.beta
        m[0], m[1] = (1 - b) * m[0] + b * (seconds / pace - base), (1 - b) * m[1] + b * more
        self.extra_scale = min(4.0, max(0.25, m[0] / m[1]))
        return seconds / pace - base, more
