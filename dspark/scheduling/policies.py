"""The verification-length policies by name: plain, MTP-1, fixed block, confidence threshold, EMA
of acceptance, and the load-aware prefix (Algorithm 1) and async policies (prefix.py,
asynchronous.py), all behind the interface of base.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .asynchronous import AsyncPolicy
from .base import Policy, RequestStates, StepOutcome
from .prefix import PrefixPolicy

__all__ = ["Policy", "PlainPolicy", "FixedPolicy", "MTP1Policy", "ThresholdPolicy", "EMAPolicy",
           "PrefixPolicy", "AsyncPolicy", "POLICY_NAMES", "make_policy"]


class PlainPolicy(Policy):
    """No speculation: draft nothing, verify nothing, one token per request per step."""

    name = "plain"

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        return [0] * len(requests)


class FixedPolicy(Policy):
    """Verify a fixed block (or the whole proposal when it is shorter)."""

    name = "fixed"

    def __init__(self, num_draft: int | None = None):
        if num_draft is not None and num_draft < 0:
            raise UsageError(f"num_draft must be >= 0, got {num_draft}")
        self.num_draft = num_draft

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        return [block_size if self.num_draft is None else self.num_draft] * len(requests)


class MTP1Policy(FixedPolicy):
    """DeepSeek's production baseline: one drafted token per step."""

    name = "mtp1"

    def __init__(self):
        super().__init__(1)


class ThresholdPolicy(Policy):
    """Verify up to (not including) the first draft token whose confidence is below a threshold."""

    name = "threshold"

    def __init__(self, threshold: float = 0.5, num_draft: int | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise UsageError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold, self.num_draft = threshold, num_draft
        self.name = f"threshold-{threshold:g}"

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        return [self.num_draft or block_size] * len(requests)

    def verify_lengths(self, requests, proposals):
        out = []
        for p in proposals:
            n = len(p)
            if p.confidences is not None:
                below = [k for k, c in enumerate(p.confidences.tolist()) if c < self.threshold]
                n = below[0] if below else n
            out.append(n)
        return out


@dataclass
class EMAState:
    """What the EMA policy keeps of one request."""

    ema: float | None = None   # accepted tokens per drafted block, averaged (None: no block verified yet)
    drafts: int = 0            # drafted blocks verified since its last decision
    accepted: int = 0          # and their accepted tokens


class EMAPolicy(Policy):
    """Draft length from an exponential moving average of each request's accepted tokens per round."""

    name = "ema"

    def __init__(self, alpha: float = 0.3, num_draft: int | None = None, margin: int = 1):
        if not 0.0 < alpha <= 1.0:
            raise UsageError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha, self.num_draft, self.margin = alpha, num_draft, margin
        self.states: RequestStates[EMAState] = RequestStates(EMAState)

    def observe(self, outcome: StepOutcome) -> None:
        for o in outcome.requests:
            if o.speculated:
                st = self.states[o.request_id]
                st.drafts += 1
                st.accepted += o.accepted
        self.states.drop(outcome.ended)

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        cap = self.num_draft or block_size
        out = []
        for r in requests:
            st = self.states[r.id]
            if st.drafts:
                acc = st.accepted / st.drafts
                st.ema = (1 - self.alpha) * (acc if st.ema is None else st.ema) + self.alpha * acc
                st.drafts = st.accepted = 0
            ema = cap / 2 if st.ema is None else st.ema
            out.append(max(1, min(cap, round(ema) + self.margin)))
        return out


POLICY_NAMES = ("plain", "mtp1", "fixed", "threshold", "ema", "prefix", "async")


def make_policy(name: str, num_draft: int | None = None, *, cost_table=None, threshold: float = 0.5,
                ema_alpha: float = 0.3) -> Policy:
    """A policy by name; ``threshold-X`` sets the threshold inline (e.g. threshold-0.7)."""
    name = name.strip().lower()
    if name == "plain":
        return PlainPolicy()
    if name == "fixed":
        return FixedPolicy(num_draft)
    if name == "mtp1":
        return MTP1Policy()
    if name == "threshold" or name.startswith("threshold-"):
        if name != "threshold":
            try:
                threshold = float(name.split("-", 1)[1])
            except ValueError:
                raise UsageError(f"policy {name!r}: expected threshold-X with X a number") from None
        return ThresholdPolicy(threshold, num_draft)
    if name == "ema":
        return EMAPolicy(ema_alpha, num_draft)
    if name == "prefix":
        return PrefixPolicy(cost_table, num_draft)
    if name == "async":
        return AsyncPolicy(cost_table, num_draft)
    raise UsageError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
