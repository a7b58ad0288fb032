"""The DSpark drafter (parallel backbone + sequential head + confidence head); DFlash is the same
class without the heads.

One forward of the backbone over [anchor, MASK, ..., MASK] (gamma rows) gives gamma hidden states
h_1..h_gamma and base logits U_k = lm_head(h_k) (the target's frozen head, restricted to the
draft vocabulary). The sequential head then samples left to right from softmax(U_k + B_k(x_{k-1}))
and the confidence head scores each drafted token.

The draft vocabulary (``draft_vocab``, saved with the weights) is a subset of the target's: the
most frequent tokens of the training answers, EAGLE-3 style, so that the Markov tables stay small
(V_draft x r) and the drafter's LM head costs a fraction of the target's. Tokens outside it are
never drafted (their draft probability is 0, which the verifier handles like any other).

Checkpoints: ``config.json`` + ``model.safetensors`` (trained weights only: the embedding and LM
head come from the target at load time and are never saved twice). Loading never unpickles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import DsparkError, UsageError
from ..runtime.kv_cache import KVCache
from ..runtime.linear import Weight, linear, pack, serve_fast, time_kernels
from ..runtime.attention import SlotBatch, attend
from ..runtime.layer import Attend, LayerShape, LayerWeights, decoder_layer, rms_norm
from ..runtime.model import RopeTable
from ..sampling import SamplingParams, argmax, probs_from_logits, race_sample, sample_rows, uniforms
from .backbone import Backbone, DrafterLayer
from .base import DraftContext, Drafter, Proposal
from .compiled import BlockParts, CompiledBlock, warm_up
from .config import DrafterConfig
from .heads import ConfidenceHead, MarkovRows, SequentialHead


class DSparkModel(nn.Module):
    draft_vocab: torch.Tensor       # registered buffers
    t2d: torch.Tensor
    prev_rows: torch.Tensor

    def __init__(self, config: DrafterConfig, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.config = c = config
        if draft_vocab is None:
            draft_vocab = torch.arange(c.vocab_size)
        self.register_buffer("draft_vocab", draft_vocab.long().clone())
        c.draft_vocab_size = int(draft_vocab.numel())
        vd = c.draft_vocab_size
        t2d = torch.full((c.vocab_size,), vd, dtype=torch.long)
        t2d[self.draft_vocab] = torch.arange(vd)
        self.register_buffer("t2d", t2d, persistent=False)   # target id -> draft index (vd = outside)
        # target id -> row of the Markov table W1 for a previous token: its draft index, and for a token
        # outside the draft vocabulary the shared row vd, or (markov_full_table) a row of its own
        prev_rows = t2d.clone()
        if c.markov_full_table:
            outside = t2d == vd
            prev_rows[outside] = vd + torch.arange(int(outside.sum()))
        self.register_buffer("prev_rows", prev_rows, persistent=False)
        self.backbone = Backbone(c)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.head = SequentialHead(c, vd) if c.has_markov else None
        self.confidence = ConfidenceHead(c, c.has_markov) if c.confidence_head else None
        self.embed: torch.Tensor | None = None      # frozen target parts, attached, never saved
        self.lm_head: torch.Tensor | None = None    # the target's LM head rows of the draft vocabulary
        self.lm_head_packed: Weight | None = None   # the same, packed for serving (runtime/linear.py)
        self.target_lm_head: torch.Tensor | None = None

    # ------------------------------------------------------------------ target parts
    def attach(self, embed: torch.Tensor, lm_head: torch.Tensor, init_mask: bool = False) -> DSparkModel:
        """Share the target's embedding [V, d] and LM head [V, d] (frozen)."""
        c = self.config
        if embed.shape[0] < c.vocab_size or lm_head.shape[0] < c.vocab_size:
            raise UsageError(f"drafter expects a target vocabulary of {c.vocab_size}, got {lm_head.shape[0]}")
        if embed.shape[1] != c.hidden_size:
            raise UsageError(f"drafter hidden size {c.hidden_size} != target embedding {embed.shape[1]}")
        self.embed = embed.detach()
        self.target_lm_head = lm_head.detach()
        self.lm_head = lm_head.detach()[self.draft_vocab.to(lm_head.device)].contiguous()
        self.lm_head_packed = None
        if init_mask:
            with torch.no_grad():
                self.mask_embedding.copy_(self.embed_tokens(torch.tensor([c.mask_token_id]))[0].float())
        return self

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None, "attach() the target's embedding first"
        x = F.embedding(ids.to(self.embed.device), self.embed)
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "attach() the target's LM head first"
        if h.dim() == 2:
            u = linear(h, self.lm_head if self.lm_head_packed is None else self.lm_head_packed)
        else:
            u = h @ self.lm_head.to(h.dtype).T
        cap = self.config.final_logit_softcap
        return torch.tanh(u / cap) * cap if cap else u

    # ------------------------------------------------------------------ training forward
    def forward_train(self, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
        """All blocks of one sequence in one forward (teacher forcing).

        features [L, m*d] (target layers at each position), ids [L], anchors [A] (sorted positions,
        anchors[a] + gamma may run past L: those rows are masked by the caller).
        Returns hidden [A, g, d], logits [A, g, Vd] (with the sequential bias), confidence logits
        [A, g] or None.
        """
        c = self.config
        dev = self.backbone.fc.weight.device       # the inputs follow the drafter's weights
        features, ids, anchors = features.to(dev), ids.to(dev), anchors.to(dev)
        g, L, A = c.block_size, ids.shape[0], anchors.shape[0]
        ctx_len = int(anchors.max()) if A else 0
        ctx = self.backbone.fuse(features[:ctx_len].to(self.backbone.fc.weight.dtype))
        kv = self.backbone.context_kv(ctx, torch.arange(ctx_len, device=dev))
        x = self.mask_embedding.to(ctx.dtype).expand(A, g, -1).clone()
        x[:, 0] = self.embed_tokens(ids[anchors]).to(x.dtype)
        steps = torch.arange(g, device=dev)[None]
        pos = (anchors[:, None] + steps).reshape(-1)
        h = self.backbone(x.reshape(A * g, -1), pos, kv, None, anchors=anchors).view(A, g, -1)
        logits = self.base_logits(h)
        conf = None
        e = None
        if self.head is not None:
            idx = (anchors[:, None] + steps).clamp(max=L - 1)   # x_{k-1}: anchor, then truth
            prev = self.prev_rows[ids[idx]]
            bias, e = self.head.teacher_forced(h, prev)
            logits = logits + bias
        if self.confidence is not None:
            conf = self.confidence(h, e)
        return h, logits, conf

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}
        tmp = folder / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt", "architecture": self.config.architectures[0]})
        tmp.replace(folder / "model.safetensors")
        self.config.save(folder)

    @classmethod
    def load(cls, folder, dtype: torch.dtype = torch.float32) -> DSparkModel:
        folder = Path(folder)
        config = DrafterConfig.load(folder)
        try:
            state = load_file(str(folder / "model.safetensors"))
        except (OSError, SafetensorError, ValueError) as e:
            raise DsparkError(f"cannot read drafter weights in {folder}: {e}") from None
        if "draft_vocab" not in state:
            raise DsparkError(f"{folder}/model.safetensors has no draft_vocab: not a dspark drafter")
        model = cls(config, state["draft_vocab"])
        state.setdefault("backbone.feature_scale", model.backbone.feature_scale)   # drafters saved before it existed
        missing, unexpected = model.load_state_dict(
            {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise DsparkError(f"drafter weights in {folder} do not match its config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model.to(dtype)


class DSparkDrafter(Drafter):
    """Serving wrapper: per-request context cache, one batched block forward, sequential sampling."""

    folder: Path    # where it was loaded from: set by drafters.load_trained, absent otherwise

    def __init__(self, model: DSparkModel, target, name: str | None = None, block_size: int | None = None):
        c = model.config
        self.model = serve_fast(model.eval())   # few-row products on the fast CPU path
        self.config = c
        self.name = name or c.kind
        self.block_size = block_size or c.block_size
        if self.block_size > c.block_size:
            raise UsageError(f"{self.name} drafts at most {c.block_size} tokens per round")
        self.feature_layers = tuple(c.target_layer_ids)
        dt = target.dtype
        self.kv_dtype = torch.float32 if (dt == torch.bfloat16 and target.device.type == "cpu") else dt
        self.model.to(dtype=dt, device=target.device)
        self.model.attach(target.embed, target.lm_head)
        self.model.lm_head_packed = pack(self.model.lm_head)
        self.device = target.device
        # calibrated confidence c_k = sigmoid(z_k / T_k + b_k) (b = 0 unless calibrated with --shift)
        # (sts_greedy_*: fitted on greedy rollouts, for greedy requests; else the sampled regime's)
        def per_position(values, default):
            values = list(values or [])[:c.block_size]
            return torch.tensor(values + [default] * (c.block_size - len(values)), device=self.device)
        self.temps, self.shifts = per_position(c.sts_temperatures, 1.0), per_position(c.sts_shifts, 0.0)
        if c.sts_greedy_temperatures:
            self.greedy_temps = per_position(c.sts_greedy_temperatures, 1.0)
            self.greedy_shifts = per_position(c.sts_greedy_shifts, 0.0)
        else:
            self.greedy_temps, self.greedy_shifts = self.temps, self.shifts
        self.cache: KVCache | None = None
        self._serving_weights()
        self._compiled: CompiledBlock | None = None
        self._backbone = self._eager_backbone    # the pass ``use_graphs`` chose
        head = self.model.head
        self._markov = MarkovRows(head, pack(head.w2.weight.detach())) if head is not None and MarkovRows.fits(head) else None

    def compile(self) -> str:
        """Run one request's drafting pass as compiled graphs from now on (drafters/compiled.py),
        building them at once; what happened, in one line."""
        if self._compiled is not None and not self._compiled.disabled:
            return "compiled already"
        graphs, what = self.build_graphs()
        self.use_graphs(graphs)
        return what

    def build_graphs(self) -> tuple[CompiledBlock | None, str]:
        """The compiled graphs built (on a scratch cache), not yet used, and what happened in one
        line (``use_graphs`` then; see Decoder.build_graphs)."""
        parts = self.block_parts()
        graphs = CompiledBlock(parts)
        if not graphs.disabled:
            seconds = warm_up(parts, graphs)
            if not graphs.disabled:
                graphs.warm = True
                return graphs, f"compiled the {self.name} drafter's one-request pass in {seconds:.0f} s"
        return graphs, f"eager {self.name} drafter ({graphs.disabled})"

    def block_parts(self) -> BlockParts:
        """What the compiled pass is built from (drafters/compiled.py)."""
        c, bb = self.config, self.model.backbone
        return BlockParts(self._layers, self._fc, bb.fc_norm.weight.detach(), bb.norm.weight.detach(),
                          LayerShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                     c.head_dim ** -0.5),
                          self._rope, len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size,
                          c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self._dtype, self.kv_dtype,
                          self.device)

    def use_graphs(self, graphs: CompiledBlock | None) -> None:
        """Run one request's drafting pass through these graphs from the next call on."""
        self._compiled = graphs
        usable = graphs is not None and not graphs.disabled
        self._backbone = self._compiled_backbone if usable else self._eager_backbone

    def prepare(self, max_requests: int, max_len: int) -> None:
        c = self.cache
        if c is None or c.num_slots < max_requests or c.max_len < max_len:
            if c is not None and c.num_free != c.num_slots:
                raise RuntimeError("cannot resize the drafter cache while requests are in flight")
            cfg = self.config
            self.cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                 num_slots=max_requests, max_len=max_len, dtype=self.kv_dtype, device=self.device)

    def _slot(self, ctx: DraftContext) -> int:
        if ctx.slot is None:
            if self.cache is None:
                self.prepare(1, max(1024, 2 * len(ctx.tokens)))
            assert self.cache is not None       # prepare() always leaves one
            ctx.slot = self.cache.allocate()
        return ctx.slot

    def release(self, ctx: DraftContext) -> None:
        slot, ctx.slot = ctx.slot, None
        if slot is not None:
            assert self.cache is not None       # the slot came from it (_slot)
            self.cache.free(slot)

    def _serving_weights(self) -> None:
        """The backbone's weights laid out for the runtime's kernels: fused q/k/v and gate/up
        products, the feature scale folded into the fusion projection, RoPE tables in the model
        dtype (same weights as training; only how the products are grouped changes)."""
        bb = self.model.backbone
        self._dtype = dt = bb.fc.weight.dtype
        self._fc = pack((bb.fc.weight.detach().float() * bb.feature_scale.float()[None]).to(dt))
        with torch.no_grad():       # weights for inference: no autograd history, detached views
            self._layers = [LayerWeights(input_norm=l.input_norm.weight.detach(), qkv_bias=None, o_bias=None,
                                         qkv=torch.cat([l.q_proj.weight, l.k_proj.weight, l.v_proj.weight]),
                                         o=l.o_proj.weight.detach(), post_attn_norm=l.post_norm.weight.detach(),
                                         gate_up=torch.cat([l.gate_proj.weight, l.up_proj.weight]),
                                         down=l.down_proj.weight.detach(),
                                         q_norm=None if l.q_norm is None else l.q_norm.weight.detach(),
                                         k_norm=None if l.k_norm is None else l.k_norm.weight.detach())
                            for l in cast(Iterable[DrafterLayer], bb.layers)]
        self._layers = [lw.packed() for lw in self._layers]
        time_kernels([self._fc, self.model.lm_head_packed,
                      *(w for lw in self._layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))])
        self._rope = RopeTable(bb.rope.inv_freq, 1.0, dt, self.device)

    def _forward(self, contexts: list[DraftContext], active: list[DraftContext], g: int) -> torch.Tensor | None:
        """One pass of the backbone for a batch of requests -> hidden states [len(active), g, d].

        Every request's context cache takes the target features handed over since its last round
        (fused once, their keys / values appended); each active request's block [anchor, MASK *
        (g-1)] attends to its whole context and to its whole block (non-causal). Context rows and
        block rows share each layer's one q/k/v product; block keys / values are written past the
        context length in the cache and overwritten by the next round's context."""
        slots, feats, starts, new = self._take_context(contexts, g)
        nc, R = sum(new), len(active)
        if nc == 0 and R == 0:
            return None
        dev = self.device
        rows_slot: list[int] = []
        rows_pos: list[int] = []          # cache slot and position of every row (context rows, then block rows)
        for slot, s, n in zip(slots, starts, new):
            rows_slot += [slot] * n
            rows_pos += range(s, s + n)
        for ctx in active:
            end = len(ctx.tokens) - 1     # the anchor's position
            rows_slot += [self._slot(ctx)] * g
            rows_pos += range(end, end + g)
        rows = _Rows(torch.tensor(rows_slot, device=dev), torch.tensor(rows_pos, device=dev), slots, starts, new)
        f = None if not nc else feats[0] if len(feats) == 1 else torch.cat(feats)      # [nc, m*d]
        x = None                                                                        # [R * g, d]
        if R:
            m = self.model
            x = m.mask_embedding.expand(R, g, -1).clone()
            x[:, 0] = m.embed_tokens(torch.tensor([ctx.tokens[-1] for ctx in active], device=dev)).to(x.dtype)
            x = x.reshape(R * g, -1)
        return self._backbone(f, x, rows, active, g)

    def _take_context(self, contexts: list[DraftContext], g: int) -> tuple[list[int], list, list[int], list[int]]:
        """(each request's cache slot, the target features handed over since its last round, where
        they start in its slot, how many rows each has): the features are taken from the contexts."""
        slots = [self._slot(ctx) for ctx in contexts]     # allocates the cache on first use
        cache = self.cache
        assert cache is not None        # _slot() allocated it
        feats, starts, new = [], [], []
        for ctx, slot in zip(contexts, slots):
            n = sum(f.shape[0] for f in ctx.features)
            if cache.lengths[slot] + n != len(ctx.tokens) - 1:
                raise RuntimeError("drafter context out of step with the request")
            cache.check_room(slot, n + (g if ctx.num_draft > 0 else 0))
            feats.extend(ctx.features)
            ctx.features.clear()
            starts.append(cache.lengths[slot])
            new.append(n)
        return slots, feats, starts, new

    def _compiled_backbone(self, f: torch.Tensor | None, x: torch.Tensor | None, rows: _Rows,
                           active: list[DraftContext], g: int) -> torch.Tensor | None:
        """One request's pass through the compiled graphs where they take its shape, else eager."""
        graphs, cache = self._compiled, self.cache
        assert graphs is not None and cache is not None
        if (f is not None and x is not None and len(rows.slots) == 1 and len(active) == 1
                and graphs.takes(f.shape[0], g, rows.starts[0])):
            cos, sin = self._rope.tables(rows.pos, int(rows.pos.max()))
            h = graphs(f.to(self._dtype), x, cos, sin, cache, rows.pos, rows.slots[0], len(active[0].tokens) - 1 + g)
            if h is not None:
                cache.lengths[rows.slots[0]] += f.shape[0]
                return h.view(1, g, -1)
        return self._eager_backbone(f, x, rows, active, g)

    def _eager_backbone(self, f: torch.Tensor | None, x: torch.Tensor | None, rows: _Rows,
                        active: list[DraftContext], g: int) -> torch.Tensor | None:
        """The backbone's layers over the context rows ``f`` [nc, m*d] (fused here) and the block rows
        ``x`` [R * g, d]; the context rows' keys / values stay in the cache."""
        c, bb, cache = self.config, self.model.backbone, self.cache
        assert cache is not None
        rope = self._rope.tables(rows.pos, int(rows.pos.max()))
        ctx_rows = None
        if f is not None:
            ctx_rows = rms_norm(linear(f.to(self._dtype), self._fc), bb.fc_norm.weight, c.rms_norm_eps)
        shape = LayerShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                           c.head_dim ** -0.5)
        attend_fn = self._block_attention(active, g)
        for li, lw in enumerate(self._layers):
            x = decoder_layer(lw, x, shape, rope, (cache.k[li], cache.v[li], rows.slot, rows.pos), attend_fn,
                              context=ctx_rows)
        for slot, n in zip(rows.slots, rows.new):
            cache.lengths[slot] += n
        # x is set iff a request drafts
        return rms_norm(x, bb.norm.weight, c.rms_norm_eps).view(len(active), g, -1) if x is not None else None

    def _block_attention(self, active: list[DraftContext], g: int) -> Attend:
        """Each active request's block of g rows attends to its whole slot up to the block's end
        (context and block, non-causal): R > 1 blocks in one product over their slots
        (runtime/attention.py), else block by block."""
        ends = [len(ctx.tokens) - 1 for ctx in active]        # each anchor's position
        slots = [self._slot(ctx) for ctx in active]
        batch = None
        if len(active) > 1:
            batch = SlotBatch.of([(s, g) for s in slots], ends, [i * g for i in range(len(active))], self.device,
                                 causal=False)

        def attend_blocks(qs, kc, vc, window, out):
            if batch is not None:
                batch.attend(qs, kc, vc, None, out)
                return
            for i, (s, end) in enumerate(zip(slots, ends)):
                rows = slice(i * g, (i + 1) * g)
                attend(qs[rows], kc[s, :, :end + g], vc[s, :, :end + g], None, out[rows])
        return attend_blocks

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        active = [c for c in contexts if c.num_draft > 0]
        steps = min(self.block_size, max((c.num_draft for c in active), default=0))
        h = self._hidden(contexts, active, steps)      # [R, steps, d]; every context cache kept in step
        if not active:
            return [Proposal.empty() for _ in contexts]
        assert h is not None                # hidden states whenever a request is active
        toks, pd, ends = self._sample_block(h, active, steps)
        confs = self._confidences(h, toks[:, :steps], active, steps)
        # back to the full vocabulary: token ids [R, steps], probabilities [R, steps, V]
        vocab = self.model.draft_vocab
        probs = torch.zeros(len(active), steps, self.config.vocab_size, device=pd.device)
        probs[:, :, vocab] = pd
        ids = vocab[toks[:, 1:]]
        results = {id(c): Proposal.empty() for c in contexts}
        for i, c in enumerate(active):
            n = min(c.num_draft, steps, ends.get(i, steps))
            results[id(c)] = Proposal(ids[i, :n], probs[i, :n], confs[i, :n])   # views: fresh tensors
        return [results[id(c)] for c in contexts]

    def _hidden(self, contexts: list[DraftContext], active: list[DraftContext], steps: int) -> torch.Tensor | None:
        """The backbone's hidden states [R, steps, d] for the drafts. A bonus-anchor block (imported
        z-lab DFlash / SpecForge checkpoints, ``sample_from_anchor`` false) is [anchor, MASK *
        steps]: the anchor slot's output is unused and draft k is read from slot k."""
        bonus = 1 if steps and not self.config.sample_from_anchor else 0
        h = self._forward(contexts, active, steps + bonus)
        return h[:, 1:].contiguous() if bonus and h is not None else h

    def _sample_block(self, h: torch.Tensor, active: list[DraftContext],
                      steps: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
        """The drafts, position by position (the Markov head's bias depends on the token before):
        (draft-vocabulary indices [R, steps + 1], column 0 the anchor; their laws [R, steps, Vd];
        where a grammar ended a request's block). Requests with the same sampling settings sample
        together; each request draws from its own stream; seeded sampled requests race their law
        with the verifier's keys (DraftContext.exact)."""
        m, R, dev = self.model, len(active), self.device
        U = m.base_logits(h.view(R * steps, -1)).float().view(R, steps, -1)   # [R, steps, Vd]
        vocab = m.draft_vocab
        state = m.head.init_state(R, h[:, 0]) if m.head is not None else None
        groups = _sampling_groups(active)
        u = uniforms([c.generator for c in active], steps, U.device)      # [R, steps]
        exact = [i for i, c in enumerate(active) if c.exact]
        toks = torch.empty(R, steps + 1, dtype=torch.long, device=U.device)
        toks[:, 0] = m.prev_rows[torch.tensor([c.tokens[-1] for c in active], device=dev)]
        pd = torch.empty(R, steps, vocab.numel(), device=U.device)
        grammars = _GrammarMasks(active, vocab, U.device)
        try:
            for k in range(steps):
                logits = U[:, k]
                if self._markov is not None:
                    logits = logits + self._markov(toks[:, k]).float()
                elif m.head is not None:
                    bias, _, state = m.head.step(h[:, k], toks[:, k], state)
                    logits = logits + bias.float()
                logits = grammars.mask(logits, k)
                for params, rows in groups:
                    p = probs_from_logits(logits[rows], params)
                    toks[rows, k + 1] = argmax(p) if params.greedy else sample_rows(p, u=u[rows, k])
                    pd[rows, k] = p
                if exact:
                    ex = torch.tensor(exact, device=U.device)
                    toks[ex, k + 1] = race_sample(pd[ex, k], [active[i].params.seed for i in exact],
                                                  [len(active[i].tokens) + k for i in exact], ids=vocab)
                grammars.advance(toks[:, k + 1], k)
        finally:
            grammars.undo()
        return toks, pd, grammars.ends

    def _confidences(self, h: torch.Tensor, prev: torch.Tensor, active: list[DraftContext],
                     steps: int) -> torch.Tensor:
        """c_k [R, steps] from h_k and the token before draft k (``prev``, draft-vocabulary indices),
        in one pass after sampling, calibrated per regime: sigmoid(z_k / T_k + b_k) with the greedy
        regime's T, b for greedy requests; 1 without a confidence head."""
        m = self.model
        if m.confidence is None:
            return torch.ones(len(active), steps, device=h.device)
        e = m.head.w1(prev) if m.head is not None else None
        greedy = torch.tensor([c.params.greedy for c in active], device=h.device)[:, None]
        temps = torch.where(greedy, self.greedy_temps[:steps], self.temps[:steps])
        shifts = torch.where(greedy, self.greedy_shifts[:steps], self.shifts[:steps])
        return torch.sigmoid(m.confidence(h, e).float() / temps + shifts)


@dataclass(frozen=True)
class _Rows:
    """The rows of one drafter pass: context rows, then block rows."""

    slot: torch.Tensor          # [rows] each row's cache slot
    pos: torch.Tensor           # [rows] its position there
    slots: list[int]            # per request of the call: its slot
    starts: list[int]           # where its new context rows start in its slot
    new: list[int]              # how many new context rows it has


def _sampling_groups(active: list[DraftContext]) -> list[tuple[SamplingParams, slice | torch.Tensor]]:
    """(settings, their rows) of the requests sharing sampling settings: one vectorised pass each."""
    by_params: dict[tuple, list[int]] = {}
    for i, c in enumerate(active):
        by_params.setdefault((c.params.temperature, c.params.top_k, c.params.top_p), []).append(i)
    return [(active[rows[0]].params, slice(None) if len(rows) == len(active) else torch.tensor(rows))
            for rows in by_params.values()]


class _GrammarMasks:
    """Structured outputs in a drafted block: a request with a grammar samples each position from
    the tokens the grammar allows after its drafts so far; where none of the draft vocabulary is
    allowed (or the grammar has ended) its block ends. The grammars are set back (``undo``) before
    the proposal is returned."""

    def __init__(self, active: list[DraftContext], vocab: torch.Tensor, dev: torch.device):
        self.items = [(i, c.grammar) for i, c in enumerate(active) if c.grammar is not None]
        self.vocab, self.dev = vocab, dev
        self.vocab_cpu = vocab.cpu() if self.items else None
        self.pushed = {i: 0 for i, _ in self.items}
        self.ends: dict[int, int] = {}      # request -> the length its block ends at
        self.allowed: dict[int, torch.Tensor] = {}   # the full-vocabulary mask position k was sampled from

    def mask(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Position k's logits [R, Vd], each grammar request's restricted to what it allows."""
        if not self.items:
            return logits
        logits = logits.clone()
        for i, g in self.items:
            if i in self.ends:
                continue
            self.allowed[i] = g.allowed_now()
            ok = self.allowed[i][self.vocab_cpu].to(self.dev)
            if ok.any():
                logits[i] = logits[i].masked_fill(~ok, float("-inf"))
            else:
                self.ends[i] = k
        return logits

    def advance(self, toks: torch.Tensor, k: int) -> None:
        """Each grammar takes its request's draft at position k (``toks`` [R], draft-vocabulary indices)."""
        for i, g in self.items:
            if i not in self.ends:
                if g.push(int(self.vocab[toks[i]]), self.allowed[i]):
                    self.pushed[i] += 1
                else:            # the grammar has ended: nothing after this token is drafted
                    self.ends[i] = k + 1

    def undo(self) -> None:
        for i, g in self.items:
            g.pop(self.pushed[i])
