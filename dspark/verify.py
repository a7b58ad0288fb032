"""Verification: rejection sampling with residual resampling, the bonus token, the greedy path.

For a block of l drafted tokens x_1..x_l drawn from q_1..q_l, and the target's logits at the
l + 1 positions (the anchor's row predicts x_1, ..., row l predicts the bonus token):

- accept x_k with probability min(1, p_k(x_k) / q_k(x_k)), stopping at the first rejection;
- at a rejection emit a token from norm(max(0, p_k - q_k)) (from p_k if that has no mass);
- if all l are accepted emit a bonus token from p_{l+1}.

The emitted tokens are then distributed exactly as the target's own samples. ``q`` must be the
distribution the drafts were really drawn from (after the drafter's own temperature / top-k /
top-p); ``None`` means each draft was a deterministic choice (n-gram lookup), i.e. a point mass.

Point masses are verified by drawing the target's own token at each position, exactly as plain
decoding draws it, and accepting the draft while they agree: the same law (x_k survives with
probability p_k(x_k), a mismatch is a draw from p_k without x_k), and one draw per emitted token,
so a seeded request emits the very tokens of plain decoding with that seed, whatever was drafted
(the n-gram drafter's proposals depend on the requests it served before).

``verify`` takes one request; ``verify_batch`` takes every request of a step, flattened into rows
(greedy and sampled, with draft probabilities or point masses), does the arithmetic for all at
once and brings the answers to the host in one transfer, as vLLM's rejection sampler does. It
draws each request's uniforms from the request's own generator by the very calls ``verify`` makes,
so it answers exactly as ``verify`` would, request by request.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .sampling import SamplingParams, argmax, probs_from_logits, sample


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: accept while the draft equals the target's argmax."""
    best = argmax(target_logits).cpu()
    l = draft_tokens.shape[0]
    draft_tokens = draft_tokens.cpu()
    if l == 0:
        return 0, int(best[0])
    mismatch = (draft_tokens != best[:l]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else l
    return n, int(best[n])


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           params: SamplingParams, generator: torch.Generator | None) -> tuple[int, int]:
    """Returns (number of accepted drafts n, the token emitted after them).

    draft_tokens [l] long; draft_probs [l, V] fp32 or None (point masses); target_logits [l+1, V].
    The emitted tokens are ``draft_tokens[:n]`` followed by the returned token.
    """
    l = draft_tokens.shape[0]
    if target_logits.shape[0] != l + 1:
        raise ValueError(f"need {l + 1} target rows for {l} drafts, got {target_logits.shape[0]}")
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    p = probs_from_logits(target_logits, params)  # fp32 [l+1, V]
    return verify_probs(draft_tokens, draft_probs, p, generator)


def verify_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, p: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """``verify`` on target probabilities already processed by the sampling settings."""
    l = draft_tokens.shape[0]
    dev = p.device
    if draft_probs is None:     # point masses: draw the target's token, accept while they agree
        for k, x in enumerate(draft_tokens.tolist()):
            y = int(sample(p[k], generator))
            if y != x:
                return k, y
        return l, int(sample(p[l], generator))
    draft_tokens = draft_tokens.to(dev)
    draft_probs = draft_probs.to(dev)
    if l:
        rows = torch.arange(l, device=dev)
        p_x = p[rows, draft_tokens]
        q_x = draft_probs.float()[rows, draft_tokens]
        u = torch.rand(l, generator=generator, device=dev)
        rejected = (u * q_x >= p_x).nonzero()
        n = int(rejected[0, 0]) if rejected.numel() else l
    else:
        n = 0
    if n == l:  # every draft accepted: bonus token from the target
        return n, int(sample(p[l], generator))
    residual = (p[n] - draft_probs[n].float()).clamp_min_(0.0)
    mass = float(residual.sum())
    if mass <= 1e-12:  # p == q there: resample from the target
        residual = p[n]
    return n, int(sample(residual, generator))


