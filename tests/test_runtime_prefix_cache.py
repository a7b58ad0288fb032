"""Prefix caching: which slot a new request takes and how much of its prompt is already there; a
request that reuses a prefix emits exactly what it emits without the cache (greedy and seeded
sampling, through a drafter that conditions on target features, so that the features kept for the
prefix are checked as well as the keys and values)."""

import pytest
import torch

from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.runtime.kv_cache import KVCache
from dspark.runtime.prefix_cache import Move, Placement, PrefixCache
from dspark.sampling import SamplingParams
from dspark.scheduling.policies import FixedPolicy

from _tiny import tiny_drafter_model, tiny_target


def test_choose_brings_the_longest_match_over_the_minimum_to_the_lowest_slot():
    pc = PrefixCache(4, 64, min_match=3)
    pc.keep(1, [1, 2, 3, 4, 5])
    pc.keep(2, [1, 2, 3, 9])
    pc.keep(3, [1, 2])
    # slot 1 holds its prompt but the last token: the two slots exchange their entries
    assert pc.choose([0, 1, 2, 3], [1, 2, 3, 4, 7]) == Placement(0, 4, None, (Move(1, 0, 4),))
    assert len(pc.held[0]) == 0                          # taken: its entries are the new request's now
    assert pc.choose([1, 2, 3], [1, 2, 3, 9]) == Placement(1, 3, None, (Move(2, 0, 3),))   # the last token runs
    assert pc.choose([2, 3], [1, 2, 8]) == Placement(2, 0, None, ())    # 2 tokens: under the minimum
    pc.keep(3, [5, 5, 5, 5])
    pc.keep(2, [6, 6, 6, 6])
    # e.g. prompt logprobs asked: no prefix; slot 2's entries are newer than slot 3's, so they stay
    assert pc.choose([2, 3], [6, 6, 6, 6, 1], reusable=False) == Placement(2, 0, None, (Move(3, 4, 0),))
    assert pc.held[3].tolist() == [6, 6, 6, 6]
    assert pc.choose([3], [6, 6, 6, 6, 1]) == Placement(3, 4, None, ())
    assert (pc.queries, pc.hits) == (5 + 4 + 3 + 5, 4 + 3 + 4)


def test_free_slots_keep_the_sequences_used_most_recently():
    """Prompts seen one at a time are all still there for a burst that brings them back (as
    llama.cpp's server slots keep them), while every request still takes the lowest free slot."""
    pc = PrefixCache(4, 64, min_match=3)
    prompts = [[p] * 6 for p in (1, 2, 3, 4, 5)]
    for prompt in prompts:             # one at a time: each in slot 0, which it leaves holding it
        assert pc.choose([0, 1, 2, 3], prompt).slot == 0
        pc.keep(0, prompt)
    assert sorted(tuple(h[:1]) for h in pc.held) == [(2,), (3,), (4,), (5,)]   # the oldest dropped
    free = [0, 1, 2, 3]
    for prompt in prompts[1:]:         # a burst of the four kept: every one found, slots 0, 1, 2, 3
        pl = pc.choose(free, prompt)
        assert (pl.slot, pl.cached) == (free[0], 5)
        free.remove(pl.slot)
    assert pc.choose([0], prompts[0]) == Placement(0, 0, None, ())


def test_a_shared_preamble_is_copied_and_the_sequences_that_share_it_stay():
    pc = PrefixCache(3, 64, min_match=3)
    pre = [9, 9, 9, 9]
    pc.keep(0, pre + [1, 1, 1, 0], prompt_len=7)      # prompt pre + [1, 1, 1], answer [0]
    # another question after the same preamble: reused in place, slot 0's sequence copied aside first
    assert pc.choose([0, 1, 2], pre + [2, 2]) == Placement(0, 4, None, (Move(1, 8, 0),))
    assert pc.held[1].tolist() == pre + [1, 1, 1, 0]
    pc.keep(0, pre + [2, 2, 5], prompt_len=6)
    # slot 1 holds more of it but not its whole prompt: copied from there, slot 1 keeps its sequence
    # and slot 0's goes to slot 2 (the least recently used)
    assert pc.choose([0, 1, 2], pre + [1, 3, 3]) == Placement(0, 5, None, (Move(2, 7, 0), Move(1, 0, 5)))
    assert pc.held[1].tolist() == pre + [1, 1, 1, 0] and pc.held[2].tolist() == pre + [2, 2, 5]


