"""Few-row matrix products ``x @ w.T``: what decoding and verification spend most of a step on.

Decoding and verifying multiply a few rows by large weights, so a step's cost is mostly how fast
a kernel streams each weight. On CPUs, the bf16 weights of the runtime (the target's layers and LM
head, the trained drafters' serving weights) are packed once, at load time, into oneDNN's blocked
layout, the layout torch's own compiler uses for frozen CPU linears
(``mkldnn::_reorder_linear_weight`` / ``_linear_pointwise``). A packed product gives exactly the
bits of ``F.linear`` (checked once per process on a probe before anything is packed, else nothing
is packed) and runs faster for a few rows and no slower for many (docs/runtime.md). A weight shape
keeps a row's bits up to some row count (``rows_alike_limit``, checked once per shape on random
inputs): the batch-invariant mode multiplies its rows in chunks no larger than that, so a row gets
the same bits whatever the batch, and other products take any number of rows at once (where
oneDNN switches kernels depends on the CPU's instruction sets, hence the check on the machine).

fp32 weights are packed as well where oneDNN packs them (``fp32_packing_available``): a target's
layers (``pack(w, fp32=True)``) always, since whole forwards run faster with them packed at every
load measured, from prefill to decoding (docs/avx2.md; timed one product at a time, the small
layers show no gain, their weights staying in the caches); its LM head (``pack_head``) where,
timed once per shape, packed products of 8 and of 16 rows run faster than the dense path.
``DSPARK_PACKED_FP32=0`` keeps every fp32 weight plain. oneDNN's fp32 kernels round otherwise than
``F.linear``, so the batch-invariant mode's products run on the plain tensor: the head keeps it
(it is the model's own ``lm_head``), a layer makes it on the first such product.

Where packing is not available (another device, a torch without oneDNN, a probe that disagrees,
``DSPARK_PACKED_LINEAR=0``), weights stay plain tensors and ``linear`` takes the dense
path: one bf16 row as a matrix-vector product and a few rows as ``w @ x.T``, the faster layouts
measured; a few fp32 rows as ``w @ x.T`` where, timed once per weight shape, that is faster than
``F.linear`` (``transposed_faster``: it is on CPUs with AVX2 alone, for large weights, docs/avx2.md);
``F.linear`` for everything else.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TypeVar, overload

import torch
import torch.nn.functional as F


class PackedWeight(torch.nn.Module):
    """A 2-D bf16 or fp32 weight ``[out, in]`` in oneDNN's packed layout (opaque: use ``linear`` on it, or
    ``dense()`` for the plain tensor, which re-lays it out: not for the hot path). A module holding
    the packed tensor as a buffer, so that a compiled forward reached through it takes the tensor as
    a frozen constant (runtime/compiled.py)."""

    packed: torch.Tensor

    def __init__(self, w: torch.Tensor, alike: int | None = None, plain: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None),
                             persistent=False)
        self.shape, self.dtype, self.device = w.shape, w.dtype, w.device
        # rows_alike products run in chunks of at most this many rows (None: any number)
        self.alike = alike
        # fp32: the plain tensor, on which rows_alike products run (packed products do not give
        # F.linear's bits); given (the LM head, kept plain anyway) or made at the first such product
        self.plain = plain

    def dense(self) -> torch.Tensor:
        return self.plain if self.plain is not None else self.packed.to_dense()

    def exact(self) -> torch.Tensor:
        """The plain tensor, kept from now on (an fp32 weight in batch-invariant mode)."""
        if self.plain is None:
            self.plain = self.packed.to_dense()
        return self.plain

    def __repr__(self) -> str:
        return f"PackedWeight({tuple(self.shape)}, {self.dtype})"


Weight = torch.Tensor | PackedWeight


@functools.cache
def packing_available() -> bool:
    """Whether this torch packs bf16 CPU linears through oneDNN with exactly ``F.linear``'s bits."""
    return _packs(torch.bfloat16)


@functools.cache
def fp32_packing_available() -> bool:
    """Whether this torch packs fp32 CPU linears through oneDNN, their products within fp32 rounding
    of ``F.linear``'s (not its bits: see ``pack_head``)."""
    return _packs(torch.float32)


def _packs(dtype: torch.dtype) -> bool:
    """A probe of packed products in ``dtype`` against ``F.linear``: the same bits for bf16, within
    fp32 rounding for fp32 (whose batch-invariant products run on the plain tensor instead)."""
    if os.environ.get("DSPARK_PACKED_LINEAR", "1") == "0":
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 80, generator=g).to(dtype)
        b = torch.randn(96, generator=g).to(dtype)
        p = PackedWeight(w)
        for rows in (1, 3, 17):
            x = torch.randn(rows, 80, generator=g).to(dtype)
            for bias in (None, b):
                got, want = linear(x, p, bias), F.linear(x, w, bias)
                if not (torch.equal(got, want) if dtype == torch.bfloat16
                        else torch.allclose(got, want, rtol=1e-4, atol=1e-4)):
                    return False
        return True
    except (RuntimeError, AttributeError, NotImplementedError):   # an op missing from this torch build
        return False


