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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ..errors import DsparkError
from ..runtime.loading import cache_dir

log = logging.getLogger("dspark")


class StaleCostTable(DsparkError):
    """A table written by an older dspark, without the drafter's timings."""


def table_key(target_name: str, drafter_name: str, dtype: str, device: str) -> str:
    return f"{target_name}|{drafter_name}|{dtype}|{device}"


def table_key_for(target, drafter) -> str:
    """The key of a loaded target (runtime.loading.Target) and drafter."""
    return table_key(target.name, drafter.name, str(target.model.dtype).replace("torch.", ""),
                     str(target.model.device))


def table_path(key: str) -> Path:
    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{h}.json"


def _segment(axis: list, x: float) -> tuple[int, int, float]:
    """(i, i + 1, fraction) of x between axis[i] and axis[i + 1] (an increasing axis), clamped."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    i = bisect.bisect_right(axis, x) - 1
    return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclass
class CostTable:
    key: str
    requests: list[int]          # R axis
    verified: list[int]          # drafted tokens verified per request (0 = plain step)
    contexts: list[int]          # context lengths
    seconds: list                # [context][R][verified] median seconds per engine step
    machine: str = ""
    draft: list | None = None    # [context][R][verified] median seconds of the drafter's call in
                                 # those steps (None: not measured, counted as the target's)

    def __post_init__(self):
        self._memo: dict = {}    # schedulers ask for the same few points every step
        step = np.asarray(self.seconds, dtype=float)
        draft = np.zeros_like(step) if self.draft is None else np.asarray(self.draft, dtype=float)
        self._rows = {name: a.tolist() for name, a in (("step", step), ("draft", draft), ("target", step - draft))}
        self._least_drafted = min((v for v in self.verified if v > 0), default=1)   # a call's smallest measure

    def _interp(self, grid: str, requests: float, verified: float, context: int) -> float:
        """Bilinear interpolation (clamped at the edges) of a grid at the nearest measured context;
        plain Python on the few numbers involved: policies ask for hundreds of points a step."""
        c = min(range(len(self.contexts)), key=lambda i: abs(self.contexts[i] - context))
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

    def to_json(self) -> dict:
        return {"key": self.key, "requests": self.requests, "verified": self.verified,
                "contexts": self.contexts, "seconds": self.seconds, "draft": self.draft, "machine": self.machine}

    def save(self, path: Path | None = None) -> Path:
        path = Path(path) if path else table_path(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        try:
            d = json.loads(Path(path).read_text())
            t = cls(d["key"], d["requests"], d["verified"], d["contexts"], d["seconds"], d.get("machine", ""),
                    d.get("draft"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DsparkError(f"cannot read cost table {str(path)!r}: {e}; run `dspark profile` again") from None
        if t.draft is None:
            raise StaleCostTable(f"cost table {str(path)!r} was made by an older dspark (no drafter timings); "
                              "run `dspark profile` again")
        shape = (len(t.contexts), len(t.requests), len(t.verified))
        increasing = all(all(a < b for a, b in zip(ax, ax[1:])) for ax in (t.requests, t.verified, t.contexts))
        if np.asarray(t.seconds).shape != shape or np.asarray(t.draft).shape != shape or not increasing:
            raise DsparkError(f"cost table {str(path)!r} is malformed; run `dspark profile` again")
        return t

    @classmethod
    def find(cls, key: str) -> "CostTable | None":
        path = table_path(key)
        if not path.is_file():
            log.warning("no cost table for %s: run `dspark profile` (policies that weigh cost fall "
                        "back to fixed blocks)", key)
            return None
        try:
            return cls.load(path)
        except StaleCostTable as e:     # as if there were none: the policies that need one say so
            log.warning("%s", e)
            return None


class CostModel:
    """Seconds of an engine step, from the cost table, corrected online by the steps the engine
    reports. The table is measured once, on uniform steps, on the machine's state of that day;
    a serving step differs (ragged blocks, other contexts, a busier or quieter machine). Two
    factors, each an exponential average of measured / predicted: one for a plain step at the
    step's size, one for what drafting and verifying drafts add to it."""

    def __init__(self, cost_table, beta: float = 0.05):
        self.table = cost_table
        self.beta = beta
        self.base_scale = 1.0     # measured / table, plain steps
        self.extra_scale = 1.0    # measured / table, the part drafting adds
        self._pending = None      # (plain part, drafting part) predicted for the step being run
        self._measured = [[0.0, 0.0], [0.0, 0.0]]   # averages (measured, predicted): plain part, extra part

    def _parts(self, requests, extra, context, drafting, depth) -> tuple[float, float]:
        t = self.table
        per = max(0.0, extra / max(1, requests))
        base = t.target_seconds(requests, 0, context)
        if drafting is None:
            return base, t.step_seconds(requests, per, context) - base
        return base, t.target_seconds(requests, per, context) - base + t.drafter_seconds(drafting, depth, context)

    def seconds(self, requests: int, extra: float, context: int, drafting: int | None = None,
                depth: float = 0.0) -> float:
        """A step of R requests verifying ``extra`` drafted tokens in all (beyond the R anchors).
        ``drafting``: how many requests drafted, ``depth`` tokens each on average; None = all R,
        ``extra / R`` each (the table's own rows). Without a table every token is free (the
        fixed policy's view): 1 s a step whatever it verifies."""
        if self.table is None:
            return 1.0
        base, more = self._parts(requests, extra, context, drafting, depth)
        return base * self.base_scale + more * self.extra_scale

    def expect(self, requests: int, extra: float, context: int, drafting: int, depth: float) -> None:
        """The step about to run (what the policy chose), to compare with what it will cost."""
        if self.table is not None and requests:
            self._pending = self._parts(requests, extra, context, drafting, depth)

    def observe(self, seconds: float) -> None:
        """Ratio estimators (exponential averages of measured and of predicted seconds), so that a
        probe step whose drafting part is small next to the timing noise weighs little."""
        if self._pending is None:
            return
        base, more = self._pending
        self._pending = None
        plain = more <= 0
        measured, predicted = (seconds, base) if plain else (seconds - base * self.base_scale, more)
        m = self._measured[0 if plain else 1]
        if not m[1]:         # start from the table's own figure (ratio 1), as one earlier step
            m[0] = m[1] = predicted
        b = self.beta
        m[0], m[1] = (1 - b) * m[0] + b * measured, (1 - b) * m[1] + b * predicted
        scale = min(4.0, max(0.25, m[0] / m[1]))
        if plain:
            self.base_scale = scale
        else:
            self.extra_scale = scale
