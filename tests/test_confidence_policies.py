"""Confidence-scheduled verification stays lossless.

* Appendix A of the paper: vocabulary {A, B}, p_t = (0.7, 0.3), p_d = (0.5, 0.5), c_1 = 0.8,
  c_2 = 0.9 after x_1 = A and 0 after B. With SPS(1, 2, 3) = (1.0, 0.5, 0.45) a search without the
  early stop verifies x_1 only when it is A and emits A with probability 0.85; the test detects it.
  Algorithm 1 never drafts there, so it is also run where it picks several lengths.
* Every policy through the engine (tiny target, DSpark drafter whose confidences depend on the
  sampled tokens): chi-square against the target's exact law, asserting several lengths were chosen.
"""

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.sampling import SamplingParams
from dspark.scheduling.algorithm1 import expected_commit, prefix_schedule
from dspark.scheduling.base import RequestView, StepOutcome
from dspark.scheduling.policies import make_policy
from dspark.scheduling.costs import CostTable
from dspark.verify import verify

from _lossless import chi2_pvalue, exact_law
from _tiny import VOCAB, tiny_drafter_model, tiny_target

P_T = torch.tensor([0.7, 0.3])
P_D = torch.tensor([0.5, 0.5])


def _appendix_a(sps_values, early_stop, draws=20000, seed=0, commit=lambda surv: 0):
    """First emitted token counts and the set of verification lengths chosen (``commit``: the
    candidates taken whatever they return, from the step's survivals)."""
    g = torch.Generator().manual_seed(seed)
    logits = P_T.log().expand(3, 2)              # the target: (0.7, 0.3) at every position
    params = SamplingParams(temperature=1.0)
    counts, lengths = [0, 0], set()
    for _ in range(draws):
        x = torch.multinomial(P_D.expand(2, 2), 1, generator=g).squeeze(-1)
        c = [0.8, 0.9 if x[0] == 0 else 0.0]
        surv = [[c[0], c[0] * c[1]]]
        n = prefix_schedule(surv, lambda B: sps_values[B - 1], early_stop=early_stop, commit=commit(surv))[0]
        lengths.add(n)
        acc, nxt = verify(x[:n], P_D.expand(n, 2), logits[:n + 1], params, g)
        first = int(x[0]) if acc > 0 else int(nxt)
        counts[first] += 1
    return counts, lengths


def test_search_without_early_stop_is_biased_and_detected():
    counts, lengths = _appendix_a((1.0, 0.5, 0.45), early_stop=False)
    assert lengths == {0, 2}
    assert counts[0] / sum(counts) == pytest.approx(0.85, abs=0.01)
    assert chisquare(counts, [0.7 * sum(counts), 0.3 * sum(counts)]).pvalue < 1e-6


def test_algorithm1_never_drafts_in_appendix_a_and_is_lossless_where_it_does():
    counts, lengths = _appendix_a((1.0, 0.5, 0.45), early_stop=True)
    assert lengths == {0}                   # the vacuous case
    counts, lengths = _appendix_a((1.0, 0.9, 0.85), early_stop=True)
    assert lengths == {1, 2}                 # several lengths, chosen after seeing x_1
    assert chisquare(counts, [0.7 * sum(counts), 0.3 * sum(counts)]).pvalue > 1e-3


def test_committing_to_candidates_fixed_before_the_draws_is_lossless_and_one_read_from_them_is_not():
    # a price that falls per token (the second verified token nearly free, as on a CPU, where the
    # first makes the step ragged): the early stop alone verifies nothing here
    sps = (1.0, 0.5, 0.49)
    assert _appendix_a(sps, early_stop=True, draws=200)[1] == {0}
    # committing to the first candidate (a_1 is known before x_1 is drawn) or to two: the law holds
    for k in (1, 2):
        counts, lengths = _appendix_a(sps, early_stop=True, commit=lambda surv, k=k: k)
        assert max(lengths) >= 1
        assert chisquare(counts, [0.7 * sum(counts), 0.3 * sum(counts)]).pvalue > 1e-3
    # committing to two where a_2 (which depends on x_1) says the second pays: the same test rejects it
    counts, _ = _appendix_a(sps, early_stop=True, commit=lambda surv: 2 if surv[0][1] > 0 else 0)
    assert chisquare(counts, [0.7 * sum(counts), 0.3 * sum(counts)]).pvalue < 1e-6


def test_expected_commit_sees_past_a_ragged_steps_first_token():
    # 8 requests' lookup blocks (survivals known before the step) where the first verified token costs
    # as much as 40 more: the early stop verifies nothing, the commit the count that pays best
    R = 8
    rows = [[0.9, 0.8, 0.7, 0.6] for _ in range(R)]

    def sps(B):
        extra = np.asarray(B, float) - R
        return 1.0 / (1.0 + np.where(extra > 0, 0.25, 0.0) + 0.005 * extra)
    assert prefix_schedule(rows, sps) == [0] * R
    commit = expected_commit(rows, [4] * R, [1.0] * 4, sps)
    assert commit == 4 * R
    assert prefix_schedule(rows, sps, sps_many=sps, commit=commit) == [4] * R
    # a sampled block's survivals past its first are expected from the recent proposals' (falling
    # fast past the first): a lower count
    weak = expected_commit(rows, [1] * R, [0.9, 0.3, 0.05, 0.01], sps)
    assert 0 < weak < commit
    # nothing that pays: none
    assert expected_commit([[0.05, 0.01]] * R, [2] * R, [1.0, 1.0], sps) == 0


