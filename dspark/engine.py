"""The engine: requests in flight; each step draft -> schedule -> ONE target forward -> verify.

Requests join and leave at any step (continuous batching). Each step:

1. the policy says how many tokens to draft per decoding request; the drafter proposes them for
   all requests in one batched call;
2. the policy says how many of the proposed tokens each request verifies;
3. one target forward runs over every request's tokens flattened into a ragged batch (the anchor
   plus the verified drafts of each decoding request, and chunks of new requests' prompts), each
   request attending only to its own cache slot;
4. every request's block is verified in one call over flattened rows (verify.verify_batch:
   rejection sampling, each request with its own generator, one host synchronisation); each
   emits 1 to l+1 tokens, and its cache rolls back over the rejected drafts;
5. the policy is told the step's outcome (scheduling.base.StepOutcome): per request what was
   drafted, verified and accepted, the step's wall time, and which requests ended.

A request holds one cache slot from admission to its end; a finished or cancelled request frees
it at once, and requests wait in a queue while every slot is taken. With ``prefix_caching`` a freed
slot's entries stay valid until the slot is taken again, and a request whose prompt starts with
what a free slot holds takes that slot and prefills only the rest, or copies what a request in
flight has computed of it (runtime/prefix_cache.py).

With ``isolate_failures`` (the server's engine), a failure while serving one request (its
grammar, its sampling settings, its log probabilities, its ``on_tokens`` callback, its drafts) ends
that request alone: status "failed", finish_reason "error", the reason in ``Request.error``; the
others and the engine go on, and only a failure of what all share (the policy, the target's
forward) leaves ``step`` with an exception. Without it (batch generation, which has no one to
tell), any failure leaves ``step`` with its exception.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from .drafters.base import DraftContext, Drafter, PlainDrafter, Proposal
from .errors import UsageError
from .metrics import GenerationStats
from .runtime.model import Decoder
from .runtime.prefix_cache import PrefixCache
from .sampling import (SamplingParams, penalised_logits, probs_from_logits, race_sample, sample_from_logits,
                       token_logprobs)
from .scheduling.base import Policy, RequestOutcome, RequestView, StepOutcome
from .scheduling.policies import FixedPolicy
from .verify import stack_requests, target_rows, verify, verify_batch

if TYPE_CHECKING:
    from .structured import GrammarState

_ids = itertools.count()


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks for: one type for the engine (``Engine.add_request``), the Python API,
    the server's jobs and regeneration, so that a new option is spelled out once.

    ``logprobs``: record each output token's log probability and this many most likely tokens'
    (Request.output_logprobs; None = nothing recorded); ``prompt_logprobs``: the same for every
    prompt token after the first (Request.prompt_logprobs_out, filled as it prefills);
    ``min_tokens``: the stop tokens have probability 0 until the output holds that many (the law
    the output then follows, which speculative decoding reproduces like any other); ``grammar``: a
    structured.GrammarState of this request alone (it advances with the output, so options that
    carry one serve one request), whose allowed tokens restrict the law at every position.
    ``exact_seed``: a seeded sampled request's text is plain decoding's with that seed, whatever
    drafted it and whatever shared its steps (each token drawn by a race keyed by the seed and its
    position, its drafts accepted while they equal that token); False: verified by rejection sampling, the method's own
    acceptance, reproducible only for the same drafter, history and batch (what `dspark eval` and
    `dspark calibrate` measure)."""

    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop_ids: frozenset[int] | None = None    # None: the engine's eos ids
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    grammar: GrammarState | None = None
    exact_seed: bool = True


@dataclass
class Request:
    prompt_ids: list[int]
    options: RequestOptions               # its stop_ids resolved (never None)
    on_tokens: Callable | None = None     # called with each list of newly emitted tokens
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list = field(default_factory=list)
    status: str = "waiting"               # waiting | running | finished | cancelled | failed
    finish_reason: str | None = None      # stop | length | cancelled | error
    error: str | None = None              # failed: what went wrong serving it
    stats: GenerationStats = field(default_factory=GenerationStats)
    slot: int | None = None
    prefilled: int = 0
    generator: torch.Generator | None = None
    # a seeded sampled request (RequestOptions.exact_seed): every token it emits is drawn by
    # sampling.race_sample keyed by its seed and position, so its text is plain decoding's with that
    # seed whatever drafted and whatever shared its steps
    exact: bool = False
    ctx: DraftContext | None = None
    t_start: float = 0.0
    prompt_features: list = field(default_factory=list)   # target features of prefilled chunks
    round_rows: int = 0                   # feature rows its last verified round added to its draft context
    # with ``logprobs``: per output token (its log probability, [(token, log probability)] of the
    # ``logprobs`` most likely), from the target's logits (sampling.token_logprobs)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs_out: list = field(default_factory=list)   # with ``prompt_logprobs``: prompt tokens 2..

    @property
    def done(self) -> bool:
        return self.status in ("finished", "cancelled", "failed")

    # the options, read where the engine and the policies use them
    @property
    def params(self) -> SamplingParams:
        return self.options.params

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.options.stop_ids or frozenset()

    @property
    def logprobs(self) -> int | None:
        return self.options.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.options.prompt_logprobs

    @property
    def min_tokens(self) -> int:
        return self.options.min_tokens

    @property
    def grammar(self) -> GrammarState | None:
        return self.options.grammar


