"""Verification-length policies behind one interface.

Each engine step a policy first says how many tokens to draft for each request
(``draft_lengths``), then, seeing the proposals (tokens, probabilities, confidences), how many of
them each request verifies (``verify_lengths``). A policy may only look at information available
before the target verifies, so whatever it decides, the output stays the target's distribution.
"""

from __future__ import annotations

from ..errors import UsageError


class Policy:
    name = "policy"
    # True: before draft_lengths, the engine leaves in each request's ``ctx.state["_free"]`` how many
    # tokens the drafter could propose it without a forward (Drafter.free_lengths)
    uses_free_drafts = False

    def draft_lengths(self, requests, block_size: int) -> list[int]:
        """Tokens to draft per request (before clipping to what each request may still emit)."""
        return [block_size] * len(requests)

    def verify_lengths(self, requests, proposals) -> list[int]:
        return [len(p) for p in proposals]

    def observe_step(self, seconds: float) -> None:
        """The wall time of the decoding step just decided (steps that also prefilled are not
        reported): policies that weigh cost correct their cost table with it."""


class PlainPolicy(Policy):
    """No speculation: draft nothing, verify nothing, one token per request per step."""

    name = "plain"

    def draft_lengths(self, requests, block_size):
        return [0] * len(requests)


class FixedPolicy(Policy):
    """Verify a fixed block (or the whole proposal when it is shorter)."""

    name = "fixed"

    def __init__(self, block: int | None = None):
        if block is not None and block < 0:
            raise UsageError(f"block must be >= 0, got {block}")
        self.block = block

    def draft_lengths(self, requests, block_size):
        return [block_size if self.block is None else self.block] * len(requests)


class MTP1Policy(FixedPolicy):
    """DeepSeek's production baseline: one drafted token per step."""

    name = "mtp1"

    def __init__(self):
        super().__init__(1)


POLICY_NAMES = ("plain", "mtp1", "fixed", "threshold", "ema", "prefix", "async")


def make_policy(name: str, block: int | None = None, *, cost_table=None, threshold: float = 0.5,
                ema_alpha: float = 0.3) -> Policy:
    """A policy by name; ``threshold-X`` sets the threshold inline (e.g. threshold-0.7)."""
    name = name.strip().lower()
    if name == "plain":
        return PlainPolicy()
    if name == "fixed":
        return FixedPolicy(block)
    if name == "mtp1":
        return MTP1Policy()
    from . import confidence
    if name == "threshold" or name.startswith("threshold-"):
        if name != "threshold":
            try:
                threshold = float(name.split("-", 1)[1])
            except ValueError:
                raise UsageError(f"policy {name!r}: expected threshold-X with X a number") from None
        return confidence.ThresholdPolicy(threshold, block)
    if name == "ema":
        return confidence.EMAPolicy(ema_alpha, block)
    if name == "prefix":
        return confidence.PrefixPolicy(cost_table, block)
    if name == "async":
        return confidence.AsyncPolicy(cost_table, block)
    raise UsageError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