def test_free_profiles_learn_each_strength_apart():
    from dspark.scheduling.profile import FreeProfiles
    prof = FreeProfiles(4)
    assert prof.conditional(3) == prof.conditional(1) == pytest.approx([0.5] * 4)
    for _ in range(200):
        prof.observe(1, 4, 0)            # one-token matches: rejected at once
        prof.observe(4, 4, 4)            # long ones: accepted whole
    assert prof.conditional(1)[0] < 0.1 and prof.conditional(4)[0] > 0.9
    assert prof.conditional(9) == prof.conditional(8)          # past the strongest, alike
    # a strength seen a few times leans on all strengths' pooled profile
    prof.observe(2, 4, 4)
    assert 0.3 < prof.conditional(2)[0] < 0.7
    assert prof.tries[0] > 400


class _Spy:
    """Wraps a policy and records the verification lengths it chose."""

    def __init__(self, policy):
        self.policy, self.name, self.lengths = policy, policy.name, set()
        self.uses_free_drafts = policy.uses_free_drafts

    def draft_lengths(self, requests, block_size, free=None):
        return self.policy.draft_lengths(requests, block_size, free)

    def wants_free(self, requests):
        return self.policy.wants_free(requests)

    def verify_lengths(self, requests, proposals):
        out = self.policy.verify_lengths(requests, proposals)
        self.lengths.update(out)
        return out

    def observe(self, outcome):
        self.policy.observe(outcome)


def _requests(n: int):
    """Stand-ins for n decoding requests with nothing drafted yet (what the policies read of them)."""
    return [RequestView(i, context=2, pending_rows=0, room=64) for i in range(n)]


def _timed(seconds: float) -> StepOutcome:
    """A decoding step's outcome that tells only its time (no block verified)."""
    return StepOutcome((), seconds, decode_only=True)


def _cost_table():
    # steps get dearer with more verified tokens, so prefix / async verify some tokens, not all
    return CostTable("tiny", requests=[1, 8, 32], verified=[0, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.03, 1.1], [1.4, 1.5, 1.8], [2.5, 2.7, 3.2]]])


@pytest.mark.parametrize("policy", ["threshold-0.5", "ema", "prefix", "async"])
def test_every_policy_keeps_the_target_distribution(policy):
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, "dspark", "vanilla", draft_vocab=torch.tensor([0, 1, 2, 4]),
                                               scale=2.0), target)
    spy = _Spy(make_policy(policy, 3, cost_table=_cost_table()))
    prompt, n_new, draws = [1, 3, 2, 4], 4, 3000
    engine = Engine(target, drafter, spy, max_requests=32, block_size=3, max_len=16)
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, top_k=4, seed=s), n_new,
                               exact_seed=False)
            for s in range(draws)]
    engine.run()
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert len(spy.lengths) >= 3, f"{policy} chose lengths {spy.lengths}: too few to test anything"
    law = exact_law(target, prompt, n_new, SamplingParams(temperature=1.0, top_k=4), VOCAB)
    assert chi2_pvalue(counts, law) > 1e-3


def test_async_capacity_recovers_after_a_step_that_drafted_nothing():
    from dspark.drafters.base import Proposal
    from dspark.scheduling.asynchronous import AsyncPolicy
    cheap = CostTable("tiny", requests=[1, 8, 32], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.01, 1.03], [1.4, 1.42, 1.45], [2.5, 2.52, 2.6]]])
    pol = AsyncPolicy(cheap, num_draft=3)
    reqs = _requests(2)
    empty = [Proposal.empty(), Proposal.empty()]
    pol.capacity = 0
    pol.verify_lengths(reqs, empty)              # two steps in which nothing was drafted ...
    pol.verify_lengths(reqs, empty)
    want = pol.draft_lengths(reqs, 3)            # ... must not pin K at 0: the default profile counts
    assert pol.capacity > 0 and all(0 < w <= min(3, pol.capacity) for w in want)


@pytest.mark.parametrize("name", ["prefix", "async"])
def test_no_drafting_when_it_does_not_pay_but_a_one_token_probe_in_turn(name):
    # drafting + verifying one token costs 1.5x a step and the observed first-token acceptance is
    # 10 %: neither policy drafts, except one token of one request (in turn) every 8 steps, and that
    # probe is verified whatever its confidence so that the profile keeps learning
    from dspark.drafters.base import Proposal
    dear = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.5, 1.8], [1.4, 2.1, 2.5]]])
    pol = make_policy(name, 3, cost_table=dear)
    pol.probe_budget = 1.0          # probes cheap enough to come every 8 steps (see the next test)
    pol.probe_far = 1.0             # however far drafting is from paying (see test_probes_thin_out...)
    pol.profile.hits, pol.profile.tries = [0.1, 0.05, 0.05], [1.0] * 3
    reqs = _requests(2)
    plans = []
    for _ in range(16):
        want = pol.draft_lengths(reqs, 3)
        props = [Proposal(torch.tensor([1] * w), None, torch.tensor([0.01] * w)) if w else Proposal.empty()
                 for w in want]
        plans.append((want, pol.verify_lengths(reqs, props)))
    assert [w for w, _ in plans[:7]] == [[0, 0]] * 7
    assert plans[7][0] in ([1, 0], [0, 1]) and plans[15][0] in ([1, 0], [0, 1])
    assert plans[7][0] != plans[15][0]                          # the probe goes round the requests
    assert plans[7][1] == plans[7][0]                           # and is verified despite c = 0.01


