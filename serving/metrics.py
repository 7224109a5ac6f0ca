"""Prometheus metrics of the server: vLLM's names and buckets under the `mirror_rt:` prefix, plus speculation's own.

Every series carries `model_name`; counters are declared without `_total` (prometheus_client appends it). Token
counters, TTFT and inter-token latency move per engine step (`progress`; a step committing k tokens after a gap d
counts k observations of d / k), the rest when a request ends. One registry per app, so apps in one process never
collide; a `sink` receives every update too (Ray replicas). Unlabelled series and the reason/kind ones exist at 0
from the first scrape.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` series beside each counter and histogram (as vLLM)

PREFIX = "mirror_rt:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "draining")
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tools")
RECENT = 50  # finished requests the server page lists
# sink(kind, name, doc, label names, buckets) -> a family with .labels(*values).inc/set/observe;
# kind is "counter" | "gauge" | "histogram", name has no prefix, buckets is None but for histograms.
Sink = Callable[[str, str, str, list, "tuple | None"], object]


class Tee:
    """Metric families (or their labelled children) updated together."""

    def __init__(self, *parts):
        self.parts = parts

    def labels(self, *values) -> Tee:
        return Tee(*(part.labels(*values) for part in self.parts))

    def inc(self, amount: float = 1) -> None:
        for part in self.parts:
            part.inc(amount)

    def set(self, value: float) -> None:
        for part in self.parts:
            part.set(value)

    def observe(self, value: float) -> None:
        for part in self.parts:
            part.observe(value)


class ServerMetrics:
    """Every metric of one server, labelled with its model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, sink: Sink | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name, self.sink = model_name, sink
        self._prefix_seen = (None, 0, 0)  # the decoder's prefix cache and its counters at the last step
        self.recent: collections.deque = collections.deque(maxlen=RECENT)  # (unix time, RequestRecord)
        self._gauges()
        self._counters()
        self._histograms()
        for reason in FINISH_REASONS:  # present from the first scrape, at 0
            self.request_success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.request_rejected.labels(model_name, reason)
        for kind in CONSTRAINT_KINDS:
            self.constrained.labels(model_name, kind)

    def _gauges(self) -> None:
        g = self._make(Gauge)
        self.running = g("num_requests_running", "Requests in the batch now (decoding, or their prompt going in)")
        self.waiting = g("num_requests_waiting", "Requests queued for a row of the batch")
        self.kv_usage = g("kv_cache_usage_perc", "Share of the KV budget held (0..1): blocks reserved by the "
                          "requests in the batch plus the prefix cache's")
        self.kv_budget = g("kv_cache_budget_bytes", "The KV budget: both models' rows and the prefix cache "
                           "(--kv-cache-gb)")
        self.prefix_blocks = g("prefix_cache_blocks", "Blocks of 16 positions the prefix cache holds")
        self.prefix_bytes = g("prefix_cache_bytes", "KV bytes the prefix cache holds (at most --prefix-cache-share "
                              "of the budget)")
        self.gamma = g("spec_decode_gamma", "Draft tokens per window at the latest step (0: target-only, by load)")
        self.spec_enabled = g("spec_decode_enabled", "1 when the server's default mode speculates (sd, mirror)")

    def _counters(self) -> None:
        c = self._make(Counter)
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests that ran")
        self.generation_tokens = c("generation_tokens", "Tokens generated (usage.completion_tokens summed)")
        self.request_success = c("request_success", "Requests ended, by finish reason", ["finished_reason"])
        self.request_rejected = c("request_rejected", "Requests refused before running, by reason", ["reason"])
        self.drafts = c("spec_decode_num_drafts", "Draft windows verified by the target (one per verify step)")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted_tokens = c("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                  "window position", ["position"])
        self.draft_hidden = c("draft_hidden_seconds", "Draft time that ran while the target computed (Mirror)")
        self.reuse_hits = c("reuse_hits", "Verdicts whose next window was precomputed (Mirror)")
        self.reuse_checks = c("reuse_checks", "Verdicts checked against the precomputed windows (Mirror)")
        self.draft_faults = c("draft_faults", "Requests whose draft failed; decoding fell back to the target")
        self.constrained = c("constrained_requests", "Requests whose output a grammar constrained, by kind "
                             "(json_object, json_schema, regex, choice, grammar, tools)", ["kind"])
        self.device_fallback = c("device_fallback", "Roles loaded on another device than requested",
                                 ["role", "requested", "actual"])
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.responses = c("http_requests", "HTTP responses by route (handler; none: no route), method and status "
                           "code, the HTTP layer's own errors included", ["handler", "method", "status"])

    def _histograms(self) -> None:
        h = self._make(Histogram)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time per generated token after the first (per token)",
                     buckets=ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to end", buckets=LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Arrival to start of generation", buckets=LATENCY_BUCKETS)
        self.draft_step = h("draft_step_seconds", "One draft forward", buckets=STEP_BUCKETS)
        self.target_verify = h("target_verify_seconds", "One target verification of a draft window",
                               buckets=STEP_BUCKETS)
        self.batch_size = h("num_sequences_per_step", "Sequences decoded by one step of the batch",
                            buckets=BATCH_BUCKETS)

    def _make(self, kind):
        def make(name, doc, labels=(), **kw):
            names = ["model_name", *labels]
            family = kind(PREFIX + name, doc, names, registry=self.registry, **kw)
            if self.sink is not None:
                family = Tee(family, self.sink(kind.__name__.lower(), name, doc, names, kw.get("buckets")))
            if not labels:  # the series exists from the first scrape, at 0 (as vLLM's): rate() sees the first request
                family.labels(self.model_name)
            return family
        return make

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def status(self) -> dict:
        """The server page's figures: load and totals read back from this registry, recent requests newest first."""
        def value(name: str, **labels) -> float:
            return self.registry.get_sample_value(PREFIX + name, {"model_name": self.model_name, **labels}) or 0

        return {"running": int(value("num_requests_running")), "waiting": int(value("num_requests_waiting")),
                "requests": {reason: int(value("request_success_total", finished_reason=reason))
                             for reason in FINISH_REASONS},
                "generation_tokens": int(value("generation_tokens_total")),
                "draft_tokens": int(value("spec_decode_num_draft_tokens_total")),
                "accepted_tokens": int(value("spec_decode_num_accepted_tokens_total")),
                "kv_cache": {"budget_bytes": int(value("kv_cache_budget_bytes")), "usage": value("kv_cache_usage_perc"),
                             "prefix_cache_bytes": int(value("prefix_cache_bytes"))},
                "recent": [record.summary(ended) for ended, record in reversed(self.recent)]}

    # --- updates -------------------------------------------------------------------------

    def set_load(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def step(self, batch: int, decoder) -> None:
        """One step that decoded `batch` sequences (0: none); `decoder` is read after the step."""
        m = self.model_name
        if batch:
            self.batch_size.labels(m).observe(batch)
        self.gamma.labels(m).set(decoder.gamma)
        self.kv_usage.labels(m).set(decoder.kv_usage())
        self.kv_budget.labels(m).set(decoder.budget_bytes())
        cache = decoder.cache
        self.prefix_blocks.labels(m).set(len(cache) if cache is not None else 0)
        self.prefix_bytes.labels(m).set(cache.bytes if cache is not None else 0)
        if cache is not None:
            seen, queries, hits = self._prefix_seen
            if seen is not cache:  # a new decoder (the engine was reset): its counters start at 0
                queries = hits = 0
            self.prefix_queries.labels(m).inc(cache.queries - queries)
            self.prefix_hits.labels(m).inc(cache.hits - hits)
            self._prefix_seen = (cache, cache.queries, cache.hits)

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def fallbacks(self, placement) -> None:
        """Count the roles that fell back at load (`devices.placement.Placement.fallbacks`; None: none)."""
        for role, requested in (placement.fallbacks if placement is not None else {}).items():
            self.device_fallback.labels(self.model_name, role, requested, placement.device(role)).inc()

    def progress(self, job) -> None:
        """Count what `job` committed since the last call (`job.metered`: steps counted per choice): the prompt's
        tokens and TTFT with its first token, then each step's tokens and per-token gaps."""
        m = self.model_name
        for index, gen in enumerate(job.generations):
            steps, done = gen.steps, job.metered.get(index, 0)
            if len(steps) <= done:
                continue
            if not job.metered:  # the job's first token: its prompt has been read
                self.prompt_tokens.labels(m).inc(len(job.prompt))
            if index == 0 and done == 0:
                self.ttft.labels(m).observe(steps[0].time - job.arrived)
            self.generation_tokens.labels(m).inc(sum(step.tokens for step in steps[done:]))
            itl = self.itl.labels(m)
            for before, after in zip(steps[max(done - 1, 0):], steps[max(done, 1):]):
                for _ in range(after.tokens):
                    itl.observe((after.time - before.time) / after.tokens)
            job.metered[index] = len(steps)

    def responded(self, handler: str, method: str, status: int) -> None:
        self.responses.labels(self.model_name, handler, method, str(status)).inc()

    def finished(self, record) -> None:
        """One request's end (`serving.records.RequestRecord`); its tokens were counted as they came (`progress`)."""
        m = self.model_name
        self.recent.append((time.time(), record))
        self.request_success.labels(m, record.finish_reason).inc()
        if record.constraint:
            self.constrained.labels(m, record.constraint).inc()
        self.e2e.labels(m).observe(record.e2e_s)
        if record.queue_s is not None:
            self.queue_time.labels(m).observe(record.queue_s)
        if record.ran:
            self._speculation(record)

    def _speculation(self, record) -> None:
        m, stats = self.model_name, record.stats
        proposed, accepted = stats.get("proposed_per_position", []), stats.get("accepted_per_position", [])
        self.drafts.labels(m).inc(proposed[0] if proposed else 0)
        self.draft_tokens.labels(m).inc(sum(proposed))
        self.accepted_tokens.labels(m).inc(sum(accepted))
        for position, count in enumerate(accepted):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        for seconds in record.durations.get("draft_forward", ()):
            self.draft_step.labels(m).observe(seconds)
        for seconds in record.durations.get("target_verify", ()):
            self.target_verify.labels(m).observe(seconds)
        self.draft_hidden.labels(m).inc(stats.get("draft_hidden_s", 0.0))
        self.reuse_hits.labels(m).inc(stats.get("reuse_hits", 0))
        self.reuse_checks.labels(m).inc(stats.get("reuse_checks", 0))
        if record.draft_fault:
            self.draft_faults.labels(m).inc()
