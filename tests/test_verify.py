"""Rejection sampling keeps the target's distribution exactly: chi-square on seeded draws.

A synthetic target and drafter over a 4-token vocabulary, both context dependent, generate
3-token sequences through rounds of (draft l tokens, verify); the joint distribution of the
sequences must equal the target's own autoregressive distribution after temperature / top-k /
top-p. A deliberately biased verifier must fail the same test. The batched verifier (every request
of a step in one call) must give the per-request one's answers bit for bit, with one host
synchronisation.
"""

import functools
import itertools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.verify import stack_requests, target_rows, verify, verify_batch, verify_greedy, verify_probs

V, SEQ, DRAWS = 4, 3, 24000


def _table(seed):
    g = torch.Generator().manual_seed(seed)
    return {prefix: torch.randn(V, generator=g) * 1.5
            for n in range(SEQ + 4) for prefix in itertools.product(range(V), repeat=n)}


TARGET, DRAFT = _table(0), _table(1)


@functools.cache
def _draft_law(prefix, dparams):
    """The drafter's law after ``prefix`` (computed once: the rollouts ask for it again and again)."""
    return probs_from_logits(DRAFT[prefix], dparams)


def _rollout(tparams, dparams, l, gen, point_mass=False):
    """One draw, as a coroutine: yields each round's (draft tokens, draft probabilities or None,
    target logits [l + 1, V]), is sent (accepted, next token), returns the sequence."""
    out = []
    while len(out) < SEQ:
        drafts, qs = [], []
        for _ in range(l):
            q = _draft_law(tuple(out + drafts), dparams)
            x = int(q.argmax()) if point_mass else int(sample(q, gen))
            drafts.append(x)
            qs.append(q)
        logits = torch.stack([TARGET[tuple(out + drafts[:i])] for i in range(l + 1)])
        n, nxt = yield (torch.tensor(drafts, dtype=torch.long),
                        None if point_mass else torch.stack(qs) if qs else None, logits)
        out.extend(drafts[:n] + [nxt])
    return tuple(out[:SEQ])


def _draws_one_by_one(verifier, tparams, dparams, l, point_mass, seed):
    """DRAWS sequences, each round verified alone by ``verifier`` (``verify``'s signature)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(DRAWS):
        co = _rollout(tparams, dparams, l, gen, point_mass)
        block = next(co)
        while True:
            try:
                block = co.send(verifier(*block, tparams, gen))
            except StopIteration as done:
                yield done.value
                break


def _draws_batched(tparams, dparams, l, point_mass, seed, lanes=64):
    """DRAWS sequences from ``lanes`` rollouts in lockstep, each with its own generator (as the
    engine's requests have), every round of all lanes verified in one ``verify_batch`` call."""
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(lanes)]
    started = min(lanes, DRAWS)
    live = {i: _rollout(tparams, dparams, l, gens[i], point_mass) for i in range(started)}
    blocks = {i: next(co) for i, co in live.items()}
    while live:
        order = list(blocks)
        rows = target_rows(torch.cat([blocks[i][2] for i in order]), tparams)   # row-wise: one call
        per = rows.split([blocks[i][2].shape[0] for i in order])
        got = verify_batch(*stack_requests([(blocks[i][0], blocks[i][1], r, tparams.greedy, gens[i])
                                            for i, r in zip(order, per)]))
        for i, res in zip(order, got):
            assert res is not None
            try:
                blocks[i] = live[i].send(res)
            except StopIteration as done:
                yield done.value
                if started < DRAWS:
                    started += 1
                    live[i] = _rollout(tparams, dparams, l, gens[i], point_mass)
                    blocks[i] = next(live[i])
                else:
                    del live[i], blocks[i]


def _per_request(*args):
    return _draws_one_by_one(verify, *args)


VERIFIERS = pytest.mark.parametrize("draws", [_per_request, _draws_batched], ids=["per_request", "batched"])


def _exact(tparams):
    exp = {}
    for seq in itertools.product(range(V), repeat=SEQ):
        p = 1.0
        for i in range(SEQ):
            p *= float(probs_from_logits(TARGET[seq[:i]], tparams)[seq[i]])
        exp[seq] = p
    return exp