ALIKE_EVERY = 40        # the check compares every row count up to this one, then the counts below
ALIKE_COUNTS = (*range(2, ALIKE_EVERY + 1), 48, 63, 64, 65, 100, 128, 129, 160)
MIN_ALIKE_ROWS = 8      # a shape kept alike only below this stays dense: chunks that small cost too much


@functools.cache
def rows_alike_limit(shape: tuple[int, int]) -> int | None:
    """Up to how many rows packed products of this weight shape give a row the bits it gets alone
    (one row runs as two, see ``linear``): None where every count checked agrees, else the largest
    count below the first that differs (1: even two rows differ), at most ``ALIKE_EVERY`` (chunks
    come in every size up to the limit, and only the counts up to it were each checked). CPUs whose
    oneDNN changes kernels with the row count (AMX from 33 rows on) round some rows otherwise in
    large blocks, and only on some inputs (rows with subnormal values, in the cases met), so the
    check is broad: 160 rows, half of them 5 % and half 30 % subnormal, each computed alone against
    every count up to 40 and counts on both sides of the usual kernel boundaries up to 160."""
    g = torch.Generator().manual_seed(0)
    w = PackedWeight(torch.randn(shape, generator=g).bfloat16())
    x = torch.randn(160, shape[1], generator=g)
    share = torch.where(torch.arange(160) % 2 == 0, 0.05, 0.30).unsqueeze(1)
    x[torch.rand(160, shape[1], generator=g) < share] = 1e-39
    x = x.bfloat16()
    alone = torch.cat([linear(x[i:i + 1], w, rows_alike=True) for i in range(160)])
    agreed = 1
    for m in ALIKE_COUNTS:
        if not torch.equal(linear(x[:m], w, rows_alike=True), alone[:m]):
            return min(agreed, ALIKE_EVERY)
        agreed = m
    return None


@overload
def pack(w: Weight, fp32: bool = False) -> Weight: ...
@overload
def pack(w: Weight | None, fp32: bool = False) -> Weight | None: ...
def pack(w: Weight | None, fp32: bool = False) -> Weight | None:
    """``w`` packed for ``linear`` where that is available (bf16, CPU, 2-D) and its kernels keep
    rows alike up to at least ``MIN_ALIKE_ROWS`` rows, else ``w``. ``fp32``: an fp32 weight too
    (a target's layers), where oneDNN packs fp32 and ``DSPARK_PACKED_FP32`` is not 0."""
    if (fp32 and isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32
            and w.device.type == "cpu" and os.environ.get("DSPARK_PACKED_FP32") != "0"
            and fp32_packing_available()):
        return PackedWeight(w)
    if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.bfloat16
            and w.device.type == "cpu" and packing_available()):
        limit = rows_alike_limit(tuple(w.shape))
        if limit is None or limit >= MIN_ALIKE_ROWS:
            return PackedWeight(w, limit)
    return w


