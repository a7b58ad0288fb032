"""What the load-aware policies (prefix and async) share: the acceptance they observed, the cost
model they price steps with, the one-token probes while drafting does not pay, and what they keep of
each request.

Drafters without a confidence head get a survival profile from the acceptance they showed so far
(per position, over the engine's recent rounds), which depends only on the past.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from .base import Policy, RequestOutcome, RequestStates, StepOutcome
from .costs import CostModel
from .profile import AcceptanceProfile, RecentSurvivals

log = logging.getLogger("dspark")


@dataclass
class LoadAwareState:
    """What a load-aware policy keeps of one request."""

    # verified blocks not yet learnt from (AcceptanceProfile.learn): the lengths the policy chose
    # (> 0), how many drafted blocks the target verified, how many times each position was accepted
    lengths: list[int] = field(default_factory=list)
    drafts: int = 0
    hits: list[int] = field(default_factory=list)
    width: int = 0              # the longest drafted block verified so far


St = TypeVar("St", bound=LoadAwareState)


def context_length(requests) -> int:
    """The requests' mean context (prompt and output so far)."""
    return int(sum(r.context for r in requests) / max(1, len(requests)))


def drafted(proposals) -> tuple[int, float]:
    """(how many requests drafted with the drafter's forward, their mean draft length): a lookup's
    free proposals cost no drafter call."""
    lengths = [len(p) for p in proposals if len(p) and not p.free]
    return len(lengths), sum(lengths) / max(1, len(lengths))


