"""Starting a larger drafter from a smaller one's weights, with the function it computes unchanged.

A drafter that has stopped improving at its size (docs/lineage.md, the seventh stage) is worth growing rather
than training from scratch: the weights it learned over hours carry over, and the new capacity
starts silent, so the first step of the new run drafts exactly what the saved drafter drafted.

* More layers: layer i >= n (n saved) starts as a copy of the last saved layer with its two
  residual outputs (``o_proj``, ``down_proj``) at zero, so it adds nothing to the residual stream
  until training moves them (the other weights get gradients from the first update on).
* Another Markov rank (vanilla head, B = W2 W1[x]): the bias table M = W1 W2^T is re-factored at
  the new rank. Down: its best rank-k factors (Eckart-Young) from a thin SVD of R1 R2^T, with
  W1 = Q1 R1, W2 = Q2 R2 (never the [V, V] table itself), split as sqrt(S) on each side; the
  confidence head reads W1[x] too, so its weights over those columns are carried through the same
  basis (exact on the kept subspace). Up: new W1 columns small random, new W2 columns and
  confidence weights zero (unchanged function, trainable).
"""

from __future__ import annotations

import re

import torch

from ..errors import UsageError

_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")
SILENT = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")   # a grown layer's outputs


def _layers(state: dict[str, torch.Tensor]) -> int:
    ids = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
    return max(ids) + 1 if ids else 0


def grow_layers(state: dict[str, torch.Tensor], layers: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``state`` with layers up to ``layers``: copies of the last one, outputs silent."""
    n = _layers(state)
    if n == 0 or layers <= n:
        return state, []
    last = {m.group(2): v for k, v in state.items() if (m := _LAYER.match(k)) and int(m.group(1)) == n - 1}
    out = dict(state)
    for i in range(n, layers):
        for name, v in last.items():
            out[f"backbone.layers.{i}.{name}"] = torch.zeros_like(v) if name in SILENT else v.clone()
    return out, list(range(n, layers))


def change_rank(state: dict[str, torch.Tensor], rank: int, hidden: int) -> dict[str, torch.Tensor]:
    """``state``'s vanilla Markov head (and the confidence head's columns over W1[x]) at ``rank``."""
    w1, w2 = state["head.w1.weight"].float(), state["head.w2.weight"].float()
    r = w1.shape[1]
    if r == rank:
        return state
    conf = state.get("confidence.linear.weight")
    out = dict(state)
    if rank < r:
        q1, r1 = torch.linalg.qr(w1)
        q2, r2 = torch.linalg.qr(w2)
        u, s, vh = torch.linalg.svd(r1 @ r2.T)
        root = s[:rank].sqrt()
        new1, new2 = q1 @ (u[:, :rank] * root), q2 @ (vh[:rank].T * root)
        if conf is not None:
            # w.e = Q1[x] (R1 w) and e' = Q1[x] U_k sqrt(S_k): w' = U_k^T R1 w / sqrt(S_k)
            we = conf[:, hidden:].float()
            tail = (we @ r1.T @ u[:, :rank]) / root.clamp_min(1e-12)
    else:
        gen = torch.Generator().manual_seed(0)
        new1 = torch.cat([w1, torch.randn(w1.shape[0], rank - r, generator=gen) * 0.02], 1)
        new2 = torch.cat([w2, torch.zeros(w2.shape[0], rank - r)], 1)
        if conf is not None:
            tail = torch.cat([conf[:, hidden:].float(), torch.zeros(conf.shape[0], rank - r)], 1)
    out["head.w1.weight"] = new1.to(state["head.w1.weight"].dtype)
    out["head.w2.weight"] = new2.to(state["head.w2.weight"].dtype)
    if conf is not None:
        out["confidence.linear.weight"] = torch.cat([conf[:, :hidden], tail.to(conf.dtype)], 1)
    return out


def grow(state: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], head_type: str, hidden: int,
         where: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A saved state reshaped toward ``mine`` (the new drafter's state dict) where growing is
    defined; returns it with a description of each change (empty: nothing to grow)."""
    done = []
    state, new = grow_layers(state, _layers(mine))
    if new:
        done.append(f"layers {new} from layer {new[0] - 1} (outputs at zero)")
    key = "head.w1.weight"
    if key in state and key in mine and state[key].shape[1] != mine[key].shape[1]:
        if head_type != "vanilla":
            raise UsageError(f"{where}: Markov rank {state[key].shape[1]} -> {mine[key].shape[1]} "
                             f"is defined for the vanilla head, not {head_type!r}")
        done.append(f"Markov rank {state[key].shape[1]} -> {mine[key].shape[1]}")
        state = change_rank(state, mine[key].shape[1], hidden)
    return state, done
