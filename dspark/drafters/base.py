"""The one drafter interface: propose a block per request, with its probabilities and confidences.

Every drafter (n-gram lookup, an independent draft LM, the trained DSpark / DFlash / EAGLE-3
drafters) implements ``propose`` over a batch of requests. The engine then asks a policy how
many of the proposed tokens each request verifies, runs the target, and verifies with the
``probs`` returned here: they must be exactly the distributions the tokens were drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling import SamplingParams, argmax, race_sample, sample


@dataclass
class Proposal:
    tokens: torch.Tensor                      # [k] long
    probs: torch.Tensor | None = None         # [k, V] fp32 the tokens were drawn from; None = point masses
    confidences: torch.Tensor | None = None   # [k]: P(token j survives | tokens < j survived)
    free: bool = False                        # made without a drafter forward (a lookup): costs nothing to draft
    forced: bool = False                      # the tokens a request's grammar forces next (structured outputs)
    # how strong a free proposal's evidence is, for the policies to learn each strength's acceptance
    # apart: a lookup's matched suffix length (0: no such measure)
    evidence: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n],
                        None if self.confidences is None else self.confidences[:n], self.free, self.forced,
                        self.evidence)

    @staticmethod
    def empty() -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long))


@dataclass
class DraftContext:
    """What a drafter sees of one request."""

    tokens: list[int]               # prompt + output so far; the last one (the anchor) is not yet verified
    params: SamplingParams          # the drafter's sampling settings for this request
    generator: torch.Generator | None
    num_draft: int                  # how many tokens to propose this round (0 = none)
    state: dict[str, Any] = field(default_factory=dict)  # the drafter's own per-request state
    slot: int | None = None         # the request's slot in the drafter's own cache (drafters that keep one)
    # target features ([n, len(feature_layers) * d]) of the positions verified since the last round,
    # appended by the engine for drafters that declare ``feature_layers``; the drafter consumes them
    features: list = field(default_factory=list)
    # the request's structured.GrammarState, or None: a drafter may sample only what the grammar allows
    # (allowed_now / push / pop, undone before it returns); the proposal stays exactly its drawing law
    grammar: Any = None
    # a seeded sampled request (engine.py, ``exact_seed``): the verifier draws each of its tokens by
    # sampling.race_sample keyed by (params.seed, position); a drafter that races its own law with the
    # same keys proposes that token most often
    exact: bool = False


def draft_token(p: torch.Tensor, ctx: DraftContext, k: int, ids: torch.Tensor | None = None) -> int:
    """The k-th draft (0: the one after the anchor) from its law ``p`` [V] (column j is token
    ids[j], or j): its argmax for a greedy request, the race keyed by the request's seed and the
    draft's position for a seeded one (``DraftContext.exact``), else a draw from its generator;
    returns the column."""
    if ctx.params.greedy:
        return int(argmax(p))
    if ctx.exact:
        return int(race_sample(p[None], [ctx.params.seed], [len(ctx.tokens) + k], ids=ids)[0])
    return int(sample(p, ctx.generator))


class Drafter:
    """Base class. ``block_size`` is the default number of drafted tokens per round (gamma)."""

    name = "drafter"
    block_size = 0
    feature_layers: tuple[int, ...] = ()   # target layers a learned drafter conditions on

    @property
    def call_block_size(self) -> int:
        """The most tokens one call of the drafter's model drafts (a hybrid's lookups may propose
        longer blocks than its trained drafter ever drafts)."""
        return self.block_size

    def prepare(self, max_requests: int, max_len: int) -> None:
        """Reserve room for ``max_requests`` concurrent requests of up to ``max_len`` tokens."""

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        raise NotImplementedError

    def free_lengths(self, contexts: list[DraftContext]) -> list[int]:
        """How many tokens each request could be proposed this round without a drafter forward (a
        lookup's), asked before the policy sets ``num_draft``; the proposal itself comes from
        ``propose`` as usual. Only a cost-weighing policy asks."""
        return [0] * len(contexts)

    def release(self, context: DraftContext) -> None:
        """The request ended (finished or cancelled): free what it held."""

    def reset(self) -> None:
        """Forget what earlier requests taught the drafter, as a freshly started server would."""


class PlainDrafter(Drafter):
    """No drafting: every round verifies only the anchor, i.e. plain decoding."""

    name = "plain"

    def propose(self, contexts):
        return [Proposal.empty() for _ in contexts]
