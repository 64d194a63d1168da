"""The server's Prometheus metrics (`/metrics`), named as vLLM names its own where there is one, so
dashboards built for it read these."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=self.registry)

        self.requests = counter("ladder_request_success_total", "Finished requests, by finish reason",
                                ("finished_reason",))
        self.prompt_tokens = counter("ladder_prompt_tokens_total", "Prompt tokens of finished requests").labels(**labels)
        self.generation_tokens = counter("ladder_generation_tokens_total", "Generated tokens").labels(**labels)
        self.running = Gauge("ladder_num_requests_running", "Requests in the running batch (prefilling included)",
                             ["model_name"], registry=self.registry).labels(**labels)
        self.waiting = Gauge("ladder_num_requests_waiting", "Requests waiting for a KV-cache row",
                             ["model_name"], registry=self.registry).labels(**labels)
        self.kv_cache_usage = Gauge("ladder_kv_cache_usage_perc", "Positions the requests hold in the KV cache, "
                                    "of all its positions (0 to 1)", ["model_name"], registry=self.registry).labels(**labels)
        self.kv_cache_bytes = Gauge("ladder_kv_cache_bytes", "The KV cache's size on rank 0", ["model_name"],
                                    registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS_S, registry=self.registry).labels(**labels)

        self.time_to_first_token = histogram("ladder_time_to_first_token_seconds", "Arrival to first token")
        self.inter_token_latency = histogram("ladder_inter_token_latency_seconds", "Between two tokens of a request")
        self.e2e_latency = histogram("ladder_e2e_request_latency_seconds", "Arrival to the last token")
        self._labels = labels

    def finished(self, reason: str, prompt_tokens: int, e2e_s: float) -> None:
        self.requests.labels(finished_reason=reason, **self._labels).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e_latency.observe(e2e_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
