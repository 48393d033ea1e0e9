"""Prometheus metrics (``specdec_*``), served on ``/metrics`` of each service's ``--metrics-port``.

Coordinator (recorded by the public front from what it streams, so the counters equal the stats
in the responses exactly):
  specdec_requests_total{finish_reason}            finished requests
  specdec_request_errors_total{code}               failed requests by gRPC status
  specdec_drafts_total                             target passes that verified a non-empty block
  specdec_draft_tokens_total                       proposed tokens
  specdec_accepted_tokens_total                    accepted proposals
  specdec_accepted_tokens_by_position_total{position}
  specdec_target_passes_total                      target passes (verify calls)
  specdec_forced_tokens_total                      tokens a structured-output constraint forced,
                                                   proposed by the coordinator (no draft call)
  specdec_emitted_tokens_total                     tokens sent to clients
  specdec_predrafts_total                          blocks drafted while the previous one was
                                                   verified (pipelined drafting, docs/pipelining.md)
  specdec_predraft_hits_total{branch=accepted|rejection}
                                                   of those, the blocks a step used, by the branch
                                                   of the verdict they were drafted for
  specdec_step_seconds_total{part=predraft}        their seconds, beside the draft's on the path
  specdec_time_to_first_token_seconds              histogram
  specdec_inter_token_latency_seconds              histogram (per token, between chunks)
  specdec_request_latency_seconds                  histogram (end to end)
  specdec_step_seconds_total{part=draft|verify}    time split
  specdec_registry_records_ignored_total{reason}   registry records passed over when listing
                                                   replicas (each listing counts): invalid,
                                                   unsigned, forged or stale (runtime.registry)

Draft and target:
  specdec_live_sessions, specdec_kv_cache_bytes    gauges
  specdec_rpc_seconds{method}                      histogram
  specdec_running_works                            gauge: engine calls in the batch
  specdec_waiting_works                            gauge: session starts waiting for KV room
  specdec_batch_rows, specdec_batch_sessions       histograms: rows and sessions per iteration's pass
  specdec_batch_prefill_rows_total                 prefill rows fed (chunked prefill)
  specdec_iterations_total                         batched passes run
  specdec_queue_wait_seconds                       histogram: submission to first pass of a work
  specdec_grammar_compiles, specdec_grammar_cache_hits, specdec_grammar_compile_seconds,
  specdec_grammar_cache_bytes, specdec_grammar_refusals
                                                   structured-output constraints compiled, served
                                                   from the compile cache, and the seconds spent
                                                   compiling, since start (only grow)

vLLM's names for the same (model_name and engine labels): vllm:spec_decode_num_drafts_total,
vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
vllm:spec_decode_num_accepted_tokens_per_pos_total{position}, vllm:request_success_total
{finished_reason: stop, length, abort}, vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, vllm:num_requests_running (a token sent) and
vllm:num_requests_waiting (not yet).

PromQL: acceptance rate = rate(specdec_accepted_tokens_total[5m]) / rate(specdec_draft_tokens_total[5m]);
mean accepted length per draft block (vLLM's count, including the recovered/bonus token) =
(rate(specdec_accepted_tokens_total[5m]) + rate(specdec_drafts_total[5m])) / rate(specdec_drafts_total[5m]);
share of passes without a draft block (the adaptive policy pausing, k = 0, empty n-gram lookups) =
1 - rate(specdec_drafts_total[5m]) / rate(specdec_target_passes_total[5m]).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("specdec_requests", "Finished requests", ["finish_reason"], registry=REGISTRY)
REQUEST_ERRORS = Counter("specdec_request_errors", "Failed requests by gRPC status", ["code"], registry=REGISTRY)
DRAFTS = Counter("specdec_drafts", "Target passes that verified a non-empty draft block", registry=REGISTRY)
DRAFT_TOKENS = Counter("specdec_draft_tokens", "Proposed draft tokens", registry=REGISTRY)
ACCEPTED_TOKENS = Counter("specdec_accepted_tokens", "Accepted draft tokens", registry=REGISTRY)
FORCED_TOKENS = Counter(
    "specdec_forced_tokens", "Tokens a constraint forced, proposed by the coordinator itself", registry=REGISTRY
)
ACCEPTED_BY_POSITION = Counter(
    "specdec_accepted_tokens_by_position", "Accepted draft tokens by block position", ["position"], registry=REGISTRY
)
TARGET_PASSES = Counter("specdec_target_passes", "Target verification passes", registry=REGISTRY)
PREDRAFTS = Counter("specdec_predrafts", "Blocks drafted while the previous block was verified", registry=REGISTRY)
PREDRAFT_HITS = Counter(
    "specdec_predraft_hits", "Blocks drafted ahead that a step used, by branch", ["branch"], registry=REGISTRY
)
EMITTED_TOKENS = Counter("specdec_emitted_tokens", "Tokens streamed to clients", registry=REGISTRY)
REGISTRY_RECORDS_IGNORED = Counter(
    "specdec_registry_records_ignored",
    "Registry records passed over when listing replicas, by why: invalid, unsigned, forged, stale",
    ["reason"],
    registry=REGISTRY,
)
TTFT = Histogram(
    "specdec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
ITL = Histogram(
    "specdec_inter_token_latency_seconds",
    "Latency per token between streamed chunks",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram(
    "specdec_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
STEP_SECONDS = Counter("specdec_step_seconds", "Time spent per step part", ["part"], registry=REGISTRY)

# The same requests under vLLM's names and labels (checked against vLLM's v1 metrics), so that
# dashboards and alerts written for vLLM work unchanged: `model_name` (the served model) and
# `engine` ("0": one request path per coordinator process) on every family.
VLLM_LABELS = ["model_name", "engine"]
VLLM_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", VLLM_LABELS, registry=REGISTRY)
VLLM_DRAFT_TOKENS = Counter(
    "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", VLLM_LABELS, registry=REGISTRY
)
VLLM_ACCEPTED_TOKENS = Counter(
    "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", VLLM_LABELS, registry=REGISTRY
)
VLLM_ACCEPTED_BY_POSITION = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Accepted tokens per draft position.",
    [*VLLM_LABELS, "position"],
    registry=REGISTRY,
)
VLLM_SUCCESS = Counter(
    "vllm:request_success", "Count of finished requests.", [*VLLM_LABELS, "finished_reason"], registry=REGISTRY
)
VLLM_PROMPT_TOKENS = Counter(
    "vllm:prompt_tokens", "Number of prefill tokens processed.", VLLM_LABELS, registry=REGISTRY
)
VLLM_GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Number of generation tokens processed.", VLLM_LABELS, registry=REGISTRY
)
VLLM_TTFT = Histogram(
    "vllm:time_to_first_token_seconds", "Time to first token.", VLLM_LABELS, buckets=LATENCY_BUCKETS, registry=REGISTRY
)
VLLM_ITL = Histogram(
    "vllm:inter_token_latency_seconds", "Inter-token latency.", VLLM_LABELS, buckets=LATENCY_BUCKETS, registry=REGISTRY
)
VLLM_E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "End to end request latency.",
    VLLM_LABELS,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests generating (a token sent).", VLLM_LABELS, registry=REGISTRY)
VLLM_WAITING = Gauge(
    "vllm:num_requests_waiting", "Requests not yet at their first token.", VLLM_LABELS, registry=REGISTRY
)
VLLM_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> vLLM's

LIVE_SESSIONS = Gauge("specdec_live_sessions", "Live sessions on this replica", registry=REGISTRY)
PASS_BACKEND = Gauge(
    "specdec_pass_backend_info",
    "1 for the backend of this replica's batched pass (docs/batching.md, 'Backends')",
    ["backend", "batch_invariant"],
    registry=REGISTRY,
)
KV_BYTES = Gauge("specdec_kv_cache_bytes", "KV-cache bytes held by this replica", registry=REGISTRY)
PREFIX_CACHE_BYTES = Gauge(
    "specdec_prefix_cache_bytes", "Bytes of KV the prefix cache holds (outside the KV pool)", registry=REGISTRY
)
GRAMMAR_COMPILES = Gauge(
    "specdec_grammar_compiles", "Structured-output constraints compiled since start (only grows)", registry=REGISTRY
)
GRAMMAR_CACHE_HITS = Gauge(
    "specdec_grammar_cache_hits",
    "Structured-output constraints served from the compile cache since start (only grows)",
    registry=REGISTRY,
)
GRAMMAR_COMPILE_SECONDS = Gauge(
    "specdec_grammar_compile_seconds", "Seconds spent compiling constraints since start (only grows)", registry=REGISTRY
)
GRAMMAR_CACHE_BYTES = Gauge(
    "specdec_grammar_cache_bytes", "Estimated bytes of the compiled constraints cached", registry=REGISTRY
)
GRAMMAR_REFUSALS = Gauge(
    "specdec_grammar_refusals",
    "Constraints refused again from memory, without a compile, since start (only grows)",
    registry=REGISTRY,
)
PREFIX_CACHE_HIT_TOKENS = Gauge(
    "specdec_prefix_cache_hit_tokens",
    "Prompt positions copied from the prefix cache instead of computed, since start (only grows)",
    registry=REGISTRY,
)
PREFIX_CACHE_QUERIED_TOKENS = Gauge(
    "specdec_prefix_cache_queried_tokens",
    "Prompt positions (whole blocks) looked up in the prefix cache, since start: hit / queried is its hit rate",
    registry=REGISTRY,
)
# Seconds the replica's one model thread spent running engine calls: its rate is the busy
# fraction in [0, 1], what deploy/ scales the draft pool on (docs/autoscaling.md).
MODEL_BUSY = Counter("specdec_model_busy_seconds", "Seconds the model thread spent in engine calls", registry=REGISTRY)
RPC_SECONDS = Histogram(
    "specdec_rpc_seconds", "Server-side RPC latency", ["method"], buckets=LATENCY_BUCKETS, registry=REGISTRY
)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RUNNING_WORKS = Gauge("specdec_running_works", "Engine calls in the running batch", registry=REGISTRY)
WAITING_WORKS = Gauge("specdec_waiting_works", "Session starts waiting for KV room", registry=REGISTRY)
BATCH_ROWS = Histogram("specdec_batch_rows", "Rows per batched pass", buckets=ROW_BUCKETS, registry=REGISTRY)
BATCH_SESSIONS = Histogram(
    "specdec_batch_sessions", "Sessions per batched pass", buckets=ROW_BUCKETS, registry=REGISTRY
)
PREFILL_ROWS = Counter("specdec_batch_prefill_rows", "Prefill rows fed by batched passes", registry=REGISTRY)
ITERATIONS = Counter("specdec_iterations", "Batched passes run", registry=REGISTRY)
QUEUE_WAIT = Histogram(
    "specdec_queue_wait_seconds",
    "From submission to an engine call's start",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)


# The coordinator's speculation policy (docs/goodput.md)
K_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
CHOSEN_K = Histogram("specdec_chosen_k", "k chosen per step", ["policy"], buckets=K_BUCKETS, registry=REGISTRY)
POLICY_STEPS = Counter(
    "specdec_policy_steps",
    "Steps of adaptive requests, speculating or not",
    ["policy", "speculating"],
    registry=REGISTRY,
)
COST_MODEL = Gauge(
    "specdec_cost_model_seconds",
    "The load-aware policy's current estimate of one pass's seconds, per replica and pass size",
    ["kind", "replica", "size"],
    registry=REGISTRY,
)


def record_choices(policy: str, steps_by_k) -> None:
    """A finished request's steps by the k its policy chose."""
    for k, steps in enumerate(steps_by_k):
        for _ in range(steps):
            CHOSEN_K.labels(policy).observe(k)
        if steps:
            POLICY_STEPS.labels(policy, "true" if k else "false").inc(steps)


