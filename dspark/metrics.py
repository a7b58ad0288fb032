"""Per-request counters, named as vLLM's spec-decode metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Per-call counters, named as vLLM's spec-decode metrics."""

    num_tokens: int = 0              # new tokens emitted
    num_rounds: int = 0              # target forwards after prefill
    num_drafts: int = 0              # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forced_tokens: int = 0       # tokens a grammar forced, proposed instead of drafts and accepted (not drafts)
    accepted_per_position: list = field(default_factory=list)
    num_cached_tokens: int = 0       # prompt tokens found in the prefix cache, not run (vLLM's RequestOutput field)
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    finish_reason: str = "length"

    @property
    def accept_length(self) -> float:
        """Tokens emitted per round, bonus included (the prefill's token is not a round)."""
        return (self.num_tokens - 1) / self.num_rounds if self.num_rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        d["tokens_per_second"] = self.tokens_per_second
        return d