def test_an_exchange_moves_the_entries_and_features_with_their_tokens():
    cache = KVCache(2, 1, 2, num_slots=3, max_len=8, dtype=torch.float32)
    for k in cache.k + cache.v:
        k.copy_(torch.randn(k.shape))
    before = [t.clone() for t in cache.k + cache.v]
    pc = PrefixCache(3, 8, min_match=2)
    pc.store_features(1, 0, torch.randn(5, 4))
    pc.store_features(0, 0, torch.randn(3, 4))
    f0, f1 = pc.features[0, :3].clone(), pc.features[1, :5].clone()
    pc.keep(1, [7, 7, 7, 7, 7])
    pc.keep(0, [8, 8, 8])
    pl = pc.choose([0, 1, 2], [7, 7, 7, 7, 1])
    assert pl == Placement(0, 4, None, (Move(1, 3, 4),))
    cache.exchange(pl.slot, *pl.moves[0])
    for t, b in zip(cache.k + cache.v, before):
        assert torch.equal(t[0, :, :4], b[1, :, :4]) and torch.equal(t[1, :, :3], b[0, :, :3])
        assert torch.equal(t[2], b[2])
    assert torch.equal(pc.features[0, :4], f1[:4]) and torch.equal(pc.features[1, :3], f0)
    assert pc.held[1].tolist() == [8, 8, 8] and pc.choose([1, 2], [8, 8, 8, 2]) == Placement(1, 3, None, ())
    with pytest.raises(ValueError, match="free"):
        cache.exchange(0, 0, 1, 1)


def test_choose_copies_from_a_request_in_flight_or_waits_for_its_prefill():
    pc = PrefixCache(4, 64, min_match=3)
    pc.keep(2, [7, 7, 7])
    prompt = [7, 7, 7, 7, 8, 9]
    # slot 0 decodes and has computed 5 of the prompt's tokens: copy them into the lowest free slot
    assert pc.choose([1, 2, 3], prompt, running=[(0, [7, 7, 7, 7, 8, 1], None)]) == Placement(1, 5, 0, ())
    # a free slot that holds as much of its prompt: exchanged with the lowest free slot
    pc.keep(3, [7, 7, 7, 7, 8])
    assert pc.choose([2, 3], prompt, running=[(0, [7, 7, 7, 7, 8, 1], None)]) == Placement(2, 5, None, (Move(3, 3, 5),))
    # slot 0 is prefilling this prompt and has computed none of it: wait for it rather than repeat it
    assert pc.choose([1], prompt, running=[(0, [], prompt)]) is None
    # ... unless a free slot already holds nearly as much (5 tokens to come, 3 there)
    pc.keep(2, [7, 7, 7])
    assert pc.choose([1, 2], prompt, running=[(0, [], prompt)]) == Placement(1, 3, None, (Move(2, 0, 3),))


def _engine(target, drafter, caching, **kw):
    return Engine(target, drafter, FixedPolicy(3), max_requests=2, max_len=96, block_size=3,
                  prefix_caching=caching, prefix_min_match=4, **kw)


def _drafter(target):
    return DSparkDrafter(tiny_drafter_model(target, scale=2.0), target)


