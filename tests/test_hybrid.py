"""The n-gram / trained hybrid (drafters/hybrid.py): lossless when both kinds of proposal are
verified in one run, greedy equal to plain decoding, and its name's syntax."""

import pytest
import torch

from dspark.drafters import HybridDrafter, NgramDrafter, load_drafter
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.errors import UsageError
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import FixedPolicy

from _lossless import chi2_pvalue, exact_law
from _tiny import VOCAB, tiny_drafter_model, tiny_target


def _hybrid(target, min_match=2):
    model = DSparkDrafter(tiny_drafter_model(target, scale=2.0), target)
    # no history: which part serves a round depends on the request's own sampled text only
    return HybridDrafter(NgramDrafter(block_size=3, history_tokens=0), model, min_match=min_match)


def _run(target, drafter, prompt, params_list, n_new, block=3):
    engine = Engine(target, drafter, FixedPolicy(block), max_requests=32, block_size=block,
                    max_len=len(prompt) + n_new + block + 2)
    reqs = [engine.add_request(prompt, p, n_new, exact_seed=False) for p in params_list]   # rejection sampling
    engine.run()
    return reqs


def test_sampled_output_has_target_distribution_with_both_parts_serving():
    target = tiny_target(scale=3.0)
    hybrid = _hybrid(target)
    prompt, n_new, draws = [2, 0, 1, 4, 3, 0, 2], 4, 3000
    params = SamplingParams(temperature=1.0, top_k=4)
    reqs = _run(target, hybrid, prompt, [SamplingParams(temperature=1.0, top_k=4, seed=s) for s in range(draws)],
                n_new)
    lookup, model = hybrid.served
    assert lookup > draws // 5 and model > draws // 2, f"one part barely served: {hybrid.served}"
    assert sum(r.stats.num_accepted_tokens for r in reqs) > draws * 0.3
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert chi2_pvalue(counts, exact_law(target, prompt, n_new, params, VOCAB)) > 1e-3


def test_greedy_equals_plain_and_the_lookup_skips_the_model():
    target = tiny_target(seed=2)
    greedy = SamplingParams(temperature=0)
    for prompt in ([1, 2, 3, 1, 2], [4, 4, 1, 0, 2], [3]):
        plain = _run(target, None, prompt, [greedy], 12, 0)[0].output_ids
        hybrid = _hybrid(target)
        calls = []
        inner = hybrid.model.propose
        hybrid.model.propose = lambda ctxs: calls.append(len(ctxs)) or inner(ctxs)
        assert _run(target, hybrid, prompt, [greedy], 12)[0].output_ids == plain
        assert len(calls) == hybrid.served[1] and all(n == 1 for n in calls)


@pytest.mark.parametrize("spec", ["dspark+ngram", "ngram+", "ngram+ngram", "ngram+plain", "ngram+a+b"])
def test_bad_hybrid_names_are_clear_errors(spec):
    target = tiny_target()

    class T:
        name, model = "tiny", target
    with pytest.raises(UsageError, match="ngram"):
        load_drafter(spec, T())


def test_min_match_is_checked():
    with pytest.raises(ValueError):
        HybridDrafter(NgramDrafter(), NgramDrafter(), min_match=0)


def test_auto_is_the_hybrid_where_a_trained_dspark_exists(target_fp32):
    class Untrained:
        name, model = "tiny", tiny_target()
    assert isinstance(load_drafter("auto", Untrained()), NgramDrafter)
    auto = load_drafter("auto", target_fp32)
    assert isinstance(auto, HybridDrafter) and auto.name == "ngram+dspark" and auto.min_match == 1
