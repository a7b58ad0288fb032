"""The policy interface, what the engine tells a policy after each step, and per-request state.

Each engine step a policy first says how many tokens to draft for each request
(``draft_lengths``), then, seeing the proposals (tokens, probabilities, confidences), how many of
them each request verifies (``verify_lengths``). A policy may only look at information available
before the target verifies, so whatever it decides, the output stays the target's distribution.
After the target has verified, the engine hands the policy the step's outcome (``observe``): per
request what was drafted, verified and accepted, the step's wall time, and which requests ended.
A policy keeps what it learns of a request in a state of its own (``RequestStates``), created when
the request first comes and dropped when the outcome says it ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass(frozen=True)
class RequestView:
    """A decoding request as a policy sees it, made by the engine (and the simulator) each step."""

    id: int
    context: int            # tokens of its context: the prompt and the output so far
    pending_rows: int       # target feature rows handed to its draft context that the drafter has not
                            # taken in yet (its prompt's before its first call; else the positions
                            # verified since it last drafted)
    room: int               # tokens it may still emit

    def backlog(self, depth: int) -> int:
        """Context rows its next drafter call takes in beyond a steady round's (the anchor and
        ``depth`` drafts)."""
        return max(0, self.pending_rows - 1 - depth)


@dataclass(frozen=True)
class RequestOutcome:
    """One decoding request's part of a step, as the target verified it."""

    request_id: int
    drafted: int          # tokens the drafter proposed (clipped to what the request may still emit)
    verified: int         # tokens of the block the target verified (the policy's length, or the
                          # grammar's forced tokens, or a lookup's block cut at its first forbidden token)
    accepted: int         # of those, the tokens the target accepted
    free: bool = False    # the block was a lookup's (no drafter forward)
    forced: bool = False  # the block was what the request's grammar forces next (not a draft)

    @property
    def speculated(self) -> bool:
        """A drafted block went to the target: what GenerationStats counts as a draft (``num_drafts``,
        ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_position``)."""
        return not self.forced and self.verified > 0


@dataclass(frozen=True)
class StepOutcome:
    """One engine step, frozen once it has run: its rows, the policy's decisions and what the target
    made of them, and its timings. The policy observes it, and so does every listener of the
    engine's public hook (``Engine.add_step_listener``)."""

    requests: tuple[RequestOutcome, ...]   # the decoding requests whose blocks were verified
    seconds: float                         # the step's wall time
    decode_only: bool                      # it verified decoding requests and prefilled no prompt:
                                           # its time is the price of a decoding step
    ended: tuple[int, ...] = ()            # ids of the requests that ended in it or since the last
                                           # step (finished, cancelled, failed)
    # the step's parts as the engine timed them (0 where it did not): the target's forward and the
    # rows it ran (prefilled tokens and decoding blocks), and the drafter's call
    forward_rows: int = 0
    forward_seconds: float = 0.0
    draft_seconds: float = 0.0
    # context rows the drafter's call took in beyond its requests' steady rounds (the positions each
    # verified at its last round): a request's first call takes in its prompt, one that has not
    # drafted for a while the positions verified since
    draft_rows: int = 0
    index: int = 0                  # the engine's step count at this step
    prefill_tokens: int = 0         # prompt tokens it prefilled
    policy_seconds: float = 0.0     # the policy's own decisions (draft and verify lengths)


S = TypeVar("S")


class RequestStates(Generic[S]):
    """A policy's typed state per request (by request id): made by ``factory`` on first use,
    dropped with ``drop`` when the request has ended."""

    def __init__(self, factory: Callable[[], S]):
        self._factory = factory
        self._states: dict[int, S] = {}

    def __getitem__(self, request_id: int) -> S:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = self._factory()
        return state

    def get(self, request_id: int) -> S | None:
        """The request's state if it has one (without making one)."""
        return self._states.get(request_id)

    def drop(self, request_ids: Iterable[int]) -> None:
        for i in request_ids:
            self._states.pop(i, None)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states


class Policy:
    name = "policy"
    # True: the engine passes ``draft_lengths`` how many tokens the drafter could propose each request
    # without a forward (Drafter.free_lengths)
    uses_free_drafts = False

    def draft_lengths(self, requests: Sequence[RequestView], block_size: int,
                      free: Sequence[int] | None = None) -> list[int]:
        """Tokens to draft per request (before clipping to what each request may still emit).
        ``free``: per request, the tokens a lookup could propose at no cost (``uses_free_drafts``
        policies only; None = none)."""
        return [block_size] * len(requests)

    def wants_free(self, requests: Sequence[RequestView]) -> bool:
        """Whether the engine asks the drafter this step what each request could be proposed for
        nothing (``free`` in ``draft_lengths``): a lookup per request costs a step time too."""
        return self.uses_free_drafts

    def verify_lengths(self, requests: Sequence[RequestView], proposals) -> list[int]:
        return [len(p) for p in proposals]

    def observe(self, outcome: StepOutcome) -> None:
        """The step just run, after verification (every step, also those that prefilled)."""
