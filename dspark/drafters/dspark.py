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

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import DsparkError, UsageError
from ..runtime.kv_cache import KVCache
from ..runtime.model import serve_fast
from ..sampling import probs_from_logits, sample_rows
from .backbone import Backbone, packed_block_mask
from .base import DraftContext, Drafter, Proposal
from .config import DrafterConfig
from .heads import ConfidenceHead, SequentialHead


class DSparkModel(nn.Module):
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
        self.backbone = Backbone(c)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.head = SequentialHead(c, vd) if c.has_markov else None
        self.confidence = ConfidenceHead(c, c.has_markov) if c.confidence_head else None
        self.embed = None      # frozen target parts, attached, never saved
        self.lm_head = None    # the target's LM head rows of the draft vocabulary
        self.target_lm_head = None

    # ------------------------------------------------------------------ target parts
    def attach(self, embed: torch.Tensor, lm_head: torch.Tensor, init_mask: bool = False) -> "DSparkModel":
        """Share the target's embedding [V, d] and LM head [V, d] (frozen)."""
        c = self.config
        if embed.shape[0] < c.vocab_size or lm_head.shape[0] < c.vocab_size:
            raise UsageError(f"drafter expects a target vocabulary of {c.vocab_size}, got {lm_head.shape[0]}")
        if embed.shape[1] != c.hidden_size:
            raise UsageError(f"drafter hidden size {c.hidden_size} != target embedding {embed.shape[1]}")
        self.embed = embed.detach()
        self.target_lm_head = lm_head.detach()
        self.lm_head = lm_head.detach()[self.draft_vocab.to(lm_head.device)].contiguous()
        if init_mask:
            with torch.no_grad():
                self.mask_embedding.copy_(self.embed_tokens(torch.tensor([c.mask_token_id]))[0].float())
        return self

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids.to(self.embed.device), self.embed)
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
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
        g, L, A = c.block_size, ids.shape[0], anchors.shape[0]
        ctx_len = int(anchors.max()) if A else 0
        ctx = self.backbone.fuse(features[:ctx_len].to(self.backbone.fc.weight.dtype))
        kv = self.backbone.context_kv(ctx, torch.arange(ctx_len))
        x = self.mask_embedding.to(ctx.dtype).expand(A, g, -1).clone()
        x[:, 0] = self.embed_tokens(ids[anchors]).to(x.dtype)
        pos = (anchors[:, None] + torch.arange(g)[None]).reshape(-1)
        mask = packed_block_mask(anchors, g, ctx_len)
        h = self.backbone(x.reshape(A * g, -1), pos, kv, mask).view(A, g, -1)
        logits = self.base_logits(h)
        conf = None
        e = None
        if self.head is not None:
            idx = (anchors[:, None] + torch.arange(g)[None]).clamp(max=L - 1)   # x_{k-1}: anchor, then truth
            prev = self.t2d[ids[idx]]
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
    def load(cls, folder, dtype: torch.dtype = torch.float32) -> "DSparkModel":
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
        self.device = target.device
        # calibrated confidence c_k = sigmoid(z_k / T_k + b_k) (b = 0 unless calibrated with --shift)
        temps = c.sts_temperatures or [1.0] * c.block_size
        self.temps = torch.tensor(temps[:c.block_size] + [1.0] * (c.block_size - len(temps)))
        shifts = c.sts_shifts or [0.0] * c.block_size
        self.shifts = torch.tensor(shifts[:c.block_size] + [0.0] * (c.block_size - len(shifts)))
        self.cache: KVCache | None = None

    def prepare(self, max_requests: int, max_len: int) -> None:
        c = self.cache
        if c is None or c.num_slots < max_requests or c.max_len < max_len:
            if c is not None and c.num_free != c.num_slots:
                raise RuntimeError("cannot resize the drafter cache while requests are in flight")
            cfg = self.config
            self.cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                 num_slots=max_requests, max_len=max_len, dtype=self.kv_dtype, device=self.device)

    def _slot(self, ctx: DraftContext) -> int:
        if "slot" not in ctx.state:
            if self.cache is None:
                self.prepare(1, max(1024, 2 * len(ctx.tokens)))
            ctx.state["slot"] = self.cache.allocate()
        return ctx.state["slot"]

    def release(self, ctx: DraftContext) -> None:
        slot = ctx.state.pop("slot", None)
        if slot is not None:
            self.cache.free(slot)

    def _ingest(self, contexts: list[DraftContext]) -> None:
        """Fuse the target features the engine handed over since the last round into each
        request's context cache (one batched projection for all requests)."""
        rows, owners = [], []
        for ctx in contexts:
            slot = self._slot(ctx)
            n_new = 0
            if ctx.features:
                f = torch.cat(ctx.features) if len(ctx.features) > 1 else ctx.features[0]
                ctx.features.clear()
                rows.append(f)
                owners.append((slot, f.shape[0]))
                n_new = f.shape[0]
            if self.cache.lengths[slot] + n_new != len(ctx.tokens) - 1:
                raise RuntimeError("drafter context out of step with the request")
        if not rows:
            return
        bb = self.model.backbone
        ctx_all = bb.fuse(torch.cat(rows).to(self.model.backbone.fc.weight.dtype))
        pos = torch.cat([torch.arange(self.cache.lengths[s], self.cache.lengths[s] + n) for s, n in owners])
        for li, layer in enumerate(bb.layers):
            k, v = layer.context_kv(ctx_all, pos.to(self.device), bb.rope)
            at = 0
            for slot, n in owners:
                start = self.cache.lengths[slot]
                self.cache.k[li][slot, :, start:start + n] = k[at:at + n].transpose(0, 1)
                self.cache.v[li][slot, :, start:start + n] = v[at:at + n].transpose(0, 1)
                at += n
        for slot, n in owners:
            self.cache.lengths[slot] += n

    def _block_hidden(self, contexts: list[DraftContext], g: int) -> torch.Tensor:
        """One backbone forward over every request's [anchor, MASK * (g-1)] -> [R, g, d]."""
        m = self.model
        bb = m.backbone
        R = len(contexts)
        x = m.mask_embedding.expand(R, g, -1).clone()
        x[:, 0] = m.embed_tokens(torch.tensor([c.tokens[-1] for c in contexts])).to(x.dtype)
        x = x.reshape(R * g, -1)
        slots = [c.state["slot"] for c in contexts]
        pos = torch.cat([torch.arange(self.cache.lengths[s], self.cache.lengths[s] + g) for s in slots]).to(self.device)
        for li, layer in enumerate(bb.layers):
            h = layer.input_norm(x)
            q = bb.rope(layer.q_proj(h).view(R * g, layer.H, layer.hd), pos)
            k = bb.rope(layer.k_proj(h).view(R * g, layer.Hkv, layer.hd), pos)
            v = layer.v_proj(h).view(R * g, layer.Hkv, layer.hd)
            outs = []
            for i, s in enumerate(slots):
                n = self.cache.lengths[s]
                sl = slice(i * g, (i + 1) * g)
                kk = torch.cat([self.cache.k[li][s, :, :n], k[sl].transpose(0, 1).to(self.kv_dtype)], 1)
                vv = torch.cat([self.cache.v[li][s, :, :n], v[sl].transpose(0, 1).to(self.kv_dtype)], 1)
                o = F.scaled_dot_product_attention(q[sl].transpose(0, 1).to(self.kv_dtype), kk, vv, enable_gqa=True)
                outs.append(o.transpose(0, 1).reshape(g, -1))
            a = torch.cat(outs).to(x.dtype)
            x = x + layer.o_proj(a)
            h = layer.post_norm(x)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
        return bb.norm(x).view(R, g, -1)

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        self._ingest(contexts)
        active = [c for c in contexts if c.num_draft > 0]
        results = {id(c): Proposal.empty() for c in contexts}
        if not active:
            return [results[id(c)] for c in contexts]
        m = self.model
        steps = min(self.block_size, max(c.num_draft for c in active))
        h = self._block_hidden(active, steps)
        U = m.base_logits(h).float()                      # [R, g, Vd]
        R = len(active)
        prev = m.t2d[torch.tensor([c.tokens[-1] for c in active], device=self.device)]
        state = m.head.init_state(R, h[:, 0]) if m.head is not None else None
        V = self.config.vocab_size
        vocab = m.draft_vocab
        # requests with the same sampling settings sample together (one vectorised pass per group)
        groups: dict = {}
        for i, c in enumerate(active):
            groups.setdefault((c.params.temperature, c.params.top_k, c.params.top_p), []).append(i)
        groups = [(active[rows[0]].params, torch.tensor(rows), [active[i].generator for i in rows])
                  for rows in groups.values()]
        dev = U.device
        toks = torch.empty(R, steps, dtype=torch.long, device=dev)   # draft-vocabulary indices
        pd = torch.empty(R, steps, vocab.numel(), device=dev)         # draft-vocabulary probabilities
        confs = torch.ones(R, steps, device=dev)
        for k in range(steps):
            logits = U[:, k]
            e = None
            if m.head is not None:
                bias, e, state = m.head.step(h[:, k], prev, state)
                logits = logits + bias.float()
            if m.confidence is not None:
                confs[:, k] = torch.sigmoid(m.confidence(h[:, k], e).float() / self.temps[k] + self.shifts[k])
            for params, rows, gens in groups:
                p = probs_from_logits(logits[rows], params)
                toks[rows, k] = p.argmax(-1) if params.greedy else sample_rows(p, gens)
                pd[rows, k] = p
            prev = toks[:, k]
        probs = torch.zeros(R, steps, V, device=dev)
        probs[:, :, vocab] = pd
        toks = vocab[toks]
        for i, c in enumerate(active):
            n = min(c.num_draft, steps)
            results[id(c)] = Proposal(toks[i, :n], probs[i, :n], confs[i, :n])   # views: fresh tensors
        return [results[id(c)] for c in contexts]
