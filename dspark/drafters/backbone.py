"""The parallel drafter backbone (DFlash / DSpark): target-feature fusion + KV-injected layers.

Context enters by KV injection: the chosen target layers' outputs at each context position are
concatenated, scaled per channel by a fixed vector measured on the training data, projected to d by
a bias-free linear layer and RMS-normalised (``fuse``; the scale could be folded into the
projection's weights, it is kept apart so that Adam sees well-conditioned inputs); in every
drafter layer the keys / values are ``[k_proj(context); k_proj(block)]`` while queries come from
the block only. Block positions attend to all of their own block (non-causal) and, through the
attention mask, to the context strictly before their anchor. RoPE positions continue from the
context: block position j of an anchor at sequence position i sits at i + j.

Layout: the layers are Qwen3 decoder layers (``qk_norm``: an RMSNorm over each head's query and
key before RoPE), the layout DeepSpec's checkpoints and the engines that load them use; drafters
saved without it load with ``qk_norm`` false.

Training runs every block of a sequence in one forward. Each block row attends to the context
strictly before its anchor and to its own block only, so attention is computed in two parts
(``block_attention``): the rows against the shared context keys under a per-anchor prefix mask, and
each block against its own ``gamma`` keys, joined in one softmax. A dense mask over all blocks of a
sequence would spend ``(A * gamma)^2`` scores on pairs it throws away; with every position an
anchor that is most of the forward.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.linear import dense
from .config import DrafterConfig


class Rope(nn.Module):
    """Rotary embeddings (rotate-half convention); cos / sin tables grown on demand."""

    inv_freq: torch.Tensor          # registered buffer
    _cos: torch.Tensor | None
    _sin: torch.Tensor | None

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._cos = self._sin = None

    def _tables(self, n: int, device):
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != device:
            size = max(n, 2048, 0 if self._cos is None else 2 * self._cos.shape[0])
            ang = torch.arange(size, dtype=torch.float32, device=device)[:, None] * self.inv_freq.to(device)[None]
            ang = torch.cat([ang, ang], -1)
            self._cos, self._sin = ang.cos(), ang.sin()
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [n, heads, hd] at integer positions pos [n]."""
        cos, sin = self._tables(int(pos.max()) + 1 if pos.numel() else 1, x.device)
        cos, sin = cos[pos][:, None].to(x.dtype), sin[pos][:, None].to(x.dtype)
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin


class DrafterLayer(nn.Module):
    """A pre-norm decoder layer whose keys / values also cover injected context."""

    def __init__(self, c: DrafterConfig, in_dim: int | None = None):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        in_dim = in_dim or d
        self.H, self.Hkv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.input_norm = nn.RMSNorm(in_dim, eps=c.rms_norm_eps)
        self.q_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps) if c.qk_norm else None
        self.q_proj = nn.Linear(in_dim, self.H * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.Hkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.Hkv * hd, bias=False)
        self.o_proj = nn.Linear(self.H * hd, d, bias=False)
        self.post_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)

    def queries(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Queries of rows x [n, in_dim] (already normalised) at positions pos: [n, H, hd]."""
        q = self.q_proj(x).view(-1, self.H, self.hd)
        return rope(q if self.q_norm is None else self.q_norm(q), pos)

    def keys(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Keys of rows x [n, in_dim] (already normalised) at positions pos: [n, Hkv, hd]."""
        k = self.k_proj(x).view(-1, self.Hkv, self.hd)
        return rope(k if self.k_norm is None else self.k_norm(k), pos)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor, rope: Rope):
        """Keys (with RoPE) and values of injected context rows ctx [n, d]: [n, Hkv, hd] each."""
        return self.keys(ctx, pos, rope), self.v_proj(ctx).view(-1, self.Hkv, self.hd)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, mask: torch.Tensor | None, residual: torch.Tensor | None = None,
                anchors: torch.Tensor | None = None):
        """x [Q, in_dim] block rows at positions pos; k_ctx / v_ctx [C, Hkv, hd]. Either ``anchors``
        [A] (Q = A * gamma rows, block a's rows see context < anchors[a] and their own block:
        ``block_attention``) or ``mask`` [Q, C + Q] (True = may attend) or neither (every row sees
        everything)."""
        h = self.input_norm(x)
        n = h.shape[0]
        q = self.queries(h, pos, rope)
        k = self.keys(h, pos, rope)
        v = self.v_proj(h).view(n, self.Hkv, self.hd)
        if anchors is not None:
            a = block_attention(q, k_ctx.to(k.dtype), v_ctx.to(v.dtype), k, v, anchors)
        else:
            k = torch.cat([k_ctx.to(k.dtype), k]).transpose(0, 1)
            v = torch.cat([v_ctx.to(v.dtype), v]).transpose(0, 1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                               enable_gqa=True).transpose(0, 1)
        x = (x if residual is None else residual) + self.o_proj(a.reshape(n, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Backbone(nn.Module):
    """Fusion + ``num_hidden_layers`` non-causal KV-injected layers + final norm."""

    feature_scale: torch.Tensor     # registered buffer

    def __init__(self, c: DrafterConfig):
        super().__init__()
        width = len(c.target_layer_ids) * c.target_hidden_size
        # fixed per-channel input scale (1 / mean |feature| on the training data, set before training):
        # target residual streams carry a few channels hundreds of times larger than the rest, which
        # would otherwise dominate the projection and make Adam's steps badly conditioned
        self.register_buffer("feature_scale", torch.ones(width))
        self.fc = nn.Linear(width, c.hidden_size, bias=False)
        self.fc_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rope = Rope(c.head_dim, c.rope_theta)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[n, m * d_target] concatenated target features -> [n, d]."""
        return self.fc_norm(self.fc(features * self.feature_scale.to(features.dtype)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [cast(DrafterLayer, layer).context_kv(ctx, pos, self.rope) for layer in self.layers]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, kv: list, mask: torch.Tensor | None,
                anchors: torch.Tensor | None = None) -> torch.Tensor:
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, pos, self.rope, k, v, mask, anchors=anchors)
        return self.norm(x)


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Attention of A blocks of g rows each: block a's rows see the context keys < anchors[a] and
    the g keys of their own block (non-causal).

    q [A*g, H, hd]; k_ctx / v_ctx [C, Hkv, hd]; k_blk / v_blk [A*g, Hkv, hd] -> [A*g, H, hd].
    Scores: [H, A, g, C] against the context (masked past each anchor) and [H, A, g, g] within
    the block, one softmax over both (fp32): the same numbers as a dense mask over
    [C + A*g] keys, at C + g keys per row instead of C + A*g."""
    n, H, hd = q.shape
    A = anchors.shape[0]
    g = n // A
    rep = H // k_ctx.shape[1]
    C = k_ctx.shape[0]
    scale = hd ** -0.5
    qh = (q * scale).view(A, g, H, hd).permute(2, 0, 1, 3)                       # [H, A, g, hd]
    kb = k_blk.view(A, g, -1, hd).repeat_interleave(rep, 2).permute(2, 0, 1, 3)   # [H, A, g, hd]
    vb = v_blk.view(A, g, -1, hd).repeat_interleave(rep, 2).permute(2, 0, 1, 3)
    s_own = qh @ kb.transpose(-1, -2)                                              # [H, A, g, g]
    if C:
        kc = k_ctx.repeat_interleave(rep, 1).transpose(0, 1)                       # [H, C, hd]
        vc = v_ctx.repeat_interleave(rep, 1).transpose(0, 1)
        s_ctx = (qh.reshape(H, A * g, hd) @ kc.transpose(-1, -2)).view(H, A, g, C)
        hidden = torch.arange(C, device=q.device)[None, :] >= anchors[:, None]    # [A, C]
        s_ctx = s_ctx.masked_fill(hidden[None, :, None, :], float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_own], -1), -1, dtype=torch.float32).to(q.dtype)
        out = (p[..., :C].reshape(H, A * g, C) @ vc).view(H, A, g, hd) + p[..., C:] @ vb
    else:
        out = torch.softmax(s_own, -1, dtype=torch.float32).to(q.dtype) @ vb
    return out.permute(1, 2, 0, 3).reshape(n, H, hd)


