"""Prometheus metrics of a server, named like vLLM's under a ``nanoserve:`` prefix: engine
state read from the latest EngineStats at scrape time, latencies from every RequestOutput."""
from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.outputs import RequestOutput

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import EngineStats

PREFIX = "nanoserve:"

# Latencies on a CPU test box and on a busy GPU differ by orders of magnitude: wide buckets.
_FAST_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0,
                 30.0, 60.0, 300.0)
_SLOW_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
                 600.0, 1800.0, 3600.0)


class _EngineStatsCollector(Collector):
    """Gauges and counters computed from the engine's latest stats at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self._model_name = model_name
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # names are only known from collect(); nothing else registers them

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        gauges = (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
             stats.kv_cache_usage),
        )
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV cache.", stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.generation_tokens),
        )
        spec = stats.spec
        if spec is not None:  # vLLM's spec-decode counters
            counters += (
                ("spec_decode_num_drafts", "Verify steps of a sequence with proposals.",
                 spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Tokens proposed.", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                 spec.num_accepted_tokens),
            )
        for kind, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in metrics:
                family = kind(PREFIX + name, doc, labels=["model_name"])
                family.add_metric([self._model_name], value)
                yield family
        if spec is not None:
            family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Proposals accepted, by position in the draft.",
                                         labels=["model_name", "position"])
            for position, value in enumerate(spec.accepted_per_pos):
                family.add_metric([self._model_name, str(position)], value)
            yield family


class ServerMetrics:
    """The metrics of one server, in a private registry so several apps can coexist."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry)

        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._ttft = histogram("time_to_first_token_seconds",
                               "Arrival to first generated token.", _FAST_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds",
                              "Time between successive generated tokens.", _FAST_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds",
                              "Arrival to the end of the request.", _SLOW_BUCKETS)
        self._queue = histogram("request_queue_time_seconds",
                                "Arrival to first being scheduled.", _SLOW_BUCKETS)
        self._last_token_time: dict[str, float] = {}  # request id -> its previous token time

    def observe(self, out: RequestOutput) -> None:
        """Record one engine output; called for every output of every request, in order."""
        times, rid, label = out.metrics, out.request_id, self.model_name
        last = times.get("last_token_time")
        prev = self._last_token_time.get(rid)
        if last is not None:
            if prev is None and "arrival_time" in times:
                self._ttft.labels(label).observe(times["first_token_time"] - times["arrival_time"])
            elif prev is not None and last > prev:
                self._itl.labels(label).observe(last - prev)
            self._last_token_time[rid] = last
        if not out.finished:
            return
        self._last_token_time.pop(rid, None)
        self._success.labels(label, out.outputs[0].finish_reason or "abort").inc()
        arrival = times.get("arrival_time")
        if arrival is not None and "finished_time" in times:
            self._e2e.labels(label).observe(times["finished_time"] - arrival)
        if arrival is not None and "first_scheduled_time" in times:
            self._queue.labels(label).observe(times["first_scheduled_time"] - arrival)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
