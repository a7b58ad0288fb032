import pytest
import torch

from dspark.errors import UsageError
from dspark.sampling import SamplingParams, argmax, penalised_logits, probs_from_logits, sample_from_logits

from _lossless import naive_penalised


def test_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    full = probs_from_logits(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(full, logits.softmax(-1))
    hot = probs_from_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(hot, (logits / 0.5).softmax(-1))
    k2 = probs_from_logits(logits, SamplingParams(top_k=2))
    assert (k2[2:] == 0).all() and abs(float(k2.sum()) - 1) < 1e-6
    assert torch.equal(probs_from_logits(logits, SamplingParams(top_k=-1)), full)
    # top-p keeps the smallest prefix reaching p (the first token always stays)
    p = probs_from_logits(logits, SamplingParams(top_p=0.7))
    kept = (p > 0).sum().item()
    assert full[:kept - 1].sum() < 0.7 <= full[:kept].sum()
    assert (probs_from_logits(logits, SamplingParams(top_p=1e-6)) > 0).sum() == 1
    greedy = probs_from_logits(logits, SamplingParams(temperature=0))
    assert greedy.tolist() == [1.0, 0, 0, 0, 0]


def test_probabilities_are_fp32_from_bf16_logits():
    logits = torch.randn(3, 50).to(torch.bfloat16)
    p = probs_from_logits(logits, SamplingParams(top_p=0.9))
    assert p.dtype == torch.float32
    tok, probs = sample_from_logits(logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert tok.shape == (3,) and probs.dtype == torch.float32


def test_seeded_generator_repeats():
    logits = torch.randn(100)
    a = [int(sample_from_logits(logits, SamplingParams(seed=5), g)[0])
         for g in [SamplingParams(seed=5).generator()] for _ in range(20)]
    b = [int(sample_from_logits(logits, SamplingParams(seed=5), g)[0])
         for g in [SamplingParams(seed=5).generator()] for _ in range(20)]
    assert a == b


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(top_k=1.5), dict(seed=-1), dict(presence_penalty=2.5),
                                    dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
                                    dict(repetition_penalty=float("inf")), dict(logit_bias=((1, 200.0),)),
                                    dict(logit_bias=((1, 1.0), (1, 2.0))), dict(logit_bias=((-1, 1.0),))])
def test_bad_settings_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        SamplingParams(**kwargs)


def _chi2_pvalue(counts, probs):
    from scipy.stats import chisquare
    keep = probs > 0
    n = counts.sum()
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return chisquare(counts[keep], probs[keep] / probs[keep].sum() * n).pvalue


