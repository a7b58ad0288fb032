"""n-gram lookup where the text repeats itself, a trained drafter everywhere else.

Copying what followed an earlier occurrence of the last few tokens is nearly free and, where a
long suffix matches (code that restates its own names, the steps of a word problem, phrasing
shared with earlier answers), accepted over long spans; a trained drafter costs a forward of its
own and is accepted a token or two at a time, but anywhere. ``HybridDrafter`` asks the lookup
first and keeps its proposal when the matched suffix is at least ``min_match`` tokens long; the
other requests of the step go to the trained drafter in one batched call. (SuffixDecoding and
Arctic Inference's hybrid with a model drafter choose between the two the same way, per request
and round.)

Both kinds of proposal are verified exactly as alone: the lookup's as point masses, the trained
drafter's against the distributions it sampled from, so the output keeps the target's
distribution. A request the lookup serves does not call the trained drafter; the target features
of its verified positions wait in its context and the trained drafter takes them in at its next
call, as after any round without drafting.
"""

from __future__ import annotations

from typing import cast

from .base import DraftContext, Drafter, Proposal
from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    def __init__(self, lookup: NgramDrafter, model: Drafter, min_match: int = 1):
        if min_match < 1:
            raise ValueError("min_match must be >= 1")
        self.lookup, self.model, self.min_match = lookup, model, min_match
        self.name = f"{lookup.name}+{model.name}"
        self.block_size = max(lookup.block_size, model.block_size)
        self.feature_layers = model.feature_layers
        self.served = [0, 0]    # proposals made by (the lookup, the trained drafter)

    @property
    def call_block_size(self) -> int:
        return self.model.call_block_size

    def prepare(self, max_requests: int, max_len: int) -> None:
        self.lookup.prepare(max_requests, max_len)
        self.model.prepare(max_requests, max_len)

    def free_lengths(self, contexts: list[DraftContext]) -> list[int]:
        """The lookup's proposal length where the lookup would serve the request, else 0."""
        out = []
        for ctx in contexts:
            p, n = self.lookup.match(ctx)
            out.append(len(p) if n >= self.min_match else 0)
        return out

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        out: list[Proposal | None] = []
        rest = []
        for i, ctx in enumerate(contexts):
            p, n = self.lookup.match(ctx) if ctx.num_draft > 0 else (Proposal.empty(), 0)
            if n >= self.min_match and len(p):
                out.append(p.truncate(ctx.num_draft))
            else:
                out.append(None)
                rest.append(i)
        self.served[0] += len(contexts) - len(rest)
        if rest:
            self.served[1] += len(rest)
            for i, p in zip(rest, self.model.propose([contexts[i] for i in rest])):
                out[i] = p
        return cast(list[Proposal], out)   # the model filled every None (one proposal per context)

    def release(self, context: DraftContext) -> None:
        self.lookup.release(context)
        self.model.release(context)

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
        self.served = [0, 0]
