"""``dspark profile``: measure full engine steps on this machine into the cost table, and the
drafter's share of each."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from ..drafters.base import Drafter, Proposal
from ..engine import Engine
from ..sampling import SamplingParams
from ..scheduling.policies import FixedPolicy
from ..scheduling.costs import CostTable, table_key_for


class _ExactLength(Drafter):
    """Runs the real drafter, then pads or cuts each proposal to exactly the requested length so
    that a profiled step verifies exactly that many tokens; ``seconds`` sums the real drafter's time."""

    def __init__(self, inner: Drafter, vocab: int):
        self.inner = inner
        self.name = inner.name
        self.block_size = inner.block_size
        self.feature_layers = inner.feature_layers   # the engine hands the target features on
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)
        self.seconds = 0.0

    def prepare(self, max_requests, max_len):
        self.inner.prepare(max_requests, max_len)

    def release(self, ctx):
        self.inner.release(ctx)

    def propose(self, contexts):
        out = []
        t = time.perf_counter()
        proposals = self.inner.propose(contexts)
        self.seconds += time.perf_counter() - t
        for ctx, p in zip(contexts, proposals):
            need = ctx.num_draft - len(p)
            if need > 0:
                pad = torch.randint(0, self.vocab, (need,), generator=self.gen)
                p = Proposal(torch.cat([p.tokens.cpu(), pad]))
            out.append(p.truncate(ctx.num_draft))
        return out