@dataclass
class _Chunk:
    """A prefilling request's chunk of prompt in a step's batch."""

    req: Request
    start: int          # where its tokens start in the batch
    n: int              # how many
    scored: int         # rows asked for its prompt log probabilities (the first ``scored`` of the chunk)
    completes: bool     # the prompt's last chunk: its last row is asked for too (the first token)


@dataclass
class _Batch:
    """A step's ragged batch: the tokens of every decoding request's block (anchor + drafts) and then
    of the prefilling chunks; which rows' logits are wanted."""

    ids: list[int] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)   # (cache slot, tokens) per request
    rows: list[int] = field(default_factory=list)                   # the rows whose logits are wanted
    sent: list[int] = field(default_factory=list)     # per decoding request: tokens it sent (padding too)
    start: list[int] = field(default_factory=list)    # per decoding request: where its tokens start
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass
class _StepLog:
    """What a step records while it runs, passed through its parts and frozen into its StepOutcome."""

    outcomes: list[RequestOutcome] = field(default_factory=list)
    decode_only: bool = False
    forward_rows: int = 0
    forward_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_rows: int = 0
    prefill_tokens: int = 0
    policy_seconds: float = 0.0


class Engine:
    def __init__(self, target: Decoder, drafter: Drafter | None = None, policy: Policy | None = None, *,
                 max_requests: int = 1, max_len: int = 4096, block_size: int | None = None,
                 prefill_chunk: int = 2048, decoding_chunk: int = 512, score_chunk: int = 256, eos_ids=(),
                 prefix_caching: bool = False, prefix_min_match: int = 16,
                 isolate_failures: bool = False):
        if max_requests < 1 or max_len < 2:
            raise UsageError("need max_requests >= 1 and max_len >= 2")
        self.target = target
        self.drafter = drafter or PlainDrafter()
        self.policy = policy or FixedPolicy()
        self.block_size = self.drafter.block_size if block_size is None else block_size
        self.prefill_chunk = prefill_chunk
        # prompt tokens per step while other requests decode: a step's time is mostly its tokens', and
        # the requests decoding wait for the whole step, so a long prompt goes in smaller chunks then
        self.decoding_chunk = decoding_chunk
        # prompt rows scored per step at most (prompt log probabilities, echo: each a vocabulary-wide
        # row of the LM head, log-softmax and top-k), so that such a request's prompt is spread over
        # steps and the requests decoding beside it wait one short step at a time
        self.score_chunk = score_chunk
        self.eos_ids = frozenset(eos_ids)
        self.cache = target.new_cache(max_requests, max_len)
        # prefix_min_match: the fewest prompt tokens a slot must already hold to be reused for them
        self.prefix = PrefixCache(max_requests, max_len, min_match=prefix_min_match) if prefix_caching else None
        self.drafter.prepare(max_requests, max_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.step_seconds = 0.0     # wall time inside step()
        self.policy_seconds = 0.0   # of which the policy's decisions (draft and verify lengths)
        self.last_step: StepOutcome | None = None   # the record of the last step run
        self._listeners: list[Callable[[StepOutcome], None]] = []
        self._left: list[int] = []  # ids of requests released since the policy was last told
        self.isolate_failures = isolate_failures   # a failure serving one request ends it alone (see above)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], options: RequestOptions | SamplingParams,
                    max_new_tokens: int | None = None, *, on_tokens: Callable | None = None, **fields) -> Request:
        """Queue a request: ``options`` (RequestOptions), or its sampling settings with
        ``max_new_tokens`` and any other RequestOptions field as a keyword (``stop_ids``,
        ``logprobs``, ...); ``on_tokens`` is called with each list of newly emitted tokens."""
        if isinstance(options, SamplingParams):
            if max_new_tokens is None:
                raise UsageError("max-new-tokens is needed with sampling settings")
            options = RequestOptions(options, max_new_tokens, **fields)
        elif max_new_tokens is not None or fields:
            raise UsageError("with RequestOptions, give no other option")
        if not prompt_ids:
            raise UsageError("prompt is empty")
        self._check(options, len(prompt_ids))
        stops = self.eos_ids if options.stop_ids is None else frozenset(options.stop_ids)
        req = Request(list(prompt_ids), dataclasses.replace(options, stop_ids=stops), on_tokens)
        req.generator = options.params.generator(self.target.device)
        req.exact = options.params.seed is not None and not options.params.greedy and options.exact_seed
        req.t_start = time.perf_counter()
        self.waiting.append(req)
        return req

    def _check(self, o: RequestOptions, prompt_len: int) -> None:
        """The options checked against this engine's vocabulary and cache."""
        vocab = self.target.config.vocab_size
        for name, k in (("logprobs", o.logprobs), ("prompt_logprobs", o.prompt_logprobs)):
            if k is not None and not 0 <= k <= vocab:
                raise UsageError(f"{name} must be in [0, {vocab}], got {k}")
        if o.max_new_tokens <= 0:
            raise UsageError(f"max-new-tokens must be > 0, got {o.max_new_tokens}")
        if not isinstance(o.min_tokens, int) or o.min_tokens < 0:
            raise UsageError(f"min_tokens must be an integer >= 0, got {o.min_tokens!r}")
        if o.max_new_tokens > self.room(prompt_len):
            raise UsageError(f"prompt ({prompt_len} tokens) + max-new-tokens ({o.max_new_tokens}) "
                             f"exceed the per-request cache of {self.cache.max_len} tokens")
        stops = self.eos_ids if o.stop_ids is None else frozenset(o.stop_ids)
        if any(not 0 <= t < vocab for t in stops):
            raise UsageError(f"stop token ids must be in [0, {vocab}), got {sorted(stops)}")

    def room(self, prompt_len: int) -> int:
        """The most new tokens a request with this prompt may ask for: its cache slot also holds the
        drafted block of the last round and the bonus token."""
        return self.cache.max_len - self.block_size - 1 - prompt_len

    def cancel(self, req: Request) -> None:
        if req.done:
            return
        if req.status == "waiting":
            self.waiting.remove(req)
        else:
            self._release(req)
        req.status, req.finish_reason = "cancelled", "cancelled"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        waiting = []        # with prefix caching: requests that wait for a prefill in flight to share it
        while self.waiting and self.cache.num_free:
            req = self.waiting.popleft()
            if self.prefix is None:
                req.slot = self.cache.allocate()
            else:
                pick = self.prefix.choose(self.cache.free_slots, req.prompt_ids, req.prompt_logprobs is None,
                                          self._in_flight())
                if pick is None:
                    waiting.append(req)
                    continue
                slot, n, source, moves = pick
                for move in moves:
                    self.cache.exchange(slot, move.other, move.out, move.into)
                req.slot = self.cache.allocate(slot, length=0 if source is not None else n)
                if source is not None:
                    self.cache.copy_prefix(source, slot, n)
                    self.prefix.copy_features(source, slot, n)
                req.prefilled = req.stats.num_cached_tokens = n
                if self.drafter.feature_layers:
                    req.prompt_features = self.prefix.prefix_features(slot, n)
            req.status = "running"
            self.running.append(req)
        self.waiting.extendleft(reversed(waiting))

    def _in_flight(self) -> list:
        """(slot, tokens of its computed entries, its prompt if still prefilling) of each request in
        flight; the entries past the output (drafts after a stop) are not the output's."""
        out = []
        for r in self.running:
            assert r.slot is not None   # a running request holds a slot
            n = self.cache.lengths[r.slot]
            seq = r.prompt_ids[:n] if n <= len(r.prompt_ids) else (r.prompt_ids + r.output_ids)[:n]
            out.append((r.slot, seq, r.prompt_ids if r.ctx is None else None))
        return out

    def _release(self, req: Request, keep: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            if self.prefix is not None and keep:   # entries past the output (drafts after a stop) are not kept
                seq = req.prompt_ids + req.output_ids
                self.prefix.keep(req.slot, seq[:min(self.cache.lengths[req.slot], len(seq))], len(req.prompt_ids))
            self.cache.free(req.slot)
            req.slot = None
        if req.ctx is not None:
            self.drafter.release(req.ctx)
        self._left.append(req.id)

    def _fail(self, req: Request, e: Exception) -> None:
        """A failure serving ``req`` alone: with ``isolate_failures`` it ends ``req`` (status "failed",
        finish_reason "error"; its cache entries are not kept for prefix caching; the caller reports
        it among the step's ended), else it goes on up (called in an ``except`` block)."""
        if not self.isolate_failures:
            raise e
        req.error = f"{type(e).__name__}: {e}"
        released = req.done
        req.status = "failed"
        req.finish_reason = req.stats.finish_reason = "error"
        if not released:
            self._release(req, keep=False)

    # ------------------------------------------------------------------ one step
    def add_step_listener(self, listener: Callable[[StepOutcome], None]) -> Callable[[], None]:
        """Call ``listener`` with every step's record (StepOutcome), after the policy has observed
        it; returns the function that removes it. Benchmarks and traces read the steps here."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def step(self) -> list[Request]:
        """Advance every running request by one target forward; returns requests that ended."""
        t0 = time.perf_counter()
        log = _StepLog()
        try:
            return self._step(log)
        finally:
            dt = time.perf_counter() - t0
            self.step_seconds += dt
            self.policy_seconds += log.policy_seconds
            self._observe(log, dt)

    def _observe(self, log: _StepLog, seconds: float) -> None:
        """The step's record, frozen: to the policy (per request its block as verified, the step's
        time, the requests released since the last step), then to the listeners."""
        outcome = StepOutcome(tuple(log.outcomes), seconds, log.decode_only, tuple(self._left),
                              forward_rows=log.forward_rows, forward_seconds=log.forward_seconds,
                              draft_seconds=log.draft_seconds, draft_rows=log.draft_rows, index=self.num_steps,
                              prefill_tokens=log.prefill_tokens, policy_seconds=log.policy_seconds)
        self._left = []
        self.last_step = outcome
        self.policy.observe(outcome)
        for listener in list(self._listeners):
            listener(outcome)

    @torch.inference_mode()
    def _step(self, log: _StepLog) -> list[Request]:
        """admit -> draft -> lay out the ragged batch -> one target forward -> verify every block ->
        accept and emit -> the prefilled prompts' first tokens; returns the requests that ended."""
        self._admit()
        if not self.running:
            return []
        self.num_steps += 1
        # in slot order: the decoding rows then fill their range of slots in order, which the batched
        # attention reads in place (runtime/attention.py SlotBatch.dense) instead of gathering and
        # scattering them in every layer; a request admitted into a freed slot joins the running
        # list at its end, so that arrival order would lose this once requests end apart
        decode = sorted((r for r in self.running if r.ctx is not None), key=lambda r: cast(int, r.slot))
        prefill = [r for r in self.running if r.ctx is None]
        proposals, drafted = self._draft(decode, log)
        ended = [r for r in decode if r.done]      # its drafting failed: it ended alone
        if ended:
            kept = [i for i, r in enumerate(decode) if not r.done]
            decode, proposals = [decode[i] for i in kept], [proposals[i] for i in kept]
            drafted = [drafted[i] for i in kept]
        batch = self._layout(decode, proposals, prefill)
        if not batch.ids:
            return ended
        log.decode_only = bool(decode) and not batch.chunks
        log.prefill_tokens = sum(c.n for c in batch.chunks)
        t0 = time.perf_counter()
        logits, feats = self._forward(batch)
        log.forward_rows, log.forward_seconds = len(batch.ids), time.perf_counter() - t0
        head, blocks = self._blocks(logits, proposals)
        verdicts = self._verify(decode, proposals, blocks, head)
        for i, (r, verdict) in enumerate(zip(decode, verdicts)):
            if verdict is None:     # it failed verification and ended alone
                ended.append(r)
            elif self._accept(r, proposals[i], verdict, drafted[i], batch.sent[i], batch.start[i], feats, blocks[i],
                              log):
                ended.append(r)
        at = 0 if head is None else head.shape[0]     # the chunks' logits rows follow the blocks'
        return ended + self._prefilled(batch.chunks, logits, at)

    def _block_ids(self, anchor: int, proposal: Proposal, width: int) -> list[int]:
        """A decoding request's rows in the step: its anchor (last token) and its verified drafts.
        ``width``: the step's longest proposal, for layouts that pad to it (evaluation.concurrency)."""
        return [anchor, *proposal.tokens.tolist()]

    def _layout(self, decode: list[Request], proposals: list[Proposal], prefill: list[Request]) -> _Batch:
        """The step's ragged batch: each decoding request's anchor and verified drafts (all their
        rows wanted), then chunks of the prefilling prompts up to ``prefill_chunk`` tokens in all
        (``decoding_chunk`` while requests decode; the rows of the prompt log probabilities asked
        for, ``score_chunk`` at most, and a completed prompt's last row)."""
        b = _Batch()
        width = max((len(p) for p in proposals), default=0)
        for r, p in zip(decode, proposals):
            assert r.ctx is not None and r.slot is not None   # decoding: it has a context and a slot
            ids = self._block_ids(r.ctx.tokens[-1], p, width)   # anchor, drafts[, padding]
            n = len(ids)
            b.start.append(len(b.ids))
            b.rows.extend(range(len(b.ids), len(b.ids) + len(p) + 1))   # the anchor's and the drafts' logits
            b.ids.extend(ids)
            b.segments.append((r.slot, n))
            b.sent.append(n)
        chunk = min(self.prefill_chunk, self.decoding_chunk) if decode else self.prefill_chunk
        budget, scores = max(chunk, 1), max(self.score_chunk, 1)
        for r in prefill:
            if budget <= 0:
                break
            assert r.slot is not None   # a running request holds a slot
            n = min(budget, len(r.prompt_ids) - r.prefilled)
            if r.prompt_logprobs is not None:       # scored rows: at most ``scores`` more this step
                if scores <= 0:
                    continue
                n = min(n, scores)
            start = len(b.ids)
            b.ids.extend(r.prompt_ids[r.prefilled:r.prefilled + n])
            b.segments.append((r.slot, n))
            # with prompt_logprobs, the rows of the chunk's positions whose next token is in the prompt
            scored = 0 if r.prompt_logprobs is None else min(n, len(r.prompt_ids) - 1 - r.prefilled)
            b.rows.extend(range(start, start + scored))
            r.prefilled += n
            budget -= n
            scores -= scored
            completes = r.prefilled == len(r.prompt_ids)
            if completes:
                b.rows.append(len(b.ids) - 1)
            b.chunks.append(_Chunk(r, start, n, scored, completes))
        return b

    def _forward(self, b: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The one target forward of the step: (the wanted rows' logits, the features the drafter
        reads at every position, or None); the prefilled chunks' features go to their requests."""
        wanted = self.drafter.feature_layers
        out = self.target(torch.tensor(b.ids, dtype=torch.long), b.segments, self.cache, feature_layers=wanted,
                          logits_rows=torch.tensor(b.rows, dtype=torch.long) if b.rows else None)
        if not wanted:
            return out.logits, None
        feats = out.features[0] if len(wanted) == 1 else torch.cat(out.features, -1)
        for c in b.chunks:
            c.req.prompt_features.append(feats[c.start:c.start + c.n])
            if self.prefix is not None:
                assert c.req.slot is not None   # a running request holds a slot
                self.prefix.store_features(c.req.slot, c.req.prefilled - c.n, feats[c.start:c.start + c.n])
        return out.logits, feats

    @staticmethod
    def _blocks(logits: torch.Tensor | None, proposals: list[Proposal]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(the decoding requests' rows of the target's raw logits [sum(l + 1), V], or None when none
        decodes; each request's rows [l + 1, V] of them, what log probabilities report)."""
        if not proposals:
            return None, []
        assert logits is not None   # every decoding request has logits rows
        sizes = [len(p) + 1 for p in proposals]
        head = logits[:sum(sizes)]
        return head, list(head.split(sizes))

    def _verify(self, decode: list[Request], proposals: list[Proposal], blocks: list[torch.Tensor],
                head: torch.Tensor | None) -> list[tuple[int, int] | None]:
        """Each decoding request's (accepted drafts n, the token emitted after them), or None where
        verifying it failed (its grammar, its sampling settings, a NaN in its law) and it ended
        alone (``_fail``). Every request's block goes through one ``verify_batch`` call (one host
        synchronisation for the step); ``verify``, request by request, answers only if that call
        itself fails, so that one request's failure still ends that request alone."""
        verdicts: list[tuple[int, int] | None] = [None] * len(decode)
        rows, kept = [], []
        raw = True          # every block verified on the target's logits as they are
        for i, (r, p, logits) in enumerate(zip(decode, proposals, blocks)):
            try:      # its law: its penalties, its grammar, its sampling settings
                if r.exact:
                    verdicts[i] = self._verify_exact(r, p, logits)
                    raw = False
                    continue
                law = target_rows(self._law(r, logits, p.tokens), r.params)
                raw = raw and law is logits
                rows.append((p.tokens, p.probs, law, r.params.greedy, r.generator))
                kept.append(i)
            except Exception as e:     # it alone ends
                self._fail(r, e)
                raw = False
        if not kept:
            return verdicts
        try:
            # every block as the forward gave it: its rows are verified in place, not copied
            got = verify_batch(*stack_requests(rows, head if raw else None))
        except Exception:
            if not self.isolate_failures:
                raise
            got = []
            for i in kept:      # request by request, so that what failed ends alone
                r, p = decode[i], proposals[i]
                try:
                    got.append(verify(p.tokens, p.probs, self._law(r, blocks[i], p.tokens), r.params, r.generator))
                except Exception as e:
                    self._fail(r, e)
                    got.append(None)
        for i, v in zip(kept, got):
            if v is None and not decode[i].done:      # verify_batch: a NaN where its law is read
                self._fail(decode[i], FloatingPointError("NaN in the target's or the drafter's probabilities"))
            verdicts[i] = v
        return verdicts

    def _accept(self, r: Request, p: Proposal, verdict: tuple[int, int], drafted: int, sent: int, start: int,
                feats: torch.Tensor | None, logits: torch.Tensor, log: _StepLog) -> bool:
        """r's verified block: its cache rolls back over the rejected drafts (and ``sent`` - l - 1
        padding), the drafter gets the kept positions' features, its stats and the policy's outcome
        count it, and its accepted drafts and the next token are emitted; True if r ended."""
        assert r.ctx is not None and r.slot is not None   # decoding: it has a context and a slot
        n, nxt = verdict
        l = len(p)
        self.cache.truncate(r.slot, self.cache.lengths[r.slot] - sent + 1 + n)
        if feats is not None:
            r.ctx.features.append(feats[start:start + n + 1])
            r.round_rows = n + 1
            if self.prefix is not None:
                self.prefix.store_features(r.slot, self.cache.lengths[r.slot] - n - 1, feats[start:start + n + 1])
        s = r.stats
        s.num_rounds += 1
        if p.forced:
            s.num_forced_tokens += n
        elif l:
            s.num_drafts += 1
            s.num_draft_tokens += l
            s.num_accepted_tokens += n
            if len(s.accepted_per_position) < l:
                s.accepted_per_position.extend([0] * (l - len(s.accepted_per_position)))
            for i in range(n):
                s.accepted_per_position[i] += 1
        log.outcomes.append(RequestOutcome(r.id, drafted, l, n, p.free, p.forced))
        return self._emit(r, p.tokens[:n].tolist() + [nxt], logits)

    def _prefilled(self, chunks: list[_Chunk], logits: torch.Tensor | None, at: int) -> list[Request]:
        """The chunks' prompt log probabilities (their rows from ``at`` on), and for each prompt
        now prefilled its first token drawn and its drafting context; returns those that ended."""
        ended = []
        for c in chunks:
            r = c.req
            first_row, at = at, at + c.scored + int(c.completes)   # its rows: the scored ones, then the last
            try:
                if c.scored:      # row j of the chunk predicts the prompt's next token
                    # scored rows: asked for, and only with prompt_logprobs
                    assert logits is not None and r.prompt_logprobs is not None
                    first_pos = r.prefilled - c.n + 1
                    r.prompt_logprobs_out.extend(token_logprobs(
                        logits[first_row:first_row + c.scored], r.prompt_ids[first_pos:first_pos + c.scored],
                        r.prompt_logprobs))
                if not c.completes:
                    continue
                assert logits is not None   # a completed prompt's last row was asked for
                if r.exact:
                    law = probs_from_logits(self._law(r, logits[at - 1:at]), r.params)
                    first = race_sample(law, [r.params.seed], [len(r.prompt_ids)])[0]
                else:
                    first, _ = sample_from_logits(self._law(r, logits[at - 1:at])[0], r.params, r.generator)
            except Exception as e:     # its grammar, its sampling settings: it alone ends
                self._fail(r, e)
                ended.append(r)
                continue
            r.stats.prefill_seconds = time.perf_counter() - r.t_start
            r.ctx = DraftContext(list(r.prompt_ids), r.params, r.generator, 0, features=r.prompt_features,
                                 grammar=r.grammar, exact=r.exact)
            if self._emit(r, [int(first)], logits[at - 1:at]):
                ended.append(r)
        return ended

    @staticmethod
    def _law(r: Request, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits r's tokens are drawn from at these rows (row k follows the output plus the first
        k drafts): the target's, penalised (SamplingParams) and with the stop tokens ruled out
        before ``min_tokens``, and only the tokens r's grammar allows there; the raw logits when
        none applies."""
        if r.params.penalised:
            logits = penalised_logits(logits, r.params, r.prompt_ids, r.output_ids, drafts)
        early = r.min_tokens - len(r.output_ids)        # rows 0 .. early - 1 come before min_tokens
        if r.grammar is not None:
            allowed = r.grammar.masks([] if drafts is None else drafts.tolist())
            if early > 0 and r.stop_ids:   # where the grammar allows only stop tokens, they win over min_tokens
                stops = torch.zeros(allowed.shape[1], dtype=torch.bool)
                stops[list(r.stop_ids)] = True
                rows = allowed[:early].clone()
                other = (rows & ~stops).any(-1)
                rows[other] &= ~stops
                allowed = torch.cat([rows, allowed[early:]])
            return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
        if early > 0 and r.stop_ids:
            logits = logits.float().clone()
            logits[:early, list(r.stop_ids)] = float("-inf")
        return logits

    def _draft(self, decode: list[Request], log: _StepLog) -> tuple[list[Proposal], list[int]]:
        """(the block each request verifies, how many tokens the drafter proposed it): the policy
        says how many to draft, the drafter proposes them, the policy says how many to verify."""
        proposals = [Proposal.empty() for _ in decode]
        if not decode:
            return proposals, []
        ctxs = cast(list[DraftContext], [r.ctx for r in decode])   # decoding requests all have a context
        views = [RequestView(r.id, len(c.tokens), sum(f.shape[0] for f in c.features),
                             r.max_new_tokens - len(r.output_ids)) for r, c in zip(decode, ctxs)]
        # what each request could draft at no cost, for the policies that weigh it
        free = self.drafter.free_lengths(ctxs) if self.policy.wants_free(views) else None
        t0 = time.perf_counter()
        want = self.policy.draft_lengths(views, self.block_size, free)
        log.policy_seconds += time.perf_counter() - t0
        active = []
        for i, (r, w) in enumerate(zip(decode, want)):
            ctxs[i].num_draft = max(0, min(w, r.max_new_tokens - len(r.output_ids) - 1))
            if ctxs[i].num_draft > 0:
                active.append(i)
        if active:
            # the context rows each drafting request hands the drafter beyond its last round's (it empties
            # them when it drafts): its prompt at its first call, else the rounds since it last drafted
            rows = [max(0, views[i].pending_rows - decode[i].round_rows) for i in active]
            t0 = time.perf_counter()
            got = self._propose([decode[i] for i in active])
            log.draft_seconds = time.perf_counter() - t0
            log.draft_rows = sum(n for n, p in zip(rows, got) if not p.free)
            for i, p in zip(active, got):
                proposals[i] = p.truncate(ctxs[i].num_draft)
        t0 = time.perf_counter()
        lengths = self.policy.verify_lengths(views, proposals)
        log.policy_seconds += time.perf_counter() - t0
        out = [p.truncate(max(0, n)) for p, n in zip(proposals, lengths)]
        self._jump_forward(decode, out)
        return out, [len(p) for p in proposals]

    def _jump_forward(self, decode: list[Request], out: list[Proposal]) -> None:
        """Under a grammar: the tokens it forces replace a block that does not start with them, and
        a lookup's block ends before its first forbidden token."""
        for i, r in enumerate(decode):
            if r.grammar is None or r.done:
                continue
            try:
                # jump-forward: what the grammar forces, unless the block starts with it
                forced = r.grammar.forced(min(self.block_size, r.max_new_tokens - len(r.output_ids) - 1))
                if forced and out[i].tokens[:len(forced)].tolist() != forced:
                    out[i] = Proposal(torch.tensor(forced, dtype=torch.long), free=True, forced=True)
                elif len(out[i]) and out[i].probs is None:
                    # point masses (a lookup's) end before their first forbidden token: verified, it would be
                    # rejected for certain and the target's token drawn from its own law, as it is now
                    out[i] = out[i].truncate(r.grammar.valid_prefix(out[i].tokens.tolist()))
            except Exception as e:     # its grammar: it alone ends
                self._fail(r, e)

    def _verify_exact(self, r: Request, p: Proposal, logits: torch.Tensor) -> tuple[int, int]:
        """A seeded sampled request: at each row the token its seed and that position draw from the
        target's law (sampling.race_sample), the drafts accepted while they equal it. Its output is
        plain decoding's with that seed, whatever was drafted: a draft is a guess at that token,
        which the DSpark drafter, racing its own law with the same keys, makes with probability near
        sum min(p, q)."""
        probs = probs_from_logits(self._law(r, logits, p.tokens), r.params)     # [l + 1, V]
        if not bool(torch.isfinite(probs).all()):
            raise FloatingPointError("NaN in the target's probabilities")
        start = len(r.prompt_ids) + len(r.output_ids)
        ys = race_sample(probs, [r.params.seed] * probs.shape[0], list(range(start, start + probs.shape[0]))).tolist()
        drafts = p.tokens.tolist()
        n = next((k for k, (x, y) in enumerate(zip(drafts, ys)) if x != y), len(drafts))
        return n, int(ys[n])

    def _propose(self, reqs: list[Request]) -> list[Proposal]:
        """The drafter's proposals for these requests, in one call; if that call fails (with
        ``isolate_failures``), one call per request, so that a failure drafting for one (its grammar,
        its sampling settings) ends that one alone (an empty proposal in its place)."""
        ctxs = cast(list[DraftContext], [r.ctx for r in reqs])
        try:
            return self.drafter.propose(ctxs)
        except Exception:
            if not self.isolate_failures:
                raise
        out = []
        for r, c in zip(reqs, ctxs):
            try:
                out.append(self.drafter.propose([c])[0])
            except Exception as e:
                self._fail(r, e)
                out.append(Proposal.empty())
        return out

    def _emit(self, r: Request, tokens: list[int], logits: torch.Tensor) -> bool:
        """Append emitted tokens (cut at a stop token or the length limit; ``logits``: the target's
        rows they were drawn from); True if r ended. A failure here (its log probabilities, its
        grammar refusing a token, its ``on_tokens``) ends r alone."""
        try:
            return self._append(r, tokens, logits)
        except Exception as e:
            self._fail(r, e)
            return True

    def _append(self, r: Request, tokens: list[int], logits: torch.Tensor) -> bool:
        for i, t in enumerate(tokens):
            if t in r.stop_ids:
                tokens = tokens[:i + 1]
                r.finish_reason = "stop"
                break
        tokens = tokens[:r.max_new_tokens - len(r.output_ids)]
        if r.logprobs is not None and tokens:
            r.output_logprobs.extend(token_logprobs(logits, tokens, r.logprobs))
        if r.grammar is not None and tokens:
            r.grammar.advance(tokens)
        r.output_ids.extend(tokens)
        assert r.ctx is not None   # emitting: its prompt is prefilled
        r.ctx.tokens.extend(tokens)
        if r.on_tokens and tokens:
            r.on_tokens(tokens)
        if r.finish_reason is None and len(r.output_ids) >= r.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is None:
            return False
        r.stats.num_tokens = len(r.output_ids)
        r.stats.seconds = time.perf_counter() - r.t_start
        r.stats.finish_reason = r.finish_reason
        r.status = "finished"
        self._release(r)
        return True

    def run(self) -> None:
        """Step until every request has ended."""
        while self.has_work():
            self.step()


def serving_policy(target, drafter, name: str, max_requests: int = 32):
    """(a fresh policy, the `dspark profile` cost table it prices with or None) for --policy
    ``name`` (scheduling.auto.serving_policy: "auto" = prefix, on that table where one was measured,
    else on step costs learned while serving)."""
    from .scheduling.auto import serving_policy as policy_for
    return policy_for(name, target, drafter, max_requests)


def serving_engine(target, drafter, policy: str, max_requests: int, max_len: int,
                   prefix_caching: bool = True, isolate_failures: bool = True) -> Engine:
    """The engine `dspark serve`, `dspark bench serving` and `dspark.generate_batch` run for a loaded
    target and drafter (``policy`` as for serving_policy; prefix caching on, as in vLLM; a failing
    request ends alone unless ``isolate_failures`` is off, as for batch generation)."""
    pol, _ = serving_policy(target, drafter, policy, max_requests)
    return Engine(target.model, drafter, pol, max_requests=max_requests, max_len=max_len,
                  block_size=drafter.block_size, eos_ids=target.eos_token_ids, prefix_caching=prefix_caching,
                  isolate_failures=isolate_failures)


def check_policy_name(policy: str) -> None:
    """A bad --policy fails before anything is loaded."""
    from .scheduling.policies import make_policy
    if policy != "auto":
        make_policy(policy)
