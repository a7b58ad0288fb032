"""Shared statistics for the lossless tests: the target's exact law over short continuations and
a chi-square goodness-of-fit p-value against it."""

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from dspark.sampling import probs_from_logits
from dspark.scheduling.policies import Policy


class CyclingPolicy(Policy):
    """Verifies 0, 1, 2 or 3 drafts by a schedule that depends on nothing sampled (lossless), so
    that a law test sees several verification lengths."""

    def __init__(self):
        self.tick = 0
        self.used = set()

    def verify_lengths(self, requests, proposals):
        out = []
        for p in proposals:
            self.tick += 1
            out.append(min(len(p), self.tick % 4))
            self.used.add(out[-1])
        return out


def naive_penalised(row, params, prompt, text):
    """One row's penalised logits, token by token (the reference of sampling.penalised_logits): the
    logit bias, then the repetition penalty on tokens in the prompt or ``text``, then minus
    frequency x count and presence over ``text``."""
    out = row.float().clone()
    for t, b in params.logit_bias:
        out[t] += b
    for v in range(out.shape[0]):
        c = text.count(v)
        if params.repetition_penalty != 1.0 and (c or v in prompt):
            out[v] = out[v] / params.repetition_penalty if out[v] > 0 else out[v] * params.repetition_penalty
        out[v] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return out


def exact_law(target, prompt, n_new, params, vocab, banned=()):
    """{continuation: probability} of every ``n_new``-token continuation under the target (its
    logits penalised token by token when ``params`` has penalties; ``banned`` tokens ruled out)."""
    cache = target.new_cache(1, len(prompt) + n_new + 1)
    slot = cache.allocate()
    law = {}
    for seq in itertools.product(range(vocab), repeat=n_new):
        cache.truncate(slot, 0)
        ids = prompt + list(seq)
        logits = target(torch.tensor(ids), [(slot, len(ids))], cache).logits[len(prompt) - 1:len(ids) - 1]
        if params.penalised:
            logits = torch.stack([naive_penalised(logits[i], params, prompt, list(seq[:i])) for i in range(n_new)])
        if banned:
            logits = logits.float().clone()
            logits[:, list(banned)] = float("-inf")
        probs = probs_from_logits(logits, params)
        law[seq] = float(np.prod([float(probs[i, t]) for i, t in enumerate(seq)]))
    return law


def chi2_pvalue(counts, law, min_expected: float = 5.0):
    """Goodness of fit of observed ``counts`` to ``law``; sequences of probability 0 must not occur.
    Cells expected fewer than ``min_expected`` times are pooled into one (the chi-square
    approximation needs it)."""
    impossible = [s for s, p in law.items() if p == 0 and counts.get(s)]
    assert not impossible, f"emitted sequences the target can never produce: {impossible[:3]}"
    cells = [s for s, p in law.items() if p > 0]
    obs = np.array([counts.get(s, 0) for s in cells], float)
    exp = np.array([law[s] for s in cells])
    exp = exp / exp.sum() * obs.sum()
    small = exp < min_expected
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return chisquare(obs, exp).pvalue


def constrained_law(target, grammar, prompt, n_new, params, vocab, end, bias=None):
    """{output: probability} of every output of at most ``n_new`` tokens (ending at the token
    ``end`` or at n_new) under the grammar's masks: a fresh matcher fed the output so far at each
    step. ``target``: a loaded target (model and tokenizer); ``bias``: added to the logits first (a
    law other than the target's, that a test must tell apart)."""
    from dspark.structured import grammar_state
    law = {}

    def walk(seq, p):
        if len(seq) == n_new or (seq and seq[-1] == end):
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + p
            return
        cache = target.model.new_cache(1, len(prompt) + n_new + 1)
        ids = prompt + seq
        logits = target.model(torch.tensor(ids), [(cache.allocate(), len(ids))], cache).logits[-1:].float()
        if bias is not None:
            logits = logits + bias
        g = grammar_state(target, grammar)
        g.advance(list(seq))
        probs = probs_from_logits(logits.masked_fill(~g.masks([])[0], float("-inf")), params)[0]
        for t in range(vocab):
            if probs[t] > 0:
                walk(seq + [t], p * float(probs[t]))
    walk([], 1.0)
    return law