def _chi2(tparams, dparams, l, draws, point_mass=False, seed=0):
    counts: dict = {}
    for s in draws(tparams, dparams, l, point_mass, seed):
        counts[s] = counts.get(s, 0) + 1
    assert sum(counts.values()) == DRAWS
    exp = _exact(tparams)
    impossible = [s for s, p in exp.items() if p == 0 and counts.get(s, 0)]
    assert not impossible, f"emitted sequences the target can never produce: {impossible[:3]}"
    cells = [s for s, p in exp.items() if p > 0]
    obs = np.array([counts.get(s, 0) for s in cells], dtype=float)
    e = np.array([exp[s] for s in cells])
    return chisquare(obs, e / e.sum() * obs.sum()).pvalue


SETTINGS = [
    (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), 2),
    (SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.2), 3),
    (SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.8, top_k=2), 2),
    (SamplingParams(temperature=1.0, top_k=2, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.7), 1),
]


@VERIFIERS
@pytest.mark.parametrize("tparams,dparams,l", SETTINGS)
def test_verifier_keeps_target_distribution(tparams, dparams, l, draws):
    assert _chi2(tparams, dparams, l, draws) > 1e-3


@VERIFIERS
def test_point_mass_drafts_keep_target_distribution(draws):
    assert _chi2(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), 2, draws,
                 point_mass=True) > 1e-3


def _biased_verify(draft_tokens, draft_probs, target_logits, params, gen):
    """Wrong on purpose: after a rejection it resamples from p instead of norm(max(0, p - q))."""
    p = probs_from_logits(target_logits, params)
    n, _ = verify_probs(draft_tokens, draft_probs, p, gen)
    return n, int(sample(p[n], gen))


def test_biased_verifier_is_caught():
    tparams, dparams, l = SETTINGS[0]
    assert _chi2(tparams, dparams, l, lambda *a: _draws_one_by_one(_biased_verify, *a)) < 1e-6


def test_greedy_accepts_while_draft_matches_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]])
    assert verify_greedy(torch.tensor([1, 0, 2]), logits) == (3, 0)   # all accepted + bonus
    assert verify_greedy(torch.tensor([1, 2, 2]), logits) == (1, 0)   # mismatch at 2nd: emit argmax
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 1)
    # the general rule at temperature 0 gives the same answer, whatever the draft probabilities
    g = torch.Generator().manual_seed(0)
    q = torch.full((3, 3), 1 / 3)
    assert verify(torch.tensor([1, 2, 2]), q, logits, SamplingParams(temperature=0), g) == (1, 0)
    assert verify_probs(torch.tensor([1, 2, 2]), q, probs_from_logits(logits, SamplingParams(0)), g) == (1, 0)


def test_zero_mass_residual_falls_back_to_target():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # p == q: every draft is accepted, and no residual is ever needed
        n, t = verify_probs(torch.tensor([0]), q, p, g)
        assert n == 1
    # force the rejection branch with p == q at a zero-probability draft
    p0 = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    n, t = verify_probs(torch.tensor([0]), torch.tensor([[0.0, 1.0, 0.0]]), p0, g)
    assert (n, t) == (0, 1)


def test_wrong_number_of_target_rows():
    with pytest.raises(ValueError):
        verify(torch.tensor([1]), None, torch.zeros(1, 3), SamplingParams(), None)


# ------------------------------------------------------------------------------------ batched
LAWS = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, top_k=2, top_p=0.9)]


def _case(rng, vocab, g):
    """One request's (drafts, their probabilities or None, target logits, settings, what it tests)."""
    l = rng.choice([0, 0, 1, 2, 3, 5])
    params = rng.choice(LAWS)
    kind = rng.choice(["probs", "point mass", "probs", "zero residual"])
    logits = torch.randn(l + 1, vocab, generator=g) * rng.choice([0.5, 2.0, 6.0])
    p = probs_from_logits(logits, params if not params.greedy else SamplingParams())
    if kind == "point mass":     # mostly the target's likeliest token, so that some are accepted
        drafts = [int(p[k].argmax()) if rng.random() < 0.7 else rng.randrange(vocab) for k in range(l)]
        return torch.tensor(drafts, dtype=torch.long), None, logits, params, kind
    q = probs_from_logits(torch.randn(l, vocab, generator=g), rng.choice(LAWS[1:])) if l else torch.zeros(0, vocab)
    drafts = [int(sample(q[k], g)) for k in range(l)]
    if kind == "zero residual" and l and bool((p[0] == 0).any()):
        # q == p at a draft p gives probability 0: rejected for certain, and the residual has no mass
        q[0] = p[0]
        drafts[0] = int((p[0] == 0).nonzero()[0, 0])
    else:
        kind = "probs"
    return torch.tensor(drafts, dtype=torch.long), q, logits, params, kind


