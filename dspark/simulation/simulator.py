"""A serving deployment simulated step by step: the engine's loop (engine.py) with the target's
forward and the drafter's call replaced by their prices (costs.py) and the drafts by draws of a
drafter's statistics (acceptance.py). The policies are the engine's own classes: each step they
are asked for draft lengths and verification lengths on request views and proposals shaped as the
engine's, and told the step's outcome (scheduling.base.StepOutcome) with its simulated seconds.

What the engine does and the simulator mirrors: requests take the lowest free cache slot, decode in
slot order, prefill in chunks (``prefill_chunk`` tokens a step, ``decoding_chunk`` while others
decode) and emit their first token in the step that completes their prompt; a request drafts at
most what it may still emit less one; each verified block emits its accepted drafts and the next
token; the drafter takes in a request's context rows since its last call when it drafts. What it
does not: lookups (n-gram drafts), grammars, stop tokens (a request ends at its output length),
prefix caching. Prompts may also be prefilled elsewhere (``prefill=False``: prefill / decode
disaggregation), the requests joining the decoding steps ready.

Clocks: a step takes its forward, its drafter call and (``decisions``) the wall time the policy
spent deciding in this process; closed loops admit a request when a client's previous one ended,
open loops when it arrives (Poisson).
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..drafters.base import Proposal
from ..scheduling.base import Policy, RequestOutcome, RequestView, StepOutcome
from .acceptance import AcceptanceModel
from .costs import StepCosts, StepShape


@dataclass(frozen=True)
class Job:
    """One request of a workload."""

    prompt: int           # prompt tokens
    output: int           # new tokens it emits
    benchmark: str = ""   # whose acceptance statistics it draws from


@dataclass
class SimRequest:
    """A request in flight: what the engine's Request holds, in numbers."""

    id: int
    job: Job
    arrival: float
    slot: int = -1
    decoding: bool = False               # its prompt is prefilled
    prefilled: int = 0
    output: int = 0
    pending_rows: int = 0                # feature rows its draft context holds, not yet taken in
    round_rows: int = 0                  # feature rows its last verified round added
    admitted: float = 0.0
    first_token: float | None = None
    ended: float | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def max_new_tokens(self) -> int:
        return self.job.output

    @property
    def context(self) -> int:
        """Tokens of its context (the engine's DraftContext.tokens: the prompt and the output)."""
        return self.job.prompt + self.output

    def view(self) -> RequestView:
        return RequestView(self.id, self.context, self.pending_rows, self.job.output - self.output)


_ZEROS = torch.zeros(64, dtype=torch.long)


@dataclass
class StepRecord:
    """A simulated step: what the policy decided and what it cost (for tests and traces)."""

    requests: tuple[int, ...]      # decoding request ids, in the order the policy saw them
    want: tuple[int, ...]          # draft lengths the policy asked for
    verified: tuple[int, ...]      # verification lengths after the policy's choice
    accepted: tuple[int, ...]
    seconds: float


