"""Trained drafters (DSpark with each head, DFlash, EAGLE-3-style) through the engine.

Lossless: on a tiny random target, sampled output through the whole loop (target features handed
to the drafter, block forward, sequential sampling, verification, rollback) has the target's law,
for every drafter kind, with a draft vocabulary that leaves a token out. Greedy: the output equals
plain decoding. Checkpoints round-trip through config.json + model.safetensors.
"""

import json

import pytest
import torch

from dspark.drafters import load_drafter
from dspark.drafters.dspark import DSparkDrafter, DSparkModel
from dspark.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from dspark.engine import Engine
from dspark.errors import DsparkError, UsageError
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import FixedPolicy

from _lossless import chi2_pvalue, exact_law
from _tiny import VOCAB, as_target, tiny_drafter_model, tiny_target

KINDS = [("dspark", "vanilla"), ("dspark", "gated"), ("dspark", "rnn"), ("dflash", "none"), ("eagle3", "none")]


def _drafter(target, kind, head, vocab=None):
    model = tiny_drafter_model(target, kind, head, draft_vocab=vocab, scale=2.0)
    cls = Eagle3Drafter if kind == "eagle3" else DSparkDrafter
    return cls(model, target)


def _run_many(target, drafter, prompt, params_list, n_new, block, concurrency=32):
    engine = Engine(target, drafter, FixedPolicy(block), max_requests=concurrency, block_size=block,
                    max_len=len(prompt) + n_new + block + 2)
    reqs = [engine.add_request(prompt, p, n_new, exact_seed=False) for p in params_list]   # rejection sampling
    engine.run()
    return reqs


@pytest.mark.parametrize("kind,head", KINDS)
def test_sampled_output_has_target_distribution(kind, head):
    # target and drafter weights are scaled so that drafts are often accepted yet differ from the
    # target: sampling drafts from p^3 instead of p is then rejected with p-values below 1e-60
    target = tiny_target(scale=3.0)
    drafter = _drafter(target, kind, head, vocab=torch.tensor([0, 1, 2, 4]))   # token 3 never drafted
    prompt, n_new, draws = [1, 3, 2, 4], 4, 3000
    params = SamplingParams(temperature=1.0, top_k=4)
    reqs = _run_many(target, drafter, prompt,
                     [SamplingParams(temperature=1.0, top_k=4, seed=s) for s in range(draws)], n_new, 3)
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    assert accepted > draws * 0.3, f"{kind}: too few accepted drafts ({accepted}) to test anything"
    assert max(len(r.stats.accepted_per_position) for r in reqs) >= 2, "never drafted 2 tokens"
    assert chi2_pvalue(counts, exact_law(target, prompt, n_new, params, VOCAB)) > 1e-3


@pytest.mark.parametrize("kind,head", KINDS)
def test_greedy_equals_plain(kind, head):
    target = tiny_target(seed=2)
    prompts = [[1, 2, 3], [4, 4, 1, 0, 2], [3]]
    greedy = SamplingParams(temperature=0)
    plain = _run_many(target, None, prompts[0], [greedy], 12, 0)  # warm: plain engine
    for p in prompts:
        plain = _run_many(target, None, p, [greedy], 12, 0)[0].output_ids
        spec = _run_many(target, _drafter(target, kind, head), p, [greedy], 12, 3)[0].output_ids
        assert spec == plain


def test_confidences_are_probabilities_and_depend_on_the_drafted_prefix():
    target = tiny_target()
    drafter = _drafter(target, "dspark", "vanilla")
    engine = Engine(target, drafter, FixedPolicy(3), max_requests=2, block_size=3, max_len=32)
    seen = []
    orig = drafter.propose

    def spy(contexts):
        out = orig(contexts)
        seen.extend(out)
        return out
    drafter.propose = spy
    for s in range(2):
        engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=s), 10)
    engine.run()
    confs = torch.cat([p.confidences for p in seen if p.confidences is not None and len(p)])
    assert confs.numel() > 0 and bool(((confs > 0) & (confs < 1)).all())
    assert confs.unique().numel() > 3


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_checkpoint_round_trip_and_loading_by_path(tmp_path, kind):
    target = tiny_target()
    model = tiny_drafter_model(target, kind, "rnn" if kind == "dspark" else "none", draft_vocab=torch.tensor([0, 2, 3, 4]))
    model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                "num_hidden_layers", "architectures"):
        assert key in cfg
    assert cfg["architectures"][0].endswith("Drafter")
    cls = Eagle3Model if kind == "eagle3" else DSparkModel
    back = cls.load(tmp_path)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2
        assert torch.equal(a.to(torch.bfloat16).float(), b.float()) if a.is_floating_point() else torch.equal(a, b)
    d = load_drafter(str(tmp_path), as_target(target))
    assert isinstance(d, Eagle3Drafter if kind == "eagle3" else DSparkDrafter)


def test_corrupt_or_mismatched_checkpoint_is_a_clear_error(tmp_path):
    target = tiny_target()
    tiny_drafter_model(target).save(tmp_path)
    big = tiny_target(vocab=VOCAB + 2)
    with pytest.raises(UsageError, match="trained for"):
        load_drafter(str(tmp_path), as_target(big, "other"))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(DsparkError, match="cannot read drafter weights"):
        load_drafter(str(tmp_path), as_target(target))