@torch.no_grad()
def init_from_target(backbone: Backbone, layers: list, final_norm: torch.Tensor | None = None) -> None:
    """Start drafter layer i from the target's decoder layer ``layers[i]`` (its runtime
    ``LayerWeights``: fused qkv [q; k; v] and gate_up [gate; up], [out, in] each) and the final
    norm from the target's, instead of a random start. The shapes must match (a drafter of the
    target's width and heads) and the target layer must be a plain pre-norm one: no biases, q / k
    norms (unless the drafter has them too) or sandwich norms, which the drafter layer does not have."""
    if len(layers) != len(backbone.layers):
        raise ValueError(f"{len(layers)} target layers for {len(backbone.layers)} drafter layers")
    for mine, lw in zip(backbone.layers, layers):
        mine = cast(DrafterLayer, mine)
        extra = [n for n in ("qkv_bias", "o_bias", "q_norm", "k_norm", "pre_ff_norm", "post_ff_norm")
                 if getattr(lw, n) is not None and not (n in ("q_norm", "k_norm") and mine.q_norm is not None)]
        if extra:
            raise ValueError(f"target layer has {', '.join(extra)}, which a drafter layer lacks")
        q, k = mine.q_proj.weight.shape[0], mine.k_proj.weight.shape[0]
        inter = mine.gate_proj.weight.shape[0]
        qkv, gate_up = dense(lw.qkv), dense(lw.gate_up)
        parts = [(mine.input_norm.weight, lw.input_norm), (mine.q_proj.weight, qkv[:q]),
                 (mine.k_proj.weight, qkv[q:q + k]), (mine.v_proj.weight, qkv[q + k:]),
                 (mine.o_proj.weight, dense(lw.o)), (mine.post_norm.weight, lw.post_attn_norm),
                 (mine.gate_proj.weight, gate_up[:inter]), (mine.up_proj.weight, gate_up[inter:]),
                 (mine.down_proj.weight, dense(lw.down))]
        if mine.q_norm is not None and lw.q_norm is not None:
            assert mine.k_norm is not None          # built together with q_norm (``qk_norm``)
            parts += [(mine.q_norm.weight, lw.q_norm), (mine.k_norm.weight, lw.k_norm)]
        for dst, src in parts:
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"drafter weight {tuple(dst.shape)} != target weight {tuple(src.shape)}")
            dst.copy_(src.to(dst.dtype))
    if final_norm is not None:
        backbone.norm.weight.copy_(final_norm.to(backbone.norm.weight.dtype))
