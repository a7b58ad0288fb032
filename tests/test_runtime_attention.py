"""The batched attention of short segments (runtime/attention.py) against per-segment attention."""

import pytest
import torch

from dspark.runtime.attention import SlotBatch, attend
from dspark.runtime.kv_cache import KVCache

H, HKV, HD, MAX_LEN = 6, 2, 8, 64


def _reference(qs, kc, vc, segments, starts, window):
    """Each segment alone, its mask written out in full (causal, and the window's lower edge)."""
    out = torch.zeros(qs.shape[0], H * HD)
    row = 0
    for (slot, n), start in zip(segments, starts):
        end = start + n
        qpos = torch.arange(start, end).unsqueeze(1)
        kpos = torch.arange(end).unsqueeze(0)
        ok = kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        mask = torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))
        attend(qs[row:row + n], kc[slot, :, :end], vc[slot, :, :end], mask, out[row:row + n])
        row += n
    return out


CASES = {
    # segments [(slot, new rows)] and each slot's cached length before them
    "decoding rows, equal contexts": ([(0, 1), (1, 1), (2, 1), (3, 1)], [20, 20, 20, 20]),
    "decoding rows, ragged contexts": ([(0, 1), (1, 1), (2, 1)], [5, 31, 17]),
    "blocks of one length": ([(0, 3), (1, 3)], [10, 12]),
    "ragged blocks, a free slot among them": ([(0, 1), (2, 7), (3, 2)], [9, 14, 3]),
    "slots out of row order": ([(3, 2), (1, 1), (2, 4)], [8, 22, 11]),
    # slots spread over more than twice their number: gathered
    "spread decoding rows": ([(0, 1), (9, 1)], [5, 30]),
    "spread blocks, out of row order": ([(11, 3), (2, 2), (7, 1)], [6, 17, 25]),
}


@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding window"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_per_segment_attention(case, window):
    segments, starts = CASES[case]
    g = torch.Generator().manual_seed(hash(case) % 1000)
    kc = torch.randn(12, HKV, MAX_LEN, HD, generator=g)
    vc = torch.randn(12, HKV, MAX_LEN, HD, generator=g)
    n_total = sum(n for _, n in segments)
    qs = torch.randn(n_total, H, HD, generator=g)
    row_starts = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
    batch = SlotBatch.of(segments, starts, row_starts, "cpu")
    assert batch is not None and batch.members == frozenset(range(len(segments)))
    # in place where the slots are compact; spread ones are gathered, one entry per segment
    spread = max(s for s, _ in segments) - min(s for s, _ in segments) + 1 > 2 * len(segments)
    assert (batch.index is not None) == spread
    if spread:
        assert batch.width == len(segments) and batch.index.tolist() == sorted(s for s, _ in segments)
    out = torch.full((n_total, H * HD), float("nan"))
    batch.attend(qs, kc, vc, window, out)
    torch.testing.assert_close(out, _reference(qs, kc, vc, segments, starts, window), atol=1e-5, rtol=1e-5)


def test_scores_split_by_slots_give_the_same_rows(monkeypatch):
    g = torch.Generator().manual_seed(7)
    kc, vc = torch.randn(12, HKV, MAX_LEN, HD, generator=g), torch.randn(12, HKV, MAX_LEN, HD, generator=g)
    for case in ("ragged blocks, a free slot among them", "spread blocks, out of row order"):
        segments, starts = CASES[case]
        rows = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
        qs = torch.randn(sum(n for _, n in segments), H, HD, generator=g)
        whole, split = torch.empty(qs.shape[0], H * HD), torch.empty(qs.shape[0], H * HD)
        SlotBatch.of(segments, starts, rows, "cpu").attend(qs, kc, vc, None, whole)
        with monkeypatch.context() as m:
            m.setattr(SlotBatch, "MAX_SCORES", 1)      # one slot per product
            SlotBatch.of(segments, starts, rows, "cpu").attend(qs, kc, vc, None, split)
        torch.testing.assert_close(split, whole)


def test_what_goes_into_the_batch():
    # a prefill chunk attends on its own; one short segment alone is not batched
    b = SlotBatch.of([(0, 1), (1, 40), (2, 3)], [5, 0, 7], [0, 1, 41], "cpu")
    assert b.members == frozenset({0, 2})
    assert SlotBatch.of([(0, 1), (1, 40)], [5, 0], [0, 1], "cpu") is None
    # two segments in one slot cannot be one batch's entries
    assert SlotBatch.of([(3, 1), (3, 1)], [5, 6], [0, 1], "cpu") is None


def test_cache_hands_out_the_lowest_free_slot():
    cache = KVCache(1, HKV, HD, num_slots=4, max_len=16, dtype=torch.float32)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    cache.free(2)
    cache.free(0)
    cache.free(3)
    assert [cache.allocate() for _ in range(3)] == [0, 2, 3]


@pytest.mark.parametrize("starts", [[10, 10, 10], [4, 19, 11]], ids=["equal ends", "ragged ends"])
def test_non_causal_blocks_see_all_their_keys(starts):
    """A drafter's block (``causal=False``): every row of a segment attends to all keys up to its end."""
    segments = [(0, 3), (1, 3), (2, 3)]
    g = torch.Generator().manual_seed(11)
    kc, vc = torch.randn(3, HKV, MAX_LEN, HD, generator=g), torch.randn(3, HKV, MAX_LEN, HD, generator=g)
    qs = torch.randn(9, H, HD, generator=g)
    out = torch.empty(9, H * HD)
    SlotBatch.of(segments, starts, [0, 3, 6], "cpu", causal=False).attend(qs, kc, vc, None, out)
    ref = torch.empty(9, H * HD)
    for i, ((slot, n), start) in enumerate(zip(segments, starts)):
        end = start + n
        attend(qs[i * 3:i * 3 + 3], kc[slot, :, :end], vc[slot, :, :end], None, ref[i * 3:i * 3 + 3])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decoding_rows_and_blocks_batch_apart():
    """One block among decoding rows does not pad every row to the block's length: the rows and the
    blocks go into separate batches, and together they give every segment's own attention."""
    segments = [(0, 1), (1, 8), (2, 1), (3, 1), (4, 3), (5, 1)]
    starts = [9, 4, 12, 3, 7, 10]
    row_starts = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
    batches = SlotBatch.plan(segments, starts, row_starts, "cpu")
    assert sorted((b.rows, b.members) for b in batches) == [(1, frozenset({0, 2, 3, 5})), (8, frozenset({1, 4}))]
    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(6, HKV, MAX_LEN, HD, generator=g), torch.randn(6, HKV, MAX_LEN, HD, generator=g)
    qs = torch.randn(15, H, HD, generator=g)
    out = torch.full((15, H * HD), float("nan"))
    for b in batches:
        b.attend(qs, kc, vc, None, out)
    torch.testing.assert_close(out, _reference(qs, kc, vc, segments, starts, None), atol=1e-5, rtol=1e-5)
    # a group of one attends on its own
    assert [b.members for b in SlotBatch.plan([(0, 1), (1, 4), (2, 1)], [3, 3, 3], [0, 1, 5], "cpu")] == \
        [frozenset({0, 2})]
