"""One request's forward as one compiled graph: decoding one row and verifying one block.

At one request a bf16 forward on a CPU spends about a third of its time outside the matrix products,
in some 2,000 small operators (norms, RoPE, the fp32 cache's conversions, cache writes, attention's
views), each a few microseconds of dispatch for a few hundred bytes of work. A segment of one
request has the simplest attention of all (causal, against its own cache slot, no padding), so its
whole layer stack and the LM head compile into one graph: ``torch.compile`` (inductor) fuses the
pointwise work of a layer into a few C++ loops, takes the weights as frozen constants, and a C++
wrapper calls the kernels without Python between them (gpt-fast's compiled decoding step, on a
CPU). For the products it measures, per weight shape, its own generated kernel (a micro-kernel on
AMX tiles) against oneDNN's packed one (what the eager path runs, runtime/linear.py) and keeps the
faster (max-autotune): a one-row product streams its weight once, and on a CPU with AMX
inductor's kernel streams it faster (docs/runtime.md). On a CPU without AMX the measurement is
among oneDNN's kernels alone (``gemm_backends``).

Two graphs cover every one-request forward of at most ``MAX_ROWS`` rows: one row (a decoding step)
and a block (a verification; the row count stays symbolic, as do the context length and the cache's
length). Building both, with the kernels' measurements, takes about two minutes on two cores, in
every process (frozen graphs are not reused from inductor's on-disk cache): ``Decoder.compile``
builds them at once; a server builds them in a thread while it serves eagerly
(``Decoder.build_graphs``, then ``use_graphs``; dspark/compiling.py).

What a compiled forward computes is the eager forward's arithmetic, but inductor keeps a layer's
pointwise chain in fp32 registers where eager rounds each step to bf16, and attention runs as
torch's fused kernel (its own order of sums): the logits differ in the last bf16 bits, as those of
a batched and a lone row already do (runtime/attention.py). So it is a bf16 fast path only: fp32
models and the batch-invariant mode, whose guarantees are bit-level, never take it. Sliding-window
and multi-RoPE models (Gemma 3) stay eager too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch._inductor.config
import torch.nn.functional as F

from .kv_cache import KVCache
from .layer import LayerShape, LayerWeights, decoder_layer, rms_norm
from .linear import PackedWeight, dense

log = logging.getLogger(__name__)

# a one-request segment this long or shorter runs compiled (decoding rows, verification blocks);
# prefill chunks run eagerly, where the products dominate anyway
MAX_ROWS = 16
# the context the graphs are built after (Decoder.build_graphs): longer than any compiled segment
CONTEXT = MAX_ROWS + 1


def gemm_backends(amx: bool) -> str:
    """The product kernels inductor may measure and choose from: its own C++ template beside
    oneDNN's only where the CPU has AMX tiles. Without them the template's micro-kernel widens bf16
    to fp32 vectors; timed alone, its weight in cache, it wins some shapes, but in a whole one-row
    forward, every weight streaming from memory, it lost to oneDNN's kernels alone on an AVX-512
    BF16 CPU without AMX (docs/runtime.md)."""
    return "CPP,ATEN" if amx else "ATEN"


# inductor: weights as constants, each product's kernel chosen by measurement among the backends
# above, no Python between kernels
CONFIG = {"freezing": True, "cpp_wrapper": True, "max_autotune": True,
          "max_autotune_gemm_backends": gemm_backends(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}


@dataclass(frozen=True)
class StackParts:
    """What one request's compiled forward is built from (``Decoder.stack_parts``): the decoder's
    tensors and settings, so that compiling reads nothing of the decoder itself."""

    layers: list[LayerWeights]
    embed: torch.Tensor
    final_norm: torch.Tensor
    embed_scale: torch.Tensor | None
    lm_head: torch.Tensor
    softcap: float | None
    shape: LayerShape
    kv_dtype: torch.dtype
    device: torch.device
    dtype: torch.dtype
    batch_invariant: bool
    windowed: bool          # sliding-window attention or several RoPEs (Gemma 3)


def eligible(parts: StackParts) -> str | None:
    """Why this decoder cannot take the compiled path, or None when it can."""
    if parts.device.type != "cpu" or parts.dtype != torch.bfloat16:
        return "only bf16 on a CPU compiles (fp32 is the exact dtype)"
    if parts.batch_invariant:
        return "the batch-invariant mode keeps its own eager path"
    if parts.windowed:
        return "sliding-window attention stays eager"
    if not all(isinstance(lw.qkv, PackedWeight) for lw in parts.layers):
        return "this CPU does not pack bf16 weights (runtime/linear.py)"
    return None


def plain_weights(module: torch.nn.Module, layers: list[LayerWeights]) -> list[LayerWeights]:
    """``layers`` with their four products' weights as plain tensors, each registered as a buffer
    of ``module`` so that a graph takes it as a frozen constant (not a guarded input): inductor
    then lays each weight out for the kernel it measures fastest."""
    out = []
    for i, lw in enumerate(layers):
        lw = replace(lw, qkv=dense(lw.qkv), o=dense(lw.o), gate_up=dense(lw.gate_up), down=dense(lw.down))
        for name in ("qkv", "o", "gate_up", "down"):
            module.register_buffer(f"{name}_{i}", getattr(lw, name), persistent=False)
        out.append(lw)
    return out


class LayerStack(torch.nn.Module):
    """The layers of one request's segment: embedding -> layers -> final norm. A module so that the
    weights, registered below, are frozen into the graph instead of guarded inputs."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    embed_scale: torch.Tensor | None
    lm_head: torch.Tensor

    def __init__(self, parts: StackParts):
        super().__init__()
        # the decoder's tensors held here, not reached through it: a graph is guarded on the
        # objects it reads, and the decoder's attributes change (its compiled path, its mode)
        self.layers = plain_weights(self, parts.layers)
        self.register_buffer("embed", parts.embed, persistent=False)
        self.register_buffer("final_norm", parts.final_norm, persistent=False)
        self.register_buffer("embed_scale", parts.embed_scale, persistent=False)
        self.register_buffer("lm_head", parts.lm_head, persistent=False)
        self.softcap = parts.softcap
        self.shape = parts.shape

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: list[torch.Tensor],
                v: list[torch.Tensor], positions: torch.Tensor, end: int,
                mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """input_ids [n] of one segment ending at key ``end``; cos, sin [n, 1, hd]; k, v per layer the
        request's own slot of the cache, [1, Hkv, max_len, hd] views (so that the graph does not
        depend on the cache's number of slots); positions [n] where each row's key / value goes;
        mask the [n, n] causal triangle (zeros for one row). -> (logits [n, V], last hidden [n, d],
        every layer's output [n, d] ...)."""
        slots = torch.zeros_like(positions)     # every row into the one slot of the views
        # the segment's rows see every key before them and the causal triangle of their own; one
        # fused attention call (torch's CPU flash kernel) per layer instead of the eager path's two
        # batched products and softmax: within rounding of them, and its cost grows more slowly
        # with the context (measured in the commit that made it)
        n = input_ids.shape[0]
        full_mask = None if n == 1 else F.pad(mask, (end - n, 0))      # [n, end], 0 = visible

        def attend_slot(qs, kc, vc, window, out):
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], kc[:, :, :end], vc[:, :, :end],
                                               attn_mask=full_mask, scale=1.0, enable_gqa=True)  # q already scaled
            out.copy_(o[0].transpose(0, 1).reshape(n, -1))

        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        outs = []
        for li, lw in enumerate(self.layers):
            x = decoder_layer(lw, x, self.shape, (cos, sin), (k[li], v[li], slots, positions), attend_slot)
            outs.append(x)
        h = rms_norm(x, self.final_norm, self.shape.eps)
        logits = F.linear(h, self.lm_head)    # every row's: a one-request segment wants them all
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits, h, *outs)