def record_cost_curve(kind: str, replica: str, points) -> None:
    for size, seconds in points:
        COST_MODEL.labels(kind, replica, str(size)).set(seconds)


def record_iteration(sessions: int, rows: int, prefill_rows: int) -> None:
    if sessions:
        ITERATIONS.inc()
        BATCH_ROWS.observe(rows)
        BATCH_SESSIONS.observe(sessions)
        PREFILL_ROWS.inc(prefill_rows)


def serve_metrics(port: int, host: str) -> None:
    """Expose /metrics on ``host``:``port`` (0 = off): the process's own interface, so a service
    told to listen on loopback does not publish its metrics on every interface."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)


def watch_engine(engine) -> None:
    """Live sessions and KV bytes, read from the engine at scrape time; the pass backend, once."""
    stats = engine.stats()
    if stats.get("pass_backend"):
        PASS_BACKEND.labels(stats["pass_backend"], str(bool(stats.get("batch_invariant"))).lower()).set(1)
    LIVE_SESSIONS.set_function(lambda: engine.stats()["live_sessions"])
    KV_BYTES.set_function(lambda: engine.stats()["kv_bytes"])
    PREFIX_CACHE_BYTES.set_function(lambda: engine.stats().get("prefix_cache_bytes", 0))
    PREFIX_CACHE_HIT_TOKENS.set_function(lambda: engine.stats().get("prefix_cache_hit_tokens", 0))
    PREFIX_CACHE_QUERIED_TOKENS.set_function(lambda: engine.stats().get("prefix_cache_queried_tokens", 0))
    GRAMMAR_COMPILES.set_function(lambda: engine.stats().get("grammar_compiles", 0))
    GRAMMAR_CACHE_HITS.set_function(lambda: engine.stats().get("grammar_cache_hits", 0))
    GRAMMAR_COMPILE_SECONDS.set_function(lambda: engine.stats().get("grammar_compile_seconds", 0.0))
    GRAMMAR_CACHE_BYTES.set_function(lambda: engine.stats().get("grammar_cache_bytes", 0))
    GRAMMAR_REFUSALS.set_function(lambda: engine.stats().get("grammar_refusals", 0))


@contextmanager
def rpc_timer(method: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        RPC_SECONDS.labels(method).observe(time.perf_counter() - started)


class RequestRecorder:
    """Records one request as the front streams it: latencies from arrival times, counters from
    the stats on the last chunk (so they equal what the client received)."""

    def __init__(self, model_name: str = "") -> None:
        self.started = time.perf_counter()
        self.last: float | None = None
        self.labels = (model_name, "0")
        self.finished = self.failed = False
        VLLM_WAITING.labels(*self.labels).inc()

    def chunk(self, chunk) -> None:
        now = time.perf_counter()
        n = len(chunk.token_ids)
        if n:
            if self.last is None:
                TTFT.observe(now - self.started)
                VLLM_TTFT.labels(*self.labels).observe(now - self.started)
                VLLM_WAITING.labels(*self.labels).dec()
                VLLM_RUNNING.labels(*self.labels).inc()
            else:
                for _ in range(n):
                    ITL.observe((now - self.last) / n)
                    VLLM_ITL.labels(*self.labels).observe((now - self.last) / n)
            self.last = now
            EMITTED_TOKENS.inc(n)
            VLLM_GENERATION_TOKENS.labels(*self.labels).inc(n)
        if chunk.finish_reason:
            s = chunk.stats
            REQUESTS.labels(chunk.finish_reason).inc()
            E2E.observe(now - self.started)
            self._vllm_finished(chunk, now)
            TARGET_PASSES.inc(s.target_passes)
            DRAFT_TOKENS.inc(s.proposed_tokens)
            ACCEPTED_TOKENS.inc(s.accepted_tokens)
            FORCED_TOKENS.inc(s.forced_tokens)
            DRAFTS.inc(s.drafts)
            for position, count in enumerate(s.accepted_per_position):
                ACCEPTED_BY_POSITION.labels(str(position)).inc(count)
            record_choices(s.policy or "fixed", s.steps_by_k)
            STEP_SECONDS.labels("draft").inc(s.draft_seconds)
            STEP_SECONDS.labels("verify").inc(s.verify_seconds)
            if s.predrafts:
                PREDRAFTS.inc(s.predrafts)
                PREDRAFT_HITS.labels("accepted").inc(s.predraft_hits - s.predraft_rejection_hits)
                PREDRAFT_HITS.labels("rejection").inc(s.predraft_rejection_hits)
                STEP_SECONDS.labels("predraft").inc(s.predraft_seconds)

    def _vllm_finished(self, chunk, now: float) -> None:
        s, labels = chunk.stats, self.labels
        self._leave()
        VLLM_SUCCESS.labels(*labels, VLLM_FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason)).inc()
        VLLM_E2E.labels(*labels).observe(now - self.started)
        VLLM_PROMPT_TOKENS.labels(*labels).inc(chunk.prompt_tokens)
        VLLM_DRAFTS.labels(*labels).inc(s.drafts)
        VLLM_DRAFT_TOKENS.labels(*labels).inc(s.proposed_tokens)
        VLLM_ACCEPTED_TOKENS.labels(*labels).inc(s.accepted_tokens)
        for position, count in enumerate(s.accepted_per_position):
            VLLM_ACCEPTED_BY_POSITION.labels(*labels, str(position)).inc(count)

    def _leave(self) -> None:
        """The request is no longer running or waiting (once)."""
        if self.finished:
            return
        self.finished = True
        (VLLM_WAITING if self.last is None else VLLM_RUNNING).labels(*self.labels).dec()

    def close(self) -> None:
        """The stream is over: a request that neither finished nor failed (its caller went
        away) is an abort in vLLM's terms; a refused or failed one is counted by its status."""
        if not self.finished:
            self._leave()
            if not self.failed:
                VLLM_SUCCESS.labels(*self.labels, "abort").inc()

    def error(self, code: str) -> None:
        self.failed = True
        REQUEST_ERRORS.labels(code).inc()
