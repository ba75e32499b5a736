"""Prometheus metrics for operators, at GET /metrics in the text exposition format (the `prometheus-client` package).

Names follow vLLM's (`vllm:num_requests_running` -> `blockdraft:num_requests_running`, ...), so that dashboards and
alerts written for vLLM or SGLang carry over with a prefix change:
  blockdraft:http_requests_total{endpoint, status}       every HTTP answer (unknown paths grouped as "other")
  blockdraft:request_success_total{finished_reason}      generations that ended: stop | length | cancelled | error
  blockdraft:prompt_tokens_total, :generation_tokens_total
  blockdraft:num_requests_running, :num_requests_waiting  rows decoding now, requests queued (read at scrape time)
  blockdraft:time_to_first_token_seconds                 arrival -> first text delta (queue and prefill included)
  blockdraft:time_per_output_token_seconds               per request: (last token - first token) / (tokens - 1)
  blockdraft:e2e_request_latency_seconds, :request_queue_time_seconds
  blockdraft:spec_decode_num_drafts_total                verify steps (one proposal each)
  blockdraft:spec_decode_num_draft_tokens_total          draft tokens verified
  blockdraft:spec_decode_num_accepted_tokens_total       draft tokens accepted
  blockdraft:spec_decode_num_accepted_tokens_per_pos_total{position}  accepted at draft position 0, 1, ...
  blockdraft:spec_decode_plain_steps_total               engine steps that verified without drafting because more
                                                         rows were active than --draft-max-batch
Acceptance rate = accepted / draft tokens; mean accepted length (tau) = 1 + accepted / drafts.

Generation figures are recorded once per request when it ends (from its DecodeStats, in the scheduler's thread), so
a cancelled request's work counts too and nothing is counted twice.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "blockdraft:"
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})

# vLLM's bucket edges, so that percentiles compare across servers
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ServerMetrics:
    """One registry per server (not prometheus_client's global one, so that tests can build several apps).
    `queue_state` returns (running, waiting) at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_state, plain_steps=None) -> None:
        """plain_steps: () -> the engine's count of steps that did not draft (read at scrape time)."""
        r = self.registry = CollectorRegistry()

        def name(s: str) -> str:
            return PREFIX + s

        self.http = Counter(name("http_requests"), "HTTP answers by endpoint and status code",
                            ["endpoint", "status"], registry=r)
        self.finished = Counter(name("request_success"), "Generations that ended, by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of generations that ended", registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Tokens generated", registry=r)
        Gauge(name("num_requests_running"), "Requests decoding now (engine rows)",
              registry=r).set_function(lambda: queue_state()[0])
        Gauge(name("num_requests_waiting"), "Requests queued for a free row",
              registry=r).set_function(lambda: queue_state()[1])
        if plain_steps is not None:
            Gauge(name("spec_decode_plain_steps_total"), "Engine steps that verified without drafting (batch over "
                  "--draft-max-batch)", registry=r).set_function(plain_steps)
        self.ttft = Histogram(name("time_to_first_token_seconds"), "Arrival to first text delta (queue included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(name("time_per_output_token_seconds"), "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(name("e2e_request_latency_seconds"), "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(name("request_queue_time_seconds"), "Arrival to admission into the batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter(name("spec_decode_num_drafts"), "Verify steps (one draft proposal each)", registry=r)
        self.draft_tokens = Counter(name("spec_decode_num_draft_tokens"), "Draft tokens verified", registry=r)
        self.accepted = Counter(name("spec_decode_num_accepted_tokens"), "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"),
                                        "Draft tokens accepted at each draft position (0 = first)", ["position"],
                                        registry=r)

    def count_response(self, path: str, status: int) -> None:
        self.http.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def request_finished(self, handle) -> None:
        """Record a request that ended (a RequestHandle with `result` or `error` set); called once per request."""
        result = handle.result
        if result is None:  # failed in the engine: no usable stats
            self.finished.labels("error").inc()
            return
        s = result.stats
        reason = result.finish_reason if result.finish_reason in ("stop", "length", "cancelled") else "stop"
        self.finished.labels(reason).inc()
        n = len(result.token_ids)
        self.prompt_tokens.inc(len(handle.prompt_ids))
        self.generation_tokens.inc(n)
        self.drafts.inc(len(s.accept_lengths))
        self.draft_tokens.inc(sum(s.position_trials))
        self.accepted.inc(sum(s.position_accepted))
        for pos, count in enumerate(s.position_accepted):
            self.accepted_per_pos.labels(str(pos)).inc(count)
        if handle.started_at is not None:
            self.queue_time.observe(handle.started_at - handle.submitted_at)
        if reason == "cancelled" or handle.first_token_at is None or handle.finished_at is None:
            return  # latency of a request nobody waited for would only blur the figures
        self.ttft.observe(handle.first_token_at - handle.submitted_at)
        self.e2e.observe(handle.finished_at - handle.submitted_at)
        if n > 1:
            self.tpot.observe((handle.finished_at - handle.first_token_at) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
