"""The asynchronous policy (paper section 5.2): a capacity from stale survivals, then the top
candidates by up-to-date survival."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .algorithm1 import sorted_candidates, survivals
from .load_aware import LoadAwarePolicy, LoadAwareState, context_length, drafted


class AsyncPolicy(LoadAwarePolicy[LoadAwareState]):
    """Asynchronous scheduling (paper section 5.2): the capacity K (draft tokens verified this step
    beyond the anchors) comes from the survivals of two steps earlier by a full search over the
    cost table; this step verifies the top-K candidates by up-to-date survival, ties by position,
    down to the survival below which verifying a token costs more than it returns. K depends only
    on stale information, so the full search stays lossless."""

    name = "async"

    def __init__(self, cost_table=None, num_draft: int | None = None, lag: int = 2, probe_every: int = 8,
                 probe_budget: float = 0.01, reference_every: int = 64):
        super().__init__(cost_table, num_draft, probe_every, probe_budget, reference_every)
        self.history: deque = deque(maxlen=lag)
        self.capacity = 0

    def _new_state(self) -> LoadAwareState:
        return LoadAwareState()

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        unpriced = self._unpriced(requests)
        if unpriced is not None:
            return unpriced
        cap = self._refresh(requests, block_size)
        stale = self.history[0] if len(self.history) == self.history.maxlen else {}
        held = any(stale.get(r.id) for r in requests)   # the search reads these survivals too
        if not held and self._unchanged_since_no(requests):
            self.capacity, share = 0, [0] * len(requests)
        else:
            self.capacity, share = self._capacity(requests, cap)
            self._found(self.capacity > 0 or held)
        if not self.capacity:
            return self._drafting(requests, self._probe(requests))
        self._idle = 0
        if self._reference_due():
            return self._drafting(requests, [0] * len(requests))
        # only requests whose stale candidates held some of the top K draft (the capacity search
        # priced K verified tokens, not a drafter forward over every request), each n + 1 at most:
        # no request can be granted more than K, and one that held n is unlikely to get many more
        return self._drafting(requests, [min(cap, self.capacity, n + 1) if n else 0 for n in share])

    def _capacity(self, requests, cap) -> tuple[int, list[int]]:
        """(K, per request the number of its stale candidates among the top K)."""
        R = len(requests)
        if not R:
            return 0, []
        stale = self.history[0] if len(self.history) == self.history.maxlen else {}
        prof = self.expected_survivals(cap)
        cands: list[tuple[float, int]] = []
        for i, r in enumerate(requests):
            # requests that joined since, or drafted nothing then: the observed default profile
            # (so that a step with K = 0 does not lock the policy into plain decoding)
            cands.extend((a, i) for a in (stale.get(r.id) or prof))
        cands.sort(key=lambda t: -t[0])
        ctx = context_length(requests)
        # the top k candidates: k verified tokens, and a drafter call over the requests holding them,
        # each drafting one more than it holds (see draft_lengths)
        best_k, best, tau = 0, R / self.cost.seconds(R, 0, ctx, 0), float(R)
        plain, top = best, 0.0
        held, drafting, drafted, rows = [0] * R, 0, 0, 0
        backlog = [r.backlog(1) for r in requests]
        for k, (a, i) in enumerate(cands, 1):       # full search: no early stop needed
            tau += a
            if not held[i]:
                drafting += 1
                rows += backlog[i]
            drafted += min(cap, held[i] + 2) - (min(cap, held[i] + 1) if held[i] else 0)
            held[i] += 1
            theta = tau / self.cost.seconds(R, k, ctx, drafting, drafted / drafting, rows)
            top = max(top, theta)
            if theta > best:
                best, best_k = theta, k
        share = [0] * R
        for _, i in cands[:best_k]:
            share[i] += 1
        self._ratio = top / plain
        return best_k, share

    def verify_lengths(self, requests, proposals):
        prof = self.profile.conditional()
        surv = [survivals(p, prof) for p in proposals]
        self._note_proposals(proposals, surv)
        self.history.append({r.id: s for r, s in zip(requests, surv)})
        if self._probed is not None:
            lengths = self._probe_lengths(proposals)
        else:
            # of the top K, only candidates whose survival pays for the target's part of verifying
            # them (a drafted token already cost its drafting): a cut by a's value that depends on
            # the load, not on the tokens, so like a threshold it keeps the output lossless
            R, ctx = len(requests), context_length(requests)
            plain = self.cost.seconds(R, 0, ctx, 0)
            floor = (self.cost.seconds(R, 1, ctx, 0) - plain) / (plain / R)
            lengths = [0] * len(requests)
            for a, j, i in sorted_candidates(surv)[:self.capacity]:
                if a < floor:
                    break
                lengths[i] = max(lengths[i], j + 1)
        self._record(requests, lengths)
        self._expect(requests, lengths, *drafted(proposals))
        return lengths
