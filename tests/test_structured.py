"""Structured outputs: the output follows the target's law restricted by the grammar, exactly, through
drafting and the grammar's forced tokens (chi-square on a tiny target with a one-character-per-token
tokenizer, under verification lengths that vary; greedy equal to plain decoding under the same
grammar); the row masks of a block; clear errors for bad constraints."""

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark.drafters import DraftLMDrafter, NgramDrafter
from dspark.drafters.dspark import DSparkDrafter
from dspark.engine import Engine
from dspark.errors import UsageError
from dspark.runtime.model import Decoder
from dspark.sampling import SamplingParams
from dspark.structured import GrammarSpec, grammar_state

from _lossless import CyclingPolicy, chi2_pvalue, constrained_law
from _tiny import tiny_drafter_model, tiny_target

EOS = 4
REGEX = "(a|bc|d)+"      # after b only c; the end only where the text is complete


def _tiny(seed, scale=8.0):
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return Decoder.from_hf(m)


def _target(decoder):
    """A loaded target as the server sees it, with a tokenizer of one character per token."""
    tk = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "d": 3, "</s>": EOS}, unk_token="</s>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")
    return SimpleNamespace(model=decoder, tokenizer=tok, eos_token_ids=(EOS,))


def _constrained_law(target, grammar, prompt, n_new, params):
    return constrained_law(target, grammar, prompt, n_new, params, vocab=5, end=EOS)


def test_constrained_output_follows_the_masked_law_through_drafting():
    target = _target(_tiny(0))
    grammar = GrammarSpec("regex", REGEX).compile()
    prompt, n_new, draws = [1, 3, 2], 5, 3000
    policy = CyclingPolicy()
    engine = Engine(target.model, DraftLMDrafter(_tiny(1), block_size=3), policy, max_requests=8, max_len=24,
                    eos_ids=(EOS,))
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s), n_new, exact_seed=False,
                               grammar=grammar_state(target, grammar)) for s in range(draws)]
    engine.run()
    assert {1, 2, 3} <= policy.used, f"verification lengths used: {policy.used}"
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    assert 0 < accepted < drafted, "drafts were all accepted or all rejected: the test shows little"
    # after b the grammar forces c: proposed instead of the draft model's block (jump-forward)
    assert sum(r.stats.num_forced_tokens for r in reqs) > 100
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    law = _constrained_law(target, grammar, prompt, n_new, SamplingParams(temperature=1.0))
    assert chi2_pvalue(counts, law) > 1e-3
    # without the grammar the same draws would often break it (the test can tell the two apart)
    free = Engine(target.model, None, max_requests=8, max_len=24, eos_ids=(EOS,))
    loose = [free.add_request(prompt, SamplingParams(temperature=1.0, seed=s), n_new) for s in range(300)]
    free.run()
    assert sum(tuple(r.output_ids) not in law for r in loose) > 30


def test_greedy_under_a_grammar_equals_plain_decoding_under_it():
    target = _target(_tiny(2, scale=4.0))
    grammar = GrammarSpec("regex", "(ab|c|d)+").compile()
    greedy = SamplingParams(temperature=0)
    changed = accepted = 0
    for prompt in ([1, 2, 3], [0, 0, 1], [3]):
        runs = []
        for drafter in (None, DraftLMDrafter(_tiny(3, scale=4.0), block_size=3), NgramDrafter(block_size=3)):
            e = Engine(target.model, drafter, max_requests=1, max_len=40, eos_ids=(EOS,))
            runs.append(e.add_request(prompt, greedy, 16, grammar=grammar_state(target, grammar)))
            e.run()
        assert runs[1].output_ids == runs[0].output_ids == runs[2].output_ids
        accepted += runs[1].stats.num_accepted_tokens + runs[1].stats.num_forced_tokens
        e = Engine(target.model, None, max_requests=1, max_len=40, eos_ids=(EOS,))
        free = e.add_request(prompt, greedy, 16)
        e.run()
        changed += free.output_ids != runs[0].output_ids
    assert accepted > 0 and changed > 0


def test_block_masks_follow_the_drafts_and_leave_the_state_alone():
    target = _target(_tiny(0))
    g = grammar_state(target, GrammarSpec("regex", REGEX).compile())
    before = g.masks([])[0].tolist()
    assert before == [True, True, False, True, False]
    rows = g.masks([1, 2, 0])                    # b c a: all allowed
    assert rows.tolist() == [before, [False, False, True, False, False], [True, True, False, True, True],
                             [True, True, False, True, True]]
    rows = g.masks([1, 0, 3])                    # b a: the a is forbidden, the rows after repeat its row
    assert rows[1].tolist() == [False, False, True, False, False] and torch.equal(rows[2], rows[1])
    assert torch.equal(rows[3], rows[1])
    assert g.masks([])[0].tolist() == before     # rolled back
    g.advance([1, 2])
    assert g.masks([])[0].tolist() == [True, True, False, True, True]


