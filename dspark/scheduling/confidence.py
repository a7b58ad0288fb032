"""Confidence-driven verification policies (SPEC section 4): threshold, EMA, prefix (Algorithm 1)
and asynchronous capacity.

Every decision about draft token k of a request may depend only on what is known before token k
is sampled or on tokens of OTHER requests: c_k is computed from h_k and x_{k-1}, never from x_k,
so prefix survival a_k = c_1 ... c_k depends on x_<k. Sorting all candidates by a (ties by
position) puts a token before any extension of it; Algorithm 1 walks that order and stops at the
first candidate that does not raise expected throughput, so whether x_k is verified depends only
on candidates ranked before it. A search without that stop (pick the best total afterwards) lets
the choice for x_k depend on a_{k+1}, i.e. on x_k itself, and biases the output (Appendix A).

Drafters without a confidence head get a survival profile from the acceptance they showed so far
(per position, over the engine's recent rounds), which depends only on the past.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..errors import UsageError
from .policies import Policy
from .sps import CostModel


def _survivals(proposal, fallback: list[float]) -> list[float]:
    """Prefix survivals a_1..a_l of one proposal."""
    n = len(proposal)
    conf = proposal.confidences.tolist() if proposal.confidences is not None else fallback[:n]
    conf = conf + [fallback[-1] if fallback else 0.5] * (n - len(conf))
    out, a = [], 1.0
    for c in conf:
        a *= max(0.0, min(1.0, float(c)))
        out.append(a)
    return out


class _Profile:
    """Observed conditional acceptance per position (for drafters without confidences, and for
    requests that joined after the snapshot the async policy reads)."""

    def __init__(self, block: int, prior: float = 0.5):
        self.tries = [1.0] * max(1, block)
        self.hits = [prior] * max(1, block)

    def update(self, requests) -> None:
        for r in requests:
            seen = r.ctx.state.setdefault("_profile_seen", [0, []])
            s = r.stats
            per = list(s.accepted_per_position)
            drafts, prev = s.num_drafts, seen[1]
            if drafts == seen[0]:
                continue
            new = [per[k] - (prev[k] if k < len(prev) else 0) for k in range(len(per))]
            lengths = r.ctx.state.get("_verified_history", [])
            for k in range(len(new)):
                tried = sum(1 for L in lengths if L > k)
                if tried:
                    self.tries[min(k, len(self.tries) - 1)] += tried
                    self.hits[min(k, len(self.hits) - 1)] += new[k]
            r.ctx.state["_verified_history"] = []
            seen[0], seen[1] = drafts, per

    def conditional(self) -> list[float]:
        return [min(0.999, h / t) for h, t in zip(self.hits, self.tries)]

    def survivals(self, cap: int) -> list[float]:
        """Prefix survivals a_1..a_cap implied by the observed conditional acceptance."""
        out, a = [], 1.0
        for c in self.conditional()[:cap]:
            a *= c
            out.append(a)
        return out


class _FreeProfile(_Profile):
    """The conditional acceptance per position of free (lookup) proposals, learned from their
    verified tokens: position k counts a try when tokens 1..k-1 were accepted, a hit when k was too."""

    def observe(self, verified: int, accepted: int) -> None:
        for k in range(min(verified, len(self.tries))):
            self.tries[k] += 1
            if accepted > k:
                self.hits[k] += 1
            else:
                break


def _record(requests, lengths) -> None:
    for r, n in zip(requests, lengths):
        if n > 0:
            r.ctx.state.setdefault("_verified_history", []).append(n)


class ThresholdPolicy(Policy):
    """Verify up to (not including) the first draft token whose confidence is below a threshold."""

    name = "threshold"

    def __init__(self, threshold: float = 0.5, block: int | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise UsageError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold, self.block = threshold, block
        self.name = f"threshold-{threshold:g}"

    def draft_lengths(self, requests, block_size):
        return [self.block or block_size] * len(requests)

    def verify_lengths(self, requests, proposals):
        out = []
        for p in proposals:
            n = len(p)
            if p.confidences is not None:
                below = [k for k, c in enumerate(p.confidences.tolist()) if c < self.threshold]
                n = below[0] if below else n
            out.append(n)
        return out


class EMAPolicy(Policy):
    """Draft length from an exponential moving average of each request's accepted tokens per round."""

    name = "ema"

    def __init__(self, alpha: float = 0.3, block: int | None = None, margin: int = 1):
        if not 0.0 < alpha <= 1.0:
            raise UsageError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha, self.block, self.margin = alpha, block, margin

    def draft_lengths(self, requests, block_size):
        cap = self.block or block_size
        out = []
        for r in requests:
            st = r.ctx.state
            s = r.stats
            last = st.get("_ema_seen")
            if last is not None and s.num_drafts > last[0]:
                acc = (s.num_accepted_tokens - last[1]) / (s.num_drafts - last[0])
                st["_ema"] = (1 - self.alpha) * st.get("_ema", acc) + self.alpha * acc
            st["_ema_seen"] = (s.num_drafts, s.num_accepted_tokens)
            ema = st.get("_ema", cap / 2)
            out.append(max(1, min(cap, round(ema) + self.margin)))
        return out


