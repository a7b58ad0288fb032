"""Sampling settings and logits -> probabilities, shared by every drafter and the target.

All probability arithmetic is fp32 whatever the model dtype (DeepSpec bug #31: sampling from
bf16 probabilities while the acceptance ratio used fp32 ones biased the output). Greedy
(temperature 0) is a one-hot distribution on the argmax, so verification needs no special
case for correctness (it has a fast path for speed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import UsageError

MAX_SEED = 2 ** 64 - 1   # torch.Generator.manual_seed takes 0 .. 2**64 - 1
# a temperature below this is greedy, as in vLLM (_SAMPLING_EPS): dividing logits by less
# overflows fp32, and the law it would define differs from the argmax's only at exact ties
GREEDY_BELOW = 1e-5
# the repetition penalty divides or multiplies logits: outside this range they leave fp32's range
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_k: int = 0             # 0 or -1 = off
    top_p: float = 1.0         # in (0, 1]; 1 = off
    seed: int | None = None
    # penalties on the target's logits, as vLLM applies them (``penalised_logits``): they define
    # the distribution the output follows, which speculative decoding then reproduces exactly
    presence_penalty: float = 0.0      # in [-2, 2]: minus this for every token the output holds
    frequency_penalty: float = 0.0     # in [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0    # > 0: logits of tokens in the prompt or output / it (x it below 0)
    logit_bias: tuple = ()             # ((token id, bias in [-100, 100]), ...): added to the logits first

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or not -2 <= v <= 2:
                raise UsageError(f"{name.replace('_', ' ')} must be in [-2, 2], got {v!r}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise UsageError("logit bias names a token twice")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise UsageError(f"logit bias token ids must be integers >= 0, got {t!r}")
            if not isinstance(b, (int, float)) or math.isnan(b) or not -100 <= b <= 100:
                raise UsageError(f"logit bias values must be in [-100, 100], got {b!r}")
        r = self.repetition_penalty
        lo, hi = REPETITION_PENALTY_RANGE
        if not isinstance(r, (int, float)) or math.isnan(r) or not lo <= r <= hi:
            raise UsageError(f"repetition penalty must be in [{lo:g}, {hi:g}], got {r!r}")
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise UsageError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise UsageError(f"top-k must be an integer >= -1 (0 or -1 = off), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise UsageError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def generator(self, device="cpu") -> torch.Generator:
        """The request's own random stream: a seed fixes the request's output."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(-1)``: the first index of each row's largest value (a NaN counts as the
    largest, the first one), read from ``torch.max``, which promises the same indices: its CPU
    kernel runs several times faster than argmax's over a vocabulary-wide bf16 or fp32 row (the
    commit that brought this in has the figures), and greedy decoding takes one a token."""
    return scores.max(-1).indices


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> fp32 probabilities after temperature, top-k and top-p.

    Top-k keeps every token whose logit reaches the k-th largest (ties included, as transformers'
    warper does); top-p then keeps the smallest run of the most likely remaining tokens whose mass
    reaches p (the first one always; among equal logits the lower token id counts as the more
    likely, so which tied tokens stay never depends on a sort's whims). With top-k, top-p and the
    softmax run on the 2k + 16 largest logits alone instead of a sort of the whole vocabulary
    (which costs more than the rest of a request's share of a decoding step)."""
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, argmax(logits)[..., None], 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        # the largest 2k + 16 logits, largest first: they hold every tie of the k-th value unless
        # the last of them ties it too (then the general path below)
        vals, idx = logits.topk(min(vocab, 2 * params.top_k + 16), dim=-1)
        kth = vals[..., params.top_k - 1:params.top_k]
        if vals.shape[-1] == vocab or not bool((vals[..., -1:] >= kth).any()):
            idx, by_id = idx.sort(dim=-1)            # equal logits in token-id order, as below
            vals, by_value = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
            idx = idx.gather(-1, by_value)
            vals = vals.masked_fill(vals < kth, float("-inf"))
            if params.top_p < 1.0:
                vals = vals.masked_fill(_beyond_top_p(vals.softmax(-1), params.top_p), float("-inf"))
            return torch.zeros_like(logits).scatter_(-1, idx, vals.softmax(-1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)   # ties: lower id first
        drop_sorted = _beyond_top_p(sorted_logits.softmax(-1), params.top_p)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def _beyond_top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities sorted largest first: the tokens whose predecessors already reach top_p
    (never the first: a top_p below fp32's smallest number rounds to 0, which the first reaches)."""
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return drop


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i of ``probs`` [n, V] at uniform u[i] in [0, 1): the token whose CDF interval holds it
    (tokens of probability 0 have empty intervals and are never drawn). One cumulative sum and a
    binary search per row: cheaper over a large vocabulary than torch.multinomial's exponential
    race. The sum runs in fp64 so that each token's interval keeps its fp32 probability (an fp32
    running sum near 1 would round away probabilities below ~1e-7)."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ([..., V] fp32) -> [...] long."""
    flat = probs.reshape(-1, probs.shape[-1])
    dev = generator.device if generator is not None else "cpu"
    u = torch.rand(flat.shape[0], generator=generator, device=dev).to(flat.device)
    return _inverse_cdf(flat, u).reshape(probs.shape[:-1])


RACE_HEAD = 64    # race_sample: the most likely tokens race one by one, the rest as one group


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic): a counter-based random source."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keyed_uniforms(seeds: Sequence[int | None], positions: Sequence[int], tokens: np.ndarray) -> np.ndarray:
    """[n, k] uniforms in (0, 1), row i's column j a function of (seeds[i], positions[i],
    tokens[i, j]) alone: the same token at the same position of the same seeded request draws the
    same number, whoever asks (the drafter or the verifier) and whatever else is in the batch (a
    seed of None, which no caller passes, counts as 0)."""
    with np.errstate(over="ignore"):
        s = np.array([(x or 0) & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
        pos = np.array(positions, dtype=np.int64).astype(np.uint64)
        base = _mix(_mix(s ^ np.uint64(0x9E3779B97F4A7C15)) + pos * np.uint64(0xD1B54A32D192ED03))
        z = _mix(base[:, None] ^ (tokens.astype(np.int64).astype(np.uint64) * np.uint64(0xA24BAED4963EE407)
                                  + np.uint64(1)))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


TAIL, TAIL_PICK = -1, -2      # the keys of the tail group's race and of the pick inside it


def race_sample(probs: torch.Tensor, seeds: Sequence[int | None], positions: Sequence[int],
                ids: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [n, V] whose randomness is keyed by (seed, position, token):
    seeded requests sample this way (engine.py, ``exact_seed``), so that their text is a function
    of the seed alone. An exponential race: token x finishes at E(x) / p(x), E(x) = -log U(seed,
    position, x), the first to finish is drawn (probability p(x): the Gumbel-max trick). The
    RACE_HEAD most likely tokens race one by one; the others race as one group of their total mass
    (its own keyed E), and if the group wins, one of them is picked in proportion to p by a keyed
    uniform in token-id order: an exact draw either way. A drafter racing its q with the same keys
    proposes the verifier's token with probability near sum min(p, q). ``ids`` [V]: the token id
    of each column (a drafter's draft vocabulary); returns column indices."""
    n, V = probs.shape
    k = min(RACE_HEAD, V)
    vals, idx = probs.float().topk(k, dim=-1)                            # [n, k]
    tok = (idx if ids is None else ids.to(idx.device)[idx]).cpu().numpy()
    E = -np.log(keyed_uniforms(seeds, positions, tok))
    v = vals.double().cpu().numpy()
    with np.errstate(divide="ignore"):
        race = np.where(v > 0, E / v, np.inf)
    win = race.argmin(-1)
    out = idx.gather(-1, torch.as_tensor(win, device=idx.device).unsqueeze(-1)).squeeze(-1)
    if k == V:
        return out
    total = probs.double().sum(-1).cpu().numpy()
    tail = total - v.sum(-1)
    keys = np.full((n, 1), TAIL)
    with np.errstate(divide="ignore", invalid="ignore"):
        group = np.where(tail > 0, -np.log(keyed_uniforms(seeds, positions, keys))[:, 0] / tail, np.inf)
    rows = np.flatnonzero(group < race.min(-1))
    if len(rows):
        r = torch.as_tensor(rows, device=probs.device)
        rest = probs[r].double().scatter(-1, idx[r], 0.0)
        cdf = rest.cumsum(-1)
        u = keyed_uniforms([seeds[int(i)] for i in rows], [positions[int(i)] for i in rows],
                           np.full((len(rows), 1), TAIL_PICK))
        at = torch.as_tensor(u[:, 0], device=probs.device, dtype=torch.float64) * cdf[:, -1]
        pick = torch.searchsorted(cdf, at.unsqueeze(-1), right=True).squeeze(-1).clamp_(max=V - 1)
        out[r] = pick
    return out


def uniforms(generators: list, n: int, device="cpu") -> torch.Tensor:
    """[len(generators), n] uniforms in [0, 1), row i from ``generators[i]`` (a request's own stream)."""
    return torch.stack([torch.rand(n, generator=g, device=g.device if g is not None else "cpu")
                        for g in generators]).to(device)


def sample_rows(probs: torch.Tensor, generators: list | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [n, V] (fp32), row i drawn with ``generators[i]`` (or at the
    given uniform ``u[i]``, drawn beforehand from that row's stream), so a batch of requests
    samples in one vectorised pass and each request's tokens still depend only on its own random
    stream."""
    if u is None:
        assert generators is not None, "sample_rows needs the rows' generators or their uniforms u"
        u = uniforms(generators, 1, probs.device)[:, 0]
    return _inverse_cdf(probs, u)


def sample_from_logits(logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, the fp32 probabilities they were drawn from)."""
    probs = probs_from_logits(logits, params)
    if params.greedy:
        return argmax(probs), probs
    return sample(probs, generator), probs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list]]:
    """Per row of ``logits`` [n, V]: the log probability of ``tokens[i]`` under the raw logits
    (log-softmax before temperature and truncation, vLLM's default ``raw_logprobs``) and the ``top``
    most likely (token, log probability) pairs, most likely first."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), -1)
    chosen = lp[torch.arange(len(tokens), device=lp.device), torch.tensor(tokens, device=lp.device)].tolist()
    if not top:
        return [(c, []) for c in chosen]
    v, i = lp.topk(min(top, lp.shape[-1]), -1)
    return [(c, list(zip(ii, vv))) for c, ii, vv in zip(chosen, i.tolist(), v.tolist())]


def penalised_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                     drafts: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits [n, V] with the logit bias and penalties applied, row k after the output so
    far plus the first k drafts (the text that row k's token would follow), as vLLM orders them: the
    bias added, then the repetition penalty on tokens seen in the prompt or that text (positive
    logits divided by it, negative ones multiplied), then minus the frequency penalty times each
    token's count in the text and minus the presence penalty for each token in it (the output's
    tokens only, not the prompt's). fp32."""
    n, vocab = logits.shape
    dev = logits.device
    x = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[:, list(ids)] += torch.tensor(bias, dtype=x.dtype, device=dev)
    counts = torch.zeros(vocab, device=dev)
    if output_ids:
        counts.index_add_(0, torch.tensor(output_ids, device=dev), torch.ones(len(output_ids), device=dev))
    counts = counts.expand(n, vocab).clone()
    if n > 1 and drafts is not None and len(drafts):
        onehot = torch.nn.functional.one_hot(drafts[:n - 1].to(dev).long(), vocab).float()
        counts[1:1 + onehot.shape[0]] += onehot.cumsum(0)
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor(prompt_ids, device=dev, dtype=torch.long)] = True
        rp = params.repetition_penalty
        x = torch.where(seen | in_prompt, torch.where(x > 0, x / rp, x * rp), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * seen.float()
