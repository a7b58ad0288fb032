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
        tokens); a sampled request that has them has its l_r rows in ``draft_probs``;
    generators: each request's random stream (None: torch's default one, as for ``verify``);
    q_rows: the row of ``draft_probs`` of each draft that has one (those requests' drafts in order);
        None: their rows in order, one after the other.
    """

    lengths: list[int]
    greedy: list[bool]
    point_mass: list[bool]
    generators: list[torch.Generator | None]
    q_rows: list[int] | None = None

    def __post_init__(self):
        if not len(self.lengths) == len(self.greedy) == len(self.point_mass) == len(self.generators):
            raise ValueError("VerifyBatch: lengths, greedy, point_mass and generators differ in length")


def target_rows(target_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A request's rows of ``verify_batch``'s target: its probabilities after the sampling settings
    (``probs_from_logits``, as ``verify`` computes them), or its logits as they are when greedy."""
    return target_logits if params.greedy else probs_from_logits(target_logits, params)


Block = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool, torch.Generator | None]


def stack_requests(blocks: Sequence[Block]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, VerifyBatch]:
    """``verify_batch``'s arguments from each request's (draft tokens [l], draft probabilities [l, V]
    or None, target rows [l + 1, V] from ``target_rows``, greedy, generator), on the target rows'
    device (a greedy request's draft probabilities are never used: left out). Rows that are
    consecutive in one tensor are taken as they lie, without a copy."""
    if not blocks:
        return torch.empty(0, dtype=torch.long), None, torch.empty(0, 0), VerifyBatch([], [], [], [])
    return _stack([bl[0] for bl in blocks], [bl[1] for bl in blocks], _concat([bl[2] for bl in blocks]),
                  [bl[3] for bl in blocks], [bl[4] for bl in blocks])


def _stack(drafts, probs, target, greedy, generators) -> tuple:
    dev = target.device
    parts = [q for x, q, gr in zip(drafts, probs, greedy) if q is not None and not gr and x.shape[0]]
    base, q_rows = _rows(parts) if parts else (None, None)
    return (torch.cat([_to(x.reshape(-1).long(), dev) for x in drafts]), None if base is None else _to(base, dev),
            target, VerifyBatch([x.shape[0] for x in drafts], list(greedy), [q is None for q in probs],
                                list(generators), q_rows))