def pack_head(w: torch.Tensor) -> Weight:
    """An fp32 CPU LM head packed (keeping its plain tensor) where packed products of a few rows are
    timed faster than the dense path (``packed_faster``), else ``w``; other weights go to ``pack``."""
    if not (w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"):
        return pack(w)
    if fp32_packing_available() and packed_faster(tuple(w.shape), torch.get_num_threads()):
        return PackedWeight(w, plain=w)
    return w


@functools.cache
def packed_faster(shape: tuple[int, int], threads: int | None = None) -> bool:
    """Whether packed fp32 products of 8 and of 16 rows by a weight of this shape (a step's decoding
    rows; the same with a token verified each) both run in at most 0.9 of the dense path's time,
    timed once per shape (and thread count), the best of 3 runs each. ``DSPARK_PACKED_FP32`` = 0 or 1
    forces the answer."""
    del threads     # part of the cache key: the timing is per thread count
    if os.environ.get("DSPARK_PACKED_FP32") in ("0", "1"):
        return os.environ["DSPARK_PACKED_FP32"] == "1"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    p = PackedWeight(w, plain=w)
    for x in (torch.randn(rows, shape[1], generator=g) for rows in (8, 16)):
        if _best(lambda x=x: linear(x, p)) > 0.9 * _best(lambda x=x: linear(x, w)):
            return False
    return True


def _best(f) -> float:
    """The best of 3 timings of ``f`` after one call."""
    f()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def dense(w: Weight) -> torch.Tensor:
    """The plain tensor of a weight, packed or not."""
    return w.dense() if isinstance(w, PackedWeight) else w


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None, rows_alike: bool = False) -> torch.Tensor:
    """x @ w.T (+ b). Packed weights return contiguous rows; the dense bf16 path of a few rows
    returns a transposed view (callers that need rows copy).

    ``rows_alike`` (batch-invariant mode): a row gets the same bits whatever the number of rows
    beside it. oneDNN's one-row kernel rounds some inputs differently from its many-row one (rows
    with subnormal values through a wide down projection, on some CPUs), so with a
    packed weight one row runs as the first of two, and rows run in chunks of at most the weight's
    ``alike`` rows (where a larger block takes another kernel). Kernels also follow the input's
    layout (with the ISA capped at AVX2, a column-major block, as the transposed view the dense
    path returns, rounds otherwise than rows alone), so rows-alike products take contiguous rows on
    both paths."""
    if rows_alike:
        x = x.contiguous()
    if isinstance(w, PackedWeight):     # x in the weight's dtype, as for F.linear
        if rows_alike and w.dtype == torch.float32:
            return F.linear(x, w.exact(), b)
        if not rows_alike:
            return _packed_product(x, w, b)
        if w.alike is not None and x.shape[0] > w.alike:
            return torch.cat([linear(c, w, b, rows_alike=True) for c in x.split(w.alike)])
        if x.shape[0] == 1:
            return _packed_product(x.expand(2, -1), w, b)[:1]
        return _packed_product(x, w, b)
    if torch.compiler.is_compiling():
        # a plain weight inside a compiled graph (runtime/compiled.py): the plain product, whose
        # kernel and weight layout inductor chooses itself
        return F.linear(x, w, b)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        if x.shape[0] == 1:
            y = torch.mv(w, x[0]).unsqueeze(0)
        else:
            y = torch.matmul(w, x.t()).t()
        return y if b is None else y + b
    if (x.dtype == torch.float32 and x.device.type == "cpu" and 1 < x.shape[0] <= FEW_ROWS and not rows_alike
            and x.dim() == 2 and transposed_faster(tuple(w.shape), torch.get_num_threads())):
        y = torch.matmul(w, x.t()).t()
        return y if b is None else y + b
    return F.linear(x, w, b)


FEW_ROWS = 256      # fp32 products of up to this many rows may run as ``w @ x.T`` (a verification block, a short prompt)


def time_kernels(weights) -> None:
    """Make the fp32 few-row kernel choice of each weight's shape now (``transposed_faster`` keeps
    it), at load: a model's first steps then time their products, not the kernels."""
    for w in weights:
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu":
            transposed_faster(tuple(w.shape), torch.get_num_threads())


@functools.cache
def transposed_faster(shape: tuple[int, int], threads: int | None = None) -> bool:
    """Whether an fp32 CPU product of a few rows by a weight of this shape runs faster as ``w @ x.T``
    than as ``F.linear``, timed once per shape (and thread count) on random data at 8 rows, the
    best of 3 runs each. Which is faster depends on the BLAS and the CPU: on some (AVX2 alone),
    ``F.linear``'s few-row kernel streams a large weight once per row, ``w @ x.T`` once per call."""
    del threads     # part of the cache key: the timing is per thread count
    if os.environ.get("DSPARK_TRANSPOSED_LINEAR") in ("0", "1"):
        return os.environ["DSPARK_TRANSPOSED_LINEAR"] == "1"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    x = torch.randn(8, shape[1], generator=g)

    plain = _best(lambda: F.linear(x, w))
    flipped = _best(lambda: torch.matmul(w, x.t()))
    return flipped < 0.9 * plain


def _packed_product(x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, b, "none", [], "")


class FastLinear(torch.nn.Linear):
    """``nn.Linear`` on ``linear``'s path for 2-D inputs (rows are returned contiguous). Serving
    only: the weight is packed at the first call and repacked only if it is modified in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        key = (self.weight.data_ptr(), self.weight.dtype, self.weight._version)
        if getattr(self, "_packed_key", None) != key:
            self._packed, self._packed_key = pack(self.weight.detach()), key
        return linear(x, self._packed, self.bias).contiguous()


_M = TypeVar("_M", bound=torch.nn.Module)


def serve_fast(module: _M) -> _M:
    """Put every ``nn.Linear`` of a drafter built for training on the serving path in place (same
    weights and parameter names; only how few-row products run changes)."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = FastLinear
    return module
