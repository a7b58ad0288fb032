"""The EAGLE-3-style autoregressive baseline: one decoder layer, one token per forward.

Entry j of the drafter's sequence is [embed(t_{j+1}); fuse(target features at j)] at position j, run
causally through one layer (input 2d, residual stream = the feature half). Its output predicts
t_{j+2}. Drafting after an anchor t_i continues the chain on the drafter's own outputs: step s
feeds [embed(x_s); h_s] at position i-1+s and attends to the cached entries plus the chain so far.
Training unrolls the same chain ("training-time test") for ``block_size`` steps with teacher-
forced tokens and the drafter's own hidden states, loss weight 0.8^step (soft cross-entropy
against the target distribution).

Shares the draft vocabulary, the frozen target embedding / LM head, the checkpoint format and the
trainer with the DSpark drafter.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import probs_from_logits
from .backbone import DrafterLayer
from .base import DraftContext, Proposal, draft_token
from .config import DrafterConfig
from .dspark import DSparkDrafter, DSparkModel


class Eagle3Model(DSparkModel):
    """Same frozen parts, vocabulary and checkpoint code as DSparkModel; its own layer and forward."""

    def __init__(self, config: DrafterConfig, draft_vocab: torch.Tensor | None = None):
        super().__init__(config, draft_vocab)
        c = config
        bb = self.backbone                     # keep fc / fc_norm / norm / rope; one 2d-input layer
        bb.layers = nn.ModuleList([DrafterLayer(c, in_dim=2 * c.hidden_size)])
        del self.mask_embedding
        self.register_parameter("mask_embedding", None)

    def attach(self, embed, lm_head, init_mask: bool = False):
        return super().attach(embed, lm_head, init_mask=False)

    def forward_train(self, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
        """Unrolled chains from every anchor. Returns (None, logits [A, g, Vd], None)."""
        c = self.config
        dev = self.backbone.fc.weight.device       # the inputs follow the drafter's weights
        features, ids, anchors = features.to(dev), ids.to(dev), anchors.to(dev)
        g, L = c.block_size, ids.shape[0]
        layer = cast(DrafterLayer, self.backbone.layers[0])
        rope = self.backbone.rope
        n = int(anchors.max())                      # entries 0..n-1 (entry j reads t_{j+1})
        f = self.backbone.fuse(features[:n].to(self.backbone.fc.weight.dtype))
        e = self.embed_tokens(ids[1:n + 1]).to(f.dtype)
        x0 = torch.cat([e, f], -1)
        h = layer.input_norm(x0)
        pos0 = torch.arange(n, device=dev)
        k0 = layer.keys(h, pos0, rope)
        v0 = layer.v_proj(h).view(n, layer.Hkv, layer.hd)
        # step 0 for all entries (causal), then keep the anchors' chains
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out0 = layer(x0, pos0, rope, k0[:0], v0[:0], causal, residual=f)
        j = anchors - 1                              # the chain of anchor i starts at entry i-1
        A = j.shape[0]
        hs = [out0[j]]
        ks, vs = [], []
        ctx_mask = torch.arange(n, device=dev)[None, :] <= j[:, None]          # [A, n]
        for s in range(1, g):
            tok = ids[(j + s + 1).clamp(max=L - 1)]                # teacher-forced token x_s
            x = torch.cat([self.embed_tokens(tok).to(f.dtype), hs[-1]], -1)
            hn = layer.input_norm(x)
            pos = j + s
            ks.append(layer.keys(hn, pos, rope))
            vs.append(layer.v_proj(hn).view(A, layer.Hkv, layer.hd))
            hs.append(self._chain_attend(layer, rope, x, hn, pos, k0, v0, ctx_mask, ks, vs, hs[-1]))
        hid = self.backbone.norm(torch.stack(hs, 1))                # [A, g, d]
        return hid, self.base_logits(hid), None

    @staticmethod
    def _chain_attend(layer, rope, x, hn, pos, k0, v0, ctx_mask, ks, vs, resid):
        """Attention of chain rows to their context entries (masked) and their own chain keys."""
        A = x.shape[0]
        H, Hkv, hd = layer.H, layer.Hkv, layer.hd
        q = layer.queries(hn, pos, rope)
        rep = H // Hkv
        kc = k0.repeat_interleave(rep, 1)                         # [n, H, hd]
        vc = v0.repeat_interleave(rep, 1)
        sc = torch.einsum("ahd,nhd->ahn", q, kc) * hd ** -0.5      # [A, H, n]
        sc = sc.masked_fill(~ctx_mask[:, None, :], float("-inf"))
        kch = torch.stack(ks, 2).repeat_interleave(rep, 1)         # [A, H, s, hd]
        vch = torch.stack(vs, 2).repeat_interleave(rep, 1)
        sd = torch.einsum("ahd,ahsd->ahs", q, kch) * hd ** -0.5
        w = torch.cat([sc, sd], -1).softmax(-1)
        o = torch.einsum("ahn,nhd->ahd", w[..., :sc.shape[-1]], vc) + \
            torch.einsum("ahs,ahsd->ahd", w[..., sc.shape[-1]:], vch)
        x2 = resid + layer.o_proj(o.reshape(A, H * hd))
        hh = layer.post_norm(x2)
        return x2 + layer.down_proj(F.silu(layer.gate_proj(hh)) * layer.up_proj(hh))


class Eagle3Drafter(DSparkDrafter):
    """Serving: the drafter cache holds entries [embed(t_{j+1}); fuse(f_j)]; each round ingests
    the new verified positions (their last output is the first draft step), then chains."""

    def _serving_weights(self) -> None:
        pass   # one causal layer run by ``_run``; the parallel backbone's fused layout is not used

    def compile(self) -> str:
        return self.build_graphs()[1]

    def build_graphs(self) -> tuple[None, str]:
        return None, f"eager {self.name} drafter (its draft chain is not compiled)"

    def _ingest_and_first(self, contexts: list[DraftContext]) -> torch.Tensor:
        m = self.model
        outs = []
        for ctx in contexts:
            slot = self._slot(ctx)
            assert self.cache is not None       # _slot() allocated it
            f = torch.cat(ctx.features) if len(ctx.features) > 1 else ctx.features[0]
            ctx.features.clear()
            start = self.cache.lengths[slot]
            n = f.shape[0]
            if start + n != len(ctx.tokens) - 1:
                raise RuntimeError("drafter context out of step with the request")
            fu = m.backbone.fuse(f.to(m.backbone.fc.weight.dtype))
            e = m.embed_tokens(torch.tensor(ctx.tokens[start + 1:start + n + 1], device=self.device)).to(fu.dtype)
            out = self._run(slot, torch.cat([e, fu], -1), fu, start)
            outs.append(out[-1])
        return torch.stack(outs)

    def _run(self, slot: int, x: torch.Tensor, resid: torch.Tensor, start: int) -> torch.Tensor:
        """Rows x at positions start.. for one request: append their keys to its cache, attend causally."""
        layer, rope = cast(DrafterLayer, self.model.backbone.layers[0]), self.model.backbone.rope
        assert self.cache is not None           # the slot came from _slot()
        n = x.shape[0]
        pos = torch.arange(start, start + n, device=self.device)
        h = layer.input_norm(x)
        q = layer.queries(h, pos, rope)
        k = layer.keys(h, pos, rope)
        v = layer.v_proj(h).view(n, layer.Hkv, layer.hd)
        self.cache.check_room(slot, n)
        self.cache.k[0][slot, :, start:start + n] = k.transpose(0, 1)
        self.cache.v[0][slot, :, start:start + n] = v.transpose(0, 1)
        self.cache.lengths[slot] = start + n
        end = start + n
        mask = torch.arange(end, device=self.device)[None, :] <= pos[:, None]
        a = F.scaled_dot_product_attention(q.transpose(0, 1).to(self.kv_dtype), self.cache.k[0][slot, :, :end],
                                           self.cache.v[0][slot, :, :end], attn_mask=mask, enable_gqa=True)
        x2 = resid + layer.o_proj(a.transpose(0, 1).reshape(n, -1).to(x.dtype))
        hh = layer.post_norm(x2)
        return x2 + layer.down_proj(F.silu(layer.gate_proj(hh)) * layer.up_proj(hh))

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        m = self.model
        h_all = self._ingest_and_first(contexts)      # every request keeps its cache in step
        results = {id(c): Proposal.empty() for c in contexts}
        active = [(i, c) for i, c in enumerate(contexts) if c.num_draft > 0]
        V, vocab = self.config.vocab_size, m.draft_vocab
        for i, c in active:
            slot = self._slot(c)
            assert self.cache is not None       # _ingest_and_first() allocated the slot
            base = self.cache.lengths[slot]
            steps = min(self.block_size, c.num_draft)
            h = h_all[i]
            toks, probs = [], torch.zeros(steps, V, device=self.device)
            for s in range(steps):
                logits = m.base_logits(m.backbone.norm(h)[None]).float()[0]
                p = probs_from_logits(logits, c.params)
                t = draft_token(p, c, s, ids=vocab)
                probs[s, vocab] = p
                toks.append(int(vocab[t]))
                if s + 1 < steps:
                    x = torch.cat([m.embed_tokens(torch.tensor([toks[-1]], device=self.device)).to(h.dtype), h[None]], -1)
                    h = self._run(slot, x, h[None], base + s)[0]
            self.cache.truncate(slot, base)          # chain entries are temporary
            results[id(c)] = Proposal(torch.tensor(toks), probs)
        return [results[id(c)] for c in contexts]