# ---------------------------------------------------------------------------------------------- batched
@dataclass(frozen=True)
class VerifyBatch:
    """Per-request metadata of ``verify_batch``, one entry per request, in the order of its rows.

    lengths: l_r, the request's drafted tokens (it has l_r + 1 target rows);
    greedy: temperature 0 (its target rows are scores: only their argmax counts);
    point_mass: drafts without probabilities (``verify``'s None: a lookup's, a grammar's forced
        tokens); a sampled request that has them passes its [l_r, V] rows in ``draft_probs``;
    generators: each request's random stream (None: torch's default one, as for ``verify``).
    """

    lengths: list[int]
    greedy: list[bool]
    point_mass: list[bool]
    generators: list[torch.Generator | None]

    def __post_init__(self):
        if not len(self.lengths) == len(self.greedy) == len(self.point_mass) == len(self.generators):
            raise ValueError("VerifyBatch: lengths, greedy, point_mass and generators differ in length")


def target_rows(target_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A request's rows of ``verify_batch``'s target: its probabilities after the sampling settings
    (``probs_from_logits``, as ``verify`` computes them), or its logits as they are when greedy."""
    return target_logits if params.greedy else probs_from_logits(target_logits, params)


Block = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool, torch.Generator | None]
Stacked = tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor, VerifyBatch]


def stack_requests(blocks: Sequence[Block], target: torch.Tensor | None = None) -> Stacked:
    """``verify_batch``'s arguments from each request's (draft tokens [l], draft probabilities [l, V]
    or None, target rows [l + 1, V] from ``target_rows``, greedy, generator), on the target rows'
    device. ``target``: the blocks' target rows already in one tensor, in order (the engine's
    forward logits, when no request's law changes them); else they are concatenated. A greedy
    request's draft probabilities are never read: left out."""
    if not blocks:
        return torch.empty(0, dtype=torch.long), [], torch.empty(0, 0), VerifyBatch([], [], [], [])
    drafts = [bl[0] for bl in blocks]
    if target is None:
        target = torch.cat([bl[2] for bl in blocks])
    dev = target.device
    probs = [None if greedy or q is None else _to(q, dev) for _, q, _, greedy, _ in blocks]
    batch = VerifyBatch([x.shape[0] for x in drafts], [bl[3] for bl in blocks], [bl[1] is None for bl in blocks],
                        [bl[4] for bl in blocks])
    return torch.cat([_to(x.reshape(-1).long(), dev) for x in drafts]), probs, target, batch


@dataclass(frozen=True)
class VerifyPlan:
    """Where ``verify_batch`` finds each request's rows, and the uniforms each request's generator
    gave, drawn by the very calls ``verify`` makes. B requests, D = sum l_r drafts, D + B target
    rows; G rows of greedy requests, P rows of point-mass requests, Q drafts of the S requests
    verified against draft probabilities ("sampled")."""

    lengths: torch.Tensor       # [B] l_r
    first_row: torch.Tensor     # [B] each request's first target row
    draft_req: torch.Tensor     # [D] each draft's request
    draft_pos: torch.Tensor     # [D] each draft's position in its block
    row_req: torch.Tensor       # [D + B] each target row's request
    argmax_rows: torch.Tensor   # [G] rows whose token is the argmax (greedy requests)
    drawn_rows: torch.Tensor    # [P] rows whose token is drawn from the target (point masses; l_r = 0)
    drawn_u: torch.Tensor       # [P] the uniform of each draw
    q_drafts: torch.Tensor      # [Q] drafts accepted with probability min(1, p(x) / q(x))
    q_reqs: torch.Tensor        # [S] the sampled requests
    accept_u: torch.Tensor      # [Q] the uniforms of their acceptance tests
    final_u: torch.Tensor       # [S] each one's uniform for its residual or bonus token
    sampled: tuple[tuple[int, int, int], ...]   # host: (request, its first draft, l_r) of each sampled request
    # point-mass requests with drafts: (request, generator, its states after 1 .. l draws), to set
    # it back to where ``verify``, which draws only until the first mismatch, would leave it
    rewind: tuple[tuple[int, torch.Generator, tuple[torch.Tensor, ...]], ...]


def plan_batch(batch: VerifyBatch, dev: torch.device) -> VerifyPlan:
    """``verify_batch``'s host part: the plan's indices (on ``dev`` in one transfer) and uniforms.
    Each request's uniforms come from its own generator as ``verify`` draws them: rand(l) for the
    acceptance tests, then one rand(1) for the residual or bonus token; a point-mass request's
    rand(1) for each of its l + 1 target draws, of which ``verify`` uses only n + 1 (``rewind``).
    A point-mass request with drafts needs a generator of its own (not None, not another's)."""
    users = Counter(id(g) for g, greedy in zip(batch.generators, batch.greedy) if not greedy)
    draft_req: list[int] = []
    draft_pos: list[int] = []
    row_req: list[int] = []
    first_row: list[int] = []
    argmax_rows: list[int] = []
    drawn_rows: list[int] = []
    q_drafts: list[int] = []
    sampled: list[int] = []
    drawn_u: list[torch.Tensor] = []
    accept_u: list[torch.Tensor] = []
    final_u: list[torch.Tensor] = []
    rewind = []
    blocks: list[tuple[int, int, int]] = []
    row = 0
    for i, (l, greedy, pm, g) in enumerate(zip(batch.lengths, batch.greedy, batch.point_mass, batch.generators)):
        draft_req += [i] * l
        draft_pos += range(l)
        row_req += [i] * (l + 1)
        first_row.append(row)
        if greedy:
            argmax_rows += range(row, row + l + 1)
        elif pm or l == 0:      # l == 0: verify draws the token from p[0] either way
            drawn_rows += range(row, row + l + 1)
            if l:
                if g is None or users[id(g)] > 1:
                    raise ValueError("a point-mass request with drafts needs a generator of its own in the batch")
                states = []
                for _ in range(l):
                    drawn_u.append(torch.rand(1, generator=g, device=g.device))
                    states.append(g.get_state())
                rewind.append((i, g, tuple(states)))
            drawn_u.append(torch.rand(1, generator=g, device=_device(g)))
        else:
            q_drafts += range(row - i, row - i + l)
            sampled.append(i)
            blocks.append((i, row - i, l))
            accept_u.append(torch.rand(l, generator=g, device=dev))
            final_u.append(torch.rand(1, generator=g, device=_device(g)))
        row += l + 1
    parts = [batch.lengths, first_row, draft_req, draft_pos, row_req, argmax_rows, drawn_rows, q_drafts, sampled]
    flat = _to(torch.tensor([*itertools.chain(*parts)], dtype=torch.long), dev).split([len(p) for p in parts])
    uniforms = [_to(torch.cat(u), dev) if u else torch.empty(0, device=dev) for u in (drawn_u, accept_u, final_u)]
    return VerifyPlan(lengths=flat[0], first_row=flat[1], draft_req=flat[2], draft_pos=flat[3], row_req=flat[4],
                      argmax_rows=flat[5], drawn_rows=flat[6], drawn_u=uniforms[0], q_drafts=flat[7], q_reqs=flat[8],
                      accept_u=uniforms[1], final_u=uniforms[2], sampled=tuple(blocks), rewind=tuple(rewind))


def verify_batch(draft_tokens: torch.Tensor, draft_probs: Sequence[torch.Tensor | None] | None, target: torch.Tensor,
                 batch: VerifyBatch) -> list[tuple[int, int] | None]:
    """``verify`` for every request of a step at once, with one host synchronisation in all.

    draft_tokens [D] long: every request's drafts, concatenated (D = sum of the l_r);
    draft_probs: per request its drafts' probabilities [l_r, V] (read for sampled requests only:
        neither greedy nor point mass; only the entries of its drafts and one row are read);
    target [D + B, V]: each request's l_r + 1 rows (``target_rows``: its processed probabilities
        (fp32), or its logits when greedy), concatenated. ``stack_requests`` builds them.

    Returns per request (n accepted drafts, the token emitted after them): exactly ``verify``'s
    answer from the same generator states, and the states are left as ``verify`` leaves them. The
    arithmetic is ``verify``'s, row by row. None for a request where a value the verification
    reads is NaN (a row's argmax or its drawn total, a draft's probabilities, the residual): its
    law is broken (``verify`` would emit an arbitrary token); a NaN logit makes its whole row NaN
    once a softmax has run over it, so every broken sampled row is seen.
    """
    lengths, b, d = batch.lengths, len(batch.lengths), sum(batch.lengths)
    if not b:
        return []
    if draft_tokens.shape[0] != d or target.shape[0] != d + b:
        raise ValueError(f"need {d} draft tokens and {d + b} target rows for drafts of lengths {lengths}, "
                         f"got {draft_tokens.shape[0]} and {target.shape[0]}")
    if all(batch.greedy):       # the argmax alone decides: no plan, no generator
        return _greedy_batch(draft_tokens, target, lengths)
    dev = target.device
    plan = plan_batch(batch, dev)
    given = list(draft_probs) if draft_probs is not None else []
    q = [given[i] if i < len(given) else None for i, _, _ in plan.sampled]
    for (i, _, _), qi in zip(plan.sampled, q):
        if qi is None or qi.shape[0] < lengths[i]:
            raise ValueError(f"request {i}: need {lengths[i]} rows of draft probabilities, got "
                             f"{0 if qi is None else qi.shape[0]}")
    x = _to(draft_tokens.long(), dev)
    row_of = torch.arange(d, device=dev) + plan.draft_req       # draft j of request i: target row j + i
    y = torch.zeros(d + b, dtype=torch.long, device=dev)         # the target's own token at each row
    nan = torch.zeros(d + b, dtype=torch.bool, device=dev)
    _argmax_tokens(target, plan.argmax_rows, y, nan)
    _drawn_tokens(target, plan.drawn_rows, plan.drawn_u, y, nan)
    accept = x == y[row_of]           # greedy and point masses: the draft is the target's own token
    bad = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, plan.row_req, nan.long())
    if plan.sampled:
        _ratio_tests(target, cast(list[torch.Tensor], q), plan, x, row_of, accept, bad)
    stop = torch.where(accept, plan.lengths[plan.draft_req], plan.draft_pos)   # a block stops at its first rejection
    n = plan.lengths.clone().scatter_reduce_(0, plan.draft_req, stop, "amin")
    token = y[plan.first_row + n]
    if plan.sampled:
        _residual_tokens(target, cast(list[torch.Tensor], q), plan, n, token, bad)
    n_host, token_host, bad_host = torch.stack([n, token, bad]).tolist()    # the one synchronisation
    for i, g, states in plan.rewind:
        if n_host[i] < lengths[i]:
            g.set_state(states[n_host[i]])
    return [None if bad_host[i] else (n_host[i], token_host[i]) for i in range(b)]