def _conversation(engine, params):
    """Three requests one after another: a shared preamble with two questions, then a follow-up
    turn that repeats the second request's prompt and answer."""
    preamble = [1, 2, 3, 4, 0, 2, 1, 3, 3, 1, 4, 2]
    out = []
    for prompt in (preamble + [1, 1], preamble + [2, 0, 4]):
        out.append(engine.add_request(prompt, params, 10))
        engine.run()
    follow = out[-1].prompt_ids + out[-1].output_ids + [3, 2]
    out.append(engine.add_request(follow, params, 10))
    engine.run()
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "seeded"])
def test_reused_prefix_gives_the_same_output_and_drafts(params):
    target = tiny_target(scale=3.0)
    base = _conversation(_engine(target, _drafter(target), False), params)
    got = _conversation(_engine(target, _drafter(target), True), params)
    for a, b in zip(base, got):
        assert b.output_ids == a.output_ids
        # the drafter proposed the same tokens: it saw the same target features for the reused prefix
        assert (b.stats.num_draft_tokens, b.stats.num_accepted_tokens) == \
               (a.stats.num_draft_tokens, a.stats.num_accepted_tokens)
    assert [r.stats.num_cached_tokens for r in base] == [0, 0, 0]
    assert got[0].stats.num_cached_tokens == 0 and got[1].stats.num_cached_tokens == 12
    # the slot held the second request's prompt and its output but the last token (never run)
    assert got[2].stats.num_cached_tokens == len(got[1].prompt_ids) + len(got[1].output_ids) - 1
    assert sum(r.stats.num_accepted_tokens for r in got) > 0


def test_a_request_cancelled_mid_prefill_leaves_what_it_prefilled():
    target = tiny_target(scale=3.0)
    prompt = [1, 2, 3, 4, 0, 2, 1, 3, 3, 1, 4, 2, 0, 0, 1]
    greedy = SamplingParams(temperature=0)
    ref = Engine(target, None, max_requests=1, max_len=96)
    want = ref.add_request(prompt, greedy, 8)
    ref.run()
    e = _engine(target, _drafter(target), True, prefill_chunk=6)
    first = e.add_request(prompt, greedy, 8)
    e.step()                                     # 6 of 15 prompt tokens in the cache
    e.cancel(first)
    again = e.add_request(prompt, greedy, 8)
    e.run()
    assert again.stats.num_cached_tokens == 6 and again.output_ids == want.output_ids


def test_prompt_logprobs_take_no_prefix_and_score_every_prompt_token():
    target = tiny_target(scale=3.0)
    prompt = [1, 2, 3, 4, 0, 2, 1, 3]
    e = _engine(target, None, True)
    e.add_request(prompt, SamplingParams(temperature=0), 4)
    e.run()
    r = e.add_request(prompt, SamplingParams(temperature=0), 4, prompt_logprobs=1)
    e.run()
    assert r.stats.num_cached_tokens == 0 and len(r.prompt_logprobs_out) == len(prompt) - 1
    hit = e.add_request(prompt, SamplingParams(temperature=0), 4)
    e.run()
    assert hit.stats.num_cached_tokens == len(prompt) - 1 and hit.output_ids == r.output_ids


def test_kept_features_are_the_positions_own():
    target = tiny_target(scale=3.0)
    drafter = _drafter(target)
    e = _engine(target, drafter, True)
    r = e.add_request([1, 2, 3, 4, 0, 2], SamplingParams(temperature=1.0, seed=0), 12)
    e.run()                                      # in slot 0, the lowest
    seq = r.prompt_ids + r.output_ids
    n = len(e.prefix.held[0])
    assert n == len(seq) - 1 and e.prefix.held[0].tolist() == seq[:n]
    cache = target.new_cache(1, 96)
    out = target(torch.tensor(seq[:n]), [(cache.allocate(), n)], cache, feature_layers=drafter.feature_layers)
    assert torch.allclose(e.prefix.features[0, :n].float(), torch.cat(out.features, -1).float(), atol=1e-4)


