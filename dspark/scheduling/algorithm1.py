"""Algorithm 1 of the paper (SPEC section 4): which of the step's drafted tokens to verify.

Every decision about draft token k of a request may depend only on what is known before token k
is sampled or on tokens of OTHER requests: c_k is computed from h_k and x_{k-1}, never from x_k,
so prefix survival a_k = c_1 ... c_k depends on x_<k. Sorting all candidates by a (ties by
position) puts a token before any extension of it; Algorithm 1 walks that order and stops at the
first candidate that does not raise expected throughput, so whether x_k is verified depends only
on candidates ranked before it. A search without that stop (pick the best total afterwards) lets
the choice for x_k depend on a_{k+1}, i.e. on x_k itself, and biases the output (Appendix A).
"""

from __future__ import annotations

import numpy as np


def survivals(proposal, fallback: list[float]) -> list[float]:
    """Prefix survivals a_1..a_l of one proposal: from its confidences, or from ``fallback`` (an
    observed profile's conditional acceptance) for a drafter without them."""
    n = len(proposal)
    conf = proposal.confidences.tolist() if proposal.confidences is not None else fallback[:n]
    conf = conf + [fallback[-1] if fallback else 0.5] * (n - len(conf))
    out, a = [], 1.0
    for c in conf:
        a *= max(0.0, min(1.0, float(c)))
        out.append(a)
    return out


def sorted_candidates(survivals: list[list[float]]):
    """(a, position, request) for every candidate with a > 0, by a descending, then position."""
    cands = [(a, j, i) for i, row in enumerate(survivals) for j, a in enumerate(row) if a > 0]
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    return cands


def prefix_schedule(survivals: list[list[float]], sps, early_stop: bool = True, sps_many=None,
                    commit: int = 0) -> list[int]:
    """Algorithm 1. ``sps(B)``: steps/s at B verified tokens. Returns lengths l_r.
    ``early_stop=False`` is the biased full search of Appendix A (kept for the test that shows it).
    ``sps_many(Bs)``: the same for an array of B at once (one vectorised pricing of every candidate
    prefix instead of one call per candidate, for many candidates; the same answer).

    ``commit``: the walk takes the first ``commit`` candidates whatever they return, then goes on
    with the early stop. Lossless when ``commit`` is fixed before the step's tokens are drawn (from
    what was known then, see ``expected_commit``): whether x_k ranks among the first ``commit``
    depends only on the candidates ranked before it (other requests' and its own earlier
    positions'), never on x_k, since a_{k+1} <= a_k ranks after it. It is for prices that fall per
    token as more are verified, as on a CPU, where the first verified token makes a decoding step
    ragged (as dear as several more tokens) and the early stop alone would never pay that to reach
    the tokens behind it."""
    R = len(survivals)
    cands = sorted_candidates(survivals)
    lengths = [0] * R
    B, tau = R, float(R)
    best = tau * sps(B)
    if early_stop and commit > 0:
        head, cands = cands[:commit], cands[commit:]
        for a, j, i in head:
            lengths[i] = j + 1      # a sorted list's head holds each request's prefix
            tau += a
        B += len(head)
        best = tau * sps(B)
    if sps_many is not None and early_stop and len(cands) > 24:    # below that the loop is cheaper
        a = np.fromiter((c[0] for c in cands), float, len(cands))
        theta = (tau + np.cumsum(a)) * sps_many(B + np.arange(1, len(cands) + 1))
        prev = np.concatenate([[best], theta[:-1]])
        worse = np.flatnonzero(theta <= prev)     # the first candidate that does not improve stops it
        for _, j, i in cands[:int(worse[0]) if worse.size else len(cands)]:
            lengths[i] = j + 1   # survivals fall along a row: a request's candidates come in position order
        return lengths
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


def expected_commit(survivals: list[list[float]], settled: list[int], ratios: list[float], sps_many) -> int:
    """How many candidates to commit to (``prefix_schedule``'s ``commit``), from what is known before
    the step draws: ``settled[r]`` leading survivals of request r that were (a lookup's or a
    grammar's point masses, or a profile's survivals: all; a drafter's sampled block: a_1, which its
    confidence head computes from the anchor), and for the rest their expectation, a_s x
    ``ratios[k] / ratios[s - 1]`` (``ratios``: the recent proposals' mean survival per position,
    from the past). The count that maximises the expected tokens per second over the expected
    candidates sorted, 0 included (a full search: none of it depends on a token drawn this step)."""
    R = len(survivals)
    vals = []
    for row, s in zip(survivals, settled):
        for k, surv in enumerate(row):
            if k < s:
                vals.append(surv)
            elif s and ratios[s - 1] > 0:
                vals.append(row[s - 1] * ratios[min(k, len(ratios) - 1)] / ratios[s - 1])
    expected = -np.sort(-np.asarray(vals, float))
    expected = expected[expected > 0]
    if not expected.size:
        return 0
    theta = (R + np.concatenate([[0.0], np.cumsum(expected)])) * sps_many(R + np.arange(0, expected.size + 1))
    return int(np.argmax(theta))