def verify_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target: torch.Tensor,
                 batch: VerifyBatch) -> list[tuple[int, int] | None]:
    """``verify`` for every request of a step at once, with one host synchronisation in all.

    draft_tokens [D] long: every request's drafts, concatenated (D = sum of the l_r);
    draft_probs [N, V] or None: the rows (``batch.q_rows``) of the drafts' probabilities of the
        sampled requests that have them (neither greedy nor point_mass);
    target [D + B, V]: each request's l_r + 1 rows (``target_rows``: its processed probabilities
        (fp32), or its logits when greedy), concatenated. ``stack_requests`` builds them.

    Returns per request (n accepted drafts, the token emitted after them): exactly ``verify``'s
    answer from the same generator states, and the states are left as ``verify`` leaves them (see
    ``_plan``). The arithmetic is ``verify``'s, row by row. None for a request where a value the
    verification reads is NaN (a row's argmax or its drawn total, a draft's probabilities, the
    residual): its law is broken (``verify`` would emit an arbitrary token); a NaN logit makes
    its whole row NaN once a softmax has run over it, so every broken sampled row is seen.
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
    idx, u, rewind = _plan(batch, dev)
    if idx["q_reqs"] and (draft_probs is None or len(idx["q_rows"]) != len(idx["q_drafts"])
                          or max(idx["q_rows"]) >= draft_probs.shape[0]):
        raise ValueError(f"need {len(idx['q_drafts'])} rows of draft probabilities, got "
                         f"{0 if draft_probs is None else draft_probs.shape[0]}")
    flat = torch.tensor([*itertools.chain(*idx.values()), *lengths], dtype=torch.long)
    t = dict(zip([*idx, "lengths"], _to(flat, dev).split([*map(len, idx.values()), b])))
    x, lengths_t = _to(draft_tokens.long(), dev), t["lengths"]
    row_of = torch.arange(d, device=dev) + t["draft_req"]        # draft j of request i: target row j + i
    y = torch.zeros(d + b, dtype=torch.long, device=dev)          # the target's own token (greedy, point mass)
    nan = torch.zeros(d + b, dtype=torch.bool, device=dev)
    if idx["argmax"]:
        scores = _select(target, t["argmax"])
        top, best = scores.max(-1)      # argmax's indices; a NaN counts as the largest: top is NaN there
        y.index_copy_(0, t["argmax"], best)
        nan.index_copy_(0, t["argmax"], top.isnan())
    if idx["drawn"]:
        drawn, total = _draw(_select(target, t["drawn"]), _to(torch.cat(u["drawn"]), dev))
        y.index_copy_(0, t["drawn"], drawn)
        nan.index_copy_(0, t["drawn"], total.isnan())
    accept = x == y[row_of]
    bad = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, t["row_req"], nan.long())
    if idx["q_reqs"]:
        assert draft_probs is not None
        xq = x[t["q_drafts"]]
        p_x, q_x = target[row_of[t["q_drafts"]], xq], draft_probs[t["q_rows"], xq].float()
        accept.index_copy_(0, t["q_drafts"], ~(torch.cat(u["accept"]) * q_x >= p_x))
        bad.index_add_(0, t["draft_req"][t["q_drafts"]], (p_x.isnan() | q_x.isnan()).long())
    stop = torch.where(accept, lengths_t[t["draft_req"]], t["draft_pos"])   # a block stops at its first rejection
    n = lengths_t.clone().scatter_reduce_(0, t["draft_req"], stop, "amin")
    token = y[t["first_row"] + n]
    if idx["q_reqs"]:
        assert draft_probs is not None
        _residual_tokens(target, draft_probs, t, n, _to(torch.cat(u["final"]), dev), token, bad)
    n_host, token_host, bad_host = torch.stack([n, token, bad]).tolist()    # the one synchronisation
    for i, g, states in rewind:
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


def _residual_tokens(target: torch.Tensor, draft_probs: torch.Tensor, t: dict[str, torch.Tensor], n: torch.Tensor,
                     u: torch.Tensor, token: torch.Tensor, bad: torch.Tensor) -> None:
    """The token of each request verified against draft probabilities, into ``token``: drawn from
    the residual norm(max(0, p_n - q_n)) at its rejection, or from p where all were accepted or the
    residual has no mass (p == q there); a NaN read counts in ``bad``."""
    q_reqs = t["q_reqs"]
    nq, lq = n[q_reqs], t["lengths"][q_reqs]
    p = target.index_select(0, t["first_row"][q_reqs] + nq)
    # the draft probabilities at the rejection (row l - 1 where all are accepted: not used)
    q = draft_probs.index_select(0, t["q_rows"][t["q_first"] + torch.minimum(nq, lq - 1)]).float()
    residual = (p - q).clamp_min_(0.0)
    mass = residual.sum(-1)
    use_p = (nq == lq) | (mass.double() <= 1e-12)   # all accepted, or p == q there
    drawn, total = _draw(torch.where(use_p[:, None], p, residual), u)
    token.index_copy_(0, q_reqs, drawn)
    bad.index_add_(0, q_reqs, (mass.isnan() | total.isnan()).long())


def _plan(batch: VerifyBatch, dev: torch.device) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], list]:
    """``verify_batch``'s host part: where each request's rows are, and its uniforms, drawn from its
    own generator by the very calls ``verify`` makes: rand(l) for the acceptance tests, then one
    rand(1) for the residual or bonus token; a point-mass request's rand(1) for each of its l + 1
    target draws, after which ``verify_batch`` sets its generator back to where it stood after the
    n + 1 that ``verify`` draws (the states to set back to are in the third part). A point-mass
    request with drafts needs a generator of its own (not None, not another's in the batch)."""
    users = Counter(id(g) for g, greedy in zip(batch.generators, batch.greedy) if not greedy)
    idx: dict[str, list[int]] = {k: [] for k in (
        "draft_req",    # per draft: its request
        "draft_pos",    # per draft: its position in its block
        "row_req",      # per target row: its request
        "first_row",    # per request: its first target row
        "argmax",       # target rows whose token is the argmax (greedy requests)
        "drawn",        # target rows whose token is drawn (point-mass requests: every row)
        "q_drafts",     # drafts accepted with probability min(1, p(x) / q(x))
        "q_rows",       # their rows of draft_probs
        "q_reqs",       # their requests
        "q_first")}     # the requests' first drafts among q_drafts
    u: dict[str, list[torch.Tensor]] = {"drawn": [], "accept": [], "final": []}
    rewind = []        # (point-mass request, its generator, its states after 1 .. l draws)
    row = 0
    for i, (l, greedy, pm, g) in enumerate(zip(batch.lengths, batch.greedy, batch.point_mass, batch.generators)):
        idx["draft_req"] += [i] * l
        idx["draft_pos"] += range(l)
        idx["row_req"] += [i] * (l + 1)
        idx["first_row"].append(row)
        if greedy:
            idx["argmax"] += range(row, row + l + 1)
        elif pm or l == 0:      # l == 0: verify draws the token from p[0] either way
            idx["drawn"] += range(row, row + l + 1)
            if l:
                if g is None or users[id(g)] > 1:
                    raise ValueError("a point-mass request with drafts needs a generator of its own in the batch")
                states = []
                for _ in range(l):
                    u["drawn"].append(torch.rand(1, generator=g, device=g.device))
                    states.append(g.get_state())
                rewind.append((i, g, states))
            u["drawn"].append(torch.rand(1, generator=g, device=_device(g)))
        else:
            idx["q_first"].append(len(idx["q_drafts"]))
            idx["q_drafts"] += range(row - i, row - i + l)
            idx["q_reqs"].append(i)
            u["accept"].append(torch.rand(l, generator=g, device=dev))
            u["final"].append(torch.rand(1, generator=g, device=_device(g)))
        row += l + 1
    idx["q_rows"] = list(range(len(idx["q_drafts"]))) if batch.q_rows is None else list(batch.q_rows)
    return idx, u, rewind


def _draw(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampling._inverse_cdf's token per row, the row's total: NaN where the row holds a NaN), by
    _inverse_cdf's very arithmetic."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    idx = torch.searchsorted(cdf, (u.double() * total).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1), total


def _rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The rows of ``parts`` ([n_i, V] each) as (one tensor, the index there of each part's rows, in
    order): where every part is rows of one tensor's memory (views of a drafter's output), that
    memory's rows as they lie (no copy), else the parts concatenated."""
    first = parts[0]
    width = first.shape[-1]
    ptr = first.untyped_storage().data_ptr()
    offsets = [p.storage_offset() for p in parts]
    low = min(offsets)
    if all(p.dim() == 2 and p.shape[1] == width and p.dtype == first.dtype and p.device == first.device
           and p.stride(1) == 1 and (p.stride(0) == width or p.shape[0] == 1)
           and p.untyped_storage().data_ptr() == ptr and (o - low) % width == 0 for p, o in zip(parts, offsets)):
        n = max((o - low) // width + p.shape[0] for p, o in zip(parts, offsets))
        return (first.as_strided((n, width), (width, 1), low),
                [(o - low) // width + k for p, o in zip(parts, offsets) for k in range(p.shape[0])])
    return torch.cat(parts), list(range(sum(p.shape[0] for p in parts)))


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along rows, or, where they are consecutive rows of one tensor, a view of
    them (no copy)."""
    base, rows = _rows(parts)
    return base if rows == list(range(base.shape[0])) else torch.cat(parts)


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
