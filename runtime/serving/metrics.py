"""What the engine measures, and its Prometheus text exposition (``GET /metrics``).

Written by hand (the format is a few lines of text) so the engine needs no client library: gauges
for the queue depth, running sequences and the preallocated memory, counters for tokens and
finished requests, histograms (cumulative buckets, sum, count) for the time to first token (from
submission, queueing included) and the inter-token latency (between a request's successive tokens).
"""

from __future__ import annotations

import collections
import threading

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1
                    break
            self.sum += value
            self.count += 1

    def lines(self, name: str) -> list[str]:
        with self._lock:
            out, running = [], 0
            for b, c in zip(self.buckets, self.counts):
                running += c
                out.append(f'{name}_bucket{{le="{b:g}"}} {running}')
            out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
            out.append(f"{name}_sum {self.sum:.6f}")
            out.append(f"{name}_count {self.count}")
            return out


class Metrics:
    """Updated by the engine's thread; read by the server."""

    def __init__(self):
        self.queue_depth = 0
        self.running = 0
        self.cache_bytes = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.rejected = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.sections: list = []  # callables giving more exposition lines (serving/speculation.py's counters)

    def render(self) -> str:
        """Prometheus text format, version 0.0.4."""
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        metric("tessera_queue_depth", "gauge", "Requests waiting for a slot.", [f"tessera_queue_depth {self.queue_depth}"])
        metric("tessera_running_sequences", "gauge", "Sequences in a slot (prefilling or decoding).",
               [f"tessera_running_sequences {self.running}"])
        metric("tessera_engine_memory_bytes", "gauge", "KV cache, step scratch and slot mask, allocated once at start.",
               [f"tessera_engine_memory_bytes {self.cache_bytes}"])
        metric("tessera_generated_tokens_total", "counter", "New tokens generated.",
               [f"tessera_generated_tokens_total {self.generated_tokens}"])
        metric("tessera_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
               [f"tessera_prompt_tokens_total {self.prompt_tokens}"])
        metric("tessera_rejected_requests_total", "counter", "Requests refused at the admission bounds.",
               [f"tessera_rejected_requests_total {self.rejected}"])
        metric("tessera_finished_requests_total", "counter", "Requests finished, by reason.",
               [f'tessera_finished_requests_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished.items())])
        metric("tessera_time_to_first_token_seconds", "histogram", "From submission to the first new token.",
               self.ttft.lines("tessera_time_to_first_token_seconds"))
        metric("tessera_inter_token_latency_seconds", "histogram", "Between a request's successive tokens.",
               self.itl.lines("tessera_inter_token_latency_seconds"))
        for section in self.sections:
            out.extend(section())
        return "\n".join(out) + "\n"