class Simulator:
    """The engine's step loop over simulated requests (see the module's docstring)."""

    def __init__(self, policy: Policy, costs: StepCosts, acceptance: AcceptanceModel, *, block: int,
                 max_requests: int, prefill_chunk: int = 2048, decoding_chunk: int = 512, seed: int = 0,
                 decisions: bool = True, draws=None, record: bool = False, prefill: bool = True):
        self.policy, self.costs, self.acceptance = policy, costs, acceptance
        self.block, self.max_requests = block, max_requests
        self.prefill_chunk, self.decoding_chunk = prefill_chunk, decoding_chunk
        self.rng = random.Random(seed)
        self.decisions = decisions
        # False: prompts are prefilled elsewhere (prefill / decode disaggregation, as DeepSeek serves):
        # a request joins the decoding steps with its prompt's cache, drafter context and first token
        self.prefill = prefill
        # draws(request, length) -> (confidences or None, accepted): replaces the acceptance model's
        # draws (a test replays an engine run's own proposals)
        self.draws = draws
        self.clock = 0.0
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        self._free = list(range(max_requests - 1, -1, -1))   # lowest slot last (the engine's order)
        self._left: list[int] = []
        self._next_id = 0
        self.steps = 0
        self.decision_seconds = 0.0
        self._policy_time = 0.0     # the policy's decision time in the step running
        self.records: list[StepRecord] | None = [] if record else None

    # ------------------------------------------------------------------ requests
    def add(self, job: Job, arrival: float | None = None) -> SimRequest:
        r = SimRequest(self._next_id, job, self.clock if arrival is None else arrival)
        self._next_id += 1
        self.waiting.append(r)
        return r

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and self._free:
            r = self.waiting.pop(0)
            r.slot = self._free.pop()
            r.admitted = self.clock
            if not self.prefill:
                r.prefilled, r.output, r.first_token, r.decoding = r.job.prompt, 1, self.clock, True
            self.running.append(r)

    def _release(self, r: SimRequest) -> None:
        self.running.remove(r)
        self._free.append(r.slot)
        self._free.sort(reverse=True)
        r.ended = self.clock
        self.finished.append(r)
        self._left.append(r.id)

    def _decide(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self._policy_time += time.perf_counter() - t
        return out

    # ------------------------------------------------------------------ one step
    def step(self) -> float:
        """One engine step; returns its simulated seconds (0 when nothing runs)."""
        self._admit()
        if not self.running:
            return 0.0
        self.steps += 1
        self._policy_time = 0.0
        decode = sorted((r for r in self.running if r.decoding), key=lambda r: r.slot)
        prefill = [r for r in self.running if not r.decoding]
        d = self._draft(decode)
        chunks, prefill_tokens, attended = self._chunks(prefill, bool(decode))
        blocks = tuple(len(p) + 1 for p in d.proposals)
        depth = sum(d.drafted) / max(1, d.drafting)
        shape = StepShape(blocks, tuple(r.context for r in decode), prefill_tokens,
                          attended, d.drafting, depth, d.draft_rows)
        forward = self.costs.forward_seconds(shape)
        draft = self.costs.draft_seconds(shape)
        outcomes, ended = self._verified(decode, d)
        for r, n in chunks:
            r.pending_rows += n
            if r.prefilled == r.job.prompt:
                r.decoding, r.output = True, 1
                if r.output >= r.job.output:
                    ended.append(r)
        spent = self._policy_time
        seconds = forward + draft + (spent if self.decisions else 0.0)
        self.clock += seconds
        for r, _ in chunks:
            if r.decoding and r.first_token is None:
                r.first_token = self.clock
        for r in ended:
            self._release(r)
        outcome = StepOutcome(tuple(outcomes), seconds, bool(decode) and not chunks, tuple(self._left),
                              forward_rows=sum(blocks) + prefill_tokens, forward_seconds=forward,
                              draft_seconds=draft, draft_rows=d.draft_rows, index=self.steps,
                              prefill_tokens=prefill_tokens, policy_seconds=spent)
        self._left = []
        self._observe(outcome, spent)
        if self.records is not None:
            self.records.append(StepRecord(tuple(r.id for r in decode), tuple(d.want),
                                           tuple(len(p) for p in d.proposals),
                                           tuple(o.accepted for o in outcomes), seconds))
        return seconds

    def _draft(self, decode: list[SimRequest]) -> _Drafted:
        """The policy's draft lengths, the simulated proposals (their confidences and how many
        drafts the target would accept), the policy's verification lengths."""
        d = _Drafted([Proposal.empty() for _ in decode], [0] * len(decode), [], [0] * len(decode))
        if not decode:
            return d
        views = [r.view() for r in decode]
        free = [0] * len(decode) if self._decide(self.policy.wants_free, views) else None
        d.want = self._decide(self.policy.draft_lengths, views, self.block, free)
        for i, (r, w) in enumerate(zip(decode, d.want)):
            n = max(0, min(w, r.job.output - r.output - 1))
            if not n:
                continue
            d.draft_rows += max(0, r.pending_rows - r.round_rows)
            r.pending_rows = 0            # the drafter takes its context rows in
            conf, acc = (self.draws(r, n) if self.draws is not None
                         else self.acceptance.law(r.job.benchmark).draw(n, self.rng))
            d.proposals[i] = Proposal(_ZEROS[:n] if n <= len(_ZEROS) else torch.zeros(n, dtype=torch.long),
                                      confidences=None if conf is None else torch.tensor(conf, dtype=torch.float64))
            d.accepted[i] = acc
            d.drafted[i] = n
            d.drafting += 1
        lengths = self._decide(self.policy.verify_lengths, views, d.proposals)
        d.proposals = [p.truncate(max(0, n)) for p, n in zip(d.proposals, lengths)]
        return d

    def _chunks(self, prefill: list[SimRequest], decoding: bool) -> tuple[list[tuple[SimRequest, int]], int, int]:
        """The prompt chunks of the ragged batch after the decoding blocks: ((request, tokens) per
        chunk, prompt tokens in all, query-key pairs their attention reads)."""
        budget = max(min(self.prefill_chunk, self.decoding_chunk) if decoding else self.prefill_chunk, 1)
        chunks: list[tuple[SimRequest, int]] = []
        prefill_tokens = attended = 0
        for r in prefill:
            if budget <= 0:
                break
            n = min(budget, r.job.prompt - r.prefilled)
            attended += n * r.prefilled + n * (n + 1) // 2
            r.prefilled += n
            budget -= n
            prefill_tokens += n
            chunks.append((r, n))
        return chunks, prefill_tokens, attended

    def _verified(self, decode: list[SimRequest], d: _Drafted) -> tuple[list[RequestOutcome], list[SimRequest]]:
        """Each block emits its accepted drafts and the next token: (the outcomes, the requests ended)."""
        outcomes, ended = [], []
        for i, (r, p) in enumerate(zip(decode, d.proposals)):
            n = min(len(p), d.accepted[i])
            emit = min(n + 1, r.job.output - r.output)
            r.output += emit
            r.pending_rows += n + 1
            r.round_rows = n + 1
            r.rounds += 1
            if len(p):
                r.drafted += len(p)
                r.accepted += n
            outcomes.append(RequestOutcome(r.id, d.drafted[i], len(p), n))
            if r.output >= r.job.output:
                ended.append(r)
        return outcomes, ended

    def _observe(self, outcome: StepOutcome, spent: float) -> None:
        """The policy observes the step; its time counts on the clock with ``decisions``."""
        t = time.perf_counter()
        self.policy.observe(outcome)
        observe = time.perf_counter() - t
        if self.decisions:
            self.clock += observe
        self.decision_seconds += spent + observe


@dataclass
class _Drafted:
    """A simulated step's drafting: per decoding request its block (as verified), how many of its
    drafts the target would accept, the length the policy asked for, and how many it drafted."""

    proposals: list[Proposal]
    accepted: list[int]
    want: list[int]
    drafted: list[int]
    drafting: int = 0           # requests the drafter's call served
    draft_rows: int = 0         # catch-up context rows that call took in


def summary(requests: list[SimRequest], wall: float) -> dict:
    """Total and per-user tokens/s, latency and time to first token percentiles of ended requests."""
    done = [(r, r.ended, r.first_token or r.ended) for r in requests if r.ended is not None]
    tokens = sum(r.output for r, _, _ in done)
    lat = np.array([end - r.arrival for r, end, _ in done]) if done else np.zeros(1)
    ttft = np.array([first - r.arrival for r, _, first in done]) if done else np.zeros(1)
    per_user = [r.output / (end - r.arrival) for r, end, _ in done if end > r.arrival]
    decode = [(r.output - 1) / (end - first) for r, end, first in done if end > first and r.output > 1]
    rounds = sum(r.rounds for r, _, _ in done)
    return {"requests": len(done), "tokens": tokens, "wall_seconds": wall,
            "total_tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "per_user_tokens_per_second": float(np.mean(per_user)) if per_user else 0.0,
            "per_user_decode_tokens_per_second": float(np.mean(decode)) if decode else 0.0,
            "accept_length": (tokens - len(done)) / rounds if rounds else 0.0,
            "latency_seconds": {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)},
            "ttft_seconds": {f"p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)}}


def closed_loop(sim: Simulator, jobs: list[Job], concurrency: int) -> dict:
    """``concurrency`` clients, each sending its next job when its last one ended (what `dspark
    bench concurrency` runs): a request's latency counts from its admission."""
    queue = list(jobs)
    live = 0
    while queue or sim.has_work():
        while queue and live < concurrency:
            sim.add(queue.pop(0))
            live += 1
        before = len(sim.finished)
        sim.step()
        live -= len(sim.finished) - before
    out = summary(sim.finished, sim.clock)
    out["concurrency"] = concurrency
    out["engine_steps"] = sim.steps
    out["decision_seconds"] = sim.decision_seconds
    return out


def open_loop(sim: Simulator, jobs: list[Job], rate: float, seed: int = 0) -> dict:
    """Requests arriving as a Poisson process of ``rate`` per second; a request's latency counts from
    its arrival (queueing for a slot included)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for j in jobs:
        t += rng.expovariate(rate)
        arrivals.append((t, j))
    heapq.heapify(arrivals)
    busy = 0.0
    while arrivals or sim.has_work():
        while arrivals and arrivals[0][0] <= sim.clock:
            at, job = heapq.heappop(arrivals)
            sim.add(job, at)
        if not sim.has_work():
            sim.clock = arrivals[0][0]
            continue
        start = sim.clock
        n = len(sim.running) + len(sim.waiting)
        sim.step()
        busy += (sim.clock - start) * min(n, sim.max_requests)
    out = summary(sim.finished, sim.clock)
    out["rate"] = rate
    out["concurrency"] = busy / sim.clock if sim.clock else 0.0   # mean requests in flight
    out["engine_steps"] = sim.steps
    out["decision_seconds"] = sim.decision_seconds
    return out