def _drafted(proposals) -> tuple[int, float]:
    """(how many requests drafted with the drafter's forward, their mean draft length): a lookup's
    free proposals cost no drafter call."""
    lengths = [len(p) for p in proposals if len(p) and not p.free]
    return len(lengths), sum(lengths) / max(1, len(lengths))


def _backlog(r, depth: int) -> int:
    """Context rows request r would hand the drafter at its next call beyond a steady round's (the
    anchor and ``depth`` drafts): the positions verified since it last drafted."""
    feats, st = r.ctx.features, r.ctx.state
    seen, rows = st.get("_backlog", (0, 0))
    if len(feats) < seen:          # the drafter took them in: count afresh
        seen, rows = 0, 0
    rows += sum(f.shape[0] for f in feats[seen:])
    st["_backlog"] = (len(feats), rows)
    return max(0, rows - 1 - depth)


def _context(requests) -> int:
    return int(sum(len(r.ctx.tokens) for r in requests) / max(1, len(requests)))


def _sorted_candidates(survivals: list[list[float]]):
    """(a, position, request) for every candidate with a > 0, by a descending, then position."""
    cands = [(a, j, i) for i, row in enumerate(survivals) for j, a in enumerate(row) if a > 0]
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    return cands


def prefix_schedule(survivals: list[list[float]], sps, early_stop: bool = True, sps_many=None) -> list[int]:
    """Algorithm 1. ``sps(B)``: steps/s at B verified tokens. Returns lengths l_r.
    ``early_stop=False`` is the biased full search of Appendix A (kept for the test that shows it).
    ``sps_many(Bs)``: the same for an array of B at once (one vectorised pricing of every candidate
    prefix instead of one call per candidate, for many candidates; the same answer)."""
    R = len(survivals)
    cands = _sorted_candidates(survivals)
    if sps_many is not None and early_stop and len(cands) > 24:    # below that the loop is cheaper
        a = np.fromiter((c[0] for c in cands), float, len(cands))
        theta = (R + np.cumsum(a)) * sps_many(R + np.arange(1, len(cands) + 1))
        prev = np.concatenate([[R * sps(R)], theta[:-1]])
        worse = np.flatnonzero(theta <= prev)     # the first candidate that does not improve stops it
        lengths = [0] * R
        for _, j, i in cands[:int(worse[0]) if worse.size else len(cands)]:
            lengths[i] = j + 1   # survivals fall along a row: a request's candidates come in position order
        return lengths
    lengths = [0] * R
    B, tau = R, float(R)
    best = tau * sps(B)
    best_lengths = list(lengths)
    for a, j, i in cands:
        if lengths[i] != j:          # cannot happen with monotone survivals; keeps prefixes whole
            continue
        B += 1
        tau += a
        theta = tau * sps(B)
        lengths[i] = j + 1
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