@pytest.mark.parametrize("name", ["prefix", "async"])
def test_probes_cost_at_most_their_budget(name):
    """A probe that costs a quarter of a plain step comes at most once in 25 steps under a 1 %
    budget, and further apart once the steps show that probes cost twice what the table says."""
    from dspark.drafters.base import Proposal
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.25, 1.5], [1.0, 1.25, 1.5]]], draft=[[[0, 0.25, 0.25], [0, 0.25, 0.25]]])
    pol = make_policy(name, 3, cost_table=table)
    pol.probe_far = 1.0
    pol.profile.hits, pol.profile.tries = [0.01, 0.01, 0.01], [1.0] * 3
    reqs = _requests(2)
    assert pol.probe_gap(reqs) == 25

    def probe_steps(n, probe_seconds):
        steps = []
        for i in range(n):
            want = pol.draft_lengths(reqs, 3)
            props = [Proposal(torch.tensor([1] * w), None, torch.tensor([0.01] * w)) if w else Proposal.empty()
                     for w in want]
            pol.verify_lengths(reqs, props)
            pol.observe(_timed(probe_seconds if any(want) else 1.0))
            if any(want):
                steps.append(i)
        return steps

    first = probe_steps(100, 1.25)           # probes as dear as the table says
    assert first[:4] == [24, 49, 74, 99]
    probe_steps(1500, 1.5)                   # twice as dear: the cost model learns it
    assert pol.probe_scale > 1.7 and pol.probe_gap(reqs) >= 43


def test_prefix_drafts_only_as_deep_as_the_profile_pays():
    """Drafting costs before any confidence exists: the prefix policy drafts to the depth that
    maximises expected tokens per second on the observed acceptance profile (past steps only), and
    probes one token now and then when no depth pays."""
    from dspark.scheduling.prefix import PrefixPolicy

    def reqs():
        return _requests(1)

    def policy(seconds, conditional):
        pol = PrefixPolicy(CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                                     seconds=[[seconds, [2 * s for s in seconds]]]), num_draft=3)
        pol.profile.hits, pol.profile.tries = list(conditional), [1.0] * 3
        return pol

    # one token: 1.4 / 1.1 = 1.27x plain; two: 1.44 / 1.3 = 1.11x; three: 1.44 / 1.5 < 1
    assert policy([1.0, 1.1, 1.5], [0.4, 0.1, 0.1]).draft_lengths(reqs(), 3) == [1]
    assert policy([1.0, 1.0, 1.0], [0.4, 0.1, 0.1]).draft_lengths(reqs(), 3) == [3]   # free drafts
    pol = policy([1.0, 1.5, 2.0], [0.05, 0.05, 0.05])                                  # nothing pays
    pol.probe_far = 1.0
    r = reqs()
    gap = pol.probe_gap(r)        # a probe costs half a step: 50 steps apart under a 1 % budget
    assert gap == 50 and [pol.draft_lengths(r, 3)[0] for _ in range(gap)] == [0] * (gap - 1) + [1]


def test_drafting_depth_comes_from_every_proposal_not_only_the_verified_ones():
    """The acceptance of verified tokens overstates what a fresh draft returns when only confident
    tokens get verified: the prefix policy weighs drafting by the calibrated survivals of all
    proposals (tracked over steps), so confident-looking history does not keep it drafting."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.3, 1.6], [1.4, 1.9, 2.4]]])
    pol = PrefixPolicy(table, num_draft=3)
    pol.profile.hits, pol.profile.tries = [0.9, 0.8, 0.7], [1.0] * 3    # what verified tokens showed
    reqs = _requests(8)
    assert max(pol.draft_lengths(reqs, 3)) > 0
    mostly_hopeless = [Proposal(torch.tensor([1, 2, 3]), None, torch.tensor([c, 0.5, 0.5]))
                       for c in [0.9] + [0.05] * 7]                        # mean a_1 = 0.16
    pol.verify_lengths(reqs, mostly_hopeless)
    assert pol.expected_survivals(3)[0] < 0.2
    assert pol.draft_lengths(reqs, 3) == [0] * 8                         # 1.16 tokens for 1.36x the time


def test_async_drafts_only_for_requests_that_held_part_of_the_capacity():
    """K is priced as K verified tokens; a drafter forward over every request would cost more than
    that. Requests whose survivals two steps ago held none of the top K draft nothing."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.asynchronous import AsyncPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.05, 1.2], [1.4, 1.9, 2.4]]])
    pol = AsyncPolicy(table, num_draft=3)
    reqs = _requests(8)
    confident = [0.95] * 3
    props = [Proposal(torch.tensor([1, 2, 3]), None, torch.tensor(confident if i == 0 else [0.02] * 3))
             for i in range(8)]
    pol.capacity = 3
    for _ in range(2):                       # the snapshot two steps back: one confident request
        pol.verify_lengths(reqs, props)
    want = pol.draft_lengths(reqs, 3)
    assert 0 < pol.capacity <= 3 and want[0] > 0
    assert want[1:] == [0] * 7


