"""Batch-1 generation: one request through the engine (one engine for every path).

Plain decoding is the same path with a drafter that proposes nothing: each step verifies only the
anchor and emits one token, so both share every line that touches the target.
"""

from __future__ import annotations

from .drafters.base import Drafter, PlainDrafter
from .engine import Engine, RequestOptions
from .metrics import GenerationStats
from .runtime.model import Decoder
from .sampling import SamplingParams
from .scheduling.policies import FixedPolicy, Policy


def generate_ids(target: Decoder, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 drafter: Drafter | None = None, *, num_draft: int | None = None,
                 eos_ids: tuple[int, ...] = (), stream=None, policy: Policy | None = None,
                 grammar=None) -> tuple[list[int], GenerationStats]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; returns (new ids, stats).

    ``num_draft`` tokens are drafted per round at most (default: the drafter's block size);
    ``policy`` decides how many of them each round verifies (default: all of them). ``stream``,
    if given, is called with each list of newly emitted tokens. ``grammar``: a
    structured.GrammarState the output must match (structured outputs).
    """
    drafter = drafter or PlainDrafter()
    k = drafter.block_size if num_draft is None else num_draft
    engine = Engine(target, drafter, policy or FixedPolicy(k), max_requests=1, block_size=k,
                    max_len=len(prompt_ids) + max_new_tokens + k + 1, eos_ids=eos_ids)
    req = engine.add_request(prompt_ids, RequestOptions(params, max_new_tokens, grammar=grammar), on_tokens=stream)
    engine.run()
    return req.output_ids, req.stats
