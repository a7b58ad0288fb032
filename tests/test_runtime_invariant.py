"""Batch-invariant attention (runtime/invariant.py): a row decoded alone and the same row inside a
verified block get the same bits, so bf16 greedy speculative decoding equals bf16 plain decoding."""

import pytest
import torch

from dspark.drafters import load_drafter
from dspark.evaluation.identity import first_divergence
from dspark.generation import generate_ids
from dspark.runtime.invariant import attend_grouped, attend_rows
from dspark.runtime.kv_cache import KEY_BUCKET
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams

from test_runtime_model import _tiny


@pytest.mark.parametrize("heads", [(9, 3), (4, 2), (8, 8)])
def test_a_row_attends_bit_for_bit_alike_alone_and_inside_a_block(heads):
    """Wherever the block starts against the key buckets, for every GQA layout: the row alone, the
    row inside a causal block, and the row grouped and padded as the forward prepares decoding rows
    give the same bits, and the right values (float64 reference)."""
    H, Hkv = heads
    rep, hd, cap = H // Hkv, 64, 40 * KEY_BUCKET
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(Hkv, cap, hd, generator=g), torch.randn(Hkv, cap, hd, generator=g)
    for start in (0, 5, KEY_BUCKET - 1, KEY_BUCKET, 100, 293, 300, cap - 12):
        for n in (1, 2, 3, 8, 11):
            q = torch.randn(n, H, hd, generator=g)
            tri = torch.full((n, n), float("-inf")).triu_(1) if n > 1 else None
            block = torch.empty(n, H * hd)
            attend_rows(q, k, v, tri, block, start)
            for i in range(n):
                row = torch.empty(1, H * hd)
                attend_rows(q[i:i + 1], k, v, None, row, start + i)
                assert torch.equal(row[0], block[i]), (start, n, i)
                qg = torch.zeros(Hkv, max(rep, 4), hd)
                qg[:, :rep] = q[i].view(Hkv, rep, hd)
                og = torch.empty_like(qg)
                attend_grouped(qg, k, v, None, og, start + i)
                assert torch.equal(og[:, :rep].reshape(-1), block[i]), (start, n, i)
                L = start + i + 1
                s = q[i].reshape(Hkv, rep, hd).double() @ k[:, :L].double().transpose(1, 2)
                ref = (torch.softmax(s, -1) @ v[:, :L].double()).reshape(-1)
                assert (ref - block[i].double()).abs().max() < 1e-4


def test_bf16_decoding_and_verifying_a_block_give_the_same_logits():
    """bf16 runtime (fp32 attention): logits of tokens decoded one at a time equal those of the same
    tokens verified as one block after a rollback, bit for bit, beside other requests' rows."""
    model = Decoder.from_hf(_tiny("qwen2"), dtype=torch.bfloat16)
    model.batch_invariant = True
    g = torch.Generator().manual_seed(1)
    prompt, other, block = (torch.randint(0, 97, (n,), generator=g) for n in (21, 30, 8))
    cache = model.new_cache(2, 64)
    a, b = cache.allocate(), cache.allocate()
    model(prompt, [(a, 21)], cache, logits_rows=None)
    model(other[:20], [(b, 20)], cache, logits_rows=None)
    one_by_one = torch.cat([model(block[i:i + 1], [(a, 1)], cache).logits for i in range(8)])
    cache.truncate(a, 21)
    at_once = model(torch.cat([block, other[20:23]]), [(a, 8), (b, 3)], cache).logits[:8]
    assert torch.equal(one_by_one, at_once)


def test_bf16_greedy_speculative_equals_plain_decoding(bench_prompts):
    """With the flag, bf16 (the fast dtype) keeps greedy identity on the benchmark prompts."""
    from dspark.runtime.loading import load_target
    target = load_target(dtype="bf16", batch_invariant=True)
    assert target.model.batch_invariant
    drafter = load_drafter("ngram+dspark", target)
    greedy, accepted = SamplingParams(temperature=0), 0
    for prompt in bench_prompts[::2]:       # two humaneval, one gsm8k, one mt-bench
        plain = generate_ids(target.model, prompt, greedy, 64, None, eos_ids=target.eos_token_ids)[0]
        spec, stats = generate_ids(target.model, prompt, greedy, 64, drafter, eos_ids=target.eos_token_ids)
        assert spec == plain, f"bf16 output diverges from plain decoding at token {first_divergence(spec, plain)}"
        accepted += stats.num_accepted_tokens
    assert accepted > 0
