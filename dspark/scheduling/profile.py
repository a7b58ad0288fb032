"""The acceptance a policy expects of a draft, learnt from the past only.

``AcceptanceProfile``: the observed conditional acceptance per position of the drafter's verified
tokens (the survivals of drafters without confidences, and what drafting can expect to return);
``FreeProfile``: the same for the lookups' free proposals, learnt apart, and ``FreeProfiles``: one
per strength of a lookup's evidence (its matched suffix length); ``RecentSurvivals``: the
calibrated survival rows of the recent proposals, verified or not, with running totals per position.
"""

from __future__ import annotations

import numpy as np


class AcceptanceProfile:
    """Observed conditional acceptance per position (for drafters without confidences, and for
    requests that joined after the snapshot the async policy reads)."""

    def __init__(self, block: int, prior: float = 0.5, prior_tries: float = 1.0):
        self.tries = [prior_tries] * max(1, block)
        self.hits = [prior * prior_tries] * max(1, block)

    def learn(self, lengths: list[int], width: int, hits: list[int]) -> None:
        """One request's verified blocks since it was last learnt from: ``lengths``, the lengths the
        policy chose to verify; ``width``, the longest block the request has had verified so far;
        ``hits[k]``, how many times position k was accepted. Position k counts one try per length
        beyond it (positions past ``width`` are not counted; the last position holds all deeper)."""
        last = len(self.tries) - 1
        for k in range(width):
            tried = sum(1 for L in lengths if L > k)
            if tried:
                self.tries[min(k, last)] += tried
                self.hits[min(k, last)] += hits[k] if k < len(hits) else 0

    def conditional(self) -> list[float]:
        return [min(0.999, h / t) for h, t in zip(self.hits, self.tries)]

    def survivals(self, cap: int) -> list[float]:
        """Prefix survivals a_1..a_cap implied by the observed conditional acceptance."""
        out, a = [], 1.0
        for c in self.conditional()[:cap]:
            a *= c
            out.append(a)
        return out


class FreeProfile(AcceptanceProfile):
    """The conditional acceptance per position of free (lookup) proposals, learned from their
    verified tokens: position k counts a try when tokens 1..k-1 were accepted, a hit when k was too."""

    def observe(self, verified: int, accepted: int) -> None:
        for k in range(min(verified, len(self.tries))):
            self.tries[k] += 1
            if accepted > k:
                self.hits[k] += 1
            else:
                break


class FreeProfiles:
    """The free proposals' conditional acceptance per position, learnt apart for each strength of
    their evidence (``Proposal.evidence``: a lookup's matched suffix length). One profile over all
    of them misprices both ends: a one-token match's continuation is accepted far less often than a
    long match's (docs/scheduling.md, the table under Algorithm 1). A strength seen little leans on
    the pooled profile: its estimate at a position is its own hits plus ``weight`` tries at the
    pooled rate, over its tries plus ``weight``. Strengths above ``strongest`` count as
    ``strongest``."""

    def __init__(self, block: int, weight: float = 8.0, strongest: int = 8):
        self.pooled = FreeProfile(block)
        self.weight = weight
        self.strongest = strongest
        self._by: dict[int, FreeProfile] = {}      # strength -> its own counts (no prior)

    @property
    def tries(self) -> list[float]:
        """Tries per position over all strengths (with the pooled profile's prior)."""
        return self.pooled.tries

    @property
    def hits(self) -> list[float]:
        return self.pooled.hits

    def observe(self, evidence: int, verified: int, accepted: int) -> None:
        """One free proposal of this strength: ``verified`` tokens verified, ``accepted`` of them."""
        self.pooled.observe(verified, accepted)
        strength = min(max(0, evidence), self.strongest)
        if strength not in self._by:
            self._by[strength] = FreeProfile(len(self.pooled.tries), prior_tries=0.0)
        self._by[strength].observe(verified, accepted)

    def conditional(self, evidence: int = 0) -> list[float]:
        pooled = self.pooled.conditional()
        own = self._by.get(min(max(0, evidence), self.strongest))
        if own is None:
            return pooled
        w = self.weight
        return [min(0.999, (h + w * c) / (t + w)) for h, t, c in zip(own.hits, own.tries, pooled)]


class RecentSurvivals:
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
