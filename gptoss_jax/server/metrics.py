"""Prometheus metrics in the text exposition format (0.0.4), written by hand: no dependency.

Engine gauges and counters come from the engine thread's latest `stats()` snapshot; latency
histograms and request counters are recorded by the HTTP layer.
"""

from __future__ import annotations

import bisect
import threading

PREFIX = "gptoss"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{self.name}_bucket{{{labels},le="{b}"}} {cum}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        out.append(f"{self.name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.lock = threading.Lock()
        self.labels = f'model_name="{_escape(model_name)}"'
        p = PREFIX
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time to first generated token.", TTFT_BUCKETS)
        self.itl = Histogram(f"{p}:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        self.success: dict[str, int] = {}
        self.aborted = 0
        self.http_errors: dict[str, int] = {}
        self.in_flight = 0

    def request_finished(self, finish_reason: str) -> None:
        with self.lock:
            self.success[finish_reason] = self.success.get(finish_reason, 0) + 1

    def request_aborted(self) -> None:
        with self.lock:
            self.aborted += 1

    def http_error(self, status: int) -> None:
        with self.lock:
            self.http_errors[str(status)] = self.http_errors.get(str(status), 0) + 1

    def observe_tokens(self, first: bool, gap_s: float, n_new: int) -> None:
        """A step delivered `n_new` tokens `gap_s` after the previous delivery (or arrival)."""
        with self.lock:
            if first:
                self.ttft.observe(gap_s)
                n_new -= 1
            for _ in range(max(n_new, 0)):  # tokens that arrived together share the gap
                self.itl.observe(gap_s / max(n_new, 1))

    def render(self, stats: dict) -> str:
        p, L = PREFIX, self.labels
        lines: list[str] = []

        def metric(name, kind, doc, value, labels=L):
            lines.extend([f"# HELP {p}:{name} {doc}", f"# TYPE {p}:{name} {kind}", f"{p}:{name}{{{labels}}} {value}"])

        metric("num_requests_running", "gauge", "Requests in the running batch.", stats.get("num_running", 0))
        metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.get("num_waiting", 0))
        metric(
            "kv_cache_usage_perc",
            "gauge",
            "Fraction of KV-cache pages in use (1 = full).",
            float(stats.get("kv_cache_usage", 0.0)),
        )
        metric("num_preemptions_total", "counter", "Preempted requests.", stats.get("num_preemptions", 0))
        metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.", stats.get("prompt_tokens_total", 0))
        metric("generation_tokens_total", "counter", "Generated tokens.", stats.get("generation_tokens_total", 0))
        if stats.get("spec_decode_num_accepted_tokens_per_pos"):  # with speculative decoding (vLLM's names)
            for name, doc in (
                ("num_drafts", "Verify steps of drafting requests."),
                ("num_draft_tokens", "Draft tokens verified."),
                ("num_accepted_tokens", "Draft tokens accepted."),
            ):
                metric(f"spec_decode_{name}_total", "counter", doc, stats.get(f"spec_decode_{name}", 0))
            name = f"{p}:spec_decode_num_accepted_tokens_per_pos"
            lines += [f"# HELP {name}_total Accepted draft tokens by position.", f"# TYPE {name}_total counter"]
            for i, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
                lines.append(f'{name}_total{{{L},position="{i}"}} {n}')
        if "num_compiles" in stats:
            metric("num_compiles", "gauge", "XLA compilations of engine steps so far.", stats["num_compiles"])
        with self.lock:
            metric("http_requests_in_flight", "gauge", "HTTP generation requests being served.", self.in_flight)
            lines += [
                f"# HELP {p}:request_success_total Finished requests by finish reason.",
                f"# TYPE {p}:request_success_total counter",
            ]
            for reason in sorted(set(self.success) | {"stop", "length", "tool_calls"}):
                lines.append(
                    f'{p}:request_success_total{{{L},finished_reason="{reason}"}} {self.success.get(reason, 0)}'
                )
            metric(
                "num_aborted_requests_total",
                "counter",
                "Requests whose client left before the response was complete.",
                self.aborted,
            )
            lines += [
                f"# HELP {p}:http_request_errors_total Error responses by status.",
                f"# TYPE {p}:http_request_errors_total counter",
            ]
            for status, n in sorted(self.http_errors.items()):
                lines.append(f'{p}:http_request_errors_total{{{L},status="{status}"}} {n}')
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.render(L)
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