def test_unknown_trained_name_says_how_to_build_it():
    target = tiny_target()
    with pytest.raises(UsageError, match="dspark train --recipe eagle3"):
        load_drafter("eagle3", as_target(target, "no-such-target"))


@pytest.mark.parametrize("kind,head,qk_norm", [("dspark", "vanilla", False), ("dspark", "vanilla", True),
                                               ("dspark", "rnn", False), ("dflash", "none", True)])
def test_serving_block_equals_the_training_forward(kind, head, qk_norm):
    """What the drafter learns is what it serves: the block the serving path proposes (context cache
    fed by the engine's feature rows, RoPE positions, sequential head, confidences) equals the
    training forward (features of one full-sequence target forward, as the cache stores them) with
    the drafted tokens as teacher-forced inputs."""
    from dspark.drafters.base import DraftContext
    target = tiny_target(scale=3.0)
    model = tiny_drafter_model(target, kind, head, scale=2.0, qk_norm=qk_norm)
    with torch.no_grad():
        model.backbone.feature_scale.uniform_(0.5, 2.0)
        for layer in model.backbone.layers if qk_norm else ():
            layer.q_norm.weight.uniform_(0.5, 2.0)
            layer.k_norm.weight.uniform_(0.5, 2.0)
    drafter = DSparkDrafter(model, target)
    ids = [1, 3, 2, 4, 0, 2, 1, 3, 4, 2]
    a = 6                                                   # the anchor: ids[a] is not verified yet
    kv = target.new_cache(1, 32)
    slot = kv.allocate()
    o = target(torch.tensor(ids), [(slot, len(ids))], kv, feature_layers=(0, 2), logits_rows=None)
    feats = torch.cat(o.features, -1)
    ctx = DraftContext(ids[:a + 1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(3), 3,
                       features=[feats[:3], feats[3:a]])   # handed over in two rounds, as the engine does
    prop = drafter.propose([ctx])[0]
    teacher = torch.tensor(ids[:a + 1] + prop.tokens.tolist())
    with torch.no_grad():
        _, logits, conf = model.forward_train(feats[:a], teacher, torch.tensor([a]))
    for k in range(3):
        assert torch.allclose(prop.probs[k], logits[0, k].softmax(-1), atol=1e-5), k
        if conf is not None:
            assert torch.allclose(prop.confidences[k], torch.sigmoid(conf[0, k]), atol=1e-5), k


def test_serving_batch_over_rounds_equals_the_training_forward():
    """Several requests of different lengths in one batched call, over several rounds (context
    handed over round by round, a request that drafts nothing in a round, blocks of different
    depths): each block equals the training forward of that request alone."""
    from dspark.drafters.base import DraftContext
    target = tiny_target(scale=3.0)
    model = tiny_drafter_model(target, "dspark", "vanilla", scale=2.0, layers=2)
    with torch.no_grad():
        model.backbone.feature_scale.uniform_(0.5, 2.0)
    drafter = DSparkDrafter(model, target)
    drafter.prepare(3, 64)
    seqs = [[1, 3, 2, 4, 0, 2, 1, 3, 4, 2, 2, 1, 0, 3, 1, 4], [4, 4, 1, 0, 2, 3, 3, 1, 2, 0, 1, 2, 4, 3],
            [2, 0, 1, 1, 3, 4, 2, 2, 0, 1, 3, 0, 4, 4, 2]]
    feats = []
    for ids in seqs:
        kv = target.new_cache(1, 32)
        slot = kv.allocate()
        o = target(torch.tensor(ids), [(slot, len(ids))], kv, feature_layers=(0, 2), logits_rows=None)
        feats.append(torch.cat(o.features, -1))
    anchors = [[3, 5, 9], [6, 7, 10], [2, 4, 8]]
    depths = [[3, 2, 3], [0, 3, 1], [2, 3, 3]]
    ctxs = [None] * 3
    for rnd in range(3):
        for i, ids in enumerate(seqs):
            a = anchors[i][rnd]
            if ctxs[i] is None:
                ctxs[i] = DraftContext(ids[:a + 1], SamplingParams(temperature=1.0),
                                       torch.Generator().manual_seed(i), 0, features=[feats[i][:a]])
            else:   # the positions verified since the last round, as the engine hands them over
                c = ctxs[i]
                c.features.append(feats[i][len(c.tokens) - 1:a])
                c.tokens = ids[:a + 1]
            ctxs[i].num_draft = depths[i][rnd]
        props = drafter.propose(ctxs)
        for i, (ids, p) in enumerate(zip(seqs, props)):
            a = anchors[i][rnd]
            assert len(p) == depths[i][rnd]
            if not len(p):
                continue
            teacher = torch.tensor(ids[:a + 1] + p.tokens.tolist())
            with torch.no_grad():
                _, logits, conf = model.forward_train(feats[i][:a], teacher, torch.tensor([a]))
            for k in range(len(p)):
                assert torch.allclose(p.probs[k], logits[0, k].softmax(-1), atol=1e-5), (rnd, i, k)
                assert torch.allclose(p.confidences[k], torch.sigmoid(conf[0, k]), atol=1e-5), (rnd, i, k)