def _greedy_batch(draft_tokens: torch.Tensor, target: torch.Tensor, lengths: list[int]) -> list[tuple[int, int] | None]:
    """``verify_batch`` when every request is greedy: each row's argmax and whether its score there
    is NaN come to the host with the drafts in one transfer, and each block's first mismatch is
    found there (a step of a few requests has a few dozen rows: fewer kernels than the general path)."""
    top, best = target.max(-1)      # argmax's indices (sampling.argmax); a NaN counts as the largest
    nan = top.isnan()
    flat = torch.cat([best, nan.long(), _to(draft_tokens.long(), best.device)]).tolist()   # the one synchronisation
    rows = len(best)
    out: list[tuple[int, int] | None] = []
    row = d = 0
    for l in lengths:
        y, x = flat[row:row + l + 1], flat[2 * rows + d:2 * rows + d + l]
        n = next((k for k in range(l) if x[k] != y[k]), l)
        out.append(None if any(flat[rows + row:rows + row + l + 1]) else (n, y[n]))
        row, d = row + l + 1, d + l
    return out


def _argmax_tokens(target: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, nan: torch.Tensor) -> None:
    """Greedy requests' rows [G]: the target's token is the argmax (sampling.argmax), into ``y``; a
    NaN score (which max counts as the largest) marks the row in ``nan``."""
    if rows.numel():
        top, best = _select(target, rows).max(-1)
        y.index_copy_(0, rows, best)
        nan.index_copy_(0, rows, top.isnan())


