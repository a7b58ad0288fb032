"""Batch-invariant attention (``Decoder.batch_invariant``, ``--batch-invariant``): a token decoded
alone and the same token verified inside a drafted block attend bit for bit alike, so that bf16
greedy speculative decoding emits exactly what bf16 plain decoding emits (fp32 does without it).

Why the default path is not invariant (torch's CPU kernels at the attention's shapes): CPU fp32
batched products of very few rows take another kernel than larger ones (their scores differ in
the last bits), and probabilities times values sum over the key count in blocks that depend
on it, so a row's product over exactly its keys and over a longer, masked span differ in the last
bits; bf16 rounding turns such differences into flipped near-ties. Here a query block is padded
with zero rows to ``MIN_QUERY_ROWS``, and each row meets the values over its key count rounded up
to ``KEY_BUCKET`` (the extra keys masked: probabilities exactly 0) whatever block it is in; scores
and softmax were invariant already (masked columns add exact zeros). The linear layers' part lives
in runtime/linear.py (``rows_alike``: a single row multiplied as the first of two). Padding and
wider value products cost every forward some time, most at one decoding row, so the mode is off by
default (its price: docs/identity.md); vLLM's batch-invariant mode makes the same trade.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import softmax_fp32
from .kv_cache import KEY_BUCKET

MIN_QUERY_ROWS = 4


def _bucket(end: int) -> int:
    return -(-end // KEY_BUCKET) * KEY_BUCKET


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                out: torch.Tensor, start: int) -> None:
    """Rows at positions start .. start + n - 1 (q [n, H, hd], scaled) against the request's whole
    cache slot k, v [Hkv, S, hd] (S a whole number of buckets), into out [n, H * hd]. ``mask`` as
    in ``runtime.model.attend``, over the last ``mask.shape[1]`` of the start + n visible keys."""
    n, H, hd = q.shape
    Hkv = k.shape[0]
    rep = H // Hkv
    m = n * rep
    end = start + n
    width = _bucket(end)
    qg = q.reshape(n, Hkv, rep, hd).transpose(0, 1).reshape(Hkv, m, hd)
    if m < MIN_QUERY_ROWS:
        qg = torch.cat([qg, qg.new_zeros(Hkv, MIN_QUERY_ROWS - m, hd)], 1)
    s = torch.bmm(qg, k[:, :width].transpose(1, 2))
    if mask is not None:
        s[:, :m].view(Hkv, n, rep, width)[..., end - mask.shape[1]:end].add_(mask.unsqueeze(1))
    if width > end:
        s[..., end:].fill_(float("-inf"))
    p = softmax_fp32(s)
    o = out.view(n, Hkv, rep, hd)
    if _bucket(start + 1) == width:     # every row's key count rounds up to the same width
        o.copy_(torch.bmm(p, v[:, :width])[:, :m].view(Hkv, n, rep, hd).transpose(0, 1))
        return
    a = 0                               # rows in runs of equal rounded key count, one product each
    while a < n:
        w = _bucket(start + a + 1)
        b = min(n, w - start)           # rows a .. b - 1 see at most w keys
        pr = p[:, a * rep:b * rep, :w]
        rows = (b - a) * rep
        pr = torch.cat([pr, pr.new_zeros(Hkv, MIN_QUERY_ROWS - rows, w)], 1) if rows < MIN_QUERY_ROWS \
            else pr.contiguous()
        o[a:b].copy_(torch.bmm(pr, v[:, :w])[:, :rows].view(Hkv, b - a, rep, hd).transpose(0, 1))
        a = b


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   out: torch.Tensor, start: int) -> None:
    """One decoding row at position ``start``, grouped and padded: q and out [Hkv, P, hd], the row's
    rep query heads first, P >= MIN_QUERY_ROWS (the forward prepares every decoding row of a step
    at once, see ``DecodeRows``)."""
    end = start + 1
    width = _bucket(end)
    s = torch.bmm(q, k[:, :width].transpose(1, 2))
    if mask is not None:
        s[..., end - mask.shape[1]:end].add_(mask)
    if width > end:
        s[..., end:].fill_(float("-inf"))
    torch.bmm(softmax_fp32(s), v[:, :width], out=out)


@dataclass
class DecodeRows:
    """The step's decoding rows (segments of one token), their queries grouped and padded in one
    buffer per forward: one copy per layer in, one out."""
    rows: torch.Tensor      # their indices among the forward's rows
    q: torch.Tensor         # [len(rows), Hkv, P, hd]
    out: torch.Tensor

    @staticmethod
    def of(segments, H: int, Hkv: int, hd: int, dtype, device) -> DecodeRows | None:
        ends = torch.tensor([0] + [n for _, n in segments]).cumsum(0)
        rows = ends[1:][torch.tensor([n == 1 for _, n in segments])] - 1
        if not len(rows):
            return None
        q = torch.zeros(len(rows), Hkv, max(H // Hkv, MIN_QUERY_ROWS), hd, dtype=dtype, device=device)
        return DecodeRows(rows.to(device), q, torch.empty_like(q))


def attend_all(qs, kc, vc, segments, starts, masks, window, out, dec: DecodeRows | None) -> None:
    """Every segment's attention against its own whole slot, into out [n_total, H * hd]."""
    Hkv, hd = kc.shape[1], kc.shape[3]
    rep = qs.shape[1] // Hkv
    if dec is not None:
        dec.q[:, :, :rep] = qs[dec.rows].view(-1, Hkv, rep, hd)
    row = d = 0
    for (slot, n), start, mask_for in zip(segments, starts, masks):
        if n == 1 and dec is not None:
            attend_grouped(dec.q[d], kc[slot], vc[slot], mask_for(window), dec.out[d], start)
            d += 1
        else:
            attend_rows(qs[row:row + n], kc[slot], vc[slot], mask_for(window), out[row:row + n], start)
        row += n
    if dec is not None:
        out[dec.rows] = dec.out[:, :, :rep].reshape(len(dec.rows), -1)
