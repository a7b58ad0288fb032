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
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams, probs_from_logits, sample


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
