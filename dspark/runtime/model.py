"""One config-driven decoder for the Llama, Qwen2, Qwen3 and Gemma 3 families.

A forward runs over a ragged batch: the new tokens of several requests flattened into one
``[N]`` tensor, described by ``segments`` = ``[(cache_slot, num_new_tokens), ...]``. Every linear
layer runs once over all N rows (the new keys / values go into the cache in one indexed write);
attention (runtime/attention.py) runs the short segments of decoding and verification as one
batched product over their cache slots, and each prefill chunk against its own slot. The forward
appends the new keys/values to the cache; rolling back rejected tokens is ``cache.truncate``.
The layer itself (runtime/layer.py) is shared with the trained drafters' serving backbone; what
is the target's own here is which rows attend to what (``_attention``).

Weights come from a loaded transformers model (``Decoder.from_hf``): transformers stays the
loader and the reference our logits are tested against; this module is the fast path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import DecoderConfig
from .attention import SlotBatch, attend
from .compiled import CONTEXT, CompiledForward, StackParts
from .invariant import DecodeRows, attend_all
from .kv_cache import KVCache
from .layer import Attend, LayerShape, LayerWeights, decoder_layer, rms_norm
from .linear import Weight, linear, pack_head, time_kernels


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None        # [M, V] in the model dtype, rows chosen by ``logits_rows``
    last_hidden: torch.Tensor          # [N, d] after the final norm (the LM head's input)
    features: tuple[torch.Tensor, ...]  # outputs of the requested decoder layers, each [N, d]


class RopeTable:
    """cos / sin tables per RoPE variant, grown on demand, in the model dtype."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, device):
        self.inv_freq = inv_freq.float().to(device)
        self.scaling = scaling
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0)
        self._grow(256)

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = self.inv_freq.numel()
        sign = torch.ones(2 * half, device=emb.device)
        sign[:half] = -1.0
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        # rotate_half(x) * sin == roll(x, half) * (sign * sin)
        self.sin = (emb.sin() * self.scaling * sign).to(self.dtype)

    def tables(self, positions: torch.Tensor, max_pos: int):
        if max_pos >= self.cos.shape[0]:
            self._grow(max(2 * self.cos.shape[0], max_pos + 1))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Decoder:
    def __init__(self, config: DecoderConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, ropes: dict, packed_head: Weight | None = None):
        self.config = config
        self.embed = embed
        # on a CPU, the products' weights packed once (runtime/linear.py; an fp32 LM head where
        # packed products are timed faster). The LM head also stays plain in ``lm_head`` (the
        # embedding when tied; the trained drafters share it)
        self.layers = [lw.packed(fp32=True) for lw in layers]
        self.final_norm = final_norm
        self.lm_head = lm_head
        self._head = packed_head if packed_head is not None else pack_head(lm_head)
        time_kernels([w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [self._head])
        self.ropes = ropes
        self.dtype = embed.dtype
        self.device = embed.device
        self._embed_scale = (torch.tensor(config.embed_scale, dtype=self.dtype)
                             if config.embed_scale != 1.0 else None)
        # a token decoded alone and verified inside a block attend bit for bit alike (bf16 greedy
        # identity; runtime/invariant.py), at a small cost per forward
        self.batch_invariant = False
        self.layer_shape = LayerShape(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                      config.attn_scale if config.attn_scale is not None else config.head_dim ** -0.5,
                                      config.activation)
        # one request's short segments as one compiled graph (runtime/compiled.py), once compile() is called
        self._compiled: CompiledForward | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, hf_model, dtype: torch.dtype = torch.float32, device="cpu") -> Decoder:
        """Take the weights of a loaded transformers causal LM (Llama, Qwen2, Qwen3, Gemma 3)."""
        cfg = DecoderConfig.from_hf(hf_model.config)
        base = hf_model.model
        offset = cfg.norm_offset

        def t(x):
            return None if x is None else x.detach().to(device=device, dtype=dtype).contiguous()

        def norm(mod):
            w = mod.weight.detach().float()
            return t(1.0 + w if offset else w)

        def bias(*mods):
            if all(m.bias is None for m in mods):
                return None
            return t(torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in mods]))

        rotary = base.rotary_emb
        layer_types = list(getattr(hf_model.config, "layer_types", None) or [])
        ropes = {}
        for lt in sorted(set(layer_types)):
            inv = getattr(rotary, f"{lt}_inv_freq", None)
            if inv is not None:  # Gemma 3: one RoPE per layer type (local / global)
                ropes[lt] = RopeTable(inv, float(getattr(rotary, f"{lt}_attention_scaling")), dtype, device)
        if not ropes:
            ropes["default"] = RopeTable(rotary.inv_freq, float(rotary.attention_scaling), dtype, device)

        layers = []
        for i, hl in enumerate(base.layers):
            at, mlp = hl.self_attn, hl.mlp
            rope = layer_types[i] if layer_types and layer_types[i] in ropes else "default"
            layers.append(LayerWeights(
                input_norm=norm(hl.input_layernorm),
                qkv=t(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
                qkv_bias=bias(at.q_proj, at.k_proj, at.v_proj),
                o=t(at.o_proj.weight),
                o_bias=t(at.o_proj.bias),
                post_attn_norm=norm(hl.post_attention_layernorm),
                gate_up=t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=t(mlp.down_proj.weight),
                q_norm=norm(at.q_norm) if cfg.qk_norm else None,
                k_norm=norm(at.k_norm) if cfg.qk_norm else None,
                pre_ff_norm=norm(hl.pre_feedforward_layernorm) if cfg.sandwich_norm else None,
                post_ff_norm=norm(hl.post_feedforward_layernorm) if cfg.sandwich_norm else None,
                rope=rope,
                window=getattr(at, "sliding_window", None),
            ))
            if getattr(mlp, "gate_proj", None) is not None and mlp.gate_proj.bias is not None:
                raise ValueError("MLP biases are not supported")
        cfg.sliding_windows = [lw.window for lw in layers]
        embed = t(base.embed_tokens.weight)
        head = hf_model.get_output_embeddings().weight
        lm_head = embed if head is base.embed_tokens.weight else t(head)
        return cls(cfg, embed, layers, norm(base.norm), lm_head, ropes)

    def truncated(self, num_layers: int) -> Decoder:
        """The first ``num_layers`` layers with the same final norm and LM head, sharing weights
        (an early-exit draft LM that costs no memory)."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}], got {num_layers}")
        from dataclasses import replace
        cfg = replace(self.config, num_layers=num_layers,
                      sliding_windows=self.config.sliding_windows[:num_layers])
        cut = Decoder(cfg, self.embed, self.layers[:num_layers], self.final_norm, self.lm_head, self.ropes,
                      packed_head=self._head)
        cut.batch_invariant = self.batch_invariant
        return cut

    def compile(self) -> str:
        """Run one request's decoding rows and verification blocks as compiled graphs from now on
        (runtime/compiled.py), building them at once; what happened, in one line."""
        if self._compiled is not None and not self._compiled.disabled:
            return "compiled already"
        graphs, what = self.build_graphs()
        self.use_graphs(graphs)
        return what

    def build_graphs(self) -> tuple[CompiledForward, str]:
        """The compiled graphs built (on a scratch cache), not yet used, and what happened in one
        line: a server builds them in a thread while its forwards run eagerly (``use_graphs``
        then)."""
        graphs = CompiledForward(self.stack_parts())
        if graphs.disabled:
            return graphs, f"eager forward ({graphs.disabled})"
        t = time.perf_counter()
        # the two graphs (a decoding row, a verification block) built on a scratch cache; their
        # sizes differ from each other and from the model's (a graph built where two sizes are
        # equal assumes they always are)
        cache = self.new_cache(1, 100)
        ids = torch.zeros(CONTEXT, dtype=torch.long)
        self.forward(ids, [(0, CONTEXT)], cache, logits_rows=None)     # a prefill: eager
        for n in (1, 13):
            self.forward(ids[:n], [(0, n)], cache, logits_rows=None, graphs=graphs)
        if graphs.disabled:
            return graphs, f"eager forward ({graphs.disabled})"
        graphs.warm = True
        return graphs, f"compiled the one-request forward in {time.perf_counter() - t:.0f} s"

    def stack_parts(self) -> StackParts:
        """What the compiled forward is built from (runtime/compiled.py)."""
        c = self.config
        return StackParts(self.layers, self.embed, self.final_norm, self._embed_scale, self.lm_head,
                          c.final_logit_softcap, self.layer_shape, self.kv_dtype, self.device, self.dtype,
                          self.batch_invariant, any(w is not None for w in c.sliding_windows) or len(self.ropes) != 1)

    def use_graphs(self, graphs: CompiledForward | None) -> None:
        """Run one request's short segments through these graphs from the next forward on (None:
        eagerly again)."""
        self._compiled = graphs

    @property
    def compiled(self) -> bool:
        """Whether one request's forwards run as compiled graphs (``compile`` built them)."""
        return self._compiled is not None and self._compiled.disabled is None and self._compiled.warm

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache (and attention arithmetic) dtype. On CPUs a bf16 model keeps its keys and
        values in fp32: small bf16 matrix products are ~3x slower there than fp32 ones, and the
        values are stored exactly (they come out of bf16 layers)."""
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            return torch.float32
        return self.dtype

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_slots=num_slots,
                       max_len=max_len, dtype=self.kv_dtype, device=self.device)

    def compute_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(last_hidden, self._head, rows_alike=self.batch_invariant).contiguous()  # rows contiguous: argmax, softmax
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, segments: list[tuple[int, int]], cache: KVCache, *,
                feature_layers: tuple[int, ...] = (), logits_rows: str | torch.Tensor | None = "all",
                graphs: CompiledForward | None = None) -> ForwardOutput:
        """Run the new tokens of ``segments`` (``[(slot, n), ...]``, rows in that order).

        ``logits_rows``: "all", "last" (the last row of each segment), a tensor of row indices,
        or None (no logits, e.g. to fill a cache). ``graphs``: compiled graphs to run instead of
        the decoder's own (``build_graphs`` builds them through this).
        """
        cfg = self.config
        input_ids = input_ids.to(self.device)
        if sum(n for _, n in segments) != input_ids.shape[0]:
            raise ValueError("segments do not cover input_ids")
        starts = []
        for slot, n in segments:
            cache.check_room(slot, n)
            starts.append(cache.lengths[slot])
        pos_parts = [torch.arange(start, start + n, device=self.device) for (_, n), start in zip(segments, starts)]
        positions = pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)
        max_pos = max(s + n for s, (_, n) in zip(starts, segments))
        rope_tables = {name: r.tables(positions, max_pos) for name, r in self.ropes.items()}
        compiled = graphs if graphs is not None else self._compiled
        if compiled is not None and compiled.takes(segments, starts) and not self.batch_invariant:
            (cos, sin), = rope_tables.values()
            (slot, n), = segments
            mask = self._masks(segments, starts)[0](None)   # the block's causal triangle, None for one row
            outs = compiled(input_ids, cos, sin, cache, positions, slot, max_pos, mask)
            if outs is not None:
                cache.lengths[slot] = max_pos
                logits = outs[0]        # every row's; the rows asked for:
                rows: torch.Tensor | None
                if isinstance(logits_rows, str):
                    rows = logits[-1:] if logits_rows == "last" else logits
                else:
                    rows = None if logits_rows is None else logits[logits_rows]
                return ForwardOutput(rows, outs[1], tuple(outs[2 + i] for i in feature_layers))
        # where each new row's key / value goes: (slot, position)
        wslot = torch.tensor([slot for slot, n in segments for _ in range(n)], device=self.device)
        attend_fn = self._attention(segments, starts)
        x = F.embedding(input_ids, self.embed)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        wanted = set(feature_layers)
        feats = {}
        for li, lw in enumerate(self.layers):
            x = decoder_layer(lw, x, self.layer_shape, rope_tables[lw.rope], (cache.k[li], cache.v[li], wslot, positions),
                              attend_fn, alike=self.batch_invariant)
            if li in wanted:
                feats[li] = x
        for (slot, n), start in zip(segments, starts):
            cache.lengths[slot] = start + n
        last_hidden = rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return ForwardOutput(self._logits(last_hidden, segments, logits_rows), last_hidden,
                             tuple(feats[i] for i in feature_layers))

    def _logits(self, last_hidden: torch.Tensor, segments: list[tuple[int, int]],
                logits_rows: str | torch.Tensor | None) -> torch.Tensor | None:
        if isinstance(logits_rows, str) and logits_rows == "last":
            ends = torch.tensor([0] + [n for _, n in segments]).cumsum(0)[1:] - 1
            return self.compute_logits(last_hidden[ends] if len(segments) > 1 else last_hidden[-1:])
        if isinstance(logits_rows, str):
            return self.compute_logits(last_hidden)
        if logits_rows is not None:
            return self.compute_logits(last_hidden[logits_rows])
        return None

    def _attention(self, segments: list[tuple[int, int]], starts: list[int]) -> Attend:
        """The forward's attention, laid out once for every layer: each segment attends causally
        to its own cache slot (no padding). Batch-invariant: every segment on its own
        (runtime/invariant.py). Otherwise the decoding rows in one batched product over their
        slots, the verification blocks in another, each prefill chunk on its own
        (runtime/attention.py ``SlotBatch.plan``)."""
        c = self.config
        masks = self._masks(segments, starts)
        if self.batch_invariant:
            dec = DecodeRows.of(segments, c.num_heads, c.num_kv_heads, c.head_dim, self.kv_dtype, self.device)

            def attend_invariant(qs, kc, vc, window, out):
                attend_all(qs, kc, vc, segments, starts, masks, window, out, dec)
            return attend_invariant
        row_starts = [0]
        for _, n in segments[:-1]:
            row_starts.append(row_starts[-1] + n)
        batches = SlotBatch.plan(segments, starts, row_starts, self.device)
        batched = frozenset().union(*(b.members for b in batches))
        # the segments that attend on their own: prefill chunks, or all of them without a batch
        alone = [(slot, n, start, row, mask_for) for i, ((slot, n), start, row, mask_for)
                 in enumerate(zip(segments, starts, row_starts, masks)) if i not in batched]

        def attend_segments(qs, kc, vc, window, out):
            for batch in batches:
                batch.attend(qs, kc, vc, window, out)
            for slot, n, start, row, mask_for in alone:
                end = start + n
                attend(qs[row:row + n], kc[slot, :, :end], vc[slot, :, :end], mask_for(window), out[row:row + n])
        return attend_segments

    __call__ = forward

    def _masks(self, segments, starts):
        """Per segment, a function window -> its additive attention mask: None when nothing is
        masked (one row that no window cuts), the [n, n] causal triangle over the segment's own
        keys when the window cuts none of the earlier ones (every earlier key is visible), else
        the full [n, start + n] mask."""
        out = []
        triangles = {}
        for (_, n), start in zip(segments, starts):
            memo = {}

            def mask_for(window, start=start, n=n, memo=memo):
                if window not in memo:
                    end = start + n
                    if window is None or end <= window:
                        if n not in triangles:
                            triangles[n] = None if n == 1 else torch.full(
                                (n, n), float("-inf"), dtype=self.kv_dtype, device=self.device).triu_(1)
                        memo[window] = triangles[n]
                    else:
                        qpos = torch.arange(start, end, device=self.device).unsqueeze(1)
                        kpos = torch.arange(end, device=self.device).unsqueeze(0)
                        mask = (kpos <= qpos) & (kpos > qpos - window)
                        memo[window] = torch.zeros(mask.shape, dtype=self.kv_dtype,
                                                   device=self.device).masked_fill_(~mask, float("-inf"))
                return memo[window]
            out.append(mask_for)
        return out
