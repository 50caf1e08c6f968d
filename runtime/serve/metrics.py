"""`/metrics` in Prometheus' text format, and one log line per request.

Counters and histograms are kept by prometheus_client in a registry of the server's own; running and waiting
requests, and the prefix cache's and the page pool's counters, are read from the scheduler thread at scrape time. Names follow vLLM's where one exists (k2trt: prefix)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LOG = logging.getLogger("k2trt.serve")
disable_created_metrics()  # no *_created series: a scrape is the counters and histograms only

# The label of every /v1 path the server has (tests/test_serve_limits.py checks it against the routes): any other
# path counts as "other", so a client inventing paths cannot add series without end.
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})
OTHER = "other"

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, scheduler_thread):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k2trt:requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("k2trt:prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("k2trt:generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("k2trt:request_success", "finished requests by reason", ["finished_reason"],
                                registry=r)
        self.ttft = Histogram("k2trt:time_to_first_token_seconds", "time to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("k2trt:inter_token_latency_seconds", "time between the tokens of a request",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("k2trt:e2e_request_latency_seconds", "submission to last token", buckets=_LATENCY,
                             registry=r)
        self.client_disconnects = Counter(
            "k2trt:client_disconnects", "requests cancelled because their client left, by the state they were in",
            ["state"], registry=r)
        for state in ("waiting", "prefilling", "decoding"):
            self.client_disconnects.labels(state=state)  # every state shows, at 0, from the first scrape
        running = Gauge("k2trt:num_requests_running", "requests holding a sequence slot", registry=r)
        waiting = Gauge("k2trt:num_requests_waiting", "requests waiting for a slot", registry=r)
        running.set_function(lambda: scheduler_thread.running)
        waiting.set_function(lambda: scheduler_thread.waiting)
        r.register(_CacheCollector(scheduler_thread))

    def request_done(self, endpoint: str, status: int) -> None:
        endpoint = endpoint if endpoint in ENDPOINTS else OTHER
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation_done(self, handle) -> None:
        """One finished generation (one choice): its tokens and latencies."""
        req = handle.request
        self.prompt_tokens.inc(len(req.prompt))
        self.generation_tokens.inc(len(req.token_ids))
        self.finished.labels(finished_reason=req.finish_reason or "unknown").inc()
        times = handle.token_times
        if times:
            self.ttft.observe(times[0] - req.submitted_at)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            self.e2e.observe(times[-1] - req.submitted_at)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# (kind, name, help, value from the counters): the and vLLM's names; a ratio is 0 before its denominator is.
_CACHE_FAMILIES = (
    (CounterMetricFamily, "k2trt:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
     lambda c: c.queried_tokens),
    (CounterMetricFamily, "k2trt:prefix_cache_hits", "prompt tokens found in the prefix cache (not computed)",
     lambda c: c.hit_tokens),
    (CounterMetricFamily, "k2trt:num_preemptions", "requests preempted for want of cache pages",
     lambda c: c.preemptions),
    (GaugeMetricFamily, "k2trt:cache_pages_total", "latent-cache pages in the pool", lambda c: c.pages),
    (GaugeMetricFamily, "k2trt:cache_pages_used", "latent-cache pages some request holds", lambda c: c.pages_in_use),
    (GaugeMetricFamily, "k2trt:cache_page_tokens", "positions one page holds", lambda c: c.page_tokens),
    (GaugeMetricFamily, "k2trt:kv_cache_usage_perc", "fraction of the cache pages in use",
     lambda c: c.pages_in_use / c.pages if c.pages else 0.0),
    (GaugeMetricFamily, "k2trt:prefix_cache_hit_ratio", "prompt tokens found over prompt tokens looked up",
     lambda c: c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0),
    (GaugeMetricFamily, "k2trt:cache_positions_in_use", "positions the pages in use span",
     lambda c: c.positions_in_use),
    (GaugeMetricFamily, "k2trt:cache_positions_held", "positions the running requests hold in the cache",
     lambda c: c.positions_held),
    (GaugeMetricFamily, "k2trt:cache_peak_positions_in_use", "the most positions the pages in use spanned",
     lambda c: c.peak_positions_in_use),
    (GaugeMetricFamily, "k2trt:cache_peak_positions_held", "the most positions the running requests held",
     lambda c: c.peak_positions_held),
)


class _CacheCollector:
    """The scheduler's prefix-cache and pool counters at scrape time (vLLM's names: prefix_cache_queries and
    prefix_cache_hits in tokens, num_preemptions, kv_cache_usage_perc as a fraction of the pages)."""

    def __init__(self, scheduler_thread):
        self.scheduler_thread = scheduler_thread

    def collect(self):
        c = self.scheduler_thread.cache_counters()
        for family, name, help_text, value in _CACHE_FAMILIES:
            yield family(name, help_text, value=value(c))
        s = self.scheduler_thread.spec_counters()  # speculative decoding, as vLLM counts it
        for name, help_text, value in _SPEC_COUNTERS:
            yield CounterMetricFamily(name, help_text, value=value(s))
        per_pos = CounterMetricFamily("k2trt:spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted at each draft position", labels=["position"])
        for position, accepted in enumerate(s.accepted_per_pos or []):
            per_pos.add_metric([str(position)], accepted)
        yield per_pos


_SPEC_COUNTERS = (
    ("k2trt:spec_decode_num_drafts", "verify steps of a request with drafts", lambda s: s.num_drafts),
    ("k2trt:spec_decode_num_draft_tokens", "draft tokens proposed", lambda s: s.num_draft_tokens),
    ("k2trt:spec_decode_num_accepted_tokens", "draft tokens accepted", lambda s: s.num_accepted_tokens),
)