def _drawn_tokens(target: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, y: torch.Tensor,
                  nan: torch.Tensor) -> None:
    """Point-mass requests' rows [P] (and sampled rows without drafts): the target's token drawn by
    inverse CDF from ``u`` [P], into ``y``; a row whose total is NaN is marked in ``nan``."""
    if rows.numel():
        drawn, total = _draw(_select(target, rows), u)
        y.index_copy_(0, rows, drawn)
        nan.index_copy_(0, rows, total.isnan())


def _ratio_tests(target: torch.Tensor, q: list[torch.Tensor], plan: VerifyPlan, x: torch.Tensor,
                 row_of: torch.Tensor, accept: torch.Tensor, bad: torch.Tensor) -> None:
    """Sampled requests' drafts [Q]: x accepted where u * q(x) < p(x), into ``accept``; a NaN
    probability read counts in ``bad``. Of each request's draft probabilities [l_r, V] only its
    drafts' entries are read."""
    p_x = target[row_of[plan.q_drafts], x[plan.q_drafts]]
    q_x = torch.cat([qi[torch.arange(l, device=qi.device), x[s:s + l]]
                     for qi, (_, s, l) in zip(q, plan.sampled)]).float()
    accept.index_copy_(0, plan.q_drafts, ~(plan.accept_u * q_x >= p_x))
    bad.index_add_(0, plan.draft_req[plan.q_drafts], (p_x.isnan() | q_x.isnan()).long())