class Graphs:
    """A module run as inductor graphs built with the settings above, or the reason it runs
    eagerly. A call returns None when compiling or running failed (logged once; the caller runs
    eagerly then, and for good: ``disabled`` says why)."""

    def __init__(self, module: torch.nn.Module | None, disabled: str | None, what: str):
        self.disabled = disabled
        self.what = what
        self._module = None if disabled else torch.compile(module, dynamic=True)
        # set once warm_up has built every graph: from then on a call checks a reduced set of
        # guards (dynamo's ``skip_guard_eval_unsafe``: the input tensors' checks that tell the
        # graphs apart, not the identity and global-state checks over every frozen weight and
        # setting), a few percent of a decoding step. Safe because the caller's ``takes`` admits
        # only what the graphs were built for (one request's segment in the model's dtype, the same
        # weights, inference mode), and the sizes that vary are symbolic in every graph
        self.warm = False

    def run(self, *args) -> tuple[torch.Tensor, ...] | torch.Tensor | None:
        assert self._module is not None
        try:
            with torch._inductor.config.patch(CONFIG), \
                    torch.compiler.set_stance(skip_guard_eval_unsafe=self.warm):
                return cast("tuple[torch.Tensor, ...] | torch.Tensor", self._module(*args))
        except Exception as e:   # a compiler missing or failing on this machine: run eagerly
            self.disabled = f"compiling failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            self._module = None
            log.warning("dspark: the compiled %s is off: %s", self.what, self.disabled)
            return None


class CompiledForward(Graphs):
    """The compiled ``LayerStack`` of a decoder, or the reason it runs eagerly."""

    def __init__(self, parts: StackParts):
        why = eligible(parts)
        super().__init__(None if why else LayerStack(parts), why, "one-request forward")
        # what a one-row call passes as its mask (the graph reads none): one tensor, not one a step
        self._no_mask = torch.zeros((1, 1), dtype=parts.kv_dtype)

    def takes(self, segments: list[tuple[int, int]], starts: list[int]) -> bool:
        """A segment of one request after a context at least as long as the one the graphs were
        built on (decoding, verifying): a first chunk, whose rows are all the keys, and contexts
        shorter than that were seen to build graphs of their own."""
        return (self.disabled is None and len(segments) == 1 and segments[0][1] <= MAX_ROWS
                and starts[0] >= CONTEXT)

    def __call__(self, input_ids, cos, sin, cache: KVCache, positions, slot: int, end: int,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The stack's outputs, or None when compiling or running failed (the caller runs the
        forward eagerly, and every later one too). ``mask``: the block's causal triangle, None for
        one row. A failed call wrote at most keys and values past the slot's length, which the
        eager forward overwrites."""
        # a fresh tensor made here, whatever the caller's was (a view, made outside inference
        # mode): a graph is guarded on such properties of its inputs and rebuilt when they change
        input_ids = input_ids.clone()
        k = [t[slot:slot + 1] for t in cache.k]
        v = [t[slot:slot + 1] for t in cache.v]
        out = self.run(input_ids, cos, sin, k, v, positions, end, self._no_mask if mask is None else mask)
        assert out is None or isinstance(out, tuple)
        return out