def test_async_prices_the_fixed_cost_of_a_drafter_call():
    """At 8 requests one draft token priced by interpolating whole steps costs 1/8 of the
    all-drafting step's extra (0.125 s), but a drafter call for one request costs what the table
    measured for it (0.3 - 0.35 s) on top of the target's part (0.025 s): one request's candidate
    that survives 90 % of the time pays under the first price, not the second."""
    from dspark.scheduling.asynchronous import AsyncPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.3, 1.6], [2.0, 3.0, 3.5]]], draft=[[[0, 0.3, 0.35], [0, 0.8, 0.9]]])
    reqs = _requests(8)

    def capacity(row0):
        pol = AsyncPolicy(table, num_draft=3)
        snap = {i: row0 if i == 0 else [0.05, 0.01, 0.0] for i in range(8)}
        pol.history.extend([snap, snap])        # the survivals of two steps ago
        return pol._capacity(reqs, 3)[0]

    assert 8.9 / 2.125 > 8 / 2.0 > 8.9 / (2.025 + 0.325)    # the two prices of the 90 % candidate
    assert capacity([0.9, 0.09, 0.01]) == 0
    assert capacity([1.0, 1.0, 1.0]) == 3          # 11 tokens / 2.425 s: three sure drafts pay for the call
    table.draft = None
    table.__post_init__()
    assert capacity([0.9, 0.09, 0.01]) > 0         # what the interpolated price would have done


def _run_dearer_drafting(pol, table, reqs, steps: int) -> list[int]:
    """Steps of 8 requests at confidence 0.3 whose drafting part really costs 3x the table's (plain
    part 1.4 s as the table says); the tokens drafted per step."""
    from dspark.drafters.base import Proposal
    wants = []
    for _ in range(steps):
        want = pol.draft_lengths(reqs, 3)
        props = [Proposal(torch.tensor([1] * w), None, torch.tensor([0.3] * w)) if w else Proposal.empty()
                 for w in want]
        lengths = pol.verify_lengths(reqs, props)
        n = sum(1 for w in want if w)
        extra = (table.target_seconds(8, sum(lengths) / 8, 8) - 1.4
                 + table.drafter_seconds(n, sum(want) / max(1, n), 8))
        pol.observe(_timed(1.4 + 3 * extra))
        wants.append(sum(want))
    return wants


def test_cost_model_learns_what_steps_really_cost():
    """The table says drafting one token per request adds 0.2 s to a 1.4 s step; the engine reports
    that it adds three times that. The prefix policy drafts at first (1.3 tokens for 1.6 s beats
    1 for 1.4 s), learns the real price from the steps it ran and falls back to plain decoding
    with a probe now and then (1.3 tokens for 2.0 s do not pay). Plain steps correct the plain
    price alike."""
    from dspark.scheduling.prefix import PrefixPolicy
    from dspark.scheduling.costs import CostModel
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.1, 1.2], [1.4, 1.6, 2.0]]], draft=[[[0, 0.05, 0.05], [0, 0.1, 0.2]]])
    pol = PrefixPolicy(table, num_draft=3)
    pol.profile.hits, pol.profile.tries = [0.3, 0.3, 0.3], [1.0] * 3
    reqs = _requests(8)
    wants = _run_dearer_drafting(pol, table, reqs, 80)
    assert wants[0] >= 8                                 # drafted on the table's word
    assert all(w <= 1 for w in wants[-16:])              # then only the one-token probes
    assert pol.cost.extra_scale > 2        # learnt from the drafting steps (probes are priced apart)
    cm = CostModel(table)
    for _ in range(100):
        cm.expect(8, 0, 8, 0, 0)
        cm.observe(2.8)
    assert abs(cm.pace - 2.0) < 0.05 and cm.seconds(8, 0, 8, 0) == pytest.approx(2.8, rel=0.03)
    for _ in range(100):
        cm.expect(8, 8, 8, 8, 1)           # every request drafts and verifies one token: 0.2 s more
        cm.observe(2.8 + 3 * 0.2)
        if cm.since_plain >= 40:          # a plain step now and then keeps the pace fresh
            cm.expect(8, 0, 8, 0, 0)
            cm.observe(2.8)
    assert cm.seconds(8, 8, 8, 8, 1) == pytest.approx(3.4, rel=0.03)