def _residual_tokens(target: torch.Tensor, q: list[torch.Tensor], plan: VerifyPlan, n: torch.Tensor,
                     token: torch.Tensor, bad: torch.Tensor) -> None:
    """Sampled requests' tokens, into ``token``: drawn from the residual norm(max(0, p_n - q_n)) at
    the rejection, or from p where all were accepted or the residual has no mass (p == q there); a
    NaN read counts in ``bad``. Of each request's draft probabilities one row is read."""
    nq, lq = n[plan.q_reqs], plan.lengths[plan.q_reqs]
    p = target.index_select(0, plan.first_row[plan.q_reqs] + nq)
    # each request's draft probabilities at its rejection (row l - 1 where all are accepted: not used)
    at = torch.minimum(nq, lq - 1)
    qn = torch.cat([qi.index_select(0, at[k:k + 1]) for k, qi in enumerate(q)]).float()
    residual = (p - qn).clamp_min_(0.0)
    mass = residual.sum(-1)
    use_p = (nq == lq) | (mass.double() <= 1e-12)   # all accepted, or p == q there
    drawn, total = _draw(torch.where(use_p[:, None], p, residual), plan.final_u)
    token.index_copy_(0, plan.q_reqs, drawn)
    bad.index_add_(0, plan.q_reqs, (mass.isnan() | total.isnan()).long())


def _draw(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampling._inverse_cdf's token per row, the row's total: NaN where the row holds a NaN), by
    _inverse_cdf's very arithmetic."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    idx = torch.searchsorted(cdf, (u.double() * total).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1), total


def _select(target: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """target's rows ``rows`` (increasing): target itself when they are all of them (no copy)."""
    return target if rows.shape[0] == target.shape[0] else target.index_select(0, rows)


def _device(g: torch.Generator | None):
    """Where ``sample`` draws its uniforms for generator g."""
    return g.device if g is not None else "cpu"


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """t on dev without waiting for the device (a host tensor goes through pinned memory)."""
    if t.device == dev:
        return t
    if t.device.type == "cpu" and dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)
