"""Drafters by name and by path, and the draft-LM drafter's cache bookkeeping."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters import DraftContext, DraftLMDrafter, NgramDrafter, PlainDrafter, load_drafter
from dspark.errors import DsparkError, UsageError
from dspark.generation import generate_ids
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _tiny_folder(path, vocab, tokenizer=None, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def test_names(target_fp32):
    assert isinstance(load_drafter("plain", target_fp32), PlainDrafter)
    assert isinstance(load_drafter(None, target_fp32), PlainDrafter)
    assert isinstance(load_drafter("ngram", target_fp32), NgramDrafter)
    cut = load_drafter("cut:3", target_fp32)
    assert cut.model.config.num_layers == 3 and cut.model.lm_head is target_fp32.model.lm_head
    for bad in ("cut:0", "cut:30", "cut:x", "bogus"):
        with pytest.raises(UsageError):
            load_drafter(bad, target_fp32)


def test_draft_lm_from_folder(target_fp32, tmp_path, bench_prompts):
    folder = _tiny_folder(tmp_path / "draft", target_fp32.model.config.vocab_size, target_fp32.tokenizer)
    d = load_drafter(str(folder), target_fp32, num_draft=3)
    assert isinstance(d, DraftLMDrafter) and d.block_size == 3
    prompt = bench_prompts[1]
    plain = generate_ids(target_fp32.model, prompt, GREEDY, 16)[0]
    spec, stats = generate_ids(target_fp32.model, prompt, GREEDY, 16, d)
    assert spec == plain and stats.num_draft_tokens > 0


def test_draft_lm_with_other_tokenizer_is_refused(target_fp32, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2},
                                                                               unk_token="<unk>")))
    folder = _tiny_folder(tmp_path / "other", 3, tok)
    with pytest.raises(UsageError, match="tokenizer"):
        load_drafter(str(folder), target_fp32)


def test_trained_drafter_folder_is_recognised(target_fp32, tmp_path):
    # a config that declares a drafter is read as a trained drafter, not as a draft LM
    (tmp_path / "config.json").write_text('{"architectures": ["DSparkDrafter"], "block_size": 7}')
    with pytest.raises(DsparkError, match="drafter config needs"):
        load_drafter(str(tmp_path), target_fp32)
    from dspark.drafters.dspark import DSparkDrafter
    for name in ("dspark", "dflash"):     # the committed checkpoints, by name and by path
        d = load_drafter(name, target_fp32)
        assert isinstance(d, DSparkDrafter) and d.config.kind == name
        from dspark.drafters import CHECKPOINTS
        assert isinstance(load_drafter(str(CHECKPOINTS / target_fp32.name / name), target_fp32), DSparkDrafter)


def test_draft_lm_catches_up_and_rolls_back():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)).eval()
    model = Decoder.from_hf(hf)
    d = DraftLMDrafter(model, block_size=3)
    d.prepare(2, 32)
    a = DraftContext([1, 2, 3, 4], GREEDY, None, 3)
    b = DraftContext([5, 6], GREEDY, None, 2)
    pa, pb = d.propose([a, b])
    assert len(pa) == 3 and len(pb) == 2 and pa.probs.shape == (3, 11)
    # the cache holds the context plus all but the last draft
    assert d.cache.lengths[a.slot] == 4 + 2
    # one draft accepted, then a new token: only the common prefix stays cached
    a.tokens += [int(pa.tokens[0]), 9]
    pa2, = d.propose([a])
    assert d.cache.lengths[a.slot] == len(a.tokens) + 2

    def ref(tokens, k):  # greedy drafting from scratch
        cache = model.new_cache(1, 32)
        s = cache.allocate()
        out = []
        logits = model(torch.tensor(tokens), [(s, len(tokens))], cache, logits_rows="last").logits[0]
        for _ in range(k):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor(out[-1:]), [(s, 1)], cache).logits[0]
        return out
    assert pa2.tokens.tolist() == ref(a.tokens, 3)
    assert pb.tokens.tolist() == ref([5, 6], 2)
    d.release(a)
    d.release(b)
    assert d.cache.num_free == 2


def test_ngram_lookups_follow_a_growing_request_and_a_replaced_one():
    """A request's lookup, kept in its state between rounds, is that of a fresh lookup over its whole
    text at every round, and a request whose token list was replaced or cut is read anew."""
    import random
    rng = random.Random(0)
    kept, fresh = NgramDrafter(block_size=5), NgramDrafter(block_size=5)
    ctx = DraftContext([rng.randrange(12) for _ in range(40)], SamplingParams(), None, 5)
    for _ in range(60):
        ctx.tokens.extend(rng.randrange(12) for _ in range(rng.randrange(1, 5)))
        again = DraftContext(list(ctx.tokens), SamplingParams(), None, 5)
        assert kept.propose([ctx])[0].tokens.tolist() == fresh.propose([again])[0].tokens.tolist()
    for change in ("replace", "cut"):
        if change == "replace":
            ctx.tokens = [rng.randrange(12) for _ in range(30)]
        else:
            del ctx.tokens[20:]
        again = DraftContext(list(ctx.tokens), SamplingParams(), None, 5)
        assert kept.propose([ctx])[0].tokens.tolist() == fresh.propose([again])[0].tokens.tolist()
