"""runtime/linear.py: the contract of few-row products on any CPU, with packing taken and declined.

What the guarantees need from ``linear``, and so what these tests check: a row's bits do not depend
on how many rows share the product where batch invariance is promised (``rows_alike``); plain fp32
weights' products are ``F.linear``'s or ``w @ x.T``'s (whichever was timed faster for the shape: both
are tested, forced), packed fp32 weights' batch-invariant products ``F.linear``'s bits; a packed
weight computes its dense tensor's product
(up to bf16 rounding: bit equality with ``F.linear`` is not a guarantee). Whether this CPU packs is
a hardware matter: the decision is tested with packing forced on and off, never for being taken
on the machine at hand.
"""

import pytest
import torch
import torch.nn.functional as F

from dspark.runtime import linear as L
from dspark.runtime.model import Decoder

SHAPES = [(960, 576), (576, 1536), (3072, 576)]    # the bundled target's q/k/v, down and gate/up products
_alike_limit = L.rows_alike_limit                  # the real check, before any test forces it


def _hardware_packs() -> bool:
    """Whether oneDNN can lay out a bf16 weight on this CPU at all (not whether dspark chooses to)."""
    try:
        L.PackedWeight(torch.randn(8, 16).bfloat16())
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _data(rows: int, k: int, subnormal: float = 0.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if subnormal:
        x[torch.rand(rows, k, generator=g) < subnormal] = 1e-39    # subnormal in bf16 as in fp32
    return x.bfloat16()


def _close_to_f_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    return torch.allclose(y.detach().float(), ref, rtol=2e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.fixture(params=["taken", "declined"])
def packing(request, monkeypatch):
    """The packing decision forced either way (taken needs a CPU whose oneDNN packs bf16 at all)."""
    if request.param == "taken" and not _hardware_packs():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    on = request.param == "taken"
    monkeypatch.setattr(L, "packing_available", lambda: on)
    monkeypatch.setattr(L, "rows_alike_limit", lambda shape: None if on else 0)
    return on


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_follows_the_decision_and_computes_the_product(packing, shape):
    w = _data(*shape, seed=1)
    b = _data(1, shape[0], seed=2)[0]
    p = L.pack(w)
    assert isinstance(p, L.PackedWeight) == packing
    assert p.shape == w.shape and torch.equal(L.dense(p), w)
    for rows in (1, 2, 7, 8, 33):
        x = _data(rows, shape[1], seed=rows)
        y = L.linear(x, p)
        assert y.shape == (rows, shape[0]) and _close_to_f_linear(y, x, w)
        assert _close_to_f_linear(L.linear(x, p, b), x, w, b)
        assert not packing or y.is_contiguous()


def _assert_rows_alike(p, k: int) -> None:
    """Rows alone, in blocks of several sizes, and in a column-major block (the layout of the
    transposed view the dense path returns, which the next layer's product receives) agree."""
    x = _data(40, k, subnormal=0.05, seed=4)
    block = L.linear(x, p, rows_alike=True)
    alone = torch.cat([L.linear(x[i:i + 1], p, rows_alike=True) for i in range(40)])
    assert torch.equal(alone, block)
    for m in (2, 5, 9):
        assert torch.equal(L.linear(x[:m], p, rows_alike=True), block[:m])
        column_major = x[:m].t().contiguous().t()
        assert torch.equal(L.linear(column_major, p, rows_alike=True), block[:m])


@pytest.mark.parametrize("shape", SHAPES)
def test_what_pack_chooses_keeps_a_rows_bits_at_any_row_count(shape):
    """The batch-invariant promise on this CPU as it is: whatever ``pack`` decides for the shape,
    a row (5 % subnormal inputs, which some kernels round differently alone) gets the bits it gets
    inside a block."""
    _assert_rows_alike(L.pack(_data(*shape, seed=3)), shape[1])


@pytest.mark.parametrize("shape", SHAPES)
def test_rows_alike_holds_on_either_path(packing, monkeypatch, shape):
    """The same promise with the decision forced: the dense path always; the packed path with
    this CPU's real row limit for the shape (products chunked to it, or the shape left dense)."""
    if packing:
        monkeypatch.setattr(L, "rows_alike_limit", _alike_limit)
    _assert_rows_alike(L.pack(_data(*shape, seed=3)), shape[1])


def test_the_checks_reject_a_kernel_whose_rows_differ(monkeypatch):
    """Both checks guarding the packed path decline when products differ: by row count
    (``rows_alike_limit``) or from ``F.linear`` (``packing_available``'s probe)."""
    if not _hardware_packs():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    real = L.linear

    def drifting(x, w, b=None, rows_alike=False):       # more than 3 rows: the first output moves
        y = real(x, w, b, rows_alike).clone()
        if isinstance(w, L.PackedWeight) and x.shape[0] > 3:
            y[:, 0] += y[:, 0].abs() / 64 + 1e-3
        return y

    monkeypatch.setattr(L, "linear", drifting)
    assert _alike_limit.__wrapped__((64, 48)) == 3
    assert not L.packing_available.__wrapped__()


@pytest.mark.parametrize("switch, limit", [(12, 12), (50, L.ALIKE_EVERY)])
def test_a_kernel_that_switches_at_a_row_count_is_chunked_below_it(monkeypatch, switch, limit):
    """A CPU whose packed kernel rounds otherwise beyond ``switch`` rows (as AMX does beyond 32):
    the check finds the limit (beyond the counts it checks one by one, the last of those), ``pack``
    keeps the shape packed with it, and rows-alike products run in chunks no larger, so a row's
    bits hold; unchunked, the same kernel breaks the promise."""
    if not _hardware_packs():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    real = L._packed_product

    def switching(x, w, b=None):
        y = real(x, w, b)
        return y + y.abs() / 64 + 1e-3 if x.shape[0] > switch else y

    monkeypatch.setattr(L, "_packed_product", switching)
    assert _alike_limit.__wrapped__((64, 48)) == limit
    monkeypatch.setattr(L, "rows_alike_limit", _alike_limit.__wrapped__)
    monkeypatch.setattr(L, "packing_available", lambda: True)
    w = _data(64, 48, seed=5)
    p = L.pack(w)
    assert isinstance(p, L.PackedWeight) and p.alike == limit
    x = _data(100, 48, subnormal=0.05, seed=6)
    alone = torch.cat([L.linear(x[i:i + 1], p, rows_alike=True) for i in range(100)])
    for m in (2, limit, limit + 1, 2 * limit + 3, 100):
        assert torch.equal(L.linear(x[:m], p, rows_alike=True), alone[:m])
    assert not torch.equal(L.linear(x, L.PackedWeight(w), rows_alike=True), alone)


def test_pack_leaves_other_weights_alone():
    w32 = torch.randn(8, 4)
    assert L.pack(w32) is w32                      # fp32: the exact dtype stays on F.linear
    w1 = torch.randn(8).bfloat16()
    assert L.pack(w1) is w1                        # not a matrix
    assert L.pack(None) is None
    x = torch.randn(3, 4)
    assert torch.allclose(L.linear(x, w32), F.linear(x, w32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transposed", [True, False])
def test_fp32_products_take_the_kernel_timed_faster_and_compute_the_product(monkeypatch, transposed):
    monkeypatch.setattr(L, "transposed_faster", lambda shape, threads=None: transposed)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    for rows in (1, 2, 7, 64, L.FEW_ROWS, L.FEW_ROWS + 1):
        x = torch.randn(rows, 80, generator=g)
        for bias in (None, b):
            y = L.linear(x, w, bias)
            assert y.shape == (rows, 96)
            assert torch.allclose(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # batch-invariant products keep ``F.linear`` (the path whose rows that mode is built on)
    calls = []
    monkeypatch.setattr(L.torch, "matmul", lambda *a: calls.append(a) or torch.mm(*a))
    L.linear(torch.randn(5, 80, generator=g), w, rows_alike=True)
    assert not calls


def test_the_fp32_kernel_choice_is_timed_once_per_shape_and_can_be_forced(monkeypatch):
    L.transposed_faster.cache_clear()
    try:
        assert isinstance(L.transposed_faster((64, 32), 1), bool)
        assert L.transposed_faster.cache_info().misses == 1
        L.transposed_faster((64, 32), 1)
        assert L.transposed_faster.cache_info().hits == 1
        for forced in ("0", "1"):
            monkeypatch.setenv("DSPARK_TRANSPOSED_LINEAR", forced)
            L.transposed_faster.cache_clear()
            assert L.transposed_faster((64, 32), 1) is (forced == "1")
    finally:
        L.transposed_faster.cache_clear()


def test_a_shape_whose_rows_differ_by_row_count_stays_dense(monkeypatch):
    monkeypatch.setattr(L, "rows_alike_limit", lambda shape: L.MIN_ALIKE_ROWS - 1 if shape == (8, 4) else None)
    monkeypatch.setattr(L, "packing_available", _hardware_packs)
    w, other = torch.randn(8, 4).bfloat16(), torch.randn(8, 6).bfloat16()
    assert L.pack(w) is w
    assert isinstance(L.pack(other), L.PackedWeight) == _hardware_packs()


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "0")
    L.packing_available.cache_clear()
    try:
        w = torch.randn(8, 4).bfloat16()
        assert not L.packing_available() and L.pack(w) is w
    finally:
        monkeypatch.delenv("DSPARK_PACKED_LINEAR")
        L.packing_available.cache_clear()


def test_fast_linear_follows_a_weight_changed_in_place(packing):
    m = L.serve_fast(torch.nn.Sequential(torch.nn.Linear(16, 8).bfloat16()))[0]
    x = _data(3, 16)
    assert _close_to_f_linear(m(x), x, m.weight, m.bias)
    with torch.no_grad():
        m.weight.mul_(2)
    assert _close_to_f_linear(m(x), x, m.weight, m.bias)


def test_a_bf16_decoder_packs_as_decided_and_keeps_the_plain_lm_head(packing):
    from test_runtime_model import _tiny
    dec = Decoder.from_hf(_tiny("llama"), dtype=torch.bfloat16)
    lw = dec.layers[0]
    assert all(isinstance(getattr(lw, n), L.PackedWeight) == packing for n in ("qkv", "o", "gate_up", "down"))
    assert isinstance(dec.lm_head, torch.Tensor) and isinstance(dec._head, L.PackedWeight) == packing
    assert lw.packed() is lw or not packing          # packing twice changes nothing
    fp32 = Decoder.from_hf(_tiny("llama"), dtype=torch.float32)
    assert isinstance(fp32.layers[0].qkv, L.PackedWeight) == L.fp32_packing_available()
    assert fp32._head is fp32.lm_head or fp32._head.plain is fp32.lm_head     # fp32: the head, if timed faster


@pytest.mark.parametrize("faster", ["0", "1"])
def test_an_fp32_head_is_packed_where_timed_faster_and_keeps_its_plain_rows(monkeypatch, faster):
    """The fp32 LM head packed (as forced) computes the product within fp32 rounding; batch-invariant
    products run on its plain tensor, as they do on an unpacked head (F.linear's bits)."""
    monkeypatch.setenv("DSPARK_PACKED_FP32", faster)
    L.packed_faster.cache_clear()
    try:
        from test_runtime_model import _tiny
        dec = Decoder.from_hf(_tiny("llama"), dtype=torch.float32)
        packed = faster == "1" and L.fp32_packing_available()
        assert isinstance(dec._head, L.PackedWeight) == packed
        x = _data(5, dec.lm_head.shape[1]).float()
        assert torch.allclose(L.linear(x, dec._head), F.linear(x, dec.lm_head), rtol=1e-4, atol=1e-4)
        assert torch.equal(L.linear(x, dec._head, rows_alike=True), F.linear(x, dec.lm_head))
        assert torch.equal(L.dense(dec._head), dec.lm_head)
        dec.batch_invariant = True
        assert torch.equal(dec.compute_logits(x), F.linear(x, dec.lm_head))
        w = torch.randn(8, 4).bfloat16()
        assert isinstance(L.pack_head(w), L.PackedWeight) == isinstance(L.pack(w), L.PackedWeight)   # bf16: as pack
    finally:
        L.packed_faster.cache_clear()


def test_the_fp32_packing_choice_is_timed_once_per_shape():
    L.packed_faster.cache_clear()
    try:
        assert isinstance(L.packed_faster((64, 32), 1), bool)
        L.packed_faster((64, 32), 1)
        assert L.packed_faster.cache_info().misses == 1 and L.packed_faster.cache_info().hits == 1
    finally:
        L.packed_faster.cache_clear()


@pytest.mark.parametrize("packed", ["0", "1"])
def test_fp32_layers_pack_where_oneDNN_packs_fp32_and_keep_exact_rows(monkeypatch, packed):
    """A target's fp32 layers packed (unless ``DSPARK_PACKED_FP32=0``) compute their products within
    fp32 rounding and their dense tensors exactly; batch-invariant products get ``F.linear``'s bits,
    from a plain tensor made once; a decoder in that mode gives the unpacked decoder's bits."""
    from test_runtime_model import _tiny
    monkeypatch.setenv("DSPARK_PACKED_FP32", packed)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    p = L.pack(w, fp32=True)
    assert L.pack(w) is w                                       # only where asked (a target's layers)
    assert isinstance(p, L.PackedWeight) == (packed == "1" and L.fp32_packing_available())
    if isinstance(p, L.PackedWeight):
        assert p.plain is None and torch.equal(L.dense(p), w)   # no second copy kept while serving
        for rows in (1, 3, 64):
            x = torch.randn(rows, 80, generator=g)
            assert torch.allclose(L.linear(x, p, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
            assert torch.equal(L.linear(x, p, b, rows_alike=True), F.linear(x, w, b))
        assert p.plain is not None and p.exact() is p.plain    # made once, then kept
    hf = _tiny("llama")
    dec = Decoder.from_hf(hf, dtype=torch.float32)
    monkeypatch.setenv("DSPARK_PACKED_FP32", "0")
    ref = Decoder.from_hf(hf, dtype=torch.float32)
    assert isinstance(ref.layers[0].gate_up, torch.Tensor)
    dec.batch_invariant = ref.batch_invariant = True
    ids = torch.randint(0, hf.config.vocab_size, (9,), generator=g)
    logits = []
    for d in (dec, ref):
        cache = d.new_cache(1, 16)
        logits.append(d(ids, [(cache.allocate(), 9)], cache, logits_rows="all").logits)
    assert torch.equal(*logits)


def test_an_fp32_decoder_times_its_kernel_choices_at_load(monkeypatch):
    from test_runtime_model import _tiny
    monkeypatch.setenv("DSPARK_PACKED_FP32", "0")     # every fp32 weight plain: each shape has a choice
    L.transposed_faster.cache_clear()
    try:
        dec = Decoder.from_hf(_tiny("llama"), dtype=torch.float32)
        lw = dec.layers[0]
        shapes = {tuple(w.shape) for w in (lw.qkv, lw.o, lw.gate_up, lw.down, dec.lm_head)}
        assert L.transposed_faster.cache_info().currsize == len(shapes)
        L.transposed_faster.cache_clear()
        Decoder.from_hf(_tiny("llama"), dtype=torch.bfloat16)           # bf16 has no such choice
        assert L.transposed_faster.cache_info().currsize == 0
    finally:
        L.transposed_faster.cache_clear()


def test_an_fp32_dspark_drafter_times_its_kernel_choices_at_load():
    from _tiny import tiny_drafter_model, tiny_target

    from dspark.drafters.dspark import DSparkDrafter
    target = tiny_target(dtype=torch.float32, device="cpu")
    L.transposed_faster.cache_clear()
    try:
        drafter = DSparkDrafter(tiny_drafter_model(target, draft_vocab=torch.tensor([0, 2, 3])), target)
        lw = drafter._layers[0]
        weights = (drafter._fc, drafter.model.lm_head_packed, lw.qkv, lw.o, lw.gate_up, lw.down)
        shapes = {tuple(w.shape) for w in weights}
        assert L.transposed_faster.cache_info().currsize == len(shapes)
    finally:
        L.transposed_faster.cache_clear()
