"""Batch-1 speculative generation: prefill, then rounds of draft -> one target forward -> verify.

Plain decoding is the same loop with a drafter that proposes nothing (each round verifies only
the anchor and emits one token), so both paths share every line that touches the target.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .drafters.base import DraftContext, Drafter, PlainDrafter, Proposal
from .runtime.model import Decoder
from .sampling import SamplingParams, sample_from_logits
from .verify import verify


@dataclass
class GenerationStats:
    """Per-call counters, named as vLLM's spec-decode metrics."""

    num_tokens: int = 0              # new tokens emitted
    num_rounds: int = 0              # target forwards after prefill
    num_drafts: int = 0              # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)
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


@torch.inference_mode()
def generate_ids(target: Decoder, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 drafter: Drafter | None = None, *, num_draft: int | None = None,
                 eos_ids: tuple[int, ...] = (), stream=None) -> tuple[list[int], GenerationStats]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; returns (new ids, stats).

    ``num_draft`` tokens are drafted per round (default: the drafter's block size). ``stream``,
    if given, is called with each list of newly emitted tokens.
    """
    drafter = drafter or PlainDrafter()
    k = drafter.block_size if num_draft is None else num_draft
    stats = GenerationStats(accepted_per_position=[0] * k)
    t0 = time.perf_counter()
    max_len = len(prompt_ids) + max_new_tokens + k + 1
    cache = target.new_cache(1, max_len)
    slot = cache.allocate()
    drafter.prepare(1, max_len)
    gen = params.generator(target.device)
    eos = set(eos_ids)

    out = target(torch.tensor(prompt_ids, dtype=torch.long), [(slot, len(prompt_ids))], cache,
                 logits_rows="last")
    first, _ = sample_from_logits(out.logits[0], params, gen)
    new = [int(first)]
    stats.prefill_seconds = time.perf_counter() - t0
    if stream:
        stream(new[:])
    ctx = DraftContext(list(prompt_ids) + new, params, gen, k)
    try:
        done = new[0] in eos or max_new_tokens <= 1
        if done and new[0] in eos:
            stats.finish_reason = "stop"
        while not done:
            ctx.num_draft = min(k, max_new_tokens - len(new) - 1)
            prop = drafter.propose([ctx])[0] if ctx.num_draft > 0 else Proposal.empty()
            if len(prop) > ctx.num_draft:
                prop = prop.truncate(ctx.num_draft)
            l = len(prop)
            base = cache.lengths[slot]
            inp = torch.cat([torch.tensor([ctx.tokens[-1]], dtype=torch.long), prop.tokens])
            out = target(inp, [(slot, l + 1)], cache)
            n, nxt = verify(prop.tokens, prop.probs, out.logits, params, gen)
            cache.truncate(slot, base + 1 + n)
            stats.num_rounds += 1
            if l:
                stats.num_drafts += 1
                stats.num_draft_tokens += l
                stats.num_accepted_tokens += n
                for i in range(n):
                    stats.accepted_per_position[i] += 1
            emitted = prop.tokens[:n].tolist() + [nxt]
            for i, t in enumerate(emitted):
                if t in eos:
                    emitted = emitted[:i + 1]
                    stats.finish_reason = "stop"
                    done = True
                    break
            emitted = emitted[:max_new_tokens - len(new)]
            new.extend(emitted)
            ctx.tokens.extend(emitted)
            if stream:
                stream(emitted)
            if len(new) >= max_new_tokens:
                done = True
    finally:
        drafter.release(ctx)
    stats.num_tokens = len(new)
    stats.seconds = time.perf_counter() - t0
    return new, stats
