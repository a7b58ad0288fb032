"""The engine: continuous batching over a ragged batch, lossless under concurrency, memory freed
at once, admission queues when the cache is full."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters import DraftLMDrafter, NgramDrafter
from dspark.engine import Engine, RequestOptions
from dspark.errors import UsageError
from dspark.evaluation.identity import first_divergence, top2_gap
from dspark.generation import generate_ids
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import FixedPolicy, MTP1Policy

from _lossless import CyclingPolicy, chi2_pvalue, exact_law

GREEDY = SamplingParams(temperature=0)


def _tiny(seed, vocab=5, scale=8.0):
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return Decoder.from_hf(m)


def test_concurrent_greedy_equals_batch_1(target_fp32, bench_prompts):
    """8 requests of different lengths joining at different steps, n-gram drafts of varying
    lengths, all in one ragged forward per step: each output equals its batch-1 output."""
    new = 32
    eos = target_fp32.eos_token_ids
    solo = [generate_ids(target_fp32.model, p, GREEDY, new, None, eos_ids=eos)[0] for p in bench_prompts]
    engine = Engine(target_fp32.model, NgramDrafter(block_size=6), FixedPolicy(), max_requests=8,
                    max_len=1024, eos_ids=eos, prefill_chunk=96)
    reqs = []
    for step in range(40):
        if step % 2 == 0 and len(reqs) < len(bench_prompts):   # a new request every other step
            reqs.append(engine.add_request(bench_prompts[len(reqs)], GREEDY, new))
        engine.step()
    engine.run()
    assert engine.num_steps > 0
    for r, ref in zip(reqs, solo):
        if r.output_ids != ref:
            i = first_divergence(r.output_ids, ref)
            gap = top2_gap(target_fp32.model, r.prompt_ids + ref[:i])
            assert gap < 1e-4, f"request {r.id} diverges at token {i} (top-2 gap {gap:.2e})"
            print(f"near tie at token {i}, gap {gap:.2e}")
    assert sum(r.stats.num_accepted_tokens for r in reqs) > 0


def test_sampling_through_engine_with_concurrency_keeps_target_distribution():
    target, draft = _tiny(0), _tiny(1)
    params = SamplingParams(temperature=1.0)
    prompt, n_new, draws, conc = [1, 3, 2], 3, 3000, 6
    gen_len = 7  # generate 7 tokens, test the law of the first 3 (so blocks of 3 are verified)
    policy = CyclingPolicy()
    engine = Engine(target, DraftLMDrafter(draft, block_size=3), policy, max_requests=conc,
                    max_len=24)
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s), gen_len) for s in range(draws)]
    max_running = 0
    while engine.has_work():
        engine.step()
        max_running = max(max_running, len(engine.running))
    assert max_running == conc
    assert {1, 2, 3} <= policy.used, f"verification lengths used: {policy.used}"
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids[:n_new])] = counts.get(tuple(r.output_ids[:n_new]), 0) + 1
    assert chi2_pvalue(counts, exact_law(target, prompt, n_new, params, 5)) > 1e-3


def test_logprobs_are_the_targets_at_every_emitted_position():
    """With ``logprobs``, each emitted token carries the target's log-softmax (raw logits) at its
    position and the most likely tokens in order, whether it was an accepted draft, a correction,
    a bonus or the first token after prefill; ``prompt_logprobs`` does the same for the prompt's
    tokens after the first, across prefill chunks; requests without them record nothing."""
    target, draft = _tiny(0, vocab=11, scale=2.0), _tiny(1, vocab=11, scale=2.0)
    engine = Engine(target, DraftLMDrafter(draft, block_size=3), FixedPolicy(), max_requests=3, max_len=64,
                    prefill_chunk=4)
    prompts = [[1, 3, 2, 5, 7, 1], [4], [2, 2, 9]]
    reqs = [engine.add_request(p, SamplingParams(temperature=1.0, seed=s), 20, logprobs=3, prompt_logprobs=2)
            for s, p in enumerate(prompts)]
    bare = engine.add_request([3, 4], SamplingParams(temperature=1.0, seed=9), 8)
    engine.run()
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    assert 10 < accepted < sum(r.stats.num_draft_tokens for r in reqs)    # accepted drafts and corrections
    assert bare.output_logprobs == [] and bare.prompt_logprobs_out == []
    for r in reqs:
        ids = r.prompt_ids + r.output_ids
        cache = target.new_cache(1, len(ids) + 1)
        every = torch.log_softmax(target(torch.tensor(ids), [(cache.allocate(), len(ids))], cache,
                                         logits_rows=torch.arange(len(ids) - 1)).logits.float(), -1)
        prompt, ref = every[:len(r.prompt_ids) - 1], every[len(r.prompt_ids) - 1:]
        assert len(r.prompt_logprobs_out) == len(r.prompt_ids) - 1
        for k, (t, (lp, top)) in enumerate(zip(r.prompt_ids[1:], r.prompt_logprobs_out)):
            assert lp == pytest.approx(float(prompt[k, t]), abs=1e-5), k
            assert [i for i, _ in top] == prompt[k].topk(2).indices.tolist()
        assert len(r.output_logprobs) == len(r.output_ids)
        for k, (t, (lp, top)) in enumerate(zip(r.output_ids, r.output_logprobs)):
            assert lp == pytest.approx(float(ref[k, t]), abs=1e-5), k
            best = ref[k].topk(3)
            assert [i for i, _ in top] == best.indices.tolist()
            assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-5)
    with pytest.raises(UsageError, match="logprobs"):
        engine.add_request([1], GREEDY, 2, logprobs=-1)


def test_penalties_keep_the_penalised_targets_distribution():
    """A logit bias with presence, frequency and repetition penalties through drafting: the output
    follows the target's processed law (each verified row penalised for the output plus the drafts before it), under
    verification lengths that vary; greedy with penalties equals plain decoding with them."""
    target, draft = _tiny(0), _tiny(1)
    params = dict(temperature=1.0, presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=2.0,
                  logit_bias=((4, 1.5),))
    prompt, n_new, draws = [1, 3, 2], 3, 3000
    policy = CyclingPolicy()
    engine = Engine(target, DraftLMDrafter(draft, block_size=3), policy, max_requests=6, max_len=24)
    reqs = [engine.add_request(prompt, SamplingParams(seed=s, **params), 5) for s in range(draws)]
    engine.run()
    assert {1, 2, 3} <= policy.used, f"verification lengths used: {policy.used}"
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids[:n_new])] = counts.get(tuple(r.output_ids[:n_new]), 0) + 1
    penalised = SamplingParams(**params)
    law = exact_law(target, prompt, n_new, penalised, 5)
    assert chi2_pvalue(counts, law) > 1e-3
    unpenalised = exact_law(target, prompt, n_new, SamplingParams(temperature=1.0), 5)
    assert chi2_pvalue(counts, unpenalised) < 1e-6, "the penalties changed nothing: the test shows nothing"
    greedy = SamplingParams(temperature=0, frequency_penalty=1.5, repetition_penalty=1.3, logit_bias=((5, 0.7),))
    big, big_draft = _tiny(0, vocab=11, scale=2.0), _tiny(1, vocab=11, scale=2.0)
    accepted, changed = 0, 0
    for p in ([1, 2, 3], [4, 4, 4, 4], [7]):
        plain = generate_ids(big, p, greedy, 16, None)[0]
        spec, stats = generate_ids(big, p, greedy, 16, DraftLMDrafter(big_draft, block_size=3))
        assert spec == plain
        accepted += stats.num_accepted_tokens
        changed += plain != generate_ids(big, p, GREEDY, 16, None)[0]
    assert accepted > 0 and changed > 0


def test_min_tokens_rules_out_stop_tokens_and_keeps_the_law():
    """Before ``min_tokens`` the stop tokens have probability 0: drafted ones are rejected, and the
    first tokens fit the target's law with them ruled out (chi-square, varying verification
    lengths); afterwards a stop token ends the request again."""
    target, draft = _tiny(0), _tiny(1)
    prompt, n_new, draws, stop = [1, 3, 2], 3, 3000, 0
    policy = CyclingPolicy()
    engine = Engine(target, DraftLMDrafter(draft, block_size=3), policy, max_requests=6, max_len=40)
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s), 12, stop_ids={stop}, min_tokens=n_new)
            for s in range(draws)]
    engine.run()
    assert {1, 2, 3} <= policy.used
    counts = {}
    for r in reqs:
        assert stop not in r.output_ids[:n_new] and len(r.output_ids) >= n_new
        counts[tuple(r.output_ids[:n_new])] = counts.get(tuple(r.output_ids[:n_new]), 0) + 1
    law = exact_law(target, prompt, n_new, SamplingParams(temperature=1.0), 5, banned=[stop])
    assert chi2_pvalue(counts, law) > 1e-3
    assert sum(r.finish_reason == "stop" for r in reqs) > draws / 4     # the stop token still ends them
    assert sum(r.stats.num_accepted_tokens for r in reqs) > 0
    big, big_draft = _tiny(0, vocab=11, scale=2.0), _tiny(1, vocab=11, scale=2.0)    # greedy: plain's
    for p in ([1, 2, 3], [4, 4], [7]):
        stops = {int(generate_ids(big, p, GREEDY, 3, None)[0][1])}   # a token plain greedy emits early
        plain_e = Engine(big, None, max_requests=1, max_len=64)
        spec_e = Engine(big, DraftLMDrafter(big_draft, block_size=3), max_requests=1, max_len=64)
        a = plain_e.add_request(p, GREEDY, 16, stop_ids=stops, min_tokens=8)
        b = spec_e.add_request(p, GREEDY, 16, stop_ids=stops, min_tokens=8)
        plain_e.run()
        spec_e.run()
        assert a.output_ids == b.output_ids and len(a.output_ids) >= 8
        assert not stops & set(a.output_ids[:8])
    with pytest.raises(UsageError, match="min_tokens"):
        engine.add_request(prompt, GREEDY, 4, min_tokens=-1)
    with pytest.raises(UsageError, match="stop token ids"):
        engine.add_request(prompt, GREEDY, 4, stop_ids={99})


def test_cancel_frees_memory_at_once():
    target, draft = _tiny(0, vocab=11), _tiny(1, vocab=11)
    drafter = DraftLMDrafter(draft, block_size=2)
    engine = Engine(target, drafter, max_requests=2, max_len=64)
    a = engine.add_request([1, 2, 3], GREEDY, 40)
    b = engine.add_request([4, 5], GREEDY, 40)
    c = engine.add_request([6], GREEDY, 5)
    for _ in range(3):
        engine.step()
    assert engine.cache.num_free == 0 and c.status == "waiting"
    engine.cancel(a)
    assert a.status == "cancelled" and engine.cache.num_free == 1
    assert drafter.cache.num_free == drafter.cache.num_slots - 1
    engine.step()  # c is admitted into a's slot
    assert c.status == "running"
    engine.cancel(c)
    engine.cancel(b)
    assert engine.cache.num_free == 2 and drafter.cache.num_free == drafter.cache.num_slots
    assert not engine.has_work()


def test_full_cache_queues_instead_of_failing():
    target = _tiny(0, vocab=11)
    engine = Engine(target, NgramDrafter(block_size=3), max_requests=2, max_len=40)
    reqs = [engine.add_request([1 + i % 5, 2, 3], GREEDY, 10 + i) for i in range(6)]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.running))
    assert peak == 2
    assert all(r.status == "finished" and len(r.output_ids) == r.max_new_tokens for r in reqs)
    assert engine.cache.num_free == 2


def test_decoding_rows_follow_slot_order_when_requests_end_apart():
    """Requests that end apart hand their slots to newcomers that join the running list at its
    end; the step still lays the decoding rows out in slot order (what the batched attention
    reads in place), and every request gets what it would alone."""
    target = _tiny(0, vocab=11)
    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(target, name)

        def __call__(self, ids, segments, cache, **kw):
            seen.append([slot for slot, n in segments if n == 1])
            return target(ids, segments, cache, **kw)

    engine = Engine(Spy(), max_requests=4, max_len=40)
    lengths = [3, 9, 5, 12, 7, 4, 10, 6]
    prompts = [[1 + i % 5, 2, 3 + i % 3] for i in range(len(lengths))]
    reqs = [engine.add_request(p, GREEDY, n) for p, n in zip(prompts, lengths)]
    engine.run()
    assert any(r.slot is None for r in reqs) and all(r.status == "finished" for r in reqs)
    assert all(rows == sorted(rows) for rows in seen)
    assert any(len(rows) >= 3 for rows in seen)
    for p, n, r in zip(prompts, lengths, reqs):
        assert r.output_ids == generate_ids(target, p, GREEDY, n, None)[0]


def test_request_larger_than_a_slot_is_refused():
    engine = Engine(_tiny(0, vocab=11), max_requests=1, max_len=16)
    with pytest.raises(UsageError):
        engine.add_request(list(range(10)), GREEDY, 10)


@pytest.mark.parametrize("drafter,policy", [
    (NgramDrafter(block_size=4, rule="first", max_ngram=2, weak_match_tokens=4), FixedPolicy()),
    (NgramDrafter(block_size=4, weak_match_tokens=1), FixedPolicy()),
    (NgramDrafter(block_size=4), MTP1Policy()),
    (NgramDrafter(block_size=4), "prefix"),       # the lookup's free proposals, verified by Algorithm 1
])
def test_drafter_and_policy_variants_keep_greedy_output(drafter, policy):
    """fp32 greedy through the engine equals plain decoding for every lookup rule and policy."""
    target = _tiny(0, vocab=11, scale=4.0)
    prompts = [[1 + i, 2, 3, 1 + i, 2, 3, 4] for i in range(3)]
    plain = [generate_ids(target, p, GREEDY, 24)[0] for p in prompts]
    if policy == "prefix":
        from dspark.scheduling.policies import make_policy
        from dspark.scheduling.costs import CostTable
        table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                          seconds=[[[1.0, 1.02, 1.06], [1.4, 1.45, 1.55]]])
        policy = make_policy("prefix", 4, cost_table=table)
    engine = Engine(target, drafter, policy, max_requests=3, max_len=64)
    reqs = [engine.add_request(p, GREEDY, 24) for p in prompts]
    engine.run()
    assert [r.output_ids for r in reqs] == plain
    assert sum(r.stats.num_draft_tokens for r in reqs) > 0


def test_request_options_are_one_type_whichever_way_they_are_given():
    """add_request takes a RequestOptions, or the sampling settings with max_new_tokens and any other
    option as a keyword: the same request either way; both at once is refused."""
    target = _tiny(0, vocab=11)
    params = SamplingParams(temperature=1.0, seed=5)

    def run(add):
        engine = Engine(target, NgramDrafter(block_size=3), max_requests=1, max_len=64, eos_ids=(3,))
        r = add(engine)
        engine.run()
        return r
    a = run(lambda e: e.add_request([1, 2, 3, 1, 2], params, 12, logprobs=2, min_tokens=4))
    b = run(lambda e: e.add_request([1, 2, 3, 1, 2], RequestOptions(params, 12, logprobs=2, min_tokens=4)))
    assert a.options == b.options and a.stop_ids == frozenset({3}) == b.options.stop_ids   # the engine's eos
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs and len(a.output_ids) >= 4
    engine = Engine(target, max_requests=1, max_len=64)
    with pytest.raises(UsageError, match="no other option"):
        engine.add_request([1], RequestOptions(params, 4), logprobs=2)
    with pytest.raises(UsageError, match="max-new-tokens"):
        engine.add_request([1], params)
    with pytest.raises(UsageError, match="min_tokens"):
        engine.add_request([1], RequestOptions(params, 4, min_tokens=-1))


def test_a_long_scored_prompt_is_spread_over_steps_and_others_decode_meanwhile():
    """A prompt with prompt log probabilities (echo) is prefilled ``score_chunk`` scored rows at a
    time, so a request decoding beside it gets a token in every step while it prefills; its log
    probabilities are those of one whole prefill. A prompt without goes ``decoding_chunk`` tokens
    a step while another request decodes."""
    target = _tiny(0, vocab=11, scale=2.0)
    long_prompt = [(3 * i) % 11 for i in range(120)]
    engine = Engine(target, None, FixedPolicy(), max_requests=3, max_len=256, score_chunk=16, decoding_chunk=40)
    steps: list[int] = []
    streaming = engine.add_request([1, 2, 3], SamplingParams(temperature=0), 40,
                                   on_tokens=lambda toks: steps.append(engine.num_steps))
    engine.step()
    engine.step()
    echo = engine.add_request(long_prompt, SamplingParams(temperature=0), 1, prompt_logprobs=2)
    first = engine.num_steps
    while echo.status != "finished":
        engine.step()
    prefill_steps = engine.num_steps - first
    assert prefill_steps >= len(long_prompt) // 16
    during = [s for s in steps if first < s <= first + prefill_steps]
    assert len(during) >= prefill_steps - 1 and not streaming.done   # a token in every step meanwhile
    whole = Engine(target, None, FixedPolicy(), max_requests=1, max_len=256, score_chunk=1 << 30)
    ref = whole.add_request(long_prompt, SamplingParams(temperature=0), 1, prompt_logprobs=2)
    whole.run()
    assert [lp for lp, _ in echo.prompt_logprobs_out] == pytest.approx([lp for lp, _ in ref.prompt_logprobs_out],
                                                                       abs=1e-5)
    # a long prompt without log probabilities: decoding_chunk tokens a step while the stream decodes
    plain = engine.add_request(long_prompt, SamplingParams(temperature=0), 1)
    first = engine.num_steps
    while plain.status != "finished":
        engine.step()
    assert engine.num_steps - first == -(-len(long_prompt) // 40) and not streaming.done


def test_every_step_is_one_frozen_record_for_the_policy_and_the_listeners():
    """The public hook: each step's StepOutcome reaches the policy, then each listener, in order;
    its counts agree with the requests' own; a removed listener hears no more."""
    import dataclasses

    class Watching(FixedPolicy):
        def __init__(self):
            super().__init__(3)
            self.seen = []

        def observe(self, outcome):
            self.seen.append(outcome)

    target = _tiny(0, vocab=11)
    policy = Watching()
    engine = Engine(target, NgramDrafter(block_size=3), policy, max_requests=2, max_len=64)
    heard, late = [], []
    engine.add_step_listener(heard.append)
    remove = engine.add_step_listener(late.append)
    reqs = [engine.add_request([1, 2, 3, 1, 2, 3, 1, 2], GREEDY, 12), engine.add_request([4, 5, 4, 5, 4], GREEDY, 9)]
    engine.step()
    remove()
    engine.run()
    assert len(late) == 1 and heard == policy.seen and len(heard) == engine.num_steps
    assert [r.index for r in heard] == list(range(1, engine.num_steps + 1)) and engine.last_step is heard[-1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        heard[0].seconds = 0.0
    assert heard[0].prefill_tokens == 8 + 5 and not heard[0].decode_only
    assert all(r.forward_rows == r.prefill_tokens + sum(1 + o.verified for o in r.requests) for r in heard)
    assert sorted(i for r in heard for i in r.ended) == sorted(r.id for r in reqs)
    for q in reqs:     # what the records say each request drafted and accepted is what it counted
        outcomes = [o for r in heard for o in r.requests if o.request_id == q.id]
        assert sum(o.verified for o in outcomes if o.speculated) == q.stats.num_draft_tokens
        assert sum(o.accepted for o in outcomes if o.speculated) == q.stats.num_accepted_tokens
        assert len(outcomes) == q.stats.num_rounds
