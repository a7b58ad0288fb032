"""One request's drafting pass of the parallel backbone (DSpark / DFlash) as a compiled graph.

At one request a round's drafter call is a few dozen rows through three layers: the target
features handed over since the last round (fused, their keys / values into the request's cache
slot) and the block [anchor, MASK, ...] attending to the slot non-causally. Eagerly that is some
200 small operators, most of the call's time at one request; compiled the way the target's
one-request forward is (runtime/compiled.py: inductor, weights frozen as constants and each
product's kernel chosen by measurement, a C++ wrapper, guards reduced once warm), the pointwise
work fuses and the Python between kernels goes.

Both the number of new context rows and the block's length vary from round to round (the rows
accepted last round; the policy's depth), so both are symbolic. A size of one is a graph of its
own in dynamo, so two graphs cover every call: one new context row (nothing accepted last round)
and several; a block of one row, rare, and more rows than ``MAX_ROWS`` (a prompt's first round)
run eagerly. The arithmetic is the eager pass's, rounded as inductor fuses it: bf16 only, as for
the target; the drafts it gives are verified like any others, so what it changes is which drafts
are offered, never what is emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.compiled import Graphs, plain_weights
from ..runtime.kv_cache import KVCache
from ..runtime.layer import LayerShape, LayerWeights, decoder_layer, rms_norm
from ..runtime.linear import PackedWeight, Weight, dense, linear
from ..runtime.model import RopeTable

# new context rows this many or fewer (and at least one) run compiled; a prompt's first round
# hands over the whole prompt and runs eagerly
MAX_ROWS = 32
# the slot's context before the graphs' warm-up block: longer than any compiled call's rows
CONTEXT = 2 * MAX_ROWS + 1


@dataclass(frozen=True)
class BlockParts:
    """What a drafter's compiled pass is built from (``DSparkDrafter.block_parts``): its serving
    weights and settings, so that compiling reads nothing of the drafter itself."""

    layers: list[LayerWeights]
    fc: Weight                   # the fusion of the target's features
    fc_norm: torch.Tensor
    norm: torch.Tensor
    shape: LayerShape
    rope: RopeTable
    feature_width: int           # len(target layers) x the target's hidden size
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device


def eligible(parts: BlockParts) -> str | None:
    """Why this drafter's pass cannot run compiled, or None when it can."""
    if parts.device.type != "cpu" or parts.dtype != torch.bfloat16:
        return "only bf16 on a CPU compiles"
    weights = [parts.fc, *(w for lw in parts.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))]
    if not all(isinstance(w, PackedWeight) for w in weights):
        return "this CPU does not pack bf16 weights (runtime/linear.py)"
    return None


class BlockStack(torch.nn.Module):
    """Fusion of the new context rows -> the layers over context and block -> the final norm. A
    module so that the weights, registered below, are frozen into the graph."""

    fc: torch.Tensor
    fc_norm: torch.Tensor
    norm: torch.Tensor

    def __init__(self, parts: BlockParts):
        super().__init__()
        self.layers = plain_weights(self, parts.layers)
        self.register_buffer("fc", dense(parts.fc), persistent=False)
        self.register_buffer("fc_norm", parts.fc_norm, persistent=False)
        self.register_buffer("norm", parts.norm, persistent=False)
        self.shape = parts.shape

    def forward(self, feats: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k: list[torch.Tensor], v: list[torch.Tensor], positions: torch.Tensor, end: int) -> torch.Tensor:
        """feats [c, m * d_target] the new context rows' target features; x [g, d] the block's input
        rows (the anchor's embedding, then the mask embedding); cos, sin [c + g, 1, hd]; k, v per
        layer the request's slot of the cache, [1, Hkv, max_len, hd] views; positions [c + g] where
        each row's key / value goes (the block's last at ``end`` - 1). -> the block's hidden
        states [g, d]."""
        eps = self.shape.eps
        ctx = rms_norm(linear(feats, self.fc), self.fc_norm, eps)
        slots = torch.zeros_like(positions)
        g = x.shape[0]

        def attend_block(qs, kc, vc, window, out):
            # the block sees its whole slot up to its own last row, non-causally: no mask
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], kc[:, :, :end], vc[:, :, :end],
                                               scale=1.0, enable_gqa=True)  # q already scaled
            out.copy_(o[0].transpose(0, 1).reshape(g, -1))

        for li, lw in enumerate(self.layers):
            x = decoder_layer(lw, x, self.shape, (cos, sin), (k[li], v[li], slots, positions), attend_block,
                              context=ctx)
        return rms_norm(x, self.norm, eps)


class CompiledBlock(Graphs):
    """A drafter's compiled ``BlockStack``, or the reason it runs eagerly."""

    def __init__(self, parts: BlockParts):
        why = eligible(parts)
        super().__init__(None if why else BlockStack(parts), why, "drafter pass")

    def takes(self, new_rows: int, block: int, start: int) -> bool:
        """One request's round: ``new_rows`` context rows from ``start`` on, then a block."""
        return self.disabled is None and 1 <= new_rows <= MAX_ROWS and block >= 2 and start >= CONTEXT

    def __call__(self, feats, x, cos, sin, cache: KVCache, positions, slot: int, end: int) -> torch.Tensor | None:
        k = [t[slot:slot + 1] for t in cache.k]
        v = [t[slot:slot + 1] for t in cache.v]
        with torch.inference_mode():
            # inference tensors, as propose makes them, whatever the caller's were: a graph is
            # guarded on such properties of its inputs and rebuilt when they change
            feats, x, cos, sin, positions = (t if t.is_inference() else t.clone()
                                             for t in (feats, x, cos, sin, positions))
            out = self.run(feats, x, cos, sin, k, v, positions, end)
        assert out is None or isinstance(out, torch.Tensor)
        return out


def warm_up(parts: BlockParts, graphs: CompiledBlock) -> float:
    """Build both graphs (one new context row; several) on a scratch cache; the seconds it took.
    The sizes differ from each other and from the model's (a graph built where two sizes are equal
    assumes they always are)."""
    t = time.perf_counter()
    # made outside inference mode, as the drafter's own cache is (a graph is guarded on that)
    cache = KVCache(parts.num_layers, parts.num_kv_heads, parts.head_dim, num_slots=1, max_len=4 * CONTEXT,
                    dtype=parts.kv_dtype, device=parts.device)
    with torch.inference_mode():    # the inputs made as propose makes them
        for rows, block in ((1, 6), (5, 11)):
            positions = torch.arange(CONTEXT, CONTEXT + rows + block)
            cos, sin = parts.rope.tables(positions, int(positions.max()))
            feats = torch.zeros(rows, parts.feature_width, dtype=parts.dtype)
            x = torch.zeros(block, parts.hidden_size, dtype=parts.dtype)
            if graphs(feats, x, cos, sin, cache, positions, 0, CONTEXT + rows + block) is None:
                break
    return time.perf_counter() - t