def test_a_slow_spell_over_plain_steps_does_not_lock_the_policy_into_drafting():
    """Plain steps measured during a slow spell (4x the table), then the machine recovers and
    drafting costs three times what the table says. Compared with the spell's plain steps, drafting
    steps look nearly free; the old two-factor correction learnt that and, never seeing another plain
    step, drafted for ever. Now the policy runs a plain reference step among its drafting steps,
    the spell's plain steps go stale, and it learns the real price and stops drafting."""
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.1, 1.2], [1.4, 1.6, 2.0]]], draft=[[[0, 0.05, 0.05], [0, 0.1, 0.2]]])
    pol = PrefixPolicy(table, num_draft=3)
    pol.profile.hits, pol.profile.tries = [0.3, 0.3, 0.3], [1.0] * 3
    reqs = _requests(8)
    for _ in range(8):                     # the slow spell, over plain steps
        pol.cost.expect(8, 0, 8, 0, 0)
        pol.cost.observe(4 * 1.4)
    wants = _run_dearer_drafting(pol, table, reqs, 400)
    assert wants[0] >= 8 and pol.cost.pace == pytest.approx(1.0)
    assert 0 in wants[:66]                               # a plain reference step among the drafting ones
    assert all(w <= 1 for w in wants[-50:])              # then only the one-token probes


def test_async_verifies_no_token_whose_survival_does_not_pay_for_its_verification():
    """Verifying one more token adds 0.025 s to a 2.0 s step of 8 requests (0.25 s a token): of
    the top K, a token that survives less than 10 % of the time is not worth verifying."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.asynchronous import AsyncPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.3, 1.6], [2.0, 3.0, 3.5]]], draft=[[[0, 0.3, 0.35], [0, 0.8, 0.9]]])
    pol = AsyncPolicy(table, num_draft=3)
    reqs = _requests(8)
    props = [Proposal(torch.tensor([1, 2, 3]), None, torch.tensor([0.5] * 3 if i == 0 else [0.05] * 3))
             for i in range(8)]
    pol.capacity = 5                     # survivals 0.5, 0.25, 0.125 (request 0), then 0.05 (each other)
    assert pol.verify_lengths(reqs, props) == [3] + [0] * 7
    pol.cost.table = None                # every token free: the plain top K
    pol.capacity = 5
    assert sorted(pol.verify_lengths(reqs, props), reverse=True)[:3] == [3, 1, 1]


def test_prefix_drafts_when_the_confident_few_pay_for_the_call_and_stops_when_they_are_gone():
    """Drafting pays through the tokens Algorithm 1 will verify, not the average one: a quarter of
    recent proposals at a_1 = 0.95 and the rest at 0.02 (mean 0.25) pay for a drafter call (verify
    those two: 9.9 tokens in 1.7 s against 8 in 1.4 s) where verifying every draft would not (10 in
    2.0 s). Only recent proposals count: once 64 hopeless ones followed, drafting stops."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.1, 1.2], [1.4, 2.0, 2.8]]], draft=[[[0, 0.05, 0.05], [0, 0.2, 0.4]]])
    pol = PrefixPolicy(table, num_draft=3)
    reqs = _requests(8)

    def step(first):
        want = pol.draft_lengths(reqs, 3)
        props = [Proposal(torch.tensor([1]), None, torch.tensor([c])) for c in first]
        pol.verify_lengths(reqs, props)
        return want

    step([0.95, 0.95] + [0.02] * 6)
    assert pol.expected_survivals(1)[0] == pytest.approx(0.2525)
    assert 8 + 8 * 0.2525 < 8 / 1.4 * 2.0            # verifying every draft would not pay
    assert min(step([0.95, 0.95] + [0.02] * 6)) >= 1     # the confident two do
    for _ in range(8):
        step([0.02] * 8)
    assert pol._draft_depth(reqs, 3) == 0 and sum(step([0.02] * 8)) <= 1   # a one-token probe at most