def test_batched_verification_equals_the_per_request_one_bit_for_bit():
    """verify_batch on seeded random steps (1 - 6 requests mixing lengths 0 - 5, greedy and sampled
    rows, draft probabilities and point masses, top-k / top-p laws, residuals with no mass): the same
    (n, token) per request as ``verify`` from the same generator states, which it leaves as
    ``verify`` does (the next draw agrees too)."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for step in range(300):
        vocab = rng.choice([3, 5, 40])
        cases = [_case(rng, vocab, g) for _ in range(rng.randrange(1, 7))]
        if step % 2:    # every request's rows consecutive in one tensor, as the engine's logits are
            rows = torch.cat([c[2] for c in cases]).split([c[2].shape[0] for c in cases])
            cases = [(x, q, r, params, kind) for (x, q, _, params, kind), r in zip(cases, rows)]
        mine = [torch.Generator().manual_seed(1000 * step + i) for i in range(len(cases))]
        ref = [torch.Generator().manual_seed(1000 * step + i) for i in range(len(cases))]
        want = [verify(x, q, logits, params, r) for (x, q, logits, params, _), r in zip(cases, ref)]
        got = verify_batch(*stack_requests([(x, q, target_rows(logits, params), params.greedy, m)
                                            for (x, q, logits, params, _), m in zip(cases, mine)]))
        assert got == want, f"step {step}"
        for m, r in zip(mine, ref):
            assert torch.equal(m.get_state(), r.get_state()), f"step {step}: the random streams parted"
        for (x, _, _, params, kind), (n, _) in zip(cases, want):
            seen.add(("greedy" if params.greedy else kind, len(x) == 0, n == len(x)))
    for kind in ("greedy", "probs", "point mass"):
        assert {(kind, False, False), (kind, False, True), (kind, True, True)} <= seen, kind
    assert ("zero residual", False, False) in seen


def test_a_greedy_step_verified_at_once_equals_the_per_request_one():
    """verify_batch's all-greedy path: the same (n, token) as ``verify_greedy`` per request (lengths
    0 - 5, ties in the argmax, drafts that match wholly or not at all), None where a row is NaN."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for step in range(200):
        vocab = rng.choice([2, 3, 40])
        lengths = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 7))]
        logits = torch.randint(0, 3, (sum(lengths) + len(lengths), vocab), generator=g).float()   # ties
        blocks = logits.split([l + 1 for l in lengths])
        drafts = [b[:-1].argmax(-1) if rng.random() < 0.4 else torch.randint(0, vocab, (len(b) - 1,), generator=g)
                  for b in blocks]
        if step % 10 == 0:
            blocks[0][-1, 0] = float("nan")
        got = verify_batch(*stack_requests([(x, None, b, True, None) for x, b in zip(drafts, blocks)]))
        want = [None if b.isnan().any() else verify_greedy(x, b) for x, b in zip(drafts, blocks)]
        assert got == want, f"step {step}"


def test_stacked_rows_are_taken_as_given():
    """The caller's one tensor of target rows is used as it is; draft probabilities are passed per
    request as they are (never concatenated: only their drafts' entries and one row are read)."""
    logits = torch.randn(9, 5)
    blocks = [(torch.tensor([1, 2]), None, logits[:3], True, None), (torch.tensor([3]), None, logits[3:5], True, None)]
    target = stack_requests(blocks, logits[:5])[2]
    assert target is not None and target.data_ptr() == logits.data_ptr()
    apart = stack_requests([blocks[0], (torch.tensor([3]), None, logits[4:6], True, None)])[2]
    assert torch.equal(apart, torch.cat([logits[:3], logits[4:6]]))
    q = torch.rand(2, 4, 5)      # a drafter's [requests, block, V] output, each request's first rows taken
    _, probs, _, _ = stack_requests([(torch.tensor([1, 2]), q[0, :2], torch.rand(3, 5), False, None),
                                     (torch.tensor([3]), q[1, :1], torch.rand(2, 5), True, None)])
    assert probs[0] is not None and probs[0].data_ptr() == q.data_ptr() and probs[1] is None


