"""The parallel drafter backbone (DFlash / DSpark): target-feature fusion + KV-injected layers.

Context enters by KV injection: the chosen target layers' outputs at each context position are
concatenated, scaled per channel by a fixed vector measured on the training data, projected to d by
a bias-free linear layer and RMS-normalised (``fuse``; the scale could be folded into the
projection's weights, it is kept apart so that Adam sees well-conditioned inputs); in every
drafter layer the keys / values are ``[k_proj(context); k_proj(block)]`` while queries come from
the block only. Block positions attend to all of their own block (non-causal) and, through the
attention mask, to the context strictly before their anchor. RoPE positions continue from the
context: block position j of an anchor at sequence position i sits at i + j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.linear import dense
from .config import DrafterConfig


class Rope(nn.Module):
    """Rotary embeddings (rotate-half convention); cos / sin tables grown on demand."""

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
        self.q_proj = nn.Linear(in_dim, self.H * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.Hkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.Hkv * hd, bias=False)
        self.o_proj = nn.Linear(self.H * hd, d, bias=False)
        self.post_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor, rope: Rope):
        """Keys (with RoPE) and values of injected context rows ctx [n, d]: [n, Hkv, hd] each."""
        k = rope(self.k_proj(ctx).view(-1, self.Hkv, self.hd), pos)
        return k, self.v_proj(ctx).view(-1, self.Hkv, self.hd)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, mask: torch.Tensor | None, residual: torch.Tensor | None = None):
        """x [Q, in_dim] block rows at positions pos; k_ctx / v_ctx [C, Hkv, hd]; mask [Q, C + Q]
        (True = may attend) or None (every row sees everything)."""
        h = self.input_norm(x)
        n = h.shape[0]
        q = rope(self.q_proj(h).view(n, self.H, self.hd), pos)
        k = rope(self.k_proj(h).view(n, self.Hkv, self.hd), pos)
        v = self.v_proj(h).view(n, self.Hkv, self.hd)
        k = torch.cat([k_ctx.to(k.dtype), k]).transpose(0, 1)
        v = torch.cat([v_ctx.to(v.dtype), v]).transpose(0, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
        x = (x if residual is None else residual) + self.o_proj(a.transpose(0, 1).reshape(n, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Backbone(nn.Module):
    """Fusion + ``num_hidden_layers`` non-causal KV-injected layers + final norm."""

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
        return [layer.context_kv(ctx, pos, self.rope) for layer in self.layers]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, kv: list, mask: torch.Tensor | None) -> torch.Tensor:
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, pos, self.rope, k, v, mask)
        return self.norm(x)


def packed_block_mask(anchors: torch.Tensor, block: int, ctx_len: int) -> torch.Tensor:
    """The training mask for all blocks of one sequence in one forward: block rows (a, j) see
    context positions < anchors[a] and every row of their own block. [A * block, ctx_len + A * block]."""
    A = anchors.shape[0]
    ctx_ok = torch.arange(ctx_len)[None, :] < anchors.repeat_interleave(block)[:, None]
    blk = torch.arange(A).repeat_interleave(block)
    own = blk[:, None] == blk[None, :]
    return torch.cat([ctx_ok, own], 1)


@torch.no_grad()
def init_from_target(backbone: Backbone, layers: list, final_norm: torch.Tensor | None = None) -> None:
    """Start drafter layer i from the target's decoder layer ``layers[i]`` (its runtime
    ``LayerWeights``: fused qkv [q; k; v] and gate_up [gate; up], [out, in] each) and the final
    norm from the target's, instead of a random start. The shapes must match (a drafter of the
    target's width and heads) and the target layer must be a plain pre-norm one: no biases, q / k
    norms or sandwich norms, which the drafter layer does not have."""
    if len(layers) != len(backbone.layers):
        raise ValueError(f"{len(layers)} target layers for {len(backbone.layers)} drafter layers")
    for mine, lw in zip(backbone.layers, layers):
        extra = [n for n in ("qkv_bias", "o_bias", "q_norm", "k_norm", "pre_ff_norm", "post_ff_norm")
                 if getattr(lw, n) is not None]
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
        for dst, src in parts:
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"drafter weight {tuple(dst.shape)} != target weight {tuple(src.shape)}")
            dst.copy_(src.to(dst.dtype))
    if final_norm is not None:
        backbone.norm.weight.copy_(final_norm.to(backbone.norm.weight.dtype))
