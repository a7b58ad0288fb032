"""The auto policy: a load-aware policy (prefix by default) priced by step costs it learns from the
engine's own steps, so that scheduling needs no set-up.

Where `dspark profile` has measured a full cost table, serving uses it as it is (``serving_policy``).
Otherwise the costs come from ``LearnedCosts``: loaded from the cache when an earlier run on this
machine learned them, else learned now, from every step the engine times. Two parts the steps a
policy chooses may never show, so the policy runs them itself, as regular, lossless decoding steps
(at most ``explore_steps`` of each per load):

- a plain step at a load it meets first (every request verifying nothing beyond its anchor): what
  drafting saves is priced against it, and a load first met drafting (a cold start at full load)
  would otherwise price plain decoding as dear as its cheapest drafting step. Then one every
  ``plain_every`` steps at that load until ``plain_samples`` were timed there: a plain price from
  one step that ran in a slow spell (a shared machine's speed moves by a third within minutes)
  makes verifying look as cheap as not, and while the policy drafts on that price no step of its
  own times plain decoding again (a plain step costs nothing plain decoding would not);
- the drafter's call at a new load (a policy that finds drafting dear stops drafting): until the
  drafter has been timed drafting the whole block for a number of requests within a factor of 4 of
  the current load, a quarter of the requests (then an eighth: two sizes give the call's slope;
  requests a lookup serves for free are passed over, since the call does not run for them) draft
  the whole block, the others none (those with the fewest context rows waiting for the drafter:
  the call takes in every row verified since a request last drafted, a whole prompt at its first
  call, and the lookups spare it many), and the inner policy verifies of it what pays on the
  prices known so far (the call is spent by then; verifying the whole block too would cost a heavy
  load several plain steps and teach nothing the decoding steps do not).
  Where a lookup served all requests but one or two while a load was measured, the call was timed
  for those only; once the drafter serves over 4 times as many, up to ``explore_steps`` more
  measuring steps at that load time it for them.

After each measuring step, after a decoding step of a shape the costs had seen only a few times at
its load (a load's first verifying steps teach what its verification costs) once ``reprice_soon``
steps have passed since the last rebuild, and every ``reprice_every`` steps, the table the inner
policy prices with is rebuilt from the costs, and they are saved (every
``save_every`` steps once measured).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .base import Policy, StepOutcome
from .costs import CostTable, table_key_for, table_path
from .learned import LearnedCosts, bucket, centre, learned_path, machine_id
from .load_aware import LoadAwarePolicy

log = logging.getLogger("dspark")


class AutoPolicy(Policy):
    name = "auto"

    def __init__(self, inner: LoadAwarePolicy, costs: LearnedCosts, max_requests: int,
                 explore_steps: int = 2, reprice_every: int = 32, reprice_soon: int = 8,
                 save_every: int = 256, plain_samples: int = 3, plain_every: int = 8, hurdle: float = 1.25):
        self.inner = inner
        self.costs = costs
        self.max_requests = max_requests
        self.explore_steps = explore_steps
        self.plain_samples = plain_samples
        self.plain_every = plain_every
        self.reprice_every = reprice_every
        self.reprice_soon = reprice_soon
        self.save_every = save_every
        self.uses_free_drafts = inner.uses_free_drafts
        self.measuring: int | None = None      # the depth this step runs to measure it, or None
        self._explored: dict[int, int] = {}    # requests bucket -> measuring steps run there
        self._pays: dict[int, bool] = {}       # requests bucket -> drafting paid at its last search
        self._plain: dict[int, int] = {}       # requests bucket -> plain steps run to measure them
        self._since_plain: dict[int, int] = {} # requests bucket -> steps there since its last one
        self._since_price = 0
        self._since_save = 0
        self.measuring_steps = 0               # steps run to measure, and their seconds (a run's set-up;
                                               # prompts prefilled beside them not counted)
        self.measuring_seconds = 0.0
        # Verification priced at ``hurdle`` x its expected cost from 32 requests on (none at one
        # request, in proportion between: ``CostModel.hurdle_at``). The learned prices and the
        # expected acceptances are estimates; where a step's expected gain is small their errors
        # decide whether it pays, and a step that verified for nothing costs the whole load. On a CPU
        # at 32 requests, verifying the lookups' tokens after an answer's first steps is near
        # break-even, and such steps ran dearer than priced (a ragged layout of many requests) with
        # fewer tokens accepted than promised; steps whose gain clears the hurdle (an answer's first
        # steps) still verify. At one request a step's price is its block's and the gains are large:
        # a hurdle there only drops tokens that pay. The measurements: docs/auto.md.
        inner.cost.hurdle = hurdle
        inner.reprice(costs.table(max_requests))

    def draft_lengths(self, requests, block_size, free: Sequence[int] | None = None) -> list[int]:
        # the inner policy decides first, on the prices known so far (where there are none yet, the
        # step measures); its search also says whether drafting pays at this load
        priced = self.inner.cost.table is not None
        out = self.inner.draft_lengths(requests, block_size, free) if priced else None
        if requests and priced:
            self._pays[bucket(len(requests))] = self.inner.drafting_ratio >= 1.0
        # the drafter's call is timed only on requests it serves: a lookup's free proposal (the
        # hybrid's where it matches) replaces the call, so a measuring step drafts for the others
        served = [i for i in range(len(requests)) if not (free and free[i])]
        shape = self._shape_to_measure(len(requests), len(served))
        self.measuring = None if shape is None else shape[0]
        if shape is not None:
            depth, n = shape
            want = [0] * len(requests)
            # n = 0 for a plain step; else the n requests with the least for the call to catch up on
            if n:
                for i in sorted(served, key=lambda i: requests[i].backlog(depth))[:n]:
                    want[i] = depth
            return want
        return out if out is not None else self.inner.draft_lengths(requests, block_size, free)

    def wants_free(self, requests) -> bool:
        return self.inner.wants_free(requests)

    def verify_lengths(self, requests, proposals) -> list[int]:
        return self.inner.verify_lengths(requests, proposals)

    def observe(self, outcome: StepOutcome) -> None:
        if self.measuring is not None:
            # the step's set-up part: its time less the prompt rows it prefilled beside the
            # measuring (their share of the forward), which plain decoding pays alike
            rows = outcome.forward_rows
            decoding = sum(1 + r.verified for r in outcome.requests)
            prompts = max(0, rows - decoding) / rows if rows > 0 else 0.0
            self.measuring_steps += 1
            self.measuring_seconds += outcome.seconds - prompts * outcome.forward_seconds
        new_shape = self.costs.observe(outcome)
        self.inner.observe(outcome)
        self._since_price += 1
        self._since_save += 1
        # a new shape's price is worth using soon, but a rebuild prices every shape of every load:
        # for new shapes at most every ``reprice_soon`` steps; after every measuring step
        if (self.measuring is not None or self._since_price >= self.reprice_every
                or (new_shape and self._since_price >= self.reprice_soon)):
            self._since_price = 0
            self.inner.reprice(self.costs.table(self.max_requests))
        if self._since_save >= self.save_every or self.measuring is not None:
            self._since_save = 0
            self.costs.save()
        self.measuring = None

    def _shape_to_measure(self, requests: int, served: int) -> tuple[int, int] | None:
        """(the depth to run this step to, how many of its requests draft it) to measure it; None:
        the costs know every shape at this load, or its measuring steps are spent, or (measuring
        the drafter's call) none of the ``served`` requests, those the drafter itself would serve,
        is left this step."""
        if not requests:
            return None
        b = bucket(requests)
        # a plain step first: what drafting saves is priced against it (and it costs nothing a
        # plain decoder would not pay); then spaced ones, until a few were timed at this load
        first = b not in self._plain and b not in self._explored
        since = self._since_plain[b] = self._since_plain.get(b, 0) + 1
        have = self.costs.plain_samples(requests)
        if self._plain.get(b, 0) < self.plain_samples and (
                have == 0 or (have < self.plain_samples and since > self.plain_every)):
            if first:
                log.info("auto policy: measuring the step costs at %d request(s)", requests)
            self._plain[b] = self._plain.get(b, 0) + 1
            self._since_plain[b] = 0
            return 0, 0
        ran = self._explored.get(b, 0)
        if ran >= self.explore_steps and not (ran < 2 * self.explore_steps and self._outgrown(served)):
            return None
        # on a CPU a step's verification grows with the load faster than its fixed part: where
        # drafting did not pay at a lighter load, it will not at this one, and the costs priced on
        # from the lighter loads are enough to say so (no measuring step spent on it). Nor where the
        # search at this load found that it does not pay with the drafter's call priced on from the
        # lighter loads: that price (the drafter's curve carried on linearly, flat from a single
        # load) is close to what a batched call costs, rarely far above it, so measuring would
        # seldom change the answer, and a measuring step at 32 requests costs the drafter's call
        # over every request's whole block and its prompt's features, several plain steps' worth.
        if any(not pays for lighter, pays in self._pays.items() if lighter <= b):
            return None
        # the call runs for the requests no lookup serves, so it is priced (and wanted timed) for
        # about as many as the drafter serves here: asking for the load would keep measuring a call
        # that never runs for that many (at 8 requests a lookup may serve 7 of them every step)
        depth = self.costs.missing(served) if served else None
        if depth is None:
            return None
        if first:
            log.info("auto policy: measuring the step costs at %d request(s)", requests)
        self._explored[b] = ran + 1
        # the factor-4 rule needs the call timed for a quarter of the requests, and the slope of its
        # cost for two sizes: a quarter, then an eighth (the drafter's call over all of a heavy
        # load's requests, its prompts' features included, costs several plain steps)
        return depth, max(1, -(-requests // (4 if ran == 0 else 8)))

    def _outgrown(self, served: int) -> bool:
        """Whether the drafter now serves over 4 times as many requests as its call was ever timed
        for: where the load's measuring steps found a lookup serving all requests but one or two,
        the call was timed for those, and its price for many more is a guess at its per-request
        part (on a CPU whose verification is dear, a cheap guess drafts and verifies several steps
        that do not pay). One more round of measuring steps at the load times it for them."""
        most = max((centre(k) for k in self.costs.timed), default=0.0)
        return 0 < 4 * most < served

    def close(self) -> None:
        """Keep what was learned for the next run (also saved every ``save_every`` steps)."""
        self.costs.save()


def learned_costs(target, drafter) -> LearnedCosts:
    """The step costs learned for this target, drafter, dtype, device, CPU and thread count (from
    the cache where an earlier run left them)."""
    key = f"{table_key_for(target, drafter)}|{machine_id()}"
    return LearnedCosts.load_or_new(key, drafter.block_size, learned_path(key), drafter.call_block_size)


def serving_policy(name: str, target, drafter, max_requests: int) -> tuple[Policy, CostTable | None]:
    """(the policy, the full cost table it prices with or None) for --policy ``name``. "auto" is the
    prefix policy. A policy that weighs costs (auto, prefix, async) prices with `dspark profile`'s
    table where one was measured for this target and drafter, else with the costs it learns while
    serving (``AutoPolicy``); one line says which."""
    from .policies import make_policy
    if drafter.name == "plain":
        return make_policy("plain"), None
    inner_name = "prefix" if name == "auto" else name
    if inner_name not in ("prefix", "async"):
        return make_policy(inner_name, drafter.block_size), None
    table = CostTable.find(table_key_for(target, drafter), warn=False)
    if table is not None:
        log.info("%s policy: %s on the cost table `dspark profile` measured (%s)", name, inner_name,
                 table_path(table.key))
        return make_policy(inner_name, drafter.block_size, cost_table=table), table
    costs = learned_costs(target, drafter)
    inner = make_policy(inner_name, drafter.block_size)
    assert isinstance(inner, LoadAwarePolicy)
    if costs.forward:
        log.info("%s policy: %s on step costs learned on this machine before (%s); refined as it serves",
                 name, inner_name, costs.path)
    else:
        log.info("%s policy: %s; no step costs for this machine yet: it measures them from its first "
                 "steps (a few per load) and keeps them in %s", name, inner_name, costs.path)
    policy = AutoPolicy(inner, costs, max_requests)
    policy.name = name
    return policy, None
