"""Attention of the ragged batch against the KV cache: per request (``attend``) or, for the short
segments of decoding and verification, all requests of a step in one product (``SlotBatch``).

Each request's keys and values live in its own cache slot ``[Hkv, S, hd]`` (runtime/kv_cache.py).
A decoding step of R requests attends R times over tiny shapes (three query heads per KV head
against a few hundred keys), where the per-call cost, not the arithmetic, is most of the time
(docs/runtime.md). ``SlotBatch`` runs those segments as one batched product over the slots
they occupy, the cache read in place (``k[lo:hi, :, :S]`` is a strided view; the allocator hands
out the lowest free slot, so a step's requests sit in a compact range): every query row against
the keys up to the longest segment's end, the rest masked. Segments whose slots are spread over
more than twice their number (the few requests of a step that verify a block among many that only
decode) have their slots' keys and values gathered first, up to the longest end: one copy, where
one product per segment per layer costs more (docs/runtime.md). With many long contexts the fp32
cache's bandwidth bounds both ways alike.

Softmax in fp32 whatever the cache dtype, as transformers does. Not batch-invariant (a row's
scores over a longer, masked span round differently in the last bits): runtime/invariant.py is
the path for that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def softmax_fp32(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, computed in fp32 whatever the scores' dtype (as transformers)."""
    if s.dtype == torch.float32:
        return torch.softmax(s, -1)
    return torch.softmax(s, -1, dtype=torch.float32).to(s.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           out: torch.Tensor) -> None:
    """One request's attention: q [n, H, hd] (already scaled, in the cache dtype) against its keys
    and values k, v [Hkv, S, hd], written into ``out`` [n, H * hd] (contiguous rows).

    Grouped-query heads share their KV head without copying it: a group's queries are the rows of
    one [Hkv, n * rep, hd] product. ``mask`` is additive (0 where a query may look, -inf elsewhere)
    over the last ``mask.shape[1]`` key columns: the [n, n] causal triangle of the segment's own
    keys when every earlier key is visible, or a full [n, S] mask; None when nothing is masked.
    """
    n, H, hd = q.shape
    Hkv, S = k.shape[0], k.shape[1]
    rep = H // Hkv
    s = torch.bmm(q.reshape(n, Hkv, rep, hd).transpose(0, 1).reshape(Hkv, n * rep, hd), k.transpose(1, 2))
    if mask is not None:
        s.view(Hkv, n, rep, S)[..., S - mask.shape[1]:].add_(mask.unsqueeze(1))
    p = softmax_fp32(s)
    if n == 1:
        torch.bmm(p, v, out=out.view(Hkv, rep, hd))
    else:
        out.view(n, Hkv, rep, hd).copy_(torch.bmm(p, v).view(Hkv, n, rep, hd).transpose(0, 1))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """``attend`` for unscaled queries q [n, H, hd] -> a new [n, H * hd] tensor in q's dtype."""
    n, H, hd = q.shape
    out = torch.empty(n, H * hd, dtype=k.dtype, device=k.device)
    attend(q.to(k.dtype) * scale, k, v, bias, out)
    return out.to(q.dtype)