def test_the_drafters_call_is_weighed_for_the_requests_no_lookup_serves():
    """Six of eight requests have a lookup's free proposal (accepted ~all of the time), two do not.
    Alone, the trained drafter's tokens (a_1 = 0.45) do not pay for a step that verifies them: its
    first verified tokens cost 0.6 s (the step made ragged). Beside the free proposals, verified
    anyway, that cost is paid, and the drafter's call is priced for the two requests it serves
    (0.04 s, not 0.2 for all eight): drafting one token for them pays."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.1, 1.2], [1.4, 2.2, 2.8]]], draft=[[[0, 0.01, 0.02], [0, 0.2, 0.8]]])
    pol = PrefixPolicy(table, num_draft=3)
    reqs = _requests(8)
    pol.verify_lengths(reqs, [Proposal(torch.tensor([1, 2, 3]), None, torch.tensor([0.45] * 3)) for _ in reqs])
    for _ in range(50):
        pol.free_profile.observe(4, 3, 3)
    assert pol._draft_depth(reqs, 3) == 0                       # no lookup: the drafter does not pay
    assert pol._draft_depth(reqs, 3, [0] * 8) == 0
    assert pol._draft_depth(reqs, 3, [3] * 6 + [0] * 2) >= 1     # beside the free proposals it does
    assert pol.drafting_ratio > 1.0
    assert pol._draft_depth(reqs, 3, [3] * 8) == 0              # every request served: no call to weigh


def test_drafting_prices_the_context_a_request_hands_the_drafter_after_a_pause():
    """A request that has not drafted for a while hands the drafter every position since, all at
    its next call (0.01 s a row here): 16 requests x 40 rows pending make drafting dear, though one
    row each would let it pay. The catch-up goes into the price the cost model checks too."""
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 16], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.1, 1.2], [1.4, 1.6, 2.0]]], draft=[[[0, 0.05, 0.05], [0, 0.1, 0.2]]],
                      context_row=0.01)
    reqs = _requests(16)

    def wants(rows):
        pol = PrefixPolicy(table, num_draft=3)
        pol.profile.hits, pol.profile.tries = [0.5, 0.5, 0.5], [1.0] * 3
        return pol, pol.draft_lengths([dataclasses.replace(r, pending_rows=rows) for r in reqs], 3)

    pol, want = wants(1)
    assert min(want) >= 1 and pol._rows == 0
    pol, want = wants(40)
    assert sum(want) <= 1                               # plain (or a one-token probe)
    pol.cost.expect(16, 0, 8, 1, 1, rows=16 * 38)
    assert pol.cost._pending[1] == pytest.approx(table.drafter_seconds(1, 1, 8) + 0.01 * 16 * 38)


@pytest.mark.parametrize("name", ["prefix", "async"])
def test_a_search_that_found_nothing_pays_is_not_repeated_until_what_it_read_changes(name):
    """Under heavy load nothing pays step after step; the search is skipped while its inputs stand
    (same requests, no new proposal, same prices) and runs again when one changes."""
    from dspark.drafters.base import Proposal
    dear = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.5, 1.8], [1.4, 2.1, 2.5]]], draft=[[[0, 0.3, 0.35], [0, 0.5, 0.6]]])
    pol = make_policy(name, 3, cost_table=dear)
    pol.probe_budget = 1e-6                    # no probes in this test
    pol.profile.hits, pol.profile.tries = [0.1, 0.05, 0.05], [1.0] * 3
    search = "_draft_depth" if name == "prefix" else "_capacity"
    inner, calls = getattr(pol, search), []
    setattr(pol, search, lambda *a: calls.append(1) or inner(*a))
    reqs = _requests(8)

    def step(reqs, conf=None):
        want = pol.draft_lengths(reqs, 3)
        props = [Proposal(torch.tensor([1]), None, torch.tensor([conf])) if conf is not None else Proposal.empty()
                 for _ in reqs]
        pol.verify_lengths(reqs, props)
        return want

    for _ in range(6):
        assert step(reqs) == [0] * 8
    assert len(calls) <= 3                      # async: the first steps still read their own history
    n = len(calls)
    assert step(reqs[:4]) == [0] * 4 and len(calls) == n + 1      # fewer requests: searched again
    step(reqs[:4], conf=0.99)                   # nothing changed before it drafts: no search; then
    assert len(calls) == n + 1                  # new proposals come, confident ones
    assert max(step(reqs[:4])) > 0 and len(calls) == n + 2           # searched again: drafting pays


def test_probes_thin_out_the_further_drafting_is_from_paying():
    """A probe's news matters when drafting nearly pays. The gap between probes stretches as the
    last search's best drafting step falls from plain decoding's tokens/s to 80 % of it, up to 16x."""
    from dspark.scheduling.prefix import PrefixPolicy
    table = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.25, 1.5], [1.0, 1.25, 1.5]]], draft=[[[0, 0.25, 0.25], [0, 0.25, 0.25]]])
    reqs = _requests(2)

    def gap(acceptance):
        pol = PrefixPolicy(table, num_draft=3)
        pol.profile.hits, pol.profile.tries = [acceptance] * 3, [1.0] * 3
        pol.draft_lengths(reqs, 3)
        return pol._ratio, pol.probe_gap(reqs)

    near, far, hopeless = gap(0.2), gap(0.08), gap(0.0)
    import math
    assert 0.95 < near[0] < 1 and 0.8 < far[0] < 0.9 and hopeless[0] <= 0.8 + 1e-9
    for ratio, g in (near, far):                            # the budget's own gap (25), stretched
        assert g == math.ceil(25 / ((ratio - 0.8) / 0.2))   # in proportion to the distance
    assert near[1] < 2 * 25 and hopeless[1] == 16 * 25      # at most 16x


def test_a_paying_depth_is_reused_for_a_few_steps_then_searched_again():
    """While drafting pays, prefix searches its depth once per ``search_every`` steps at the same
    number of requests while few proposals came since, and at once when that number changes or
    many new proposals came."""
    from dspark.drafters.base import Proposal
    cheap = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.02, 1.05], [1.4, 1.45, 1.5]]], draft=[[[0, 0.01, 0.02], [0, 0.02, 0.03]]])
    pol = make_policy("prefix", 3, cost_table=cheap)
    pol.profile.hits, pol.profile.tries = [0.9, 0.9, 0.9], [1.0] * 3
    inner, calls = pol._draft_depth, []
    pol._draft_depth = lambda *a: calls.append(1) or inner(*a)
    reqs = _requests(16)

    def step(reqs):
        want = pol.draft_lengths(reqs, 3)
        pol.verify_lengths(reqs, [Proposal(torch.tensor([1] * w), None, torch.tensor([0.95] * w)) for w in want])
        return want

    step(reqs[:1])                               # a search over an empty pool is redone next step
    calls.clear()
    for i in range(2 * pol.search_every):        # one request: one proposal a step
        assert max(step(reqs[:1])) > 0
        assert len(calls) == i // pol.search_every + 1
    step(reqs[:2])
    assert len(calls) == 3                       # more requests: searched at once
    step(reqs[:2])
    assert len(calls) == 3
    for i in range(3):                           # 16 proposals a step: 1/4 of the pool, searched each step
        step(reqs)
        assert len(calls) == 4 + i


def test_a_held_depth_is_searched_again_when_first_token_survival_falls():
    """A fall of the recent proposals' mean first-token survival by ``search_drift`` ends the hold at
    once, before ``search_every`` steps or 1/4 of the pool have passed."""
    from dspark.drafters.base import Proposal
    cheap = CostTable("tiny", requests=[1, 8], verified=[0, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.02, 1.05], [1.4, 1.45, 1.5]]], draft=[[[0, 0.01, 0.02], [0, 0.02, 0.03]]])
    pol = make_policy("prefix", 3, cost_table=cheap)
    inner, calls = pol._draft_depth, []
    pol._draft_depth = lambda *a: calls.append(1) or inner(*a)
    reqs = _requests(1)

    def step(conf):
        want = pol.draft_lengths(reqs, 3)
        pol.verify_lengths(reqs, [Proposal(torch.tensor([1] * w), None, torch.tensor([conf] * w)) for w in want])

    for _ in range(3):
        step(0.95)
    assert len(calls) == 2                       # the first search saw an empty pool
    step(0.95 - 8 * pol.search_drift)            # mean a_1 of 4 rows falls by 2 x search_drift
    step(0.95)
    assert len(calls) == 3


def test_recent_running_totals_match_the_last_rows():
    """RecentSurvivals's per-position totals (what expected_survivals reads) equal a recount over the rows
    it holds, through the ring's wrap-around, rows of every length and a widening row."""
    from dspark.scheduling.profile import RecentSurvivals
    rng = np.random.default_rng(0)
    ring, added = RecentSurvivals(5, width=3), []
    for i in range(23):
        row = list(np.cumprod(rng.random(rng.integers(1, 5 if i < 15 else 7))))
        ring.add(row)
        added.append(row)
        held = added[-5:]
        sums, counts = ring.sums(7)
        for k in range(7):
            assert counts[k] == sum(len(r) > k for r in held)
            assert sums[k] == pytest.approx(sum(r[k] for r in held if len(r) > k), abs=1e-12)


