"""Cost of a training anchor, side by side in one process: the cached recipe, online training, and
online training with the loss through plain autograd.

* cached: the target's features and last hidden states read from a disk cache (``dspark cache``),
  64 random anchors per sequence, every block of a sequence in one forward under a dense mask over
  [context; all blocks] (the trainer's path before block attention);
* online: the target runs inside training (one ragged forward over the step's sequences), every
  answer position an anchor, block attention (each block against its context and itself);
* online-autograd: online, with the distillation terms as plain autograd over [rows, draft
  vocabulary] fp32 tensors instead of training/losses.py's written-out gradients.

Both run the same sequences (ShareGPT answers and standard-library code under the chat template,
``dspark train --corpus``'s sources), the same drafter and loss; the paths are alternated
``--repeats`` times and the per-part times summed. Prints one JSON line per repeat and a table.

    python scripts/train_cost.py --sequences 16 --repeats 2 --paths cached,online,online-autograd
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from unittest.mock import patch

import torch
import torch.nn.functional as F

from dspark.drafters import backbone
from dspark.drafters.config import DrafterConfig, default_layer_ids, pick_mask_token
from dspark.drafters.dspark import DSparkModel
from dspark.runtime.loading import load_target
from dspark.training import corpus, trainer
from dspark.training.cache import CacheReader, OnlineSource, build_cache
from dspark.training.trainer import LOSSES, build_draft_vocab, feature_scale, sample_anchors, sequence_loss


def dense_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors):
    """The former path: one softmax over [context; every block of the sequence] under a mask."""
    A, C = anchors.shape[0], k_ctx.shape[0]
    g = q.shape[0] // A
    ctx_ok = torch.arange(C)[None, :] < anchors.repeat_interleave(g)[:, None]
    blk = torch.arange(A).repeat_interleave(g)
    mask = torch.cat([ctx_ok, blk[:, None] == blk[None, :]], 1)
    k = torch.cat([k_ctx, k_blk]).transpose(0, 1)
    v = torch.cat([v_ctx, v_blk]).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)


def autograd_loss(logits, positions, weights, gt, pt=None, pt_out=None, conf_logits=None,
                  ce_weight=0.1, l1_weight=0.9, bce_weight=1.0, kl_weight=0.0):
    """losses.drafter_loss's terms as plain autograd over [N, Vd] fp32 tensors."""
    logp = logits.float().log_softmax(-1)
    w = weights.to(logp.device)[positions]
    wsum = w.sum().clamp_min(1e-12)
    vd = logits.shape[-1]
    ce = torch.where(gt < vd, -logp.gather(-1, gt.clamp(max=vd - 1)[:, None]).squeeze(-1), torch.zeros_like(w))
    loss = ce_weight * (w * ce).sum() / wsum
    if pt is None:
        return loss, {}
    l1 = (logp.exp() - pt).abs().sum(-1) + pt_out
    accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    loss = loss + l1_weight * (w * l1).sum() / wsum
    if kl_weight:
        loss = loss + kl_weight * (w * (torch.xlogy(pt, pt) - pt * logp).sum(-1)).sum() / wsum
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        loss = loss + bce_weight * (w * bce).sum() / wsum
    return loss, {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--loss", default="tv", choices=sorted(LOSSES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="cached,online,online-autograd")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not paths or set(paths) - {"cached", "online", "online-autograd"}:
        ap.error("--paths: a comma-separated subset of cached, online, online-autograd")
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", dtype="bf16")
    tok, tc = target.tokenizer, target.model.config
    rows, _, _ = corpus.build(tok, {"chat": 0.5, "code": 0.5}, args.sequences * 250, max_len=args.max_len,
                              heldout_rows=0, log=lambda m: None)
    rows = rows[:args.sequences]
    layers = default_layer_ids(tc.num_layers)
    online = OnlineSource(rows, target, layers, max_len=args.max_len)
    tmp = tempfile.mkdtemp(prefix="dspark-train-cost-")
    as_regen = [{"id": r.id, "prompt_ids": list(r.ids[:r.start]), "answer_ids": list(r.ids[r.start:])} for r in rows]
    build_cache(as_regen if "cached" in paths else as_regen[:1], target, tmp, layers, max_len=args.max_len,
                progress=False, log=lambda m: None)     # the feature scale below reads the cache
    cached = CacheReader(tmp)
    cfg = DrafterConfig(kind="dspark", hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_hidden_layers=2, num_attention_heads=tc.num_heads, num_key_value_heads=tc.num_kv_heads,
                        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, target_layer_ids=layers,
                        mask_token_id=pick_mask_token(tok), vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
                        qk_norm=True)
    model = DSparkModel(cfg, build_draft_vocab(online, 8192, tc.vocab_size)).attach(
        target.model.embed, target.model.lm_head, init_mask=True)
    model.backbone.feature_scale.copy_(feature_scale(cached))
    weights = torch.tensor([1.0] * cfg.block_size)

    def run(name: str) -> dict:
        t: dict = defaultdict(float)
        anchors_total = 0
        t0 = time.perf_counter()
        if name != "cached":
            online.prefetch(range(len(online)))
        t["target"] = time.perf_counter() - t0
        src = cached if name == "cached" else online
        dense = patch.object(backbone, "block_attention", dense_block_attention) if name == "cached" else nullcontext()
        plain = patch.object(trainer, "drafter_loss", autograd_loss) if name == "online-autograd" else nullcontext()
        with dense, plain:
            for i in range(len(src)):
                a = time.perf_counter()
                seq = src[i]
                t["read"] += time.perf_counter() - a
                anchors = sample_anchors(seq.loss_mask, 64 if name == "cached" else 0, torch.Generator().manual_seed(i))
                anchors_total += anchors.numel()
                a = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss, _ = sequence_loss(model, seq, anchors, weights, "dspark", args.loss)
                t["forward+loss"] += time.perf_counter() - a
                a = time.perf_counter()
                loss.backward()
                t["backward"] += time.perf_counter() - a
        model.zero_grad(set_to_none=True)
        total = time.perf_counter() - t0
        return {"path": name, "anchors": anchors_total, "seconds": round(total, 2),
                "ms_per_anchor": round(1e3 * total / anchors_total, 3), **{k: round(v, 2) for k, v in t.items()}}

    results = defaultdict(list)
    run("online")                               # warm-up: allocator, RoPE tables
    for r in range(args.repeats):
        for name in (paths if r % 2 == 0 else paths[::-1]):
            res = run(name)
            results[name].append(res)
            print(json.dumps(res), flush=True)
    print("| path | anchors per pass | ms per anchor | target forward s | read s | forward+loss s | backward s |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        n = len(rs)
        print(f"| {name} | {rs[0]['anchors']} | {sum(r['ms_per_anchor'] for r in rs) / n:.3f} | "
              f"{sum(r['target'] for r in rs) / n:.2f} | {sum(r['read'] for r in rs) / n:.2f} | "
              f"{sum(r['forward+loss'] for r in rs) / n:.2f} | {sum(r['backward'] for r in rs) / n:.2f} |")


if __name__ == "__main__":
    main()