def test_choices_of_one_prompt_prefill_it_once_and_keep_their_outputs():
    target = tiny_target(scale=3.0)
    prompt = [1, 2, 3, 4, 0, 2, 1, 3, 3, 1, 4, 2, 0, 1]
    runs = []
    for caching in (False, True):
        e = Engine(target, _drafter(target), FixedPolicy(3), max_requests=4, max_len=96, block_size=3,
                   prefix_caching=caching, prefix_min_match=4)
        reqs = [e.add_request(prompt, SamplingParams(temperature=1.0, seed=s), 10) for s in range(3)]
        e.step()
        if caching:      # the first prefills; the others wait for it instead of prefilling it again
            assert [r.status for r in reqs] == ["running", "waiting", "waiting"]
        e.run()
        runs.append(reqs)
    for a, b in zip(*runs):
        assert b.output_ids == a.output_ids
        assert (b.stats.num_draft_tokens, b.stats.num_accepted_tokens) == \
               (a.stats.num_draft_tokens, a.stats.num_accepted_tokens)
    assert [r.stats.num_cached_tokens for r in runs[1]] == [0, len(prompt) - 1, len(prompt) - 1]


def test_a_follow_up_copies_the_entries_of_a_request_still_decoding():
    target = tiny_target(scale=3.0)
    greedy = SamplingParams(temperature=0)
    first_prompt = [1, 2, 3, 4, 0, 2, 1, 3]
    outs = []
    for caching in (False, True):
        e = Engine(target, _drafter(target), FixedPolicy(3), max_requests=2, max_len=96, block_size=3,
                   prefix_caching=caching, prefix_min_match=4)
        a = e.add_request(first_prompt, greedy, 40)
        for _ in range(4):
            e.step()
        assert a.status == "running" and len(a.output_ids) > 3
        follow = e.add_request(first_prompt + a.output_ids[:3] + [2], greedy, 10)
        e.run()
        outs.append((a, follow))
    assert outs[1][1].output_ids == outs[0][1].output_ids and outs[1][0].output_ids == outs[0][0].output_ids
    assert (outs[1][1].stats.num_draft_tokens, outs[1][1].stats.num_accepted_tokens) == \
           (outs[0][1].stats.num_draft_tokens, outs[0][1].stats.num_accepted_tokens)
    assert outs[1][1].stats.num_cached_tokens == len(first_prompt) + 3


def test_prompts_seen_one_at_a_time_are_all_found_by_a_burst_and_give_the_same_output():
    """Each request takes slot 0 in turn, reusing the shared preamble; the sequences it leaves are
    copied aside rather than overwritten, so a burst of the same prompts finds every one (keys,
    values and the drafter's features moved between free slots) and emits what a run without the
    cache emits."""
    target = tiny_target(scale=3.0)
    preamble = [1, 2, 3, 4, 0, 2]                     # shared by all three (a system prompt)
    prompts = [preamble + [k, 1, 3, 2, 0] for k in range(3)]
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for caching in (False, True):
        e = Engine(target, _drafter(target), FixedPolicy(3), max_requests=3, max_len=96, block_size=3,
                   prefix_caching=caching, prefix_min_match=4)
        alone = []
        for p in prompts:
            alone.append(e.add_request(p, params, 6))
            e.run()
        if caching:
            assert [r.stats.num_cached_tokens for r in alone] == [0, len(preamble), len(preamble)]
        burst = [e.add_request(p, params, 8) for p in reversed(prompts)]
        e.run()
        runs.append(burst)
    for a, b in zip(*runs):
        assert b.output_ids == a.output_ids
        assert (b.stats.num_draft_tokens, b.stats.num_accepted_tokens) == \
               (a.stats.num_draft_tokens, a.stats.num_accepted_tokens)
    assert [r.stats.num_cached_tokens for r in runs[1]] == [len(p) - 1 for p in reversed(prompts)]
    assert [r.stats.num_cached_tokens for r in runs[0]] == [0, 0, 0]
