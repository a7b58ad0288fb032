"""The prefix policy: Algorithm 1 over the engine's cost table, drafting only as deep as pays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .algorithm1 import expected_commit, prefix_schedule, survivals
from .base import RequestOutcome
from .load_aware import LoadAwarePolicy, LoadAwareState, context_length, drafted
from .profile import FreeProfiles


@dataclass
class PrefixState(LoadAwareState):
    """What the prefix policy keeps of one request."""

    free_idle: int = 0                  # steps its free proposals went unverified in a row
    free_pending: int = 0               # tokens of a free proposal verified this step (0: none)
    free_evidence: int = 0              # that proposal's strength (Proposal.evidence)
    # (strength, verified, accepted) of the free proposal verified at its last step, for the free profiles
    free_settle: tuple[int, int, int] | None = None


@dataclass
class _HeldDepth:
    """A depth the search found paying, held for the next steps while what it read stands."""

    key: tuple[int, int, int]       # (requests, context column, cap) it was searched at
    steps: int                      # steps it has been used
    added: int                      # proposals the recent pool had taken then
    depth: int
    first: float | None             # the recent proposals' mean first-token survival then


class PrefixPolicy(LoadAwarePolicy[PrefixState]):
    """Paper Algorithm 1 over the engine's cost table (drafting included). Every request drafts to
    the depth that pays on the observed acceptance profile (the depth the search priced: a request
    that verified little last step drafts as deep, since its next block's confidences are new);
    when no depth pays (heavy load, or a drafter whose drafts cost more than they return) the engine
    runs plain decoding, with a one-token probe now and then."""

    name = "prefix"
    # the engine tells it, before it decides, what each request could draft for nothing (a lookup's
    # proposal: the n-gram drafter's, or the hybrid's where its lookup matches): those are always
    # drafted, and Algorithm 1 verifies of them what pays for its share of the target's step
    uses_free_drafts = True
    # while drafting pays, the depth found holds for up to this many steps, as long as the number of
    # requests and the context column stay, fewer than 1/4 of the recent proposals it read were
    # replaced since and their mean first-token survival moved by less than ``search_drift`` (with
    # few requests, a handful of proposals a step move the pools little; a sudden fall is searched
    # at once); the search, run right after a target forward has evicted the CPU caches, is most of
    # the policy's decision time at one or two requests
    search_every = 8
    search_drift = 0.05
    # after this many steps in a row whose free proposals the search verified none of (explorations
    # aside), the lookups are asked for only every ``probe_every``-th step until one is verified
    # again: at 32 requests a lookup per request costs about 1 % of a plain step, for proposals a
    # heavy load verifies almost never (a long match keeps matching on the next steps: one found a
    # few steps late loses little)
    free_rest_after = 16

    def __init__(self, cost_table=None, num_draft: int | None = None, probe_every: int = 8,
                 probe_budget: float = 0.01, reference_every: int = 64, recent: int = 64):
        super().__init__(cost_table, num_draft, probe_every, probe_budget, reference_every, recent)
        self.free_profile = FreeProfiles(16)   # the lookups' own acceptance by strength, from 1/2
        self._held: _HeldDepth | None = None
        self._quiet = 0                         # steps verifying nothing since a free proposal was explored
        self._free_unused = 0                   # steps in a row whose free proposals went unverified
        self._free_asked = 0                    # steps since the lookups were last asked, while resting

    def _new_state(self) -> PrefixState:
        return PrefixState()

    def reprice(self, cost_table) -> None:
        super().reprice(cost_table)
        self._held = None       # a depth searched on the old prices

    def _account(self, st: PrefixState, o: RequestOutcome) -> None:
        super()._account(st, o)
        if st.free_pending:
            st.free_settle = (st.free_evidence, st.free_pending, o.accepted if o.speculated else 0)
            st.free_pending = 0

    # ------------------------------------------------------------------ draft lengths
    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None):
        unpriced = self._unpriced(requests)
        if unpriced is not None:
            return unpriced
        cap = self._refresh(requests, block_size)
        free = list(free) if free is not None else [0] * len(requests)
        depth = 0 if self._unchanged_since_no(requests) else self._depth(requests, cap, free)
        if not depth:
            return self._with_free(requests, self._probe(requests), block_size, free)
        self._idle = 0
        if self._reference_due():
            return self._drafting(requests, [0] * len(requests))
        return self._with_free(requests, [depth] * len(requests), block_size, free)

    def wants_free(self, requests) -> bool:
        if self._free_unused < self.free_rest_after:
            return True
        self._free_asked += 1
        if self._free_asked >= self.probe_every:
            self._free_asked = 0
            return True
        return False

    def _depth(self, requests, cap: int, free: list[int]) -> int:
        """The depth that pays: the held one while what its search read stands, else searched."""
        key, held, first = (self._key[0], self._key[3], cap), self._held, self._recent.mean(0)
        if (held is not None and held.key == key and held.steps < self.search_every
                and self._recent.added - held.added < self._recent.size / 4
                and first is not None and held.first is not None and abs(first - held.first) < self.search_drift):
            held.steps += 1
            return held.depth
        depth = self._draft_depth(requests, cap, free)
        self._found(depth > 0)
        self._held = _HeldDepth(key, 1, self._recent.added, depth, first) if depth else None
        return depth

    def _with_free(self, requests, want: list[int], block_size: int, free: list[int]) -> list[int]:
        """``want`` for the drafter's forward; a request with a free proposal drafts all of it
        instead (and hands the drafter no context rows this step)."""
        if not any(free):
            return self._drafting(requests, want)
        if self._probed is not None and free[self._probed]:
            self._probed = None         # the lookup serves it: no probe of the drafter this step
        self._drafting(requests, [0 if f else w for w, f in zip(want, free)])
        return [min(f, block_size) if f else w for w, f in zip(want, free)]

    def _draft_depth(self, requests, cap: int, free: Sequence[int] | None = None) -> int:
        """How deep the drafter's forward can pay this step: the depth d maximising the expected
        tokens per second of the step in which every request a lookup does not serve (``free``: its
        free proposal's length, 0: none) drafts d tokens, and Algorithm 1 then verifies the most
        likely of all the step's candidates, the lookups' free proposals among them; against the
        same step without the drafter (d = 0: the free proposals alone, or plain decoding). Where
        most requests are served for nothing, the drafter's call is priced for the few it serves,
        and its tokens are verified in a step that verifies the free ones anyway (at 8 requests on
        a CPU a step's price per verified token falls steeply with the tokens it verifies).

        The survivals the n drafting requests will show are taken to be distributed as those of the
        recent proposals (``_pooled``, past steps only): each position's pool stands for n
        candidates, so verifying the candidates down to a survival lambda verifies n x (the pool's
        share above lambda) tokens and returns n x (their mean survival x that share); a free
        proposal of length L stands for itself, a_1..a_L from the lookups' profile (the one over
        every strength: a match's strength is known only once the lookup is drafted). Every lambda
        is tried."""
        R = len(requests)
        free = list(free) if free is not None else [0] * R
        drafting = [r for r, f in zip(requests, free) if not f]
        n = len(drafting)
        if not n:           # the lookups serve every request: no call to weigh
            return 0
        ctx = context_length(requests)
        vals, pos, weights = self._pooled(cap, n)
        lengths = [min(f, cap) for f in free if f]
        if lengths:     # the free proposals, there at every depth (position -1)
            a = np.cumprod(np.clip(self.free_profile.conditional()[:cap], 0.0, 1.0))
            fv = np.concatenate([a[:f] for f in lengths])
            vals = np.concatenate([vals, fv])
            pos = np.concatenate([pos, np.full(fv.size, -1)])
            weights = np.concatenate([weights, np.ones(fv.size)])
        order = np.argsort(-vals, kind="stable")
        vals, pos, weights = vals[order], pos[order], weights[order]
        # row d: the drafter drafting d tokens (row 0: not called); candidates deeper than d count
        # for nothing in that row; column 0: verifying nothing beyond the anchors (row 0, column 0:
        # a plain step)
        w = np.where(pos[None, :] < np.arange(0, cap + 1)[:, None], weights[None, :], 0.0)
        extra = np.concatenate([np.zeros((cap + 1, 1)), np.cumsum(w, axis=1)], axis=1)
        tau = R + np.concatenate([np.zeros((cap + 1, 1)), np.cumsum(w * vals[None, :], axis=1)], axis=1)
        backlog = [r.backlog(0) for r in drafting]
        # catch-up rows are taken in by a call only: none in row 0
        rows = [sum(max(0, b - d) for b in backlog) if d else 0 for d in range(0, cap + 1)]
        theta = tau / self.cost.seconds_many(R, extra, ctx, list(range(0, cap + 1)), rows, drafting=n)
        best = theta.max(axis=1)
        d = int(np.argmax(best[1:])) + 1
        self._ratio = float(best[d]) / float(best[0])
        return d if best[d] > best[0] else 0

    # ------------------------------------------------------------------ verify lengths
    def verify_lengths(self, requests, proposals):
        if not requests:
            return []
        prof = self.profile.conditional()
        self._settle_free(requests)
        free_prof: dict[int, list[float]] = {}     # strength -> its free profile, this step
        for p in proposals:
            if p.free and p.evidence not in free_prof:
                free_prof[p.evidence] = self.free_profile.conditional(p.evidence)
        surv = [survivals(p, free_prof[p.evidence] if p.free else prof) for p in proposals]
        self._note_proposals(proposals, surv)
        n_drafting, depth = drafted(proposals)
        lengths = self._schedule(requests, proposals, surv, n_drafting, depth)
        offered = [n for n, p in zip(lengths, proposals) if p.free and len(p)]
        if offered:     # the search's own choice, explorations aside
            self._free_unused = 0 if any(offered) else self._free_unused + 1
        verifying = any(lengths)
        alone = None if verifying else self._lone_exploration(requests, proposals)
        for i, (r, p) in enumerate(zip(requests, proposals)):
            st = self.states[r.id]
            if p.free and len(p):
                lengths[i] = self._explore_free(st, lengths[i], verifying or i == alone)
                st.free_pending, st.free_evidence = lengths[i], p.evidence
        self._record(requests, lengths)
        self._expect(requests, lengths, n_drafting, depth)
        return lengths

    def _schedule(self, requests, proposals, surv, n_drafting: int, depth: float) -> list[int]:
        """Algorithm 1 over the step's candidates; a probe is verified whole, free proposals beside
        it as on any step."""
        # the drafter's call is paid already: a longer verification costs only the target's part
        ctx, R = context_length(requests), len(requests)
        price = self.cost.pricer(R, ctx, n_drafting, depth, self._rows)

        def sps(B):             # B: a number, or (sps_many) an array of them
            return 1.0 / price(B - R)
        # the candidates to verify whatever they return, fixed from what was known before the step
        # drew: a lookup's block (point masses) and a sampled block's first survival as they are, the
        # rest of a sampled block as the recent proposals fared after their first (expected_commit)
        settled = [len(p) if p.free or p.confidences is None else min(1, len(p)) for p in proposals]
        i = self._probed
        rows = surv if i is None else [a if j != i else [] for j, a in enumerate(surv)]
        width = max((len(a) for a in rows), default=0)
        commit = expected_commit(rows, settled, self.expected_survivals(width), sps) if width else 0
        if i is None:
            return prefix_schedule(rows, sps, sps_many=sps, commit=commit)
        lengths = (prefix_schedule(rows, sps, sps_many=sps, commit=commit)
                   if any(p.free and len(p) for p in proposals) else [0] * R)
        lengths[i] = len(proposals[i])
        return lengths

    def _settle_free(self, requests) -> None:
        """Learn the free proposals' acceptance per position from what the target accepted of the
        ones verified last step (their own profiles, by strength: a lookup's acceptance is not the
        drafter's, and a long match's is not a short one's)."""
        for r in requests:
            st = self.states.get(r.id)
            if st is not None and st.free_settle is not None:
                self.free_profile.observe(*st.free_settle)
                st.free_settle = None

    def _explore_free(self, st: PrefixState, n: int, allowed: bool) -> int:
        """A request whose free proposals went unverified ``probe_every`` times verifies one token of
        the next (where ``allowed``): the free profile keeps learning (never learning again after a
        bad spell costs the lookups' whole gain)."""
        if n:
            st.free_idle = 0
            return n
        st.free_idle += 1
        if st.free_idle >= self.probe_every and allowed:
            st.free_idle = 0
            return 1
        return 0

    def _lone_exploration(self, requests, proposals) -> int | None:
        """In a step that verifies nothing, the one request (if any) whose free proposal is explored.
        One token beside others verified costs the step little, but one verified alone makes the
        step ragged (a block laid out and attended beside the decoding rows: at 32 requests a fifth
        of a plain step, docs/scheduling.md): with every request exploring on its own clock, a heavy
        load would pay that in most steps. So alone, one request at a time, ``probe_every`` steps
        apart or as far apart as keeps their price within ``probe_budget`` of the plain steps."""
        self._quiet += 1
        # without prices the policy decodes plainly (``_unpriced``); a lone token is priced as the
        # policy prices verification (the table's, times what verifying steps cost over it, rho)
        if (self._quiet < self.probe_every or self.cost.table is None
                or self._quiet < self.budget_gap(requests, 0, scale=self.cost.extra_scale)):
            return None
        due = [i for i, (r, p) in enumerate(zip(requests, proposals))
               if p.free and len(p) and self.states[r.id].free_idle + 1 >= self.probe_every]
        if not due:
            return None
        self._quiet = 0
        return max(due, key=lambda i: self.states[requests[i].id].free_idle)
