"""The engine's cost table: seconds per full engine step (drafting + one verification forward)
as a function of the number of requests and of the tokens each verifies, at a few context
lengths, measured on this machine for one (target, drafter, dtype, device).

``dspark profile`` (evaluation/profile.py) measures and writes it; schedulers read
``step_seconds(requests, verified_tokens, context)`` (steps per second = 1 / that) to weigh a
longer verification against its cost.
"""

from __future__ import annotations

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


def table_key(target_name: str, drafter_name: str, dtype: str, device: str) -> str:
    return f"{target_name}|{drafter_name}|{dtype}|{device}"


def table_key_for(target, drafter) -> str:
    """The key of a loaded target (runtime.loading.Target) and drafter."""
    return table_key(target.name, drafter.name, str(target.model.dtype).replace("torch.", ""),
                     str(target.model.device))


def table_path(key: str) -> Path:
    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{h}.json"


@dataclass
class CostTable:
    key: str
    requests: list[int]          # R axis
    verified: list[int]          # drafted tokens verified per request (0 = plain step)
    contexts: list[int]          # context lengths
    seconds: list                # [context][R][verified] median seconds per engine step
    machine: str = ""

    def __post_init__(self):
        self._memo: dict = {}    # schedulers ask for the same few points every step

    def step_seconds(self, requests: int, verified: float, context: int) -> float:
        """Interpolated (linearly, clamped) seconds of one engine step at the nearest measured context."""
        c = min(range(len(self.contexts)), key=lambda i: abs(self.contexts[i] - context))
        key = (requests, verified, c)
        out = self._memo.get(key)
        if out is None:
            v_axis = np.asarray(self.verified, dtype=float)
            by_r = [np.interp(verified, v_axis, row) for row in np.asarray(self.seconds[c], dtype=float)]
            out = self._memo[key] = float(np.interp(requests, np.asarray(self.requests, dtype=float), by_r))
        return out

    def to_json(self) -> dict:
        return {"key": self.key, "requests": self.requests, "verified": self.verified,
                "contexts": self.contexts, "seconds": self.seconds, "machine": self.machine}

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
            t = cls(d["key"], d["requests"], d["verified"], d["contexts"], d["seconds"], d.get("machine", ""))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DsparkError(f"cannot read cost table {str(path)!r}: {e}; run `dspark profile` again") from None
        if np.asarray(t.seconds).shape != (len(t.contexts), len(t.requests), len(t.verified)):
            raise DsparkError(f"cost table {str(path)!r} is malformed; run `dspark profile` again")
        return t

    @classmethod
    def find(cls, key: str) -> "CostTable | None":
        path = table_path(key)
        if not path.is_file():
            log.warning("no cost table for %s: run `dspark profile` (policies that weigh cost fall "
                        "back to fixed blocks)", key)
            return None
        return cls.load(path)
