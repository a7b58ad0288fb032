"""Training losses (SPEC section 5), all computed in fp32.

DSpark:  L = 0.1 CE(ground truth) + 0.9 ||p_d - p_t||_1 + 1.0 BCE(c, c*),  c* = 1 - 0.5 ||p_d - p_t||_1
         (detached), every term weighted by w_k = exp(-(k-1)/4) and normalised by the sum of the
         weights of the supervised positions.
         With ``kl_weight``: the forward KL(p_t || p_d) on the draft vocabulary beside (or instead
         of) the L1 term; KL's gradient keeps pulling where p_d already overlaps p_t, where L1's is
         a sign. The CE term applies only where the token was sampled from the target (``gt`` =
         Vd elsewhere): on text the target did not write the token carries another law.
DFlash:  the CE term alone, same weights (or the distillation terms above, on text the target did
         not write).
EAGLE-3: soft cross-entropy against p_t at each unrolled step, weight 0.8^step.

p_d lives on the draft vocabulary; p_t on the full one. ||p_d - p_t||_1 = sum over the draft
vocabulary of |p_d - p_t| plus the target's mass outside it (where p_d is 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def target_probs(hidden: torch.Tensor, lm_head: torch.Tensor, draft_vocab: torch.Tensor,
                 softcap: float | None = None, chunk: int = 256):
    """p_t from last hidden states [P, d] with the frozen LM head [V, d]:
    (probabilities on the draft vocabulary [P, Vd] fp32, mass outside it [P])."""
    full_draft = draft_vocab.numel() == lm_head.shape[0]
    inside, outside = [], []
    for s in range(0, hidden.shape[0], chunk):
        logits = (hidden[s:s + chunk].to(lm_head.dtype) @ lm_head.T).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        p = logits.softmax(-1)
        q = p if full_draft else p[:, draft_vocab]
        inside.append(q)
        outside.append((1.0 - q.sum(-1)).clamp_min(0.0))
    if not inside:
        return hidden.new_zeros(0, draft_vocab.numel(), dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(inside), torch.cat(outside)


class _DistillTerms(torch.autograd.Function):
    """Per row of draft logits z [N, Vd] against p_t: CE at the ground truth, ||p_d - p_t||_1 (plus
    the mass outside the draft vocabulary) and the forward KL sum_v p_t (log p_t - log p_d), in one
    pass over row chunks. Written out because autograd over [N, Vd] fp32 makes some twenty passes
    through memory (log_softmax, exp, sub, abs, xlogy, products and their backwards), which cost a
    third of a training step; a chunk of rows stays in cache here. The gradients, p = softmax(z),
    s = sign(p - p_t), T = sum_v p_t:
        d l1 / dz = p * (s - <s, p>),   d kl / dz = T p - p_t,   d ce / dz = p - onehot(gt).
    The backward recomputes p from z instead of keeping [N, Vd] tensors alive."""

    CHUNK = 32      # rows: 32 x 8,192 fp32 is 1 MB, within a core's L2

    @staticmethod
    def forward(ctx, z, pt, pt_out, gt):
        n = z.shape[0]
        ce, l1, kl = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
        for a in range(0, n, _DistillTerms.CHUNK):
            b = min(n, a + _DistillTerms.CHUNK)
            logp = z[a:b].float().log_softmax(-1)
            t = pt[a:b]
            ce[a:b] = -logp.gather(-1, gt[a:b, None]).squeeze(-1)
            l1[a:b] = (logp.exp() - t).abs_().sum(-1)
            kl[a:b] = (torch.xlogy(t, t) - t * logp).sum(-1)
        ctx.save_for_backward(z, pt, gt)
        return ce, l1 + pt_out, kl

    @staticmethod
    def backward(ctx, g_ce, g_l1, g_kl):
        z, pt, gt = ctx.saved_tensors
        n = z.shape[0]
        grad = torch.empty_like(z)
        g_ce, g_l1, g_kl = (torch.zeros(n, device=z.device) if g is None else g.float()
                            for g in (g_ce, g_l1, g_kl))
        for a in range(0, n, _DistillTerms.CHUNK):
            b = min(n, a + _DistillTerms.CHUNK)
            p = z[a:b].float().softmax(-1)
            t = pt[a:b]
            s = (p - t).sign_()
            ga, gb, gc = g_l1[a:b, None], g_kl[a:b, None], g_ce[a:b, None]
            # g_l1 p (s - <s, p>) + g_kl (T p - p_t) + g_ce (p - onehot): p times one row factor
            factor = ga * (s - (s * p).sum(-1, keepdim=True)) + gb * t.sum(-1, keepdim=True) + gc
            out = p.mul_(factor).sub_(gb * t)
            out.scatter_add_(-1, gt[a:b, None], -gc)
            grad[a:b] = out
        return grad, None, None, None


def distill_terms(logits: torch.Tensor, pt: torch.Tensor, pt_out: torch.Tensor,
                  gt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce, l1, kl) per row [N], fp32, differentiable in ``logits`` [N, Vd] (any float dtype):
    -log p_d(gt), sum_v |p_d - p_t| + pt_out, sum_v p_t (log p_t - log p_d); ``gt`` [N] inside
    the draft vocabulary."""
    return _DistillTerms.apply(logits, pt.float(), pt_out.float(), gt)