def test_sample_rows_matches_each_rows_distribution():
    """Batched inverse-CDF sampling: each row's tokens follow that row's probabilities (chi-square,
    20k seeded draws per row, zero-probability tokens never drawn); a sampler that draws every row
    from the first row's distribution fails the same test."""
    from dspark.sampling import sample_rows
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0],
                           [-1.0, 0.0, 3.0, 0.2, -0.5, 1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    probs = torch.stack([probs_from_logits(logits[0], SamplingParams(top_k=3)),
                         probs_from_logits(logits[1], SamplingParams(top_p=0.8)),
                         probs_from_logits(logits[2], SamplingParams())])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    n = 20_000
    draws = torch.stack([sample_rows(probs, gens) for _ in range(n)])     # [n, 3]
    for i in range(3):
        counts = torch.bincount(draws[:, i], minlength=6).double()
        assert _chi2_pvalue(counts.numpy(), probs[i].double().numpy()) > 1e-3
    biased = torch.bincount(draws[:, 1], minlength=6).double().numpy()
    with pytest.raises(AssertionError):    # row 1's draws are not row 0's distribution
        assert _chi2_pvalue(biased, probs[0].double().numpy()) > 1e-3
    # each row depends only on its own generator: the same seed gives the same tokens in any batch
    solo = sample_rows(probs[1:2], [torch.Generator().manual_seed(7)])
    batch = sample_rows(probs, [torch.Generator().manual_seed(9), torch.Generator().manual_seed(7),
                                torch.Generator().manual_seed(9)])
    assert int(solo[0]) == int(batch[1])


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers, written out: temperature, top-k (ties at the k-th value kept), then
    top-p over the survivors (a token goes when the ones before it already reach p)."""
    x = logits.float() / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        pr = x.softmax(-1)
        out = torch.full_like(x, float("-inf"))
        for r in range(x.shape[0]):
            order = sorted(range(x.shape[1]), key=lambda i: -float(pr[r, i]))
            mass = 0.0
            for i in order:
                if mass >= top_p:
                    break
                out[r, i] = x[r, i]
                mass += float(pr[r, i])
        x = out
    return x.softmax(-1)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (5, 0.6), (40, 0.8), (0, 0.8), (3, 0.999)])
def test_top_k_top_p_match_the_reference(top_k, top_p):
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 3).to(torch.bfloat16)    # bf16: ties at the k-th value happen
    logits[0, :10] = logits[0, 0]                            # a row with a tie across the top-k cut
    logits[1, 100:140] = logits[1].max() + 1                 # more ties than the fast path looks at
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    want = _reference_probs(logits, 0.7, top_k, top_p)
    # row by row (as verification calls it: the rows without a tie take the k-value path) and batched
    for got in (torch.stack([probs_from_logits(row, params) for row in logits]), probs_from_logits(logits, params)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert ((got > 0) == (want > 0)).all()


@pytest.mark.parametrize("pen", [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4),
                                 dict(repetition_penalty=1.6), dict(repetition_penalty=0.5),
                                 dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.2),
                                 dict(logit_bias=((3, 2.5), (10, -4.0)), repetition_penalty=1.4)])
def test_penalties_match_a_token_by_token_reference_along_the_drafts(pen):
    """Row k is penalised for the output so far plus the first k drafts."""
    torch.manual_seed(0)
    params = SamplingParams(**pen)
    assert params.penalised and not SamplingParams().penalised
    prompt, output, drafts = [1, 4, 4, 9], [2, 7, 2], torch.tensor([7, 3, 3, 10])
    logits = torch.randn(5, 11, dtype=torch.bfloat16) * 3
    got = penalised_logits(logits, params, prompt, output, drafts)
    assert got.dtype == torch.float32
    for k in range(5):
        want = naive_penalised(logits[k], params, prompt, output + drafts[:k].tolist())
        torch.testing.assert_close(got[k], want)
    assert torch.equal(penalised_logits(logits[:1], params, prompt, []),
                       naive_penalised(logits[0], params, prompt, [])[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 7), (3, 49152), (8, 8192), (33, 1000)])
def test_argmax_is_torchs_argmax_with_ties_and_nans(dtype, rows, width):
    """sampling.argmax (read from torch.max) picks argmax's index: the first of tied maxima, the
    first NaN where a row has one, at widths past the kernels' vector and thread splits."""
    g = torch.Generator().manual_seed(rows * width)
    # few distinct values: ties of the largest are frequent, also across the halves of a row
    x = torch.randint(0, 4, (rows, width), generator=g).to(dtype)
    x[0, :width // 2] = x[0, :width // 2].clamp(max=2)     # row 0's first maximum: its middle
    x[0, width // 2:] = 3
    if rows > 1:
        x[1, torch.randint(0, width, (3,), generator=g)] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[0]), x[0].argmax(-1))


@pytest.mark.parametrize("vocab", [6, 200])
def test_race_sampling_matches_each_rows_distribution(vocab, monkeypatch):
    """race_sample (the seeded requests' sampler): over 20k keys (seeds) each row's tokens follow
    its probabilities (chi-square), through the one-by-one race and the tail group (forced by a head
    of 3), zero-probability tokens never drawn; racing on the probabilities squared fails the test."""
    import dspark.sampling as sampling
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 2
    probs = torch.stack([probs_from_logits(logits[0], SamplingParams(top_k=4)),
                         probs_from_logits(logits[1], SamplingParams(top_p=0.9)),
                         probs_from_logits(logits[2], SamplingParams())])
    n = 20_000
    seeds = list(range(n))
    for head in (64, 3):
        monkeypatch.setattr(sampling, "RACE_HEAD", head)
        for i in range(3):
            toks = sampling.race_sample(probs[i].expand(n, vocab), seeds, [5] * n)
            counts = torch.bincount(toks, minlength=vocab).double().numpy()
            assert _chi2_pvalue(counts, probs[i].double().numpy()) > 1e-3
        squared = sampling.race_sample(probs[2].pow(2).expand(n, vocab), seeds, [5] * n)
        with pytest.raises(AssertionError):
            assert _chi2_pvalue(torch.bincount(squared, minlength=vocab).double().numpy(),
                                probs[2].double().numpy()) > 1e-3
    # keyed: the same (seed, position) draws the same token in any batch; another position draws anew
    one = sampling.race_sample(probs[2:3], [7], [11])
    batch = sampling.race_sample(probs, [3, 9, 7], [11, 11, 11])
    assert int(one[0]) == int(batch[2])
    later = sampling.race_sample(probs[2].expand(64, vocab), [7] * 64, list(range(64)))
    assert len(set(later.tolist())) > 1


def test_race_sampling_couples_close_laws():
    """With the same keys, two laws draw the same token with probability between (1 - TV) / (1 + TV),
    the Gumbel-max coupling's guarantee, and 1 - TV = sum min(p, q), the most any coupling gives
    (here their top tokens swap ranks); independent draws agree far less often."""
    from dspark.sampling import race_sample
    torch.manual_seed(3)
    logits = torch.randn(500) * 3
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(500) * 0.5, -1)
    n = 20_000
    seeds = list(range(n))
    same = (race_sample(p.expand(n, -1), seeds, [0] * n) == race_sample(q.expand(n, -1), seeds, [0] * n))
    best = float(torch.minimum(p, q).sum())
    independent = float((p * q).sum())
    tv = 1 - best
    match = float(same.double().mean())
    assert (1 - tv) / (1 + tv) - 0.01 < match <= best + 0.01 and independent < match - 0.5, (match, best, independent)
