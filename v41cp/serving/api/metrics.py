"""The server's Prometheus metrics (``GET /metrics``, the text exposition format through ``prometheus-client``).

Names are vLLM's where the quantity is the same, so dashboards and load tools written for vLLM read them unchanged;
every series has the label ``model_name``:

* per request, observed when it ends (`RequestTimer`): ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds`` (one observation per output token after the first: an engine step that
  brings several tokens spreads its interval over them), ``vllm:e2e_request_latency_seconds`` (histograms, vLLM's
  buckets); ``vllm:request_success_total{finished_reason="stop"|"length"|"abort"}``,
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` (counters);
* from the engine loop's snapshot after each step, read at scrape time (`EngineCollector`):
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0 … 1: the
  cache blocks in use; blocks only the prefix cache holds count as free, they are evicted on demand) (gauges);
  ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
  tokens looked up / found cached) and, with speculative decoding, ``vllm:spec_decode_num_drafts_total`` (target
  verification steps), ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``.

Each server has its own `CollectorRegistry` (no process-global state: several servers in one process, as the
tests run them, do not share series).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "ENGINE_COUNTERS", "EngineCollector", "RequestTimer", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's histogram buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


# the engine loop snapshot's cumulative counters: (its part, ((series, help, the part's key), …))
ENGINE_COUNTERS = (
    ("prefix_cache", (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prompt_tokens"),
                      ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "hit_tokens"))),
    ("speculative", (("vllm:spec_decode_num_drafts", "Target verification steps (drafts).", "target_steps"),
                     ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "drafts_proposed"),
                     ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "drafts_accepted"))),
)


class EngineCollector:
    """Scrape-time series from ``snapshot()`` → the engine loop's last `EngineLoop.counters` (a dict)."""

    def __init__(self, snapshot, model_name: str):
        self.snapshot, self.model_name = snapshot, model_name

    def _family(self, kind, name: str, doc: str, value: float):
        fam = kind(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam

    def collect(self):
        s = self.snapshot()
        g, c = GaugeMetricFamily, CounterMetricFamily
        total = max(1, s.get("total_blocks", 0))
        yield self._family(g, "vllm:num_requests_running", "Requests in the engine's running batch.", s["running"])
        yield self._family(g, "vllm:num_requests_waiting", "Requests waiting for admission.", s["waiting"])
        yield self._family(g, "vllm:kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0 to 1).",
                           1.0 - s.get("free_blocks", total) / total)
        yield self._family(c, "vllm:num_preemptions", "Requests preempted (pages freed, recomputed later).",
                           s.get("preemptions", 0))
        for part, series in ENGINE_COUNTERS:          # (absent without a prefix cache / speculative decoding)
            for name, doc, key in series if s.get(part) is not None else ():
                yield self._family(c, name, doc, s[part][key])


class ServerMetrics:
    """The registry of one server; ``snapshot``: the engine loop's counters (`EngineLoop.counters`)."""

    def __init__(self, model_name: str, snapshot):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first output token.",
                              lab, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the request's end.", lab,
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Requests ended, by reason.", lab + ["finished_reason"],
                               registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of ended requests.", lab,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens of ended requests.", lab,
                                         registry=self.registry)
        self.registry.register(EngineCollector(snapshot, model_name))

    def timer(self, prompt_tokens: int) -> "RequestTimer":
        """A request's clock, started now (its arrival)."""
        return RequestTimer(self, prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's arrival, first token and token times; `finish` observes them once."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int):
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrival = self.last = time.perf_counter()
        self.tokens = 0
        self.ended = False

    def tokens_arrived(self, n: int) -> None:
        """``n`` output tokens arrived now (one engine step's)."""
        if n <= 0:
            return
        now = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        if self.tokens == 0:
            m.ttft.labels(name).observe(now - self.arrival)
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self.last) / n
        for _ in range(n_gaps):
            m.itl.labels(name).observe(gap)
        self.tokens += n
        self.last = now

    def finish(self, reason: str) -> None:
        """The request ended (``reason``: stop | length | abort); idempotent."""
        if self.ended:
            return
        self.ended = True
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(time.perf_counter() - self.arrival)
        m.success.labels(name, reason).inc()
        m.prompt_tokens.labels(name).inc(self.prompt_tokens)
        m.generation_tokens.labels(name).inc(self.tokens)