def test_vectorised_algorithm1_equals_the_loop():
    """prefix_schedule priced by one vectorised call (sps_many) picks what the candidate-by-candidate
    loop picks, on random monotone survivals and convex prices."""
    import numpy as np
    rng = np.random.default_rng(0)
    for _ in range(2000):
        R = int(rng.integers(1, 17))      # up to 16 x 7 candidates: both paths (the vectorised above 24)
        rows = [list(np.cumprod(rng.uniform(0.05, 1, int(rng.integers(0, 8))))) for _ in range(R)]
        base, slope, curve = rng.uniform(0.5, 2), rng.uniform(0, 0.3), rng.uniform(0, 0.02)

        def price(B):
            return base + slope * (B - R) + curve * (B - R) ** 2
        assert prefix_schedule(rows, lambda B: 1 / price(B)) == \
            prefix_schedule(rows, lambda B: 1 / price(B), sps_many=lambda Bs: 1 / price(np.asarray(Bs, float)))


def test_prefix_verifies_free_lookup_proposals_by_their_own_acceptance():
    """With the hybrid drafter's lookup serving, the prefix policy drafts the free proposals even
    where the trained drafter's call does not pay, learns their acceptance apart from the drafter's
    (starting at 1/2), and keeps the target's distribution."""
    from dspark.drafters import HybridDrafter, NgramDrafter
    target = tiny_target(scale=3.0)
    model = DSparkDrafter(tiny_drafter_model(target, scale=2.0), target)
    hybrid = HybridDrafter(NgramDrafter(block_size=3, history_tokens=0), model, min_match=1)
    dear = CostTable("tiny", requests=[1, 8, 32], verified=[0, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.02, 1.06], [1.4, 1.45, 1.55], [2.5, 2.6, 2.8]]],
                     draft=[[[0, 5.0, 5.0], [0, 5.0, 5.0], [0, 5.0, 5.0]]])    # the trained call never pays
    spy = _Spy(make_policy("prefix", 3, cost_table=dear))
    prompt, n_new, draws = [2, 0, 1, 2, 0, 1, 4], 4, 3000
    engine = Engine(target, hybrid, spy, max_requests=32, block_size=3, max_len=16)
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, top_k=4, seed=s), n_new,
                               exact_seed=False) for s in range(draws)]
    engine.run()
    lookup, trained = hybrid.served
    assert lookup > draws and trained < lookup / 20, hybrid.served     # probes only
    assert len(spy.lengths) >= 3 and sum(r.stats.num_accepted_tokens for r in reqs) > draws * 0.2
    assert spy.policy.free_profile.tries[0] > 100
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert chi2_pvalue(counts, exact_law(target, prompt, n_new, SamplingParams(temperature=1.0, top_k=4), VOCAB)) > 1e-3