def test_batched_verification_does_not_depend_on_how_draft_probabilities_lie_in_memory():
    """The same answers whether each request's draft probabilities are its own tensor, rows of one
    [requests, block, V] output, or a transposed (non-contiguous) view."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    lengths, vocab = [3, 1, 4], 11
    out = probs_from_logits(torch.randn(3, 5, vocab, generator=g), params)      # [requests, block, V]
    logits = [torch.randn(l + 1, vocab, generator=g) for l in lengths]
    drafts = [torch.multinomial(out[i, :l], 1, generator=g).squeeze(-1) for i, l in enumerate(lengths)]
    layouts = {"views": [out[i, :l] for i, l in enumerate(lengths)],
               "own": [out[i, :l].clone() for i, l in enumerate(lengths)],
               "transposed": [out.transpose(0, 2).contiguous().transpose(0, 2)[i, :l] for i, l in enumerate(lengths)]}
    assert not layouts["transposed"][0].is_contiguous()
    answers = {}
    for name, qs in layouts.items():
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        answers[name] = verify_batch(*stack_requests([(x, qi, target_rows(lg, params), False, gi)
                                                      for x, qi, lg, gi in zip(drafts, qs, logits, gens)]))
    ref = [verify(x, out[i, :l], lg, params, torch.Generator().manual_seed(i))
           for i, (x, l, lg) in enumerate(zip(drafts, lengths, logits))]
    assert answers["views"] == answers["own"] == answers["transposed"] == ref


def test_batched_verification_fails_a_request_whose_law_holds_nan_alone():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(3, 5, generator=g) for _ in range(3)]
    logits[1][2, 3] = float("nan")
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    drafts = torch.tensor([1, 2])
    mine = [torch.Generator().manual_seed(i) for i in range(3)]
    ref = [torch.Generator().manual_seed(i) for i in range(3)]
    got = verify_batch(*stack_requests([(drafts, None, target_rows(lg, pr), pr.greedy, m)
                                        for lg, pr, m in zip(logits, params, mine)]))
    assert got[1] is None
    assert got[0] == verify(drafts, None, logits[0], params[0], ref[0])
    assert got[2] == verify(drafts, None, logits[2], params[2], ref[2])
    nan_greedy = logits[2].clone()
    nan_greedy[0, 0] = float("nan")
    assert verify_batch(*stack_requests([(drafts, None, target_rows(nan_greedy, params[2]), True, None)])) == [None]


def test_batched_verification_refuses_what_it_cannot_reproduce():
    p = probs_from_logits(torch.zeros(3, 4), SamplingParams())
    shared = torch.Generator().manual_seed(0)
    x = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="generator of its own"):   # it is set back after the draws
        verify_batch(*stack_requests([(x, None, p, False, shared), (x, None, p, False, shared)]))
    with pytest.raises(ValueError, match="generator of its own"):
        verify_batch(*stack_requests([(x, None, p, False, None)]))
    with pytest.raises(ValueError, match="target rows"):
        verify_batch(*stack_requests([(x, None, p[:2], False, shared)]))
    with pytest.raises(ValueError, match="draft probabilities"):
        tokens, _, target, batch = stack_requests([(x, p[:2], p, False, shared)])
        verify_batch(tokens, None, target, batch)
    assert verify_batch(*stack_requests([])) == []


SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def _counted(real, name, calls):
    def counted(self, *a, **k):
        calls.append(name)
        return real(self, *a, **k)
    return counted


def _mixed_step(device="cpu"):
    """Arguments of verify_batch for a step holding every kind of request, and the per-request answers."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    cases = [_case(rng, 40, g) for _ in range(24)]
    kinds = {("greedy" if c[3].greedy else c[4], len(c[0]) > 0) for c in cases}
    assert {("greedy", True), ("probs", True), ("point mass", True), ("probs", False)} <= kinds
    # the answers per request on the same device: a device's random stream is its own
    ref = [verify(x, None if q is None else q.to(device), logits.to(device), params, torch.Generator(device).manual_seed(i))
           for i, (x, q, logits, params, _) in enumerate(cases)]
    args = stack_requests([(x, None if q is None else q.to(device), target_rows(logits.to(device), params),
                            params.greedy, torch.Generator(device).manual_seed(i))
                           for i, (x, q, logits, params, _) in enumerate(cases)])
    return args, ref


def test_batched_verification_synchronises_with_the_host_once(monkeypatch):
    """One transfer of the step's answers (a ``tolist``), none per request: every way a tensor's
    value reaches Python is counted."""
    args, ref = _mixed_step()
    calls: list[str] = []
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, _counted(getattr(torch.Tensor, name), name, calls))
    got = verify_batch(*args)
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert got == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_verification_synchronises_with_the_device_once():
    """On a GPU (torch's sync debug mode reports each synchronisation): one, and the same answers."""
    import warnings
    args, ref = _mixed_step("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = verify_batch(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
    assert got == ref