def drafter_loss(logits: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, gt: torch.Tensor,
                 pt: torch.Tensor | None = None, pt_out: torch.Tensor | None = None,
                 conf_logits: torch.Tensor | None = None, ce_weight: float = 0.1, l1_weight: float = 0.9,
                 bce_weight: float = 1.0, kl_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Loss over N supervised block positions.

    logits [N, Vd] draft logits; positions [N] block index k (0-based); weights [gamma] per position;
    gt [N] ground-truth draft index (Vd = outside the draft vocabulary: no CE term there);
    pt / pt_out: target probabilities on the draft vocabulary and the mass outside (None: CE only,
    the DFlash loss); conf_logits [N] or None. Returns (loss, detached terms for logging).
    """
    w = weights.to(logits.device)[positions]
    wsum = w.sum().clamp_min(1e-12)
    vd = logits.shape[-1]
    inv = gt < vd
    if pt is None:
        # 0 where the ground truth is outside the draft vocabulary (a select, not a boolean index:
        # its backward would be an accumulating index_put over [N, Vd])
        logp = logits.float().log_softmax(-1)
        ce = torch.where(inv, -logp.gather(-1, gt.clamp(max=vd - 1)[:, None]).squeeze(-1), torch.zeros_like(w))
        loss = (w * ce).sum() / wsum
        return loss, {"ce": loss.detach(), "loss": loss.detach()}
    assert pt_out is not None           # given together with pt
    ce, l1, kl = distill_terms(logits, pt, pt_out, gt.clamp(max=vd - 1))
    ce = torch.where(inv, ce, torch.zeros_like(ce))
    terms = {"ce": (w * ce).sum() / wsum, "l1": (w * l1).sum() / wsum}
    accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    terms["accept"] = (w * accept).sum() / wsum
    loss = ce_weight * terms["ce"] + l1_weight * terms["l1"]
    if kl_weight:
        terms["kl"] = (w * kl).sum() / wsum
        loss = loss + kl_weight * terms["kl"]
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        terms["bce"] = (w * bce).sum() / wsum
        loss = loss + bce_weight * terms["bce"]
    terms = {k: v.detach() for k, v in terms.items()}
    terms["loss"] = loss.detach()
    return loss, terms


def eagle3_loss(logits: torch.Tensor, steps: torch.Tensor, pt: torch.Tensor, pt_out: torch.Tensor,
                decay: float = 0.8) -> tuple[torch.Tensor, dict]:
    """Training-time-test loss: soft cross-entropy -sum_v p_t(v) log p_d(v) on the draft vocabulary
    (the target mass outside it cannot be matched), step s weighted decay^s, normalised."""
    logp = logits.float().log_softmax(-1)
    w = decay ** steps.float()
    wsum = w.sum().clamp_min(1e-12)
    ce = -(pt * logp).sum(-1)
    loss = (w * ce).sum() / wsum
    with torch.no_grad():
        l1 = (logp.exp() - pt).abs().sum(-1) + pt_out
        accept = (w * (1.0 - 0.5 * l1).clamp(0, 1)).sum() / wsum
    return loss, {"loss": loss.detach(), "ce": loss.detach(), "l1": ((w * l1).sum() / wsum).detach(),
                  "accept": accept}
