"""DSpark's sequential stage and confidence head.

The parallel backbone gives base logits U_k for every block position at once; the sequential head
adds a cheap bias that depends on the previous token, sampled left to right:
    p_k(v) = softmax(U_k(v) + B_k(x_{k-1}, v)).

* vanilla Markov: B = W2(W1[x_{k-1}]), W1 a V x r table, W2 a linear r -> V;
* gated Markov:   B = W2(sigmoid(G[h_k; W1[x_{k-1}]]) * W1[x_{k-1}]);
* RNN:            [g; u; o] = R[s_{k-1}; W1[x_{k-1}]; h_k], s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(u),
                  B = W2(tanh(o)), s_0 = 0.
Confidence c_k = sigmoid(w . [h_k; W1[x_{k-1}]]): P(token k survives | tokens < k survived).

Token ids here are draft-vocabulary indices; index ``draft_vocab_size`` stands for a previous
token outside the draft vocabulary (possible for the anchor). With ``markov_full_table`` (imported
checkpoints, whose W1 has a row per target token) the tokens outside the draft vocabulary have rows
of their own after the draft vocabulary's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.linear import linear
from .config import DrafterConfig


class SequentialHead(nn.Module):
    # the head's kind ("vanilla" / "gated" / "rnn"): an instance attribute that shadows nn.Module.type(),
    # which this module never uses; mypy rejects redefining a base-class method as an attribute
    type: str  # type: ignore[assignment]

    def __init__(self, c: DrafterConfig, vocab: int):
        super().__init__()
        self.type, r, d = c.markov_head_type, c.markov_rank, c.hidden_size
        self.rank = r
        self.w1 = nn.Embedding(c.vocab_size if c.markov_full_table else vocab + 1, r)
        self.w2 = nn.Linear(r, vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)          # starts as the plain backbone (bias 0)
        if self.type == "gated":
            self.gate = nn.Linear(d + r, r)
        elif self.type == "rnn":
            self.rnn = nn.Linear(2 * r + d, 3 * r)

    def init_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(n, self.rank) if self.type == "rnn" else None

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """One position for a batch of rows: h [n, d], prev [n] -> (bias [n, V], e [n, r], state)."""
        e = self.w1(prev)
        if self.type == "vanilla":
            return self.w2(e), e, state
        if self.type == "gated":
            return self.w2(torch.sigmoid(self.gate(torch.cat([h, e], -1))) * e), e, state
        assert state is not None        # the rnn head always carries one (init_state)
        g, u, o = self.rnn(torch.cat([state, e, h], -1)).chunk(3, -1)
        s = torch.sigmoid(g)
        state = s * state + (1 - s) * torch.tanh(u)
        return self.w2(torch.tanh(o)), e, state

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor):
        """All positions of [A, gamma] blocks with ground-truth previous tokens:
        h [A, gamma, d], prev [A, gamma] -> bias [A, gamma, V], e [A, gamma, r]."""
        if self.type != "rnn":
            b, e, _ = self.step(h, prev, None)
            return b, e
        state = self.init_state(h.shape[0], h)
        out_b, out_e = [], []
        for k in range(h.shape[1]):
            b, e, state = self.step(h[:, k], prev[:, k], state)
            out_b.append(b)
            out_e.append(e)
        return torch.stack(out_b, 1), torch.stack(out_e, 1)


class ConfidenceHead(nn.Module):
    def __init__(self, c: DrafterConfig, with_markov: bool):
        super().__init__()
        self.linear = nn.Linear(c.hidden_size + (c.markov_rank if with_markov else 0), 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """Confidence logit (before sigmoid and before any STS temperature)."""
        x = h if e is None else torch.cat([h, e], -1)
        return self.linear(x).squeeze(-1)


class MarkovRows:
    """The vanilla head's bias B(x) = W2 W1[x] read from a table instead of computed each time
    (serving): the row of a previous token x is computed once, alone (so that its bits never
    depend on the rows beside it), when x first comes up, and kept. A drafted token then costs a
    16 KB row instead of a product over all of W2, most of the head's time at a few requests.
    The table spans every row of W1 but only the rows filled take memory (pages never written
    are never mapped), so it stays as large as the tokens actually met."""

    # the table's span at most (bytes): larger ones (an imported full-vocabulary W1) compute B
    MAX_BYTES = 512 * 2 ** 20

    def __init__(self, head: SequentialHead, w2):
        self.w1 = head.w1.weight.detach()
        self.w2 = w2                # W2's weight as runtime.linear's ``linear`` takes it
        rows, cols = self.w1.shape[0], head.w2.weight.shape[0]
        self.table = torch.empty(rows, cols, dtype=self.w1.dtype, device=self.w1.device)
        self.known = torch.zeros(rows, dtype=torch.bool, device=self.w1.device)

    @staticmethod
    def fits(head: SequentialHead) -> bool:
        rows, cols = head.w1.weight.shape[0], head.w2.weight.shape[0]
        return head.type == "vanilla" and rows * cols * head.w1.weight.element_size() <= MarkovRows.MAX_BYTES

    def __call__(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [n] rows of W1 -> B [n, V_draft]."""
        new = prev[~self.known[prev]]
        if new.numel():
            for r in new.unique().tolist():
                self.table[r] = linear(self.w1[r:r + 1], self.w2)[0]
            self.known[new] = True
        return self.table[prev]