class _Recent:
    """The survival rows a_1..a_l of the last ``size`` proposals, as a ring of plain lists, and, kept
    as rows come and go, each position's total survival and count. Rows are added every step (each
    proposal) and read by a depth search only now and then (``pools`` builds its arrays then): both
    run right after a target forward has evicted the CPU caches, where a few list operations cost
    less than the array operations on a NaN-padded matrix they replaced, and the adds are many."""

    def __init__(self, size: int, width: int = 8):
        self.size = size
        self._rows: list = [None] * size        # the ring; None where no row came yet
        self.next = 0       # where the next row goes
        self.added = 0      # rows added so far
        self._sum = [0.0] * width               # per position: total survival of the held rows
        self._count = [0] * width               # and how many held rows reach it

    def add(self, row) -> None:
        row = [float(a) for a in row]
        if len(row) > len(self._sum):
            more = len(row) - len(self._sum)
            self._sum += [0.0] * more
            self._count += [0] * more
        s, c = self._sum, self._count
        old = self._rows[self.next]
        if old is not None:                     # the row it replaces
            for k, a in enumerate(old):
                s[k] -= a
                c[k] -= 1
        for k, a in enumerate(row):
            s[k] += a
            c[k] += 1
        self._rows[self.next] = row
        self.next = (self.next + 1) % self.size
        self.added += 1
        if self.added % self.size == 0:       # re-add from scratch now and then: no rounding drift
            self._sum = [sum(r[k] for r in self._rows if r is not None and len(r) > k) for k in range(len(s))]

    def sums(self, cap: int) -> tuple[list[float], list[int]]:
        """(total survival of the held rows, how many of them reach it) per position, ``cap`` long."""
        pad = max(0, cap - len(self._sum))
        return self._sum[:cap] + [0.0] * pad, self._count[:cap] + [0] * pad

    def mean(self, k: int) -> float | None:
        """The mean survival at position k of the held rows that reach it (None if none does)."""
        return self._sum[k] / self._count[k] if k < len(self._count) and self._count[k] else None

    def pools(self, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(survivals, their positions, rows reaching each position [cap]): position by position,
        oldest row first."""
        rows = [r for r in self._rows[self.next:] + self._rows[:self.next] if r is not None]
        per = [[r[k] for r in rows if len(r) > k] for k in range(cap)]
        counts = np.array([len(v) for v in per], dtype=np.int64)
        vals = np.array([a for v in per for a in v], dtype=float)
        return vals, np.repeat(np.arange(cap), counts), counts


class _ProfiledPolicy(Policy):
    """Keeps the observed per-position acceptance profile (the survivals of drafters without
    confidences, what drafting can expect to return, and the default for requests the async policy
    has no snapshot of). Whether drafting pays is decided on expectations: the profile's
    acceptance against the cost table, which prices drafting and verifying together. When nothing
    pays, one request (in turn) drafts and verifies one token now and then, so that the profile
    keeps learning: at least ``probe_every`` steps apart, and further apart when a probe's price
    (the cost model's, corrected by the steps that ran) exceeds ``probe_budget`` of the plain
    steps between two probes (a probe pays a whole drafter call, and with it the request's context
    features since it last drafted), and up to ``probe_far`` times further while the last search
    found drafting far from paying (its best under 80 % of plain decoding's tokens/s). The converse: while drafting pays, one step in
    ``reference_every + 1`` runs plain, so that the cost model keeps comparing drafting steps with
    plain steps of the same minutes (see CostModel)."""

    def __init__(self, cost_table=None, block: int | None = None, probe_every: int = 8,
                 probe_budget: float = 0.01, reference_every: int = 64, recent: int = 64):
        self.cost = CostModel(cost_table)
        self.block = block
        self.profile = _Profile(block or 7)
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.reference_every = reference_every
        self.probe_far = 16.0
        self._idle = 0          # steps since the last probe, while drafting does not pay
        self._probes = 0        # probes so far (whose turn is next)
        self._probed: int | None = None     # index of the request probed this step, or None
        self._recent = _Recent(recent)                # survival rows a_1..a_l of recent proposals
        self.probe_scale = 1.0                        # a probe's measured / table drafting part
        self._rows = 0                                # catch-up rows of this step's drafting requests
        self._version = 0                             # proposals seen (what the searches read)
        self._ratio = 1.0                             # best drafting tokens/s over plain, last search
        # see _unchanged_since_no: (requests, proposals seen, rho, context column)
        self._no_key: tuple[int, int, float, int] | None = None
        self._key: tuple[int, int, float, int] | None = None
        # prefix: (key, steps used, proposals added then, depth, mean a_1 then) of a paying search
        self._held = None
        self._probe_m = [0.0, 0.0]

    def _refresh(self, requests, block_size) -> int:
        cap = self.block or block_size
        if len(self.profile.tries) < cap:
            self.profile = _Profile(cap)
        self.profile.update(requests)
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
        key = (len(requests), self._version, self.cost.extra_scale, self.cost.context_index(_context(requests)))
        if key == self._no_key:
            return True
        self._key = key
        return False

    def _found(self, drafting_pays: bool) -> None:
        self._no_key = None if drafting_pays else self._key

    def _pooled(self, cap: int, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recent proposals' survivals by position (``_Recent.pools``; the observed profile's where
        none reached a position) for a search over R requests: (survivals, positions, weights), each
        position's pool standing for R candidates."""
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
        confidences), made non-increasing; from ``_Recent``'s running totals (the async policy
        asks every step)."""
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

    def observe_step(self, seconds: float) -> None:
        """Probes are priced apart: a probe's drafter call also takes in the request's context since
        it last drafted, and its one verified token makes the step ragged; both cost far more, per
        token, than the table's uniform rows say (2 - 3x on the AMD EPYC VM at 16 requests)."""
        got = self.cost.observe(seconds, learn=self._probed is None)
        if got is not None and self._probed is not None:
            m, b = self._probe_m, 0.2
            if not m[1]:
                m[0] = m[1] = got[1]
            m[0], m[1] = (1 - b) * m[0] + b * got[0], (1 - b) * m[1] + b * got[1]
            self.probe_scale = min(8.0, max(0.25, m[0] / m[1]))

    def _expect(self, requests, lengths, drafting: int, depth: float) -> None:
        self.cost.expect(len(requests), sum(lengths), _context(requests), drafting, depth, self._rows)

    def _drafting(self, requests, want: list[int]) -> list[int]:
        """Note the catch-up rows of the requests about to draft (priced with the step); returns want."""
        self._rows = sum(_backlog(r, w) for r, w in zip(requests, want) if w)
        return want

    def probe_gap(self, requests) -> int:
        """Plain steps between two probes: ``probe_every``, or more while a probe would cost more
        than ``probe_budget`` of them."""
        if self.cost.table is None:
            return self.probe_every
        R, ctx = len(requests), _context(requests)
        base, more = self.cost.parts(R, 1, ctx, 1, 1.0, _backlog(requests[self._probes % R], 1) if R else 0)
        gap = max(self.probe_every, more * self.probe_scale / (self.probe_budget * base))
        # what probes are for is to notice that drafting pays again; the further the last search
        # found it from paying, the less a probe's news can change that: the gap stretches as the
        # best drafting step's tokens/s falls from plain's to 80 % of it, at most ``probe_far`` x
        near = max(1.0 / self.probe_far, min(1.0, (self._ratio - 0.8) / 0.2))
        return math.ceil(gap / near)

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


class PrefixPolicy(_ProfiledPolicy):
    """Paper Algorithm 1 over the engine's cost table (drafting included). Drafting goes no deeper
    than the depth that pays on the observed acceptance profile, and no more than one beyond what
    the request verified last step; when no depth pays (heavy load, or a drafter whose drafts cost
    more than they return) the engine runs plain decoding, with a one-token probe now and then."""

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
    # the policy's decision time (0.3 - 0.4 ms a search on the AMD EPYC VM, against 0.1 - 0.15 ms
    # for the rest of a step's decisions at one or two requests)
    search_every = 8
    search_drift = 0.05

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_profile = _FreeProfile(16)    # the lookups' own acceptance, from 1/2
        self._free_pending = False              # some free proposal was verified last step

    def draft_lengths(self, requests, block_size):
        cap = self._refresh(requests, block_size)
        depth = 0
        if not self._unchanged_since_no(requests):
            key, held, first = (self._key[0], self._key[3], cap), self._held, self._recent.mean(0)
            if (held is not None and held[0] == key and held[1] < self.search_every
                    and self._recent.added - held[2] < self._recent.size / 4
                    and first is not None and held[4] is not None and abs(first - held[4]) < self.search_drift):
                depth = held[3]
                self._held = (key, held[1] + 1, held[2], depth, held[4])
            else:
                depth = self._draft_depth(requests, cap)
                self._found(depth > 0)
                self._held = (key, 1, self._recent.added, depth, first) if depth else None
        if not depth:
            return self._with_free(requests, self._probe(requests), block_size)
        self._idle = 0
        if self._reference_due():
            return self._drafting(requests, [0] * len(requests))
        return self._with_free(requests, [min(depth, r.ctx.state.get("_last_verified", depth - 1) + 2)
                                          for r in requests], block_size)

    def _with_free(self, requests, want: list[int], block_size: int) -> list[int]:
        """``want`` for the drafter's forward; a request with a free proposal drafts all of it
        instead (and hands the drafter no context rows this step)."""
        free = [r.ctx.state.get("_free", 0) for r in requests]
        if not any(free):
            return self._drafting(requests, want)
        if self._probed is not None and free[self._probed]:
            self._probed = None         # the lookup serves it: no probe of the drafter this step
        self._drafting(requests, [0 if f else w for w, f in zip(want, free)])
        return [min(f, block_size) if f else w for w, f in zip(want, free)]

    def _draft_depth(self, requests, cap: int) -> int:
        """How deep drafting can pay this step: the depth d maximising the expected tokens per second
        of drafting d tokens for every request and then verifying, as Algorithm 1 would, the most
        likely of them, against plain decoding. The survivals the R requests will show are taken to
        be distributed as those of the recent proposals (``_pooled``, past steps only): each
        position's pool stands for R candidates, so verifying the candidates down to a survival
        lambda verifies R x (the pool's share above lambda) tokens and returns R x (their mean
        survival x that share); every lambda is tried. Drafting is priced by the cost table for
        all R requests at depth d, verification by the tokens verified."""
        R = len(requests)
        ctx = _context(requests)
        plain = R / self.cost.seconds(R, 0, ctx, 0)
        vals, pos, weights = self._pooled(cap, R)
        order = np.argsort(-vals, kind="stable")
        vals, pos, weights = vals[order], pos[order], weights[order]
        # row d - 1: drafting d tokens; candidates deeper than d count for nothing in that row
        w = np.where(pos[None, :] < np.arange(1, cap + 1)[:, None], weights[None, :], 0.0)
        extra = np.cumsum(w, axis=1)
        tau = R + np.cumsum(w * vals[None, :], axis=1)
        backlog = [_backlog(r, 0) for r in requests]
        rows = [sum(max(0, b - d) for b in backlog) for d in range(1, cap + 1)]
        theta = tau / self.cost.seconds_many(R, extra, ctx, list(range(1, cap + 1)), rows)
        best = theta.max(axis=1)
        d = int(np.argmax(best))
        self._ratio = float(best[d]) / plain
        return d + 1 if best[d] > plain else 0

    def verify_lengths(self, requests, proposals):
        if not requests:
            return []
        prof = self.profile.conditional()
        any_free = self._settle_free(requests) | any(p.free for p in proposals)
        free_prof = self.free_profile.conditional() if any_free else prof
        surv = [_survivals(p, free_prof if p.free else prof) for p in proposals]
        self._note_proposals(proposals, surv)
        drafting, depth = _drafted(proposals)
        # the drafter's call is paid already: a longer verification costs only the target's part
        ctx, R = _context(requests), len(requests)

        price = self.cost.pricer(R, ctx, drafting, depth, self._rows)

        def sps(B):             # B: a number, or (sps_many) an array of them
            return 1.0 / price(B - R)
        if self._probed is None:
            lengths = prefix_schedule(surv, sps, sps_many=sps)
        else:       # the probe is verified whole; free proposals beside it as on any step
            i = self._probed
            lengths = (prefix_schedule([a if j != i else [] for j, a in enumerate(surv)], sps, sps_many=sps)
                       if any(p.free and len(p) for p in proposals) else [0] * R)
            lengths[i] = len(proposals[i])
        for i, (r, p) in enumerate(zip(requests, proposals)):
            if p.free and len(p):
                lengths[i] = self._explore_free(r, lengths[i])
                if lengths[i]:
                    r.ctx.state["_free_pending"] = (lengths[i], r.stats.num_accepted_tokens)
                    self._free_pending = True
            if len(p):      # a drafter that found nothing to propose (n-gram miss) says nothing here
                r.ctx.state["_last_verified"] = lengths[i]
        _record(requests, lengths)
        self._expect(requests, lengths, drafting, depth)
        return lengths

    def _settle_free(self, requests) -> bool:
        """Learn the free proposals' acceptance per position from what the target accepted of the
        ones verified last step (their own profile: a lookup's acceptance is not the drafter's).
        True if there were any."""
        if not self._free_pending:
            return False
        self._free_pending = False
        for r in requests:
            pend = r.ctx.state.pop("_free_pending", None)
            if pend is not None:
                n, before = pend
                self.free_profile.observe(n, r.stats.num_accepted_tokens - before)
        return True

    def _explore_free(self, r, n: int) -> int:
        """A request whose free proposals went unverified ``probe_every`` times verifies one token of
        the next: the free profile keeps learning (one token costs little; never learning again
        after a bad spell costs the lookups' whole gain)."""
        st = r.ctx.state
        if n:
            st["_free_idle"] = 0
            return n
        st["_free_idle"] = st.get("_free_idle", 0) + 1
        if st["_free_idle"] >= self.probe_every:
            st["_free_idle"] = 0
            return 1
        return 0


class AsyncPolicy(_ProfiledPolicy):
    """Asynchronous scheduling (paper section 5.2): the capacity K (draft tokens verified this step
    beyond the anchors) comes from the survivals of two steps earlier by a full search over the
    cost table; this step verifies the top-K candidates by up-to-date survival, ties by position,
    down to the survival below which verifying a token costs more than it returns. K depends only
    on stale information, so the full search stays lossless."""

    name = "async"

    def __init__(self, cost_table=None, block: int | None = None, lag: int = 2, probe_every: int = 8,
                 probe_budget: float = 0.01, reference_every: int = 64):
        super().__init__(cost_table, block, probe_every, probe_budget, reference_every)
        self.history: deque = deque(maxlen=lag)
        self.capacity = 0

    def draft_lengths(self, requests, block_size):
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
        ctx = _context(requests)
        # the top k candidates: k verified tokens, and a drafter call over the requests holding them,
        # each drafting one more than it holds (see draft_lengths)
        best_k, best, tau = 0, R / self.cost.seconds(R, 0, ctx, 0), float(R)
        plain, top = best, 0.0
        held, drafting, drafted, rows = [0] * R, 0, 0, 0
        backlog = [_backlog(r, 1) for r in requests]
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
        surv = [_survivals(p, prof) for p in proposals]
        self._note_proposals(proposals, surv)
        self.history.append({r.id: s for r, s in zip(requests, surv)})
        if self._probed is not None:
            lengths = self._probe_lengths(proposals)
        else:
            # of the top K, only candidates whose survival pays for the target's part of verifying
            # them (a drafted token already cost its drafting): a cut by a's value that depends on
            # the load, not on the tokens, so like a threshold it keeps the output lossless
            R, ctx = len(requests), _context(requests)
            plain = self.cost.seconds(R, 0, ctx, 0)
            floor = (self.cost.seconds(R, 1, ctx, 0) - plain) / (plain / R)
            lengths = [0] * len(requests)
            for a, j, i in _sorted_candidates(surv)[:self.capacity]:
                if a < floor:
                    break
                lengths[i] = max(lengths[i], j + 1)
        _record(requests, lengths)
        self._expect(requests, lengths, *_drafted(proposals))
        return lengths
