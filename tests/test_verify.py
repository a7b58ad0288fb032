"""Rejection sampling keeps the target's distribution exactly: chi-square on seeded draws.

A synthetic target and drafter over a 4-token vocabulary, both context dependent, generate
3-token sequences through rounds of (draft l tokens, verify); the joint distribution of the
sequences must equal the target's own autoregressive distribution after temperature / top-k /
top-p. A deliberately biased verifier must fail the same test.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.verify import verify, verify_greedy, verify_probs

V, SEQ, DRAWS = 4, 3, 24000


def _table(seed):
    g = torch.Generator().manual_seed(seed)
    return {prefix: torch.randn(V, generator=g) * 1.5
            for n in range(SEQ + 4) for prefix in itertools.product(range(V), repeat=n)}


TARGET, DRAFT = _table(0), _table(1)


def _rollout(tparams, dparams, l, gen, verifier, point_mass=False):
    out = []
    while len(out) < SEQ:
        drafts, qs = [], []
        for _ in range(l):
            q = probs_from_logits(DRAFT[tuple(out + drafts)], dparams)
            if point_mass:
                x = int(q.argmax())
            else:
                x = int(sample(q, gen))
            drafts.append(x)
            qs.append(q)
        logits = torch.stack([TARGET[tuple(out + drafts[:i])] for i in range(l + 1)])
        n, nxt = verifier(torch.tensor(drafts, dtype=torch.long),
                          None if point_mass else torch.stack(qs) if qs else None,
                          logits, tparams, gen)
        out.extend(drafts[:n] + [nxt])
    return tuple(out[:SEQ])


def _exact(tparams):
    exp = {}
    for seq in itertools.product(range(V), repeat=SEQ):
        p = 1.0
        for i in range(SEQ):
            p *= float(probs_from_logits(TARGET[seq[:i]], tparams)[seq[i]])
        exp[seq] = p
    return exp


def _chi2(tparams, dparams, l, verifier, point_mass=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(DRAWS):
        s = _rollout(tparams, dparams, l, gen, verifier, point_mass)
        counts[s] = counts.get(s, 0) + 1
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


@pytest.mark.parametrize("tparams,dparams,l", SETTINGS)
def test_verifier_keeps_target_distribution(tparams, dparams, l):
    assert _chi2(tparams, dparams, l, verify) > 1e-3


def test_point_mass_drafts_keep_target_distribution():
    assert _chi2(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), 2, verify,
                 point_mass=True) > 1e-3


def _biased_verify(draft_tokens, draft_probs, target_logits, params, gen):
    """Wrong on purpose: after a rejection it resamples from p instead of norm(max(0, p - q))."""
    p = probs_from_logits(target_logits, params)
    n, _ = verify_probs(draft_tokens, draft_probs, p, gen)
    return n, int(sample(p[n], gen))


def test_biased_verifier_is_caught():
    tparams, dparams, l = SETTINGS[0]
    assert _chi2(tparams, dparams, l, _biased_verify) < 1e-6


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
