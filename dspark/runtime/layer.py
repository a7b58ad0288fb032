"""One pre-norm decoder layer, shared by the target (runtime/model.py) and the trained drafters'
serving backbone (drafters/dspark.py).

Per layer, over the N rows of a forward (gpt-fast's ``TransformerBlock``, on flattened rows):

    h = norm(x)                              [N, d]
    q, k, v = h @ Wqkv.T                     [N, H, hd], [N, Hkv, hd], [N, Hkv, hd]
    q, k = norm(q), norm(k)                  (Qwen3, Gemma 3, drafters with qk_norm)
    q, k = rope(q), rope(k)
    cache[slot, :, pos] = k, v               every row's key / value into its slot at once
    x = x + attend(q, cache) @ Wo.T          (Gemma 3: norm before the residual add)
    x = x + down(act(gate(h')) * up(h'))     h' = norm(x)  (Gemma 3: also norm the MLP's output)

What differs between callers is only which rows attend to what: the target's segments each
attend causally to their own cache slot; a drafter's blocks attend non-causally to their slot
(``attend``). A drafter also writes keys / values for context rows that do not attend and carry
no residual stream: the fused target features, the same input at every layer (``context``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import overload

import torch
import torch.nn.functional as F

from .linear import Weight, linear, pack

# attend(qs [n, H, hd] scaled, in the cache dtype; k cache, v cache [slots, Hkv, max_len, hd];
# the layer's sliding window or None; out [n, H * hd] in the cache dtype, written in place)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "int | None", torch.Tensor], None]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight                   # Weight: a plain tensor or packed for runtime/linear.py
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    post_attn_norm: torch.Tensor
    gate_up: Weight
    down: Weight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    pre_ff_norm: torch.Tensor | None = None   # Gemma 3 sandwich norms
    post_ff_norm: torch.Tensor | None = None
    rope: str = "default"                     # which RoPE table this layer uses
    window: int | None = None                 # sliding-window length, None = full attention

    def packed(self, fp32: bool = False) -> LayerWeights:
        """The same layer with its four products' weights packed (runtime/linear.py; ``fp32``: an
        fp32 layer's too, as a target's are)."""
        new = {name: pack(getattr(self, name), fp32) for name in ("qkv", "o", "gate_up", "down")}
        if all(w is getattr(self, name) for name, w in new.items()):
            return self
        return replace(self, **new)


@dataclass(frozen=True)
class LayerShape:
    """What a layer's arithmetic needs besides its weights."""
    heads: int
    kv_heads: int
    head_dim: int
    eps: float                  # RMSNorm epsilon
    scale: float                # the queries' scale (hd ** -0.5 unless the config says otherwise)
    activation: str = "silu"    # "silu", "gelu_tanh" or "gelu"


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


KV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]   # k, v cache; rows' slots, positions
Rope = tuple[torch.Tensor, torch.Tensor]                                # cos, sin


@overload
def decoder_layer(lw: LayerWeights, x: torch.Tensor, shape: LayerShape, rope: Rope, kv: KV, attend: Attend, *,
                  context: torch.Tensor | None = None, alike: bool = False) -> torch.Tensor: ...
@overload
def decoder_layer(lw: LayerWeights, x: None, shape: LayerShape, rope: Rope, kv: KV, attend: Attend, *,
                  context: torch.Tensor | None = None, alike: bool = False) -> None: ...


def decoder_layer(lw: LayerWeights, x: torch.Tensor | None, shape: LayerShape,
                  rope: Rope, kv: KV, attend: Attend, *,
                  context: torch.Tensor | None = None, alike: bool = False) -> torch.Tensor | None:
    """One layer: x [n, d] (the residual stream of the rows that attend) -> the layer's output.

    ``context`` [c, d]: rows, already normed, whose keys / values are written before x's but which
    attend to nothing (x None: only those this call, returns None). ``rope``: cos, sin [c + n, 1,
    hd] (sin sign-folded, see model.RopeTable); ``kv``: the layer's k and v caches [slots, Hkv,
    max_len, hd] and each of the c + n rows' slot and position. ``alike``: batch-invariant linear
    products (runtime/linear.py).
    """
    H, Hkv, hd, eps = shape.heads, shape.kv_heads, shape.head_dim, shape.eps
    h = rms_norm(x, lw.input_norm, eps) if x is not None else None
    inp = h if context is None else context if h is None else torch.cat([context, h])
    assert inp is not None, "a layer needs rows"
    qkv = linear(inp, lw.qkv, lw.qkv_bias, alike).contiguous()
    qk = qkv[:, :(H + Hkv) * hd].view(-1, H + Hkv, hd)
    if lw.q_norm is not None:
        assert lw.k_norm is not None   # both set, or neither (the config's qk_norm)
        qk = torch.cat([rms_norm(qk[:, :H], lw.q_norm, eps), rms_norm(qk[:, H:], lw.k_norm, eps)], 1)
    cos, sin = rope
    qk = qk * cos + qk.roll(hd // 2, -1) * sin   # RoPE on queries and keys at once
    kc, vc, slots, positions = kv
    kc[slots, :, positions] = qk[:, H:].to(kc.dtype)
    vc[slots, :, positions] = qkv[:, (H + Hkv) * hd:].view(-1, Hkv, hd).to(vc.dtype)
    if x is None:
        return None
    # attention from one scaled copy of the attending rows' queries into one output buffer, in
    # the cache dtype (fp32 for a bf16 model on a CPU: see Decoder.kv_dtype)
    qs = qk[inp.shape[0] - x.shape[0]:, :H].to(kc.dtype) * shape.scale
    attn = torch.empty(x.shape[0], H * hd, dtype=kc.dtype, device=x.device)
    attend(qs, kc, vc, lw.window, attn)
    attn = linear(attn.to(x.dtype), lw.o, lw.o_bias, alike)
    if lw.post_ff_norm is not None:  # Gemma 3 sandwich
        assert lw.pre_ff_norm is not None   # both set, or neither (the config's sandwich_norm)
        x = x + rms_norm(attn, lw.post_attn_norm, eps)
        h = rms_norm(x, lw.pre_ff_norm, eps)
    else:
        x = x + attn
        h = rms_norm(x, lw.post_attn_norm, eps)
    g, u = linear(h, lw.gate_up, rows_alike=alike).chunk(2, dim=-1)
    if shape.activation == "silu":
        g = F.silu(g)
    else:
        g = F.gelu(g, approximate="tanh" if shape.activation == "gelu_tanh" else "none")
    m = linear(g * u, lw.down, rows_alike=alike)
    if lw.post_ff_norm is not None:
        m = rms_norm(m, lw.post_ff_norm, eps)
    return x + m
