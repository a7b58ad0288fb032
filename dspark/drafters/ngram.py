"""Prompt lookup (n-gram) drafting: copy what followed the last occurrence of the current suffix.

Like vLLM's ``ngram`` method and HF's ``prompt_lookup_num_tokens``: the drafter looks for the
longest suffix of the sequence (``max_ngram`` down to ``min_ngram`` tokens) that occurred
earlier, and proposes the tokens that followed its most recent occurrence among those whose next
token is the most frequent one after that suffix (a vote between earlier occurrences). A match of a single
token is weak evidence, so it proposes at most ``weak_match_tokens`` tokens then (verifying a
token costs a little even when the forward is bound by reading weights). The proposal is a
deterministic choice (point masses), so verification uses ``probs=None``.

Like SuffixDecoding and vLLM's suffix method, the drafter also remembers the last
``history_tokens`` tokens of the requests it served (prompts and outputs): when the request's own
text has no match of a given length, a match of at least ``history_min_ngram`` tokens in that
history proposes what followed there (answers to similar prompts repeat each other's phrasing).
The history changes which tokens are proposed, never what is emitted.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DraftContext, Drafter, Proposal

_SEPARATOR = -1   # between remembered requests: never a token id, so no match or proposal crosses it


class History:
    """Token ids of earlier requests, separated, with an index from token id to its positions."""

    def __init__(self, tokens: np.ndarray | None = None):
        self.tokens = np.empty(0, dtype=np.int64) if tokens is None else tokens
        self._order = np.argsort(self.tokens, kind="stable")   # positions grouped by token id, ascending
        self._keys = self.tokens[self._order]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def extended(self, seq, keep: int) -> History:
        joined = np.concatenate([self.tokens, np.asarray(list(seq) + [_SEPARATOR], dtype=np.int64)])
        return History(joined[-keep:])

    def positions(self, token: int) -> np.ndarray:
        lo, hi = np.searchsorted(self._keys, [token, token + 1])
        return self._order[lo:hi]


def _match_lengths(hay: np.ndarray, ends: np.ndarray, tokens: np.ndarray, longest: int) -> np.ndarray:
    """For occurrences of the last token at ``ends``: how many of the sequence's trailing tokens
    match there (up to ``longest``)."""
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.arange(ends.shape[0])
    for j in range(1, longest):
        alive = alive[ends[alive] >= j]
        alive = alive[hay[ends[alive] - j] == tokens[-1 - j]]
        if not alive.size:
            break
        length[alive] += 1
    return length


def _vote(tokens: np.ndarray, starts: np.ndarray, rule: str) -> int:
    """The continuation to copy: "first" = earliest occurrence (HF's rule); "vote" = most recent
    occurrence whose next token is the most frequent next token."""
    if rule == "first" or starts.size == 1:
        return int(starts[0])
    if starts.size > 64:
        _, inverse, counts = np.unique(tokens[starts], return_inverse=True, return_counts=True)
        return int(starts[np.flatnonzero(counts[inverse] == counts.max())[-1]])
    # a few occurrences (most lookups): counted in Python, a fraction of numpy's sort and set tests
    nxt = tokens[starts].tolist()
    seen: dict[int, int] = {}
    for t in nxt:
        seen[t] = seen.get(t, 0) + 1
    most = max(seen.values())
    return int(starts[next(k for k in range(len(nxt) - 1, -1, -1) if seen[nxt[k]] == most)])


def lookup(tokens: np.ndarray, num_tokens: int, max_ngram: int = 5, min_ngram: int = 1,
           rule: str = "vote", history: History | None = None,
           history_min_ngram: int = 2) -> tuple[np.ndarray, int]:
    """(continuation of the chosen earlier match of the longest matching suffix, its length).

    At each suffix length the request's own text is searched first, then (from
    ``history_min_ngram`` tokens up) the ``history`` of earlier requests."""
    n_tok = tokens.shape[0]
    longest = min(max_ngram, n_tok - 1)
    if longest < min_ngram:
        return tokens[:0], 0
    last = tokens[-1]
    own_ends = np.flatnonzero(tokens[:n_tok - 1] == last)
    own_len = _match_lengths(tokens, own_ends, tokens, longest)
    hist_ends = hist_len = None
    if history is not None and len(history) and longest >= history_min_ngram:
        hist_ends = history.positions(int(last))
        hist_ends = hist_ends[hist_ends < len(history) - 1]
        hist_len = _match_lengths(history.tokens, hist_ends, tokens, longest)
    for n in range(int(max(own_len.max(initial=0), 0 if hist_len is None else hist_len.max(initial=0))),
                   min_ngram - 1, -1):
        starts = own_ends[own_len >= n] + 1
        if starts.size:
            start = _vote(tokens, starts, rule)
            return tokens[start:start + num_tokens], n
        if hist_len is not None and n >= history_min_ngram:
            assert hist_ends is not None and history is not None   # set together with hist_len
            starts = hist_ends[hist_len >= n] + 1
            if starts.size:
                start = _vote(history.tokens, starts, rule)
                cont = history.tokens[start:start + num_tokens]
                cut = np.flatnonzero(cont == _SEPARATOR)
                cont = cont[:cut[0]] if cut.size else cont
                if cont.size:
                    return cont, n
    return tokens[:0], 0


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, block_size: int = 10, max_ngram: int = 5, min_ngram: int = 1,
                 weak_match_tokens: int = 5, rule: str = "vote", history_tokens: int = 1 << 16,
                 history_min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if rule not in ("vote", "first"):
            raise ValueError(f"unknown lookup rule {rule!r}")
        if history_tokens < 0 or history_min_ngram < 1:
            raise ValueError("need history_tokens >= 0 and history_min_ngram >= 1")
        self.rule = rule
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.weak_match_tokens = weak_match_tokens
        self.history_tokens = history_tokens
        self.history_min_ngram = history_min_ngram
        self.history = History()
        self._version = 0       # bumped whenever the history changes (cached lookups are stale then)

    def propose(self, contexts: list[DraftContext]) -> list[Proposal]:
        return [self.match(ctx)[0].truncate(ctx.num_draft) if ctx.num_draft > 0 else Proposal.empty()
                for ctx in contexts]

    def free_lengths(self, contexts: list[DraftContext]) -> list[int]:
        return [len(self.match(ctx)[0]) for ctx in contexts]     # a lookup costs no forward

    def match(self, ctx: DraftContext) -> tuple[Proposal, int]:
        """(the proposal for one request, up to max(block_size, num_draft) tokens; the length of the
        suffix match it copies, 0: none). Kept in the request's state until its text or the history
        changes: the policy may ask (``free_lengths``) before the round's ``propose``, and a shorter
        lookup is a prefix of a longer one."""
        want = max(self.block_size, ctx.num_draft)
        key = (len(ctx.tokens), self._version, want)
        got = ctx.state.get("_lookup")
        if got is not None and got[0] == key:
            return got[1], got[2]
        toks = np.asarray(ctx.tokens, dtype=np.int64)
        cont, n = lookup(toks, want, self.max_ngram, self.min_ngram, self.rule,
                         self.history if len(self.history) else None, self.history_min_ngram)
        if n == 1:
            cont = cont[:self.weak_match_tokens]
        p = Proposal(torch.from_numpy(cont.copy()), free=True, evidence=n)
        ctx.state["_lookup"] = (key, p, n)
        return p, n

    def release(self, context: DraftContext) -> None:
        """Remember the ended request's text (the newest ``history_tokens`` tokens are kept)."""
        if not self.history_tokens or not context.tokens:
            return
        self.history = self.history.extended(context.tokens, self.history_tokens)
        self._version += 1

    def reset(self) -> None:
        self.history = History()
        self._version += 1