@dataclass
class SlotBatch:
    """The short segments of one forward, laid out once for every layer: slot ``lo + b`` (or
    ``index[b]``, where the slots are gathered) holds batch entry b, its n_max query rows padded
    (padding rows and free slots in the range look at key 0 only; their outputs are dropped).
    ``masks`` per attention window: additive [B, 1, n_max, 1, S], -inf beyond each row's causal end
    (and before its window)."""
    lo: int
    width: int              # B: slots lo .. lo + B - 1, or the B slots in ``index``
    rows: int               # n_max
    keys: int               # S: the longest segment's end
    src: torch.Tensor       # the forward's rows of these segments
    dst: torch.Tensor       # their places in the [B * n_max] padded layout
    qpos: torch.Tensor      # [B, n_max] each padded row's position, -1 for padding
    members: frozenset      # indices of the segments in the batch
    masks: dict
    dense: int | None = None    # the first row, when the segments' rows ARE the padded layout
    ragged: bool = True         # whether any key column is masked for any row (else no mask)
    index: torch.Tensor | None = None   # the slots of entries 0 .. B - 1, where they are gathered

    # a segment this short goes into the batch (decoding rows, verification blocks); prefill chunks
    # attend on their own
    MAX_ROWS = 16
    # the batch's score tensor, [B, Hkv, n_max * rep, S], is split by slots beyond this many elements
    MAX_SCORES = 1 << 24

    @classmethod
    def plan(cls, segments, starts, row_starts, device, causal: bool = True) -> list[SlotBatch]:
        """The batches of a forward's short segments: the one-row segments (decoding) in one, the
        longer ones (verification blocks) in another. One batch pads every segment to the longest,
        so a step of 32 decoding requests in which one verifies a block of 8 would attend as 32
        blocks of 8, which costs several times what 32 rows do (docs/runtime.md); apart, the
        decoding rows keep their cost and the blocks add theirs. Segments in no batch
        (prefill chunks, a group of one) attend on their own."""
        short = [i for i, (_, n) in enumerate(segments) if n <= cls.MAX_ROWS]
        groups = [[i for i in short if segments[i][1] == 1], [i for i in short if segments[i][1] > 1]]
        batches = [cls.of(segments, starts, row_starts, device, causal, pick=g) for g in groups if g]
        return [b for b in batches if b is not None]

    @classmethod
    def of(cls, segments, starts, row_starts, device, causal: bool = True,
           pick: list[int] | None = None) -> SlotBatch | None:
        """The batch of the segments of at most MAX_ROWS rows (of those in ``pick``, when given),
        or None when fewer than two qualify or two share a slot. Slots within a range of at most
        twice their number are read in place (free slots in the range are padding entries); slots
        spread wider are gathered (``index``). ``causal=False``: every row of a segment sees all
        of its keys (a drafter's non-causal block)."""
        chosen = range(len(segments)) if pick is None else pick
        picked = [(segments[i][0], segments[i][1], starts[i], row_starts[i], i) for i in chosen
                  if segments[i][1] <= cls.MAX_ROWS]
        if len(picked) < 2:
            return None
        slots = [p[0] for p in picked]
        if len(set(slots)) != len(slots):
            return None
        lo, hi = min(slots), max(slots)
        spread = hi - lo + 1 > 2 * len(picked)
        # batch entry of each slot: its offset in the range read in place, or its rank, gathered
        entry = {s: i for i, s in enumerate(sorted(slots))} if spread else {s: s - lo for s in slots}
        width, rows = (len(slots) if spread else hi - lo + 1), max(p[1] for p in picked)
        keys = max(start + n for _, n, start, _, _ in picked)
        src: list[int] = []
        dst: list[int] = []
        qpos = torch.full((width, rows), -1, dtype=torch.long)
        for slot, n, start, row, _ in picked:
            b = entry[slot]
            src.extend(range(row, row + n))
            dst.extend(range(b * rows, b * rows + n))
            qpos[b, :n] = torch.arange(start, start + n) if causal else start + n - 1
        dense = src[0] if src == list(range(src[0], src[0] + width * rows)) and dst == list(range(width * rows)) \
            else None
        ragged = (rows > 1 and causal) or len({start + n for _, n, start, _, _ in picked}) > 1 or dense is None
        index = torch.tensor(sorted(slots), device=device) if spread else None
        return cls(lo, width, rows, keys, torch.tensor(src, device=device), torch.tensor(dst, device=device),
                   qpos.to(device), frozenset(p[4] for p in picked), {}, dense, ragged, index)

    def mask(self, window: int | None, dtype) -> torch.Tensor:
        if window not in self.masks:
            kpos = torch.arange(self.keys, device=self.qpos.device)
            q = self.qpos.unsqueeze(-1)
            ok = (kpos <= q) & (q >= 0)
            if window is not None:
                ok &= kpos > q - window
            ok |= (q < 0) & (kpos == 0)          # padding rows: key 0 only, so no row is all -inf
            m = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))
            self.masks[window] = m.view(self.width, 1, self.rows, 1, self.keys)
        return self.masks[window]

    def attend(self, qs: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int | None,
               out: torch.Tensor) -> None:
        """The batched segments' attention: qs [N, H, hd] (scaled, cache dtype) of the forward's rows,
        kc / vc one layer's cache [slots, Hkv, max_len, hd]; writes their rows of out [N, H * hd]."""
        H, hd = qs.shape[1], qs.shape[2]
        Hkv = kc.shape[1]
        rep = H // Hkv
        B, n, S = self.width, self.rows, self.keys
        if self.dense is not None:      # the usual step: every slot of the range, n rows each, in order
            q = qs[self.dense:self.dense + B * n]
        else:
            q = qs.new_zeros(B * n, H, hd)
            q[self.dst] = qs[self.src]
        q = q.view(B, n, Hkv, rep, hd).transpose(1, 2).reshape(B, Hkv, n * rep, hd)
        mask = self.mask(window, qs.dtype) if self.ragged or window is not None else None
        direct = self.dense is not None and n == 1     # [B, Hkv, rep, hd] is out's own layout
        if direct:
            assert self.dense is not None   # implied by direct
            o = out[self.dense:self.dense + B].view(B, Hkv, rep, hd)
        else:
            o = torch.empty(B, Hkv, n * rep, hd, dtype=qs.dtype, device=qs.device)
        step = max(1, self.MAX_SCORES // (Hkv * n * rep * S))
        for a in range(0, B, step):
            b = min(B, a + step)
            if self.index is None:
                k, v = kc[self.lo + a:self.lo + b, :, :S], vc[self.lo + a:self.lo + b, :, :S]
            else:
                k, v = (c[:, :, :S].index_select(0, self.index[a:b]) for c in (kc, vc))
            s = torch.matmul(q[a:b], k.transpose(2, 3))
            if mask is not None:
                s.view(b - a, Hkv, n, rep, S).add_(mask[a:b])
            torch.matmul(softmax_fp32(s), v, out=o[a:b])
        if direct:
            return
        o = o.view(B, Hkv, n, rep, hd).transpose(1, 2).reshape(B * n, H * hd)
        if self.dense is not None:
            out[self.dense:self.dense + B * n] = o
        else:
            out[self.src] = o[self.dst]