def test_copies_start_where_their_original_is_and_then_advance_alone():
    """grammar_states: one matcher built, the others copies; each advances with its own output."""
    from dspark.structured import grammar_states
    target = _target(_tiny(0))
    first, second, third = grammar_states(target, GrammarSpec("regex", REGEX).compile(), 3)
    fresh = grammar_state(target, GrammarSpec("regex", REGEX).compile())
    assert first.masks([])[0].tolist() == second.masks([])[0].tolist() == fresh.masks([])[0].tolist()
    second.advance([1])                          # b: only c may follow
    assert second.masks([])[0].tolist() == [False, False, True, False, False]
    assert first.masks([])[0].tolist() == third.masks([])[0].tolist() == fresh.masks([])[0].tolist()
    third.advance([1, 2])                        # bc: complete, so the end is allowed too
    fresh.advance([1, 2])
    assert third.masks([])[0].tolist() == fresh.copy().masks([])[0].tolist() == [True, True, False, True, True]
    assert first.copy().masks([])[0].tolist() == [True, True, False, True, False]


def test_choice_and_json_schema_compile_and_bad_constraints_are_clear():
    target = _target(_tiny(0))
    g = grammar_state(target, GrammarSpec("choice", ["ab", "d"]).compile())
    assert g.masks([])[0].tolist() == [True, False, False, True, False]
    GrammarSpec("json", {"type": "object", "properties": {"x": {"type": "integer"}}}).compile()
    GrammarSpec("json", '{"type": "string"}').compile()
    for spec, needle in [(GrammarSpec("regex", "(a"), "invalid regex"),
                         (GrammarSpec("json", {"type": "bogus"}), "invalid json"),
                         (GrammarSpec("json", "{not json"), "invalid json"),
                         (GrammarSpec("json", [1]), "JSON object"),
                         (GrammarSpec("choice", []), "non-empty list"),
                         (GrammarSpec("grammar", "start: ???"), "invalid grammar"),
                         (GrammarSpec("yaml", "x"), "unknown structured output")]:
        with pytest.raises(UsageError, match=needle):
            spec.compile()


def test_a_trained_drafter_drafts_only_what_the_grammar_allows_and_keeps_the_law():
    """The DSpark drafter samples each drafted position from the tokens the grammar allows after the
    drafts before it (the proposal's probabilities are that masked law): no draft is ever forbidden,
    the matcher is left where it was, and the output still fits the restricted law."""
    decoder = tiny_target(scale=3.0)
    target = _target(decoder)
    grammar = GrammarSpec("regex", REGEX).compile()
    drafter = DSparkDrafter(tiny_drafter_model(decoder, scale=2.0), decoder)
    seen = {"blocks": 0, "forbidden": 0}
    real = drafter.propose

    def spy(contexts):
        before = [c.grammar.masks([])[0].clone() for c in contexts]
        out = real(contexts)
        for c, p, b in zip(contexts, out, before):
            assert torch.equal(c.grammar.masks([])[0], b)          # pushes undone
            rows = c.grammar.masks(p.tokens.tolist())
            seen["blocks"] += len(p) > 0
            seen["forbidden"] += sum(not rows[k][t] for k, t in enumerate(p.tokens.tolist()))
            if p.probs is not None and len(p):
                assert float(p.probs[0][~rows[0]].sum()) == 0.0      # drawn from the masked law
        return out
    drafter.propose = spy
    prompt, n_new, draws = [1, 3, 2], 5, 2000
    engine = Engine(decoder, drafter, CyclingPolicy(), max_requests=16, max_len=24, block_size=3, eos_ids=(EOS,))
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s), n_new, exact_seed=False,
                               grammar=grammar_state(target, grammar)) for s in range(draws)]
    engine.run()
    assert seen["blocks"] > 500 and seen["forbidden"] == 0
    assert sum(r.stats.num_accepted_tokens for r in reqs) > 200
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert chi2_pvalue(counts, _constrained_law(target, grammar, prompt, n_new, SamplingParams(temperature=1.0))) > 1e-3
    # greedy through it equals plain decoding under the same grammar
    greedy = SamplingParams(temperature=0)
    for p in ([1, 2, 3], [0, 0, 1], [3]):
        outs = []
        for d in (None, DSparkDrafter(tiny_drafter_model(decoder, scale=2.0), decoder)):
            e = Engine(decoder, d, max_requests=1, max_len=40, block_size=3 if d else None, eos_ids=(EOS,))
            outs.append(e.add_request(p, greedy, 16, grammar=grammar_state(target, grammar)))
            e.run()
        assert outs[1].output_ids == outs[0].output_ids


def test_lookup_drafts_end_before_their_first_forbidden_token():
    """A point-mass proposal is cut where the grammar forbids it (its verification would reject it for
    certain and draw from the target's own law, as the cut does): no verified lookup draft is forbidden."""
    decoder = _tiny(0)
    target = _target(decoder)
    grammar = GrammarSpec("regex", "(ab|c)+d").compile()
    engine = Engine(decoder, NgramDrafter(block_size=4), max_requests=4, max_len=40, eos_ids=(EOS,))
    real, seen = engine._law, {"drafts": 0, "forbidden": 0}

    def spy(r, logits, drafts=None):
        if drafts is not None and len(drafts) and r.grammar is not None:
            rows = r.grammar.masks(drafts.tolist())
            seen["drafts"] += len(drafts)
            seen["forbidden"] += sum(not rows[k][t] for k, t in enumerate(drafts.tolist()))
        return real(r, logits, drafts)
    engine._law = spy
    # prompts full of the pattern's text, so that the lookup finds (and copies) continuations
    for s in range(40):
        engine.add_request([0, 1, 2, 0, 1, 3, 2, 0, 1, 2, 2, 3], SamplingParams(temperature=1.0, seed=s), 12,
                           grammar=grammar_state(target, grammar))
    engine.run()
    assert seen["drafts"] > 50 and seen["forbidden"] == 0
