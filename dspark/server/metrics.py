"""The server's Prometheus metrics: vLLM's request and speculative-decoding counters under a
``dspark:`` prefix, in a registry of the server's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Prometheus counters in a registry of the server's own (several servers in one process, as
    in the tests, do not collide)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        # counted when scraped (EngineWorker.counts), not set after each step: a cancelled request
        # leaves them at once, not one step (or, when idle, the next request's step) later
        self.running = Gauge("dspark:num_requests_running", "requests in the engine's batch", registry=r)
        self.waiting = Gauge("dspark:num_requests_waiting", "requests queued for a cache slot", registry=r)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("dspark:generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("dspark:request_success", "requests ended, by reason",
                                ["finished_reason"], registry=r)
        # vLLM's names: prompt tokens of the requests that could take a cached prefix, and of those found cached
        self.prefix_queries = Counter("dspark:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("dspark:prefix_cache_hits", "prompt tokens found in the prefix cache", registry=r)
        self._prefix_seen = (0, 0)
        self.steps = Counter("dspark:engine_steps", "engine steps (one target forward each)", registry=r)
        self.drafts = Counter("dspark:spec_decode_num_drafts", "rounds that verified draft tokens", registry=r)
        self.draft_tokens = Counter("dspark:spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = Counter("dspark:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                    "draft tokens accepted, by position in the block", ["position"], registry=r)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "from admission to the first token",
                              registry=r, buckets=(0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram("dspark:e2e_request_latency_seconds", "from admission to the end",
                                 registry=r, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def prefix_counted(self, prefix) -> None:
        """Bring the prefix-cache counters up to the engine's totals."""
        self.prefix_queries.inc(prefix.queries - self._prefix_seen[0])
        self.prefix_hits.inc(prefix.hits - self._prefix_seen[1])
        self._prefix_seen = (prefix.queries, prefix.hits)

    def request_ended(self, req) -> None:
        s = req.stats
        self.drafts.inc(s.num_drafts)
        self.draft_tokens.inc(s.num_draft_tokens)
        self.accepted.inc(s.num_accepted_tokens)
        for k, n in enumerate(s.accepted_per_position):
            if n:
                self.accepted_pos.labels(position=str(k)).inc(n)
