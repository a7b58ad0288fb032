"""runtime/linear.py: packed weights compute F.linear's bits; what is packed and what is not."""

import pytest
import torch
import torch.nn.functional as F

from dspark.runtime import linear as L
from dspark.runtime.model import Decoder

needs_packing = pytest.mark.skipif(not L.packing_available(), reason="this torch packs no bf16 CPU linears")


def _data(rows: int, k: int, subnormal: float = 0.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if subnormal:
        x[torch.rand(rows, k, generator=g) < subnormal] = 1e-39    # subnormal in bf16 as in fp32
    return x.bfloat16()


@needs_packing
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)])
def test_packed_product_equals_f_linear_bit_for_bit(shape):
    w = _data(*shape, seed=1)
    b = _data(1, shape[0], seed=2)[0]
    p = L.pack(w)
    assert isinstance(p, L.PackedWeight) and p.shape == w.shape
    for rows in (1, 2, 7, 8, 33):
        x = _data(rows, shape[1], seed=rows)
        y = L.linear(x, p)
        assert y.is_contiguous() and torch.equal(y, F.linear(x, w))
        assert torch.equal(L.linear(x, p, b), F.linear(x, w, b))
    assert torch.equal(p.dense(), w) and torch.equal(L.dense(p), w) and L.dense(w) is w


@needs_packing
def test_rows_alike_gives_a_row_the_same_bits_at_any_row_count():
    """Batch-invariant mode: a row with subnormal inputs through a 1536-wide product gets the
    bits it gets inside a block. (Without ``rows_alike`` the one-row kernel may differ on some
    CPUs; the test does not assume either way.)"""
    w = L.pack(_data(576, 1536, seed=3))
    x = _data(40, 1536, subnormal=0.05, seed=4)   # 4 of these 40 rows differ alone on the AMD EPYC VM
    block = L.linear(x, w, rows_alike=True)
    alone = torch.cat([L.linear(x[i:i + 1], w, rows_alike=True) for i in range(40)])
    assert torch.equal(alone, block)
    for m in (2, 5, 9):
        assert torch.equal(L.linear(x[:m], w, rows_alike=True), block[:m])


def test_pack_leaves_other_weights_alone():
    w32 = torch.randn(8, 4)
    assert L.pack(w32) is w32                      # fp32: the exact dtype stays on F.linear
    w1 = torch.randn(8).bfloat16()
    assert L.pack(w1) is w1                        # not a matrix
    assert L.pack(None) is None
    x = torch.randn(3, 4)
    assert torch.equal(L.linear(x, w32), F.linear(x, w32))


def test_a_shape_whose_rows_differ_by_row_count_stays_dense(monkeypatch):
    monkeypatch.setattr(L, "keeps_rows_alike", lambda shape: shape != (8, 4))
    w, other = torch.randn(8, 4).bfloat16(), torch.randn(8, 6).bfloat16()
    assert L.pack(w) is w
    assert isinstance(L.pack(other), L.PackedWeight) or not L.packing_available()


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "0")
    L.packing_available.cache_clear()
    try:
        w = torch.randn(8, 4).bfloat16()
        assert not L.packing_available() and L.pack(w) is w
    finally:
        monkeypatch.delenv("DSPARK_PACKED_LINEAR")
        L.packing_available.cache_clear()


@needs_packing
def test_fast_linear_repacks_a_weight_changed_in_place():
    m = L.serve_fast(torch.nn.Sequential(torch.nn.Linear(16, 8).bfloat16()))[0]
    x = _data(3, 16)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    with torch.no_grad():
        m.weight.mul_(2)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


@needs_packing
def test_a_bf16_decoder_packs_its_products_and_keeps_the_plain_lm_head():
    from test_runtime_model import _tiny
    dec = Decoder.from_hf(_tiny("llama"), dtype=torch.bfloat16)
    lw = dec.layers[0]
    assert all(isinstance(getattr(lw, n), L.PackedWeight) for n in ("qkv", "o", "gate_up", "down"))
    assert isinstance(dec.lm_head, torch.Tensor) and isinstance(dec._head, L.PackedWeight)
    assert lw.packed() is lw                       # packing twice changes nothing
    fp32 = Decoder.from_hf(_tiny("llama"), dtype=torch.float32)
    assert isinstance(fp32.layers[0].qkv, torch.Tensor) and fp32._head is fp32.lm_head
