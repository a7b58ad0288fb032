"""The drafter's compiled one-request pass (drafters/compiled.py): the eager pass's hidden states
and cache writes within bf16 rounding, over rounds of every kind it takes and the ones it leaves
eager; no graph beyond the two warm-up builds; a failed compile leaves the eager pass running. And
the vanilla head's table of bias rows (heads.MarkovRows): the head's own bias, each row computed once."""

import pytest
import torch

from dspark.drafters import compiled as DC
from dspark.drafters.base import DraftContext
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.heads import MarkovRows
from dspark.sampling import SamplingParams

from _tiny import tiny_drafter_model, tiny_target

PROMPT = DC.CONTEXT + 5
# (tokens verified since the last round, the block drafted): the prompt's own first round (eager:
# more rows than MAX_ROWS), one new row, several, a block of one row (eager), a long block
ROUNDS = [(PROMPT, 4), (1, 4), (3, 2), (5, 4), (2, 1), (1, 3), (4, 7)]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(scale=3.0, dtype=torch.bfloat16)
    model = tiny_drafter_model(target, "dspark", "vanilla", scale=2.0, layers=2, block=7)
    compiled, eager = DSparkDrafter(model, target), DSparkDrafter(model, target)
    message = compiled.compile()
    return target, compiled, eager, message


def _rounds(target, drafter):
    """The ROUNDS of one request through ``drafter._forward``: (each round's hidden states, the cache)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (PROMPT + 40,), generator=g)
    kv = target.new_cache(1, 128)
    o = target(ids, [(kv.allocate(), ids.shape[0])], kv, feature_layers=(0, 2), logits_rows=None)
    feats = torch.cat(o.features, -1)
    drafter.prepare(2, 128)
    ctx = DraftContext(ids[:1].tolist(), SamplingParams(temperature=0.0), None, 0, features=[])
    out = []
    for new, block in ROUNDS:
        end = len(ctx.tokens) - 1 + new        # the next anchor
        ctx.features.append(feats[len(ctx.tokens) - 1:end])
        ctx.tokens = ids[:end + 1].tolist()
        ctx.num_draft = block
        with torch.inference_mode():
            out.append(drafter._forward([ctx], [ctx], block))
    return out, drafter.cache


def test_a_compiled_drafter_pass_gives_the_eager_blocks(pair):
    target, compiled, eager, message = pair
    if compiled._compiled.disabled:         # e.g. a CPU whose oneDNN does not pack bf16
        assert message.startswith("eager dspark drafter (")
        pytest.skip(message)
    assert message.startswith("compiled the dspark drafter's one-request pass in")
    assert compiled._compiled.warm
    module = compiled._compiled._module
    calls = []
    compiled._compiled._module = lambda *a: calls.append((a[0].shape[0], a[1].shape[0])) or module(*a)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled._compiled.warm = False         # every guard checked: the two graphs cover these rounds
    try:
        (hc, cc), (he, ce) = _rounds(target, compiled), _rounds(target, eager)
    finally:
        compiled._compiled._module, compiled._compiled.warm = module, True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert calls == [(1, 4), (3, 2), (5, 4), (1, 3), (4, 7)]     # not the prompt's round, not a block of one
    assert cc.lengths == ce.lengths
    for (new, block), a, b in zip(ROUNDS, hc, he):
        assert a.shape == b.shape == (1, block, 32) and a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
    for kc, ke in zip(cc.k + cc.v, ce.k + ce.v):     # the context keys and values written
        n = ce.lengths[0]
        torch.testing.assert_close(kc[0, :, :n], ke[0, :, :n], atol=0.02, rtol=0.02)


def test_compiling_twice_keeps_the_graphs(pair):
    _, compiled, _, message = pair
    if compiled._compiled.disabled:
        pytest.skip(message)
    built = compiled._compiled
    assert compiled.compile() == "compiled already" and compiled._compiled is built


def test_a_failed_drafter_compile_leaves_the_eager_pass_running(monkeypatch, caplog):
    target = tiny_target(scale=3.0, dtype=torch.bfloat16)
    model = tiny_drafter_model(target, "dspark", "vanilla", scale=2.0, layers=2, block=7)
    drafter, ref = DSparkDrafter(model, target), DSparkDrafter(model, target)
    if DC.eligible(drafter.block_parts()):
        pytest.skip(DC.eligible(drafter.block_parts()))

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here\nmore lines")
    monkeypatch.setattr(DC.torch, "compile", lambda module, **kw: broken)
    message = drafter.compile()
    assert message == "eager dspark drafter (compiling failed (RuntimeError: no C++ compiler here))"
    assert "compiled drafter pass is off" in caplog.text
    (ha, ca), (hb, cb) = _rounds(target, drafter), _rounds(target, ref)
    assert all(torch.equal(a, b) for a, b in zip(ha, hb)) and ca.lengths == cb.lengths


def test_fp32_drafters_stay_eager():
    target = tiny_target(scale=3.0)
    drafter = DSparkDrafter(tiny_drafter_model(target, "dspark", "vanilla", layers=1, block=3), target)
    assert drafter.compile() == "eager dspark drafter (only bf16 on a CPU compiles)"


def test_markov_rows_are_the_heads_bias_computed_once():
    target = tiny_target(scale=3.0)
    model = tiny_drafter_model(target, "dspark", "vanilla", draft_vocab=torch.tensor([0, 2, 3, 4]))
    head = model.head
    assert MarkovRows.fits(head)
    rows = MarkovRows(head, head.w2.weight.detach())
    prev = torch.tensor([4, 1, 1, 0])          # row 4: a previous token outside the draft vocabulary
    with torch.no_grad():
        want, _, _ = head.step(None, prev, None)
    torch.testing.assert_close(rows(prev), want)
    assert rows.known.tolist() == [True, True, False, False, True]
    rows.table[1] = 7.0                        # a known row is read, never computed again
    assert (rows(torch.tensor([1]))[0] == 7.0).all()
    torch.testing.assert_close(rows(torch.tensor([2, 3])), head.step(None, torch.tensor([2, 3]), None)[0].detach())
    for kind in ("gated", "rnn"):              # their bias reads the hidden state: computed each time
        assert not MarkovRows.fits(tiny_drafter_model(target, "dspark", kind).head)
