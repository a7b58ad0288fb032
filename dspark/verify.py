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

from .sampling import SamplingParams, _inverse_cdf, probs_from_logits, sample


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: accept while the draft equals the target's argmax."""
    best = target_logits.argmax(-1).cpu()
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
    (``probs_from_logits``, as ``verify`` computes them), or its logits in fp32 when greedy."""
    return target_logits.float() if params.greedy else probs_from_logits(target_logits, params)


Block = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool, torch.Generator | None]


def stack_requests(blocks: Sequence[Block]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, VerifyBatch]:
    """``verify_batch``'s arguments from each request's (draft tokens [l], draft probabilities [l, V]
    or None, target rows [l + 1, V] from ``target_rows``, greedy, generator), concatenated on the
    target rows' device (a greedy request's draft probabilities are never used: left out)."""
    if not blocks:
        return torch.empty(0, dtype=torch.long), None, torch.empty(0, 0), VerifyBatch([], [], [], [])
    dev = blocks[0][2].device
    probs = [q for _, q, _, greedy, _ in blocks if q is not None and not greedy]
    return (torch.cat([x.reshape(-1).long() for x, *_ in blocks]),
            torch.cat([q.to(dev) for q in probs]) if probs else None,
            torch.cat([rows for _, _, rows, _, _ in blocks]),
            VerifyBatch([x.shape[0] for x, *_ in blocks], [bl[3] for bl in blocks], [bl[1] is None for bl in blocks],
                        [bl[4] for bl in blocks]))


def verify_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target: torch.Tensor,
                 batch: VerifyBatch) -> list[tuple[int, int] | None]:
    """``verify`` for every request of a step at once, with one host synchronisation in all.

    draft_tokens [D] long: every request's drafts, concatenated (D = sum of the l_r);
    draft_probs [D_q, V] or None: the drafts' probabilities of the sampled requests that have them
        (neither greedy nor point_mass), concatenated;
    target [D + B, V] fp32: each request's l_r + 1 rows (``target_rows``: its processed
        probabilities, or its logits when greedy), concatenated. ``stack_requests`` builds them.

    Returns per request (n accepted drafts, the token emitted after them): exactly ``verify``'s
    answer from the same generator states, and the states are left as ``verify`` leaves them. Each
    request's uniforms come from its own generator by the very calls ``verify`` makes: rand(l) for
    the acceptance tests, then one rand(1) for the residual or bonus token; a point-mass request's
    rand(1) for each of its l + 1 target draws, after which its generator is set back to where it
    stood after the n + 1 that ``verify`` draws. The arithmetic is ``verify``'s, row by row. None
    for a request whose target rows (or draft probabilities used) hold a NaN: its law is broken
    (``verify`` would emit an arbitrary token). A point-mass request with drafts needs a generator
    of its own (not None, not another request's in the batch), since it is set back afterwards.
    """
    lengths, b = batch.lengths, len(batch.lengths)
    if not b:
        return []
    dev = target.device
    d = sum(lengths)
    if draft_tokens.shape[0] != d or target.shape[0] != d + b:
        raise ValueError(f"need {d} draft tokens and {d + b} target rows for drafts of lengths {lengths}, "
                         f"got {draft_tokens.shape[0]} and {target.shape[0]}")
    users = Counter(id(g) for g, greedy in zip(batch.generators, batch.greedy) if not greedy)
    # the host's part: where each request's rows are, and its uniforms, drawn in verify's order
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
        "q_first")}     # the requests' first rows of draft_probs
    u_drawn: list[torch.Tensor] = []
    u_accept: list[torch.Tensor] = []
    u_final: list[torch.Tensor] = []
    rewind = []        # (point-mass request, its generator, its states after 1 .. l draws)
    row = q_row = 0
    for i, (l, greedy, pm, g) in enumerate(zip(lengths, batch.greedy, batch.point_mass, batch.generators)):
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
                    u_drawn.append(torch.rand(1, generator=g, device=g.device))
                    states.append(g.get_state())
                rewind.append((i, g, states))
            u_drawn.append(torch.rand(1, generator=g, device=_device(g)))
        else:
            idx["q_drafts"] += range(row - i, row - i + l)
            idx["q_rows"] += range(q_row, q_row + l)
            idx["q_reqs"].append(i)
            idx["q_first"].append(q_row)
            q_row += l
            u_accept.append(torch.rand(l, generator=g, device=dev))
            u_final.append(torch.rand(1, generator=g, device=_device(g)))
        row += l + 1
    if idx["q_reqs"] and (draft_probs is None or draft_probs.shape[0] != q_row):
        raise ValueError(f"need {q_row} rows of draft probabilities, got "
                         f"{0 if draft_probs is None else draft_probs.shape[0]}")
    flat = torch.tensor([*itertools.chain(*idx.values()), *lengths], dtype=torch.long)
    t = dict(zip([*idx, "lengths"], _to(flat, dev).split([*map(len, idx.values()), b])))
    x = _to(draft_tokens.long(), dev)
    row_of = torch.arange(d, device=dev) + t["draft_req"]        # draft j of request i: target row j + i
    lengths_t = t["lengths"]
    # the target's own token at the rows of the greedy and point-mass requests
    y = torch.zeros(d + b, dtype=torch.long, device=dev)
    if idx["argmax"]:
        y.index_copy_(0, t["argmax"], _select(target, t["argmax"]).argmax(-1))
    if idx["drawn"]:
        y.index_copy_(0, t["drawn"], _inverse_cdf(_select(target, t["drawn"]), _to(torch.cat(u_drawn), dev)))
    accept = x == y[row_of]
    nan = target.sum(-1).isnan().long()     # a NaN anywhere in a row makes its sum NaN
    bad = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, t["row_req"], nan)
    q_reqs = t["q_reqs"]
    if idx["q_reqs"]:
        assert draft_probs is not None
        xq = x[t["q_drafts"]]
        p_x = target[row_of[t["q_drafts"]], xq]
        q_x = draft_probs[t["q_rows"], xq].float()
        accept.index_copy_(0, t["q_drafts"], ~(torch.cat(u_accept) * q_x >= p_x))
        bad.index_add_(0, t["draft_req"][t["q_drafts"]], torch.isnan(q_x).long())
    stop = torch.where(accept, lengths_t[t["draft_req"]], t["draft_pos"])   # a block stops at its first rejection
    n = lengths_t.clone().scatter_reduce_(0, t["draft_req"], stop, "amin")
    token = y[t["first_row"] + n]
    if idx["q_reqs"]:
        assert draft_probs is not None
        nq, lq = n[q_reqs], lengths_t[q_reqs]
        p = target.index_select(0, t["first_row"][q_reqs] + nq)
        # the draft probabilities at the rejection (row l - 1 where all are accepted: not used)
        q = draft_probs.index_select(0, t["q_first"] + torch.minimum(nq, lq - 1)).float()
        residual = (p - q).clamp_min_(0.0)
        use_p = (nq == lq) | (residual.sum(-1).double() <= 1e-12)   # all accepted, or p == q there
        token.index_copy_(0, q_reqs, _inverse_cdf(torch.where(use_p[:, None], p, residual), _to(torch.cat(u_final), dev)))
        bad.index_add_(0, q_reqs, q.sum(-1).isnan().long())
    n_host, token_host, bad_host = torch.stack([n, token, bad]).tolist()    # the one synchronisation
    for i, g, states in rewind:
        if n_host[i] < lengths[i]:
            g.set_state(states[n_host[i]])
    return [None if bad_host[i] else (n_host[i], token_host[i]) for i in range(b)]


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
