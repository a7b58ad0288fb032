"""The compiled one-request forward (runtime/compiled.py): the eager forward's results, cache writes
and features within bf16 rounding; the decoders it does not take stay eager; a failed compile
leaves the eager forward running."""

import pytest
import torch

from dspark.runtime import compiled as C
from dspark.runtime.model import Decoder

from test_runtime_model import _tiny


def _decoder(dtype=torch.bfloat16) -> Decoder:
    return Decoder.from_hf(_tiny("llama-untied"), dtype=dtype)   # q/k/v and o biases


@pytest.fixture(scope="module")
def pair():
    """(compiled, eager) decoders of the same weights; compiling once for the module's tests."""
    compiled, eager = _decoder(), _decoder()
    message = compiled.compile()
    return compiled, eager, message


def _steps(dec: Decoder):
    """A prefill, four decoding rows and a verification block of 5 with two layers' features,
    rolled back and verified again, in slot 1 of 3: (every forward's logits, the block's features,
    the cache)."""
    cache = dec.new_cache(3, 64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dec.config.vocab_size, (40,), generator=g)
    logits = [dec.forward(ids[:20], [(1, 20)], cache, logits_rows="last").logits]
    for i in range(20, 24):
        logits.append(dec.forward(ids[i:i + 1], [(1, 1)], cache).logits)
    out = dec.forward(ids[24:29], [(1, 5)], cache, feature_layers=(0, 2))
    logits.append(out.logits)
    cache.truncate(1, 26)
    logits.append(dec.forward(ids[26:29], [(1, 3)], cache).logits)
    return logits, out.features, cache


def test_a_compiled_one_request_forward_gives_the_eager_results(pair):
    compiled, eager, message = pair
    if compiled._compiled.disabled:      # e.g. a CPU whose oneDNN does not pack bf16: nothing to compare
        assert message.startswith("eager forward (")
        pytest.skip(message)
    assert message.startswith("compiled the one-request forward in")
    assert compiled._compiled.warm      # both graphs built: calls check a reduced set of guards
    # another cache (slots, length), slot and context than warm_up's, every guard checked: the two
    # graphs cover them (what skipping guards once warm relies on)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled._compiled.warm = False
    try:
        _steps(compiled)
    finally:
        compiled._compiled.warm = True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    calls = []
    stack = compiled._compiled._module
    compiled._compiled._module = lambda *a: calls.append(a[0].shape[0]) or stack(*a)
    try:
        (lc, fc, cc), (le, fe, ce) = _steps(compiled), _steps(eager)
    finally:
        compiled._compiled._module = stack
    assert calls == [1, 1, 1, 1, 5, 3]            # every decoding row and block; not the prefill
    assert cc.lengths == ce.lengths == [0, 29, 0]
    for a, b in zip(lc, le):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)   # bf16 rounding apart
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(fc, fe):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
    for kc, ke in zip(cc.k + cc.v, ce.k + ce.v):   # the keys and values written, in the slot used only
        torch.testing.assert_close(kc[1, :, :29], ke[1, :, :29], atol=0.02, rtol=0.02)
        assert not kc[[0, 2]].any()


def test_two_compiled_decoders_of_other_weights_each_give_their_own_results(pair):
    """The graphs of every decoder share one code object (LayerStack.forward) and, once warm, a
    call checks only the guards that tell graphs apart: those must tell the decoders apart too."""
    first, first_eager, message = pair
    if first._compiled.disabled:
        pytest.skip(message)
    other, other_eager = _decoder(), _decoder()
    for dec in (other, other_eager):
        dec.embed.mul_(-1.5)            # other weights, the same shapes
    other.compile()
    for dec, ref in ((other, other_eager), (first, first_eager)):
        (lc, _, _), (le, _, _) = _steps(dec), _steps(ref)
        for a, b in zip(lc, le):
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)


def test_compiling_twice_keeps_the_graphs(pair):
    compiled, _, message = pair
    if compiled._compiled.disabled:
        pytest.skip(message)
    built = compiled._compiled
    assert compiled.compile() == "compiled already" and compiled._compiled is built


@pytest.mark.parametrize("why", ["fp32", "batch-invariant"])
def test_decoders_whose_guarantees_are_bitwise_stay_eager(why):
    dec = _decoder(torch.float32 if why == "fp32" else torch.bfloat16)
    dec.batch_invariant = why == "batch-invariant"
    message = dec.compile()
    assert message.startswith("eager forward (") and dec._compiled.disabled
    assert not dec._compiled.takes([(0, 1)], [5])


def test_a_failed_compile_leaves_the_eager_forward_running(monkeypatch, caplog):
    dec, ref = _decoder(), _decoder()
    if C.eligible(dec.stack_parts()):
        pytest.skip(C.eligible(dec.stack_parts()))

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here\nmore lines")
    monkeypatch.setattr(C.torch, "compile", lambda module, **kw: broken)
    message = dec.compile()
    assert message == "eager forward (compiling failed (RuntimeError: no C++ compiler here))"
    assert "compiled one-request forward is off" in caplog.text
    (la, _, ca), (lb, _, cb) = _steps(dec), _steps(ref)
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and ca.lengths == cb.lengths
