"""An independent draft LM that shares the target's tokenizer, run on our own runtime.

The draft model keeps its own KV cache slot per request. Each round it catches up on the tokens
it has not seen (the accepted drafts and the new token, found as the common prefix with what its
cache holds) in one forward, then samples the block one token at a time, all requests of the
batch in one ragged forward per step. Tokens are drawn with the request's own generator from
the fp32 distributions that the verifier then uses in its acceptance ratio.
"""

from __future__ import annotations

import torch

from ..runtime.kv_cache import KVCache
from ..runtime.model import Decoder
from ..sampling import probs_from_logits
from .base import DraftContext, Drafter, Proposal, draft_token


class DraftLMDrafter(Drafter):
    def __init__(self, model: Decoder, block_size: int = 4, name: str = "draft-lm"):
        self.model = model
        self.block_size = block_size
        self.name = name
        self.cache: KVCache | None = None

    def prepare(self, max_requests: int, max_len: int) -> None:
        c = self.cache
        if c is None or c.num_slots < max_requests or c.max_len < max_len:
            if c is not None and c.num_free != c.num_slots:
                raise RuntimeError("cannot resize the draft cache while requests are in flight")
            self.cache = self.model.new_cache(max_requests, max_len)

    def _slot(self, ctx: DraftContext) -> int:
        if ctx.slot is None:
            if self.cache is None:
                self.prepare(1, max(1024, 2 * len(ctx.tokens)))
            assert self.cache is not None   # prepare allocated it
            ctx.slot = self.cache.allocate()
            ctx.state["cached"] = []
        return ctx.slot

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        active = [c for c in contexts if c.num_draft > 0]
        results = {id(c): Proposal.empty() for c in contexts}
        if not active:
            return [results[id(c)] for c in contexts]
        # 1. catch up: feed what each request's cache lacks (always at least the anchor)
        ids, segments = [], []
        for ctx in active:
            slot = self._slot(ctx)
            assert self.cache is not None   # _slot allocated it
            cached = ctx.state["cached"]
            common = 0
            limit = min(len(cached), len(ctx.tokens) - 1)
            while common < limit and cached[common] == ctx.tokens[common]:
                common += 1
            self.cache.truncate(slot, common)
            new = ctx.tokens[common:]
            ctx.state["cached"] = list(ctx.tokens)
            ids.extend(new)
            segments.append((slot, len(new)))
        cache = self.cache
        assert cache is not None   # _slot allocated it (active is not empty)
        out = self.model(torch.tensor(ids, dtype=torch.long), segments, cache, logits_rows="last")
        logits = out.logits
        assert logits is not None   # logits_rows="last"
        drafted: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        steps = max(c.num_draft for c in active)
        for step in range(steps):
            feed, feed_seg, feed_idx = [], [], []
            for i, ctx in enumerate(active):
                if step >= ctx.num_draft:
                    continue
                p = probs_from_logits(logits[i], ctx.params)
                tok = draft_token(p, ctx, step)
                drafted[i].append(tok)
                probs[i].append(p)
                if step + 1 < ctx.num_draft:  # the last draft never needs to be fed
                    feed.append(tok)
                    feed_seg.append((self._slot(ctx), 1))
                    feed_idx.append(i)
                    ctx.state["cached"].append(tok)
            if not feed:
                break
            out = self.model(torch.tensor(feed, dtype=torch.long), feed_seg, cache)
            assert out.logits is not None   # logits_rows="all" (the default)
            logits = logits.clone()
            logits[torch.tensor(feed_idx)] = out.logits
        for i, ctx in enumerate(active):
            results[id(ctx)] = Proposal(torch.tensor(drafted[i], dtype=torch.long), torch.stack(probs[i]))
        return [results[id(c)] for c in contexts]

    def release(self, ctx: DraftContext) -> None:
        slot, ctx.slot = ctx.slot, None
        if slot is not None:
            assert self.cache is not None   # the slot came from it
            self.cache.free(slot)
