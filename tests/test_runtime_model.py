"""Our decoder's logits, features and cache against transformers on tiny random configs."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dspark.runtime.model import Decoder

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _tiny(family):
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                      "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    elif family == "llama-untied":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False, attention_bias=True))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24))
    elif family == "gemma3":
        cfg = Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               final_logit_softcapping=30.0)
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    # random init leaves norms at 1 and biases at 0; perturb everything so each weight matters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


FAMILIES = ["llama", "llama-untied", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_with_cache_and_rollback(family, invariant):
    hf = _tiny(family)
    dec = Decoder.from_hf(hf, dtype=torch.float32)
    dec.batch_invariant = invariant
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    cache = dec.new_cache(num_slots=2, max_len=64)
    slot = cache.allocate()
    # prefill 10, then a block of 6, roll back 2 of them, then the rest one by one and a block
    out1 = dec(ids[0, :10], [(slot, 10)], cache, feature_layers=(0, 1))
    out2 = dec(ids[0, 10:16], [(slot, 6)], cache)
    cache.truncate(slot, 14)
    rest = [dec(ids[0, i:i + 1], [(slot, 1)], cache) for i in range(14, 18)]
    out4 = dec(ids[0, 18:23], [(slot, 5)], cache)
    logits = torch.cat([out1.logits, out2.logits[:4]] + [o.logits for o in rest] + [out4.logits])
    torch.testing.assert_close(logits, ref.logits[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out1.features[0], ref.hidden_states[1][0, :10], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out1.features[1], ref.hidden_states[2][0, :10], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out1.last_hidden, ref.hidden_states[3][0, :10], atol=1e-5, rtol=1e-4)
    assert cache.lengths[slot] == 23


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ragged_batch_equals_separate_requests(family):
    hf = _tiny(family)
    dec = Decoder.from_hf(hf, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, 97, (n,), generator=g) for n in (9, 4, 12))
    cache = dec.new_cache(num_slots=3, max_len=32)
    sa, sb, sc = cache.allocate(), cache.allocate(), cache.allocate()
    dec(a[:7], [(sa, 7)], cache)
    dec(c[:3], [(sc, 3)], cache)
    out = dec(torch.cat([a[7:], b, c[3:]]), [(sa, 2), (sb, 4), (sc, 9)], cache)
    with torch.no_grad():
        for seq, rows in ((a, slice(0, 2)), (b, slice(2, 6)), (c, slice(6, 15))):
            n = rows.stop - rows.start
            ref = hf(seq.unsqueeze(0)).logits[0, -n:]
            torch.testing.assert_close(out.logits[rows], ref, atol=2e-5, rtol=1e-4)
    last = dec(torch.tensor([1, 2, 3]), [(sa, 1), (sb, 1), (sc, 1)], cache, logits_rows="last")
    assert last.logits.shape == (3, 97)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_short_segments_beside_a_prefill_and_a_free_slot(family, invariant):
    """One forward mixing a decoding row, short blocks and a 20-token prefill, with a free slot among
    the used ones: every row's key / value lands in its own slot (one indexed write) and every
    segment's logits equal transformers."""
    hf = _tiny(family)
    dec = Decoder.from_hf(hf, dtype=torch.float32)
    dec.batch_invariant = invariant
    g = torch.Generator().manual_seed(4)
    a, c, d = (torch.randint(0, 97, (n,), generator=g) for n in (12, 15, 24))
    cache = dec.new_cache(num_slots=4, max_len=40)
    sa, gap, sc, sd = (cache.allocate() for _ in range(4))
    cache.free(gap)
    dec(a[:10], [(sa, 10)], cache)
    dec(c[:3], [(sc, 3)], cache)
    out = dec(torch.cat([a[10:11], c[3:12], d[:20]]), [(sa, 1), (sc, 9), (sd, 20)], cache)
    nxt = dec(torch.cat([a[11:12], c[12:15], d[20:24]]), [(sa, 1), (sc, 3), (sd, 4)], cache)
    with torch.no_grad():
        for o, seq, end, rows in ((out, a, 11, slice(0, 1)), (out, c, 12, slice(1, 10)), (out, d, 20, slice(10, 30)),
                                  (nxt, a, 12, slice(0, 1)), (nxt, c, 15, slice(1, 4)), (nxt, d, 24, slice(4, 8))):
            n = rows.stop - rows.start
            ref = hf(seq[:end].unsqueeze(0)).logits[0, -n:]
            torch.testing.assert_close(o.logits[rows], ref, atol=2e-5, rtol=1e-4)
    assert [cache.lengths[s] for s in (sa, sc, sd)] == [12, 15, 24]


def test_bf16_close_to_fp32():
    hf = _tiny("qwen3")
    ids = torch.randint(0, 97, (15,), generator=torch.Generator().manual_seed(3))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        dec = Decoder.from_hf(hf, dtype=dtype)
        cache = dec.new_cache(1, 32)
        outs.append(dec(ids, [(cache.allocate(), 15)], cache).logits.float())
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[0].abs().max()


def test_truncated_shares_weights():
    dec = Decoder.from_hf(_tiny("llama"))
    cut = dec.truncated(1)
    assert cut.config.num_layers == 1 and cut.layers[0] is dec.layers[0] and cut.lm_head is dec.lm_head
    with pytest.raises(ValueError):
        dec.truncated(0)