class LoadAwarePolicy(Policy, Generic[St]):
    """Keeps the observed per-position acceptance profile (the survivals of drafters without
    confidences, what drafting can expect to return, and the default for requests the async policy
    has no snapshot of). Whether drafting pays is decided on expectations: the profile's
    acceptance against the cost table, which prices drafting and verifying together. When nothing
    pays, one request (in turn) drafts and verifies one token now and then, so that the profile
    keeps learning: at least ``probe_every`` steps apart, and further apart when a probe's price
    (the cost model's, corrected by the steps that ran) exceeds ``probe_budget`` of the plain
    steps between two probes (a probe pays a whole drafter call, and with it the request's context
    features since it last drafted), and up to ``probe_far`` times further while the last search
    found drafting far from paying (its best under 80 % of plain decoding's tokens/s). The
    converse: while drafting pays, one step in ``reference_every + 1`` runs plain, so that the cost
    model keeps comparing drafting steps with plain steps of the same minutes (see CostModel)."""

    def __init__(self, cost_table=None, num_draft: int | None = None, probe_every: int = 8,
                 probe_budget: float = 0.01, reference_every: int = 64, recent: int = 64):
        self.cost = CostModel(cost_table)
        self.num_draft = num_draft
        self.profile = AcceptanceProfile(num_draft or 7)
        self.states: RequestStates[St] = RequestStates(self._new_state)
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.reference_every = reference_every
        self.probe_far = 16.0
        self._idle = 0          # steps since the last probe, while drafting does not pay
        self._probes = 0        # probes so far (whose turn is next)
        self._probed: int | None = None     # index of the request probed this step, or None
        self._recent = RecentSurvivals(recent)        # survival rows a_1..a_l of recent proposals
        self.probe_scale = 1.0                        # a probe's measured / table drafting part
        self._rows = 0                                # catch-up rows of this step's drafting requests
        self._version = 0                             # proposals seen (what the searches read)
        self._ratio = 1.0                             # best drafting tokens/s over not drafting, last search
        # see _unchanged_since_no: (requests, proposals seen, rho, context column)
        self._no_key: tuple[int, int, float, int] | None = None
        self._key: tuple[int, int, float, int] = (0, 0, 0.0, 0)
        self._probe_m = [0.0, 0.0]
        self._warned = False

    def _new_state(self) -> St:
        raise NotImplementedError

    @property
    def drafting_ratio(self) -> float:
        """The best drafting step's tokens/s over that of the same step without the drafter's call
        (plain decoding, or the lookups' free proposals alone), at the last search (1 before any)."""
        return self._ratio

    # ------------------------------------------------------------------ what others tell it
    def reprice(self, cost_table) -> None:
        """Price steps from now on with ``cost_table`` (the auto policy's, learned as it serves); what
        the cost model corrected online (pace, drafting's ratio) carries over."""
        self.cost.table = cost_table
        self._no_key = None

    def _unpriced(self, requests) -> list[int] | None:
        """Without a cost table, nothing can say whether drafting pays: plain decoding (never the
        whole block on trust), said once. None when there is a table."""
        if self.cost.table is not None:
            return None
        if not self._warned:
            self._warned = True
            log.warning("%s policy without a cost table decodes plainly: run `dspark profile`, or use "
                        "--policy auto (learns the costs while it serves)", self.name)
        return [0] * len(requests)

    # ------------------------------------------------------------------ what the engine tells it
    def observe(self, outcome: StepOutcome) -> None:
        if outcome.decode_only:
            self._observe_seconds(outcome.seconds)
        for o in outcome.requests:
            self._account(self.states[o.request_id], o)
        self.states.drop(outcome.ended)

    def _account(self, st: St, o: RequestOutcome) -> None:
        """Keep a request's verified block for the profile to learn from at the next decision."""
        if not o.speculated:
            return
        st.drafts += 1
        if o.verified > st.width:
            st.hits.extend([0] * (o.verified - st.width))
            st.width = o.verified
        for k in range(o.accepted):
            st.hits[k] += 1

    def _observe_seconds(self, seconds: float) -> None:
        """The wall time of a decoding step. Probes are priced apart: a probe's drafter call also
        takes in the request's context since it last drafted, and its one verified token makes the
        step ragged; both cost far more, per token, than the table's uniform rows say."""
        got = self.cost.observe(seconds, learn=self._probed is None)
        if got is not None and self._probed is not None:
            m, b = self._probe_m, 0.2
            if not m[1]:
                m[0] = m[1] = got[1]
            m[0], m[1] = (1 - b) * m[0] + b * got[0], (1 - b) * m[1] + b * got[1]
            self.probe_scale = min(8.0, max(0.25, m[0] / m[1]))

    def _learn(self, requests) -> None:
        """The profile learns from the requests' blocks verified since it last did (a request that
        had no drafted block verified since keeps its chosen lengths for later)."""
        for r in requests:
            st = self.states[r.id]
            if not st.drafts:
                continue
            self.profile.learn(st.lengths, st.width, st.hits)
            st.lengths, st.drafts, st.hits = [], 0, [0] * st.width

    def _record(self, requests, lengths) -> None:
        """The lengths chosen to verify (what the profile counts as tries)."""
        for r, n in zip(requests, lengths):
            if n > 0:
                self.states[r.id].lengths.append(n)

    # ------------------------------------------------------------------ shared decisions
    def _refresh(self, requests, block_size) -> int:
        cap = self.num_draft or block_size
        if len(self.profile.tries) < cap:
            self.profile = AcceptanceProfile(cap)
        self._learn(requests)
        self._probed = None
        return cap

    def _note_proposals(self, proposals, survivals) -> None:
        """Keep the calibrated survivals of ALL recent drafted blocks (``survivals``: each proposal's
        a_1..a_l). The acceptance observed on verified tokens overstates what a fresh draft returns
        when the policy verifies only the confident ones; calibrated survivals of every proposal do
        not. Recent ones only: the first tokens of an answer draft far better than the rest, and
        what a batch of fresh requests promised says little about them twenty steps on."""
        for p, a in zip(proposals, survivals):
            if len(p) and p.confidences is not None:
                self._recent.add(a)
        if any(len(p) for p in proposals):
            self._version += 1

    def _unchanged_since_no(self, requests) -> bool:
        """Whether the last search found that nothing pays and nothing it read has changed since:
        the same number of requests, no new proposal (survivals, profile), the same drafting price
        and context column of the table. The requests' catch-up backlogs only grow meanwhile, which
        can only make drafting dearer, so the answer stands; the search is skipped (it is most of a
        policy's decision time, and under heavy load nothing pays step after step)."""
        key = (len(requests), self._version, self.cost.extra_scale,
               self.cost.context_index(context_length(requests)))
        if key == self._no_key:
            return True
        self._key = key
        return False

    def _found(self, drafting_pays: bool) -> None:
        self._no_key = None if drafting_pays else self._key

    def _pooled(self, cap: int, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recent proposals' survivals by position (``RecentSurvivals.pools``; the observed
        profile's where none reached a position) for a search over R requests: (survivals,
        positions, weights), each position's pool standing for R candidates."""
        vals, pos, counts = self._recent.pools(cap)
        empty = np.flatnonzero(counts == 0)
        if empty.size:
            prof = self.profile.survivals(cap)
            vals = np.concatenate([vals, [prof[k] for k in empty]])
            pos = np.concatenate([pos, empty])
            counts = np.where(counts == 0, 1, counts)
        return vals, pos, R / counts[pos]

    def expected_survivals(self, cap: int) -> list[float]:
        """E[a_1..a_cap] of a fresh draft: per position, the mean survival of the recent proposals
        that reached it (the observed profile's where none did, or for a drafter without
        confidences), made non-increasing; from ``RecentSurvivals``'s running totals (the async
        policy asks every step)."""
        sums, counts = self._recent.sums(cap)
        prof = self.profile.survivals(cap) if 0 in counts else None
        out: list[float] = []
        for k in range(cap):
            if counts[k]:
                a = sums[k] / counts[k]
            else:
                assert prof is not None   # computed when some count is 0
                a = prof[k]
            out.append(min(a, out[-1]) if out else a)
        return out

    def _expect(self, requests, lengths, drafting: int, depth: float) -> None:
        self.cost.expect(len(requests), sum(lengths), context_length(requests), drafting, depth, self._rows)

    def _drafting(self, requests, want: list[int]) -> list[int]:
        """Note the catch-up rows of the requests about to draft (priced with the step); returns want."""
        self._rows = sum(r.backlog(w) for r, w in zip(requests, want) if w)
        return want

    # ------------------------------------------------------------------ probes
    def probe_gap(self, requests) -> int:
        """Plain steps between two probes: ``probe_every``, or more while a probe would cost more
        than ``probe_budget`` of them."""
        if self.cost.table is None:
            return self.probe_every
        R = len(requests)
        gap = self.budget_gap(requests, 1, requests[self._probes % R].backlog(1) if R else 0, self.probe_scale)
        # what probes are for is to notice that drafting pays again; the further the last search
        # found it from paying, the less a probe's news can change that: the gap stretches as the
        # best drafting step's tokens/s falls from plain's to 80 % of it, at most ``probe_far`` x
        near = max(1.0 / self.probe_far, min(1.0, (self._ratio - 0.8) / 0.2))
        return math.ceil(gap / near)

    def budget_gap(self, requests, drafting: int, rows: int = 0, scale: float = 1.0) -> float:
        """Plain steps that must pass between two steps that verify one token (``drafting``: 1 when
        the drafter is called for it, 0 for a free one) for its price beyond a plain step (times
        ``scale``) to stay within ``probe_budget`` of theirs; at least ``probe_every``."""
        base, more = self.cost.parts(len(requests), 1, context_length(requests), drafting, float(drafting), rows)
        return max(self.probe_every, more * scale / (self.probe_budget * base))

    def _reference_due(self) -> bool:
        """Drafting pays, but the cost model has gone ``reference_every`` steps without a plain one."""
        return self.cost.since_plain >= self.reference_every

    def _probe(self, requests) -> list[int]:
        """No drafting pays: now and then one request, in turn, drafts one token."""
        self._idle += 1
        out = [0] * len(requests)
        if requests and self._idle >= self.probe_gap(requests):
            self._idle = 0
            self._probed = self._probes % len(requests)
            self._probes += 1
            out[self._probed] = 1
        return out

    def _probe_lengths(self, proposals) -> list[int]:
        """A probe token is verified whatever its confidence (a decision fixed before drafting)."""
        assert self._probed is not None   # called on a probe's step only
        out = [0] * len(proposals)
        out[self._probed] = len(proposals[self._probed])
        return out
