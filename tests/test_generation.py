"""The generation loop on the real default model (fp32): speculative greedy output equals plain
decoding token for token, seeds fix outputs; and on a tiny random target + draft pair, sampled
output through the whole loop (drafting, cache rollback, verification) has the target's law."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters import DraftLMDrafter, NgramDrafter, load_drafter
from dspark.evaluation.identity import first_divergence, top2_gap
from dspark.generation import generate_ids
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams

from _lossless import chi2_pvalue, exact_law

GREEDY = SamplingParams(temperature=0)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def identity_prompts(bench_prompts):
    """A prompt of each domain (humaneval, gsm8k, mt-bench)."""
    return bench_prompts[0:1] + bench_prompts[3:4] + bench_prompts[6:7]


@pytest.fixture(scope="module")
def plain_outputs(target_fp32, identity_prompts):
    eos = target_fp32.eos_token_ids
    return [generate_ids(target_fp32.model, p, GREEDY, NEW_TOKENS, None, eos_ids=eos)[0]
            for p in identity_prompts]


@pytest.mark.parametrize("drafter_name", ["ngram", "cut:20", "dspark", "ngram+dspark"])
def test_greedy_speculative_equals_plain_decoding(target_fp32, identity_prompts, plain_outputs, drafter_name):
    drafter = load_drafter(drafter_name, target_fp32)
    near_ties, accepted = [], 0
    pairs = list(zip(identity_prompts, plain_outputs))
    if drafter_name.startswith("cut"):   # a draft LM drafts token by token: the code prompt alone
        pairs = pairs[:1]
    for prompt, plain in pairs:
        spec, stats = generate_ids(target_fp32.model, prompt, GREEDY, NEW_TOKENS, drafter,
                                   eos_ids=target_fp32.eos_token_ids)
        accepted += stats.num_accepted_tokens
        i = first_divergence(spec, plain)
        if i is None:
            continue
        gap = top2_gap(target_fp32.model, prompt + plain[:i])
        assert gap < 1e-4, (f"{drafter_name}: output diverges from plain decoding at token {i} "
                            f"where the target's top-2 logits differ by {gap:.2e}")
        near_ties.append((i, gap))
    if near_ties:
        print(f"{drafter_name}: near-tie divergences (token, top-2 gap): {near_ties}")
    assert accepted > 0, "the drafter never had a token accepted: the test exercised nothing"


def test_same_seed_same_output(target_fp32, bench_prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    prompt = bench_prompts[0]
    for name in ("ngram", "cut:8"):
        d = load_drafter(name, target_fp32)
        a = generate_ids(target_fp32.model, prompt, params, 24, d)[0]
        b = generate_ids(target_fp32.model, prompt, params, 24, d)[0]   # the n-gram drafter remembers a
        c = generate_ids(target_fp32.model, prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=99), 24, d)[0]
        assert a == b
        assert a != c


def test_point_mass_drafts_emit_plain_decodings_seeded_tokens(target_fp32, bench_prompts):
    """n-gram drafts are verified by drawing the target's own token per position, one draw per
    emitted token: a seeded request emits exactly what plain decoding emits with that seed."""
    d = load_drafter("ngram", target_fp32)
    accepted = 0
    for prompt in (bench_prompts[0], bench_prompts[3]):      # code and math: the n-gram drafter finds repeats
        params = SamplingParams(temperature=0.8, top_k=50, seed=7)
        plain = generate_ids(target_fp32.model, prompt, params, 48, None)[0]
        spec, stats = generate_ids(target_fp32.model, prompt, params, 48, d)
        assert spec == plain
        accepted += stats.num_accepted_tokens
    assert accepted > 0


def _tiny_pair():
    torch.manual_seed(0)
    cfg = dict(vocab_size=5, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(8.0)  # sharper, context-dependent distributions
        models.append(Decoder.from_hf(m))
    return models


def test_sampled_output_has_target_distribution_through_the_loop():
    target, draft = _tiny_pair()
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = [1, 3, 2]
    n_new, draws = 3, 3000
    drafter = DraftLMDrafter(draft, block_size=2)
    counts = {}
    g_params = [SamplingParams(temperature=1.0, top_k=4, seed=s) for s in range(draws)]
    for gp in g_params:
        out, _ = generate_ids(target, prompt, gp, n_new, drafter)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert chi2_pvalue(counts, exact_law(target, prompt, n_new, params, 5)) > 1e-3


def test_ngram_lookup_prefers_longest_most_recent_match():
    from dspark.drafters.ngram import lookup
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    cont, n = lookup(toks, 3, max_ngram=3)
    assert (cont.tolist(), n) == ([7, 8, 5], 2)   # suffix "2 3" last seen before "7 8 5"
    assert lookup(np.array([4, 5, 6]), 3)[0].tolist() == []
    assert lookup(np.array([4, 5, 4, 9, 9, 9, 4]), 9)[0].tolist() == [9, 9, 9, 4]  # weak 1-token match
    d = NgramDrafter(block_size=4)
    from dspark.drafters import DraftContext
    prop = d.propose([DraftContext([1, 2, 3, 4, 1, 2], GREEDY, None, 4)])[0]
    assert prop.tokens.tolist() == [3, 4, 1, 2] and prop.probs is None
    assert prop.evidence == 2 and prop.truncate(2).evidence == 2   # the matched suffix "1 2": its strength
    weak = NgramDrafter(block_size=9, weak_match_tokens=3).propose(
        [DraftContext([4, 5, 4, 9, 9, 9, 4], GREEDY, None, 9)])[0]
    assert weak.tokens.tolist() == [9, 9, 9] and weak.evidence == 1  # a 1-token match: at most weak_match_tokens
    # vote: "1" was followed by 2 twice and by 7 once; the most recent "1 -> 2" wins over "1 -> 7"
    assert lookup(np.array([1, 2, 5, 1, 2, 6, 1, 7, 3, 1]), 2)[0].tolist() == [2, 6]


def test_ngram_history_of_earlier_requests():
    from dspark.drafters import DraftContext

    def propose(d, toks, k=4):
        return d.propose([DraftContext(list(toks), GREEDY, None, k)])[0].tokens.tolist()

    d = NgramDrafter(block_size=4)
    assert propose(d, [20, 11, 12]) == []
    d.release(DraftContext([10, 11, 12, 13, 14], GREEDY, None, 0))
    assert propose(d, [20, 11, 12]) == [13, 14]        # a 2-token match in the history; stops at its end
    assert propose(d, [30, 12]) == []                  # a 1-token match there is too weak to follow
    assert propose(d, [7, 12, 9, 11, 12]) == [13, 14]  # longer match in the history beats "12" of its own
    assert propose(d, [11, 12, 50, 11, 12]) == [50, 11, 12]   # at equal length its own text wins
    d.release(DraftContext([40, 11, 12, 60, 61, 62], GREEDY, None, 0))
    assert propose(d, [20, 11, 12]) == [60, 61, 62]    # the most recent occurrence (tied vote)
    small = NgramDrafter(block_size=4, history_tokens=4)
    small.release(DraftContext([10, 11, 12, 13, 14], GREEDY, None, 0))
    assert propose(small, [20, 11, 12]) == []          # only the newest 4 tokens are kept
    assert propose(small, [20, 13, 14]) == []          # ... and "13 14" ends its request: nothing follows
    off = NgramDrafter(block_size=4, history_tokens=0)
    off.release(DraftContext([10, 11, 12, 13, 14], GREEDY, None, 0))
    assert propose(off, [20, 11, 12]) == []


def test_generate_batch_equals_one_prompt_at_a_time(target_fp32):
    """dspark.generate_batch: every prompt through one engine, 2 at a time: greedy outputs equal
    dspark.generate's, in the order given; a seed gives prompt i the output of seed + i alone (n-gram
    drafts are verified by the target's own draws, so each equals plain decoding with its seed);
    bad input is a usage error."""
    import dspark
    from dspark.errors import UsageError
    prompts = ["def add(a, b):", "The three primary colours are", "1, 2, 3, 4,"]
    batch = dspark.generate_batch(prompts, target=target_fp32, drafter="ngram", max_new_tokens=20,
                                  max_concurrency=2, policy="fixed", sampling=GREEDY)
    for p, res in zip(prompts, batch):
        one = dspark.generate(p, target=target_fp32, drafter="ngram", max_new_tokens=20, sampling=GREEDY)
        assert res.token_ids == one.token_ids and res.text == one.text and res.drafter == "ngram"
    assert sum(r.num_accepted_tokens for r in batch) > 0
    # chat prompts one at a time: each after the first reuses the template's shared start (prefix caching)
    chats = dspark.generate_batch(prompts[:2], target=target_fp32, drafter="ngram", max_new_tokens=12, chat=True,
                                  max_concurrency=1, policy="fixed", sampling=GREEDY)
    for p, res in zip(prompts, chats):
        one = dspark.generate(p, target=target_fp32, drafter="ngram", max_new_tokens=12, chat=True, sampling=GREEDY)
        assert res.token_ids == one.token_ids
    assert [r.num_cached_tokens for r in chats] == [0, 24]
    seeded = dspark.generate_batch(prompts, target=target_fp32, drafter="ngram", max_new_tokens=12,
                                   sampling=SamplingParams(temperature=1.0, seed=5))
    for i, (p, res) in enumerate(zip(prompts, seeded)):
        alone = dspark.generate(p, target=target_fp32, drafter="plain", max_new_tokens=12,
                                sampling=SamplingParams(temperature=1.0, seed=5 + i))
        assert res.token_ids == alone.token_ids
    for bad, needle in [(dict(prompts=[]), "non-empty list"), (dict(prompts="hi"), "non-empty list"),
                        (dict(prompts=["hi"], max_concurrency=0), "max_concurrency"),
                        (dict(prompts=["hi"], policy="nope"), "policy"), (dict(prompts=[""]), "prompt is empty")]:
        with pytest.raises(UsageError, match=needle):
            dspark.generate_batch(target=target_fp32, **bad)