def context_row_seconds(target, drafter: Drafter, prompts: list[list[int]], requests: int = 16,
                        context: int = 256, repeats: int = 3, temperature: float = 1.0) -> float:
    """Seconds the drafter takes to take in one context row (a verified position's target
    features) beyond its steady rounds: a request that has not drafted for a while hands the
    drafter every position since, all at its next call. Measured as the first drafting call after
    a prefill of ``context`` tokens per request against the calls that follow (a few rows each),
    per extra row; 0 for drafters that read no target features."""
    if not drafter.feature_layers:
        return 0.0
    params = SamplingParams(temperature=temperature, seed=0)
    vocab = target.model.config.vocab_size
    seqs = [(p * (context // max(len(p), 1) + 1))[:context] for p in prompts]
    per_row = []
    for _ in range(repeats):
        exact = _ExactLength(drafter, vocab)
        engine = Engine(target.model, exact, FixedPolicy(0), max_requests=requests,
                        max_len=context + 16, block_size=1, prefill_chunk=1 << 30)
        reqs = [engine.add_request(seqs[i % len(seqs)], params, 8, stop_ids=()) for i in range(requests)]
        engine.step()                       # prefill; nothing drafted yet
        engine.policy = FixedPolicy(1)
        calls = []
        for _ in range(4):
            exact.seconds = 0.0
            engine.step()
            calls.append(exact.seconds)
        steady = statistics.median(calls[1:])
        per_row.append(max(0.0, calls[0] - steady) / (requests * context))
        for r in reqs:
            engine.cancel(r)
    return statistics.median(per_row)


def profile(target, drafter: Drafter, prompts: list[list[int]], requests=(1, 2, 4, 8, 16, 32),
            verified=(0, 1, 2, 3, 5, 7), contexts=(128, 512), repeats: int = 5, progress=None,
            temperature: float = 1.0) -> CostTable:
    """Median seconds of full engine steps and of the drafter's call in them, sampling at
    ``temperature`` (1 by default: drafting and rejection sampling over the whole vocabulary cost
    more than the greedy path, and a table measured greedy made drafting look cheaper than it is
    when serving sampled requests)."""
    params = SamplingParams(temperature=temperature, seed=0)
    requests, verified, contexts = (sorted(set(a)) for a in (requests, verified, contexts))   # the table's axes
    grid, draft_grid = [], []
    prefills: list[tuple[int, float]] = []     # (prompt tokens, seconds) of each prefill step
    for ctx_len in contexts:
        per_ctx, draft_ctx = [], []
        base = []
        for p in prompts:  # stretch or cut real prompts to the context length
            seq = (p * (ctx_len // max(len(p), 1) + 1))[:ctx_len]
            base.append(seq)
        for R in requests:
            row, draft_row, prefill = _time_load(target, drafter, base, R, verified, repeats, params, progress)
            prefills.append(prefill)
            per_ctx.append(row)
            draft_ctx.append(draft_row)
        grid.append(per_ctx)
        draft_grid.append(draft_ctx)
    context_row = context_row_seconds(target, drafter, prompts, requests=min(16, max(requests)),
                                      context=min(256, max(contexts)), temperature=temperature)
    return CostTable(table_key_for(target, drafter), list(requests), list(verified), list(contexts), grid,
                     machine=f"{os.cpu_count()} cpus, {torch.get_num_threads()} threads", draft=draft_grid,
                     context_row=context_row, prefill=list(line_fit(prefills)))


def _time_load(target, drafter: Drafter, base: list[list[int]], R: int, verified, repeats: int, params: SamplingParams,
               progress=None) -> tuple[list[float], list[float], tuple[int, float]]:
    """One load of R requests at the prompts' context: (median step seconds per verified length,
    the drafter's share of them, (prompt tokens, seconds) of the prefill step). One engine:
    prefilled once, then timed steps at each verified length."""
    ctx_len, max_v = len(base[0]), max(verified)
    per_v = repeats + 1
    new_tokens = sum(per_v * (v + 1) for v in verified) + 2
    exact = _ExactLength(drafter, target.model.config.vocab_size)
    engine = Engine(target.model, exact, FixedPolicy(0), max_requests=R,
                    max_len=ctx_len + new_tokens + max_v + 2, block_size=max_v, prefill_chunk=1 << 30)
    reqs = [engine.add_request(base[i % len(base)], params, new_tokens, stop_ids=()) for i in range(R)]
    t = time.perf_counter()
    engine.step()  # prefill every request in one forward
    prefill = (R * ctx_len, time.perf_counter() - t)
    for v in verified:
        engine.policy = FixedPolicy(v)
        engine.step()  # warm-up at this shape
    # the verified lengths in turn, one step each per repeat: a slow spell of the machine
    # (it drifts by more than a verified token costs) then lands on every length alike
    times: dict[int, list[float]] = {v: [] for v in verified}
    drafting: dict[int, list[float]] = {v: [] for v in verified}
    for _ in range(repeats):
        for v in verified:
            engine.policy = FixedPolicy(v)
            exact.seconds = 0.0
            t = time.perf_counter()
            engine.step()
            times[v].append(time.perf_counter() - t)
            drafting[v].append(exact.seconds)
    row, draft_row = [], []
    for v in verified:
        row.append(statistics.median(times[v]))
        draft_row.append(statistics.median(drafting[v]) if v else 0.0)
        if progress:
            progress(ctx_len, R, v, row[-1])
    for r in reqs:
        engine.cancel(r)
    return row, draft_row, prefill


def line_fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of seconds = a + b x tokens, least squares over (tokens, seconds) samples, both >= 0
    (through the origin where the free fit's intercept is negative)."""
    x = np.array([n for n, _ in samples], dtype=float)
    y = np.array([s for _, s in samples], dtype=float)
    if len(set(x.tolist())) < 2:
        return 0.0, float(y.mean() / max(1.0, x.mean()))
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(max(0.0, b))


def plot(table: CostTable, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    assert table.draft is not None, "plot needs the drafter's timings (profile measures them)"
    fig, axes = plt.subplots(1, len(table.contexts), figsize=(5 * len(table.contexts), 4), squeeze=False)
    for ax, ctx, grid, draft in zip(axes[0], table.contexts, table.seconds, table.draft):
        for R, row, drow in zip(table.requests, grid, draft):
            line, = ax.plot(table.verified, [1e3 * s for s in row], marker="o", label=f"{R} req")
            ax.plot(table.verified, [1e3 * s for s in drow], ls="--", color=line.get_color())
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("draft tokens verified per request")
        ax.set_ylabel("ms per engine step (dashed: the drafter's call)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(table.key)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