def test_free_proposals_explored_alone_one_request_at_a_time():
    """Under a load where verifying a lookup's proposal does not pay, each request still explores
    its free proposals now and then (so that their acceptance keeps being learned), but a step that
    verifies nothing else explores for one request at most, and no more often than keeps their
    price within the probes' budget: one token verified alone makes the whole step ragged."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.base import RequestOutcome
    R = 32
    # verifying anything costs a step 25 % more: no lookup proposal pays at 1/2 acceptance, not even
    # all of them (32 + 32 x (1/2 + 1/4 + 1/8) tokens in 2 s against 32 in 1 s)
    dear = CostTable("tiny", requests=[1, 32], verified=[0, 0.125, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.25, 1.6, 2.0], [1.0, 1.25, 1.6, 2.0]]])
    policy = make_policy("prefix", 3, cost_table=dear)
    reqs = [RequestView(i, context=8, pending_rows=0, room=64) for i in range(R)]
    verifying = []
    for _ in range(80):
        policy.draft_lengths(reqs, 3, [3] * R)
        lengths = policy.verify_lengths(reqs, [Proposal(torch.tensor([5, 6, 7]), free=True) for _ in reqs])
        verifying.append(sum(1 for n in lengths if n))
        policy.observe(StepOutcome(tuple(RequestOutcome(i, 3, n, 0, free=True) for i, n in enumerate(lengths)),
                                   1.3 if any(lengths) else 1.0, True))
    assert max(verifying) == 1                        # never several requests' tokens alone
    # still learning, each lone token within the probes' budget of the plain steps' time
    assert 2 <= sum(verifying) <= 0.01 * 80 / (0.25 / 32 / 0.125) + 1


def test_lone_explorations_thin_out_when_verifying_costs_more_than_the_table_says():
    """A lone token is priced as the policy prices verification: the table's extra times rho, what
    verifying steps were measured to cost over it. Where a lone token costs three times the table's
    price, explorations come about a third as often, so they keep within their budget."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.base import RequestOutcome
    R = 32
    dear = CostTable("tiny", requests=[1, 32], verified=[0, 0.125, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.25, 1.6, 2.0], [1.0, 1.25, 1.6, 2.0]]])
    reqs = [RequestView(i, context=8, pending_rows=0, room=64) for i in range(R)]

    def explorations(lone_seconds):
        policy = make_policy("prefix", 3, cost_table=dear)
        count = 0
        for _ in range(600):
            policy.draft_lengths(reqs, 3, [3] * R)
            lengths = policy.verify_lengths(reqs, [Proposal(torch.tensor([5, 6, 7]), free=True) for _ in reqs])
            count += any(lengths)
            policy.observe(StepOutcome(tuple(RequestOutcome(i, 3, n, 0, free=True) for i, n in enumerate(lengths)),
                                       lone_seconds if any(lengths) else 1.0, True))
        return count, policy.cost.extra_scale
    as_priced, rho = explorations(1.0 + 0.25 / 4)      # a lone token as the table prices it
    dearer, rho_dear = explorations(1.0 + 3 * 0.25 / 4)
    assert rho == pytest.approx(1.0, abs=0.1) and rho_dear > 2.0
    assert 3 <= dearer <= 0.6 * as_priced


def test_lookups_rest_while_their_proposals_go_unverified_and_wake_when_one_is_verified():
    """A lookup per request costs a step time too: after ``free_rest_after`` steps whose free
    proposals the search verified none of, the policy asks for them every ``probe_every``-th step
    only; once one is verified again (here: the step's price falls), every step."""
    from dspark.drafters.base import Proposal
    from dspark.scheduling.base import RequestOutcome
    R = 32
    dear = CostTable("tiny", requests=[1, 32], verified=[0, 0.125, 1, 3], contexts=[8],
                     seconds=[[[1.0, 1.25, 1.6, 2.0], [1.0, 1.25, 1.6, 2.0]]])
    cheap = CostTable("tiny", requests=[1, 32], verified=[0, 0.125, 1, 3], contexts=[8],
                      seconds=[[[1.0, 1.01, 1.02, 1.03], [1.0, 1.01, 1.02, 1.03]]])
    policy = make_policy("prefix", 3, cost_table=dear)
    reqs = [RequestView(i, context=8, pending_rows=0, room=64) for i in range(R)]

    def run(steps, accept):
        asked = []
        for _ in range(steps):
            ask = policy.wants_free(reqs)
            asked.append(ask)
            policy.draft_lengths(reqs, 3, [3] * R if ask else None)
            props = [Proposal(torch.tensor([5, 6, 7]), free=True) if ask else Proposal.empty() for _ in reqs]
            lengths = policy.verify_lengths(reqs, props)
            policy.observe(StepOutcome(tuple(RequestOutcome(i, len(p), n, n if accept else 0, free=p.free)
                                             for i, (p, n) in enumerate(zip(props, lengths))), 1.0, True))
        return asked

    asked = run(80, False)
    assert all(asked[:policy.free_rest_after])
    rest = asked[policy.free_rest_after + 1:]
    assert 0 < sum(rest) <= len(rest) // policy.probe_every + 1
    policy.reprice(cheap)
    asked = run(24, True)
    assert all(asked[policy.probe_every:])
