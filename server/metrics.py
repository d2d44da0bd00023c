"""Prometheus metrics: vLLM's serving metric set under our own prefix (``deep_ep_npu:``), label ``model_name``.

One :class:`Metrics` per app, each with its own ``CollectorRegistry`` (no process-global state). All intervals use
``time.monotonic()`` of the API server process, and TTFT counts from the request's arrival at the HTTP layer.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from server.engine_api import KVTransferStat

PREFIX = "deep_ep_npu:"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
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
)
_COMM_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

FINISH_REASONS = ("stop", "length", "abort", "error")
LOAD_WINDOW = 100  # engine steps the expert-load balancedness is measured over


class Metrics:
    """The server's metrics. Call the ``on_*`` hooks from the asyncio thread; ``render()`` gives the text format."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests that have produced a token.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests accepted but without a token yet.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's token deliveries, per token.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival until the engine step that prefilled it began.", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens one engine step processed (prefill chunks and decodes, all workers).",
            _TOKEN_BUCKETS,
        )
        self.engine_step_time = histogram("engine_step_seconds", "Wall time of one engine step.", _LATENCY_BUCKETS)
        self.token_step_time = histogram(
            "token_step_seconds",
            "Wall time of the engine step that produced each token (token-weighted).",
            _LATENCY_BUCKETS,
        )
        self.dispatch_latency = histogram(
            "moe_dispatch_latency_seconds",
            "MoE dispatch time of one worker in one step (all MoE layers).",
            _COMM_BUCKETS,
        )
        self.combine_latency = histogram(
            "moe_combine_latency_seconds", "MoE combine time of one worker in one step (all MoE layers).", _COMM_BUCKETS
        )
        self.ep_ranks_lost = gauge("ep_ranks_lost", "EP workers lost in elastic mode (their experts are dropped).")
        self.experts_lost = gauge(
            "experts_lost",
            "(MoE layer, expert) pairs with no replica left on the surviving "
            "workers (elastic mode): their tokens skip them.",
        )
        self._balancedness = Gauge(
            PREFIX + "expert_load_balancedness",
            f"Per MoE layer: mean / max over EP workers of the rows their "
            f"experts received in the last {LOAD_WINDOW} steps (1 = even).",
            ["model_name", "layer"],
            registry=r,
        )
        self._rank_load = Counter(
            PREFIX + "expert_load",
            "Rows (token, expert pairs) an EP worker's experts received, all MoE layers.",
            ["model_name", "rank"],
            registry=r,
        )
        self._load_window: collections.deque[Mapping[int, Sequence[int]]] = collections.deque(maxlen=LOAD_WINDOW)
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "KV-cache blocks held by requests (1 = full), averaged over the workers."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted (blocks released, recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        directed = ["model_name", "direction"]
        self._kv_transfer_tokens = Counter(
            PREFIX + "kv_transfer_tokens",
            "Prompt tokens whose KV cache was moved between instances (disaggregation), by direction (send / recv).",
            directed,
            registry=r,
        )
        self._kv_transfer_bytes = Counter(
            PREFIX + "kv_transfer_bytes",
            "KV-cache bytes moved between instances, by direction (send / recv).",
            directed,
            registry=r,
        )
        self._kv_transfer_time = Histogram(
            PREFIX + "kv_transfer_seconds",
            "Time of one request's KV transfer (recv: "
            "the decode worker's read; send: the prefill side's answer to the "
            "decode side's done).",
            directed,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for direction in ("send", "recv"):
            self._kv_transfer_tokens.labels(model_name, direction)
            self._kv_transfer_bytes.labels(model_name, direction)
        self.nonfinite_logits = counter("nonfinite_logits", "Requests ended with an error: NaN or Inf logits.")
        self._structured = Counter(
            PREFIX + "structured_output_requests",
            "Requests whose output a grammar constrains, by kind (json, "
            "json_object, regex, choice, grammar; tool calls count as json).",
            ["model_name", "kind"],
            registry=r,
        )
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds", "Compiling a grammar (cache misses only; off the engine loop).", _LATENCY_BUCKETS
        )
        for reason in FINISH_REASONS:  # export every label value from the start, at 0
            self._success.labels(model_name, reason)

    def on_grammar(self, kind: str, compile_seconds: float) -> None:
        """A request constrained by a ``kind`` grammar, compiled in ``compile_seconds`` (0: from the cache)."""
        self._structured.labels(self.model_name, kind).inc()
        if compile_seconds > 0:
            self.grammar_compile_time.observe(compile_seconds)

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)

    def on_finished(self, finish_reason: str, num_output_tokens: int, e2e_latency: float) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.request_generation_tokens.observe(num_output_tokens)
        self.e2e_request_latency.observe(e2e_latency)

    def on_step(
        self,
        step_time: float,
        num_tokens: int,
        num_batched_tokens: int,
        dispatch_times: Sequence[float],
        combine_times: Sequence[float],
    ) -> None:
        """An engine step that produced ``num_tokens`` tokens and processed ``num_batched_tokens``."""
        self.engine_step_time.observe(step_time)
        for _ in range(num_tokens):
            self.token_step_time.observe(step_time)
        if num_batched_tokens:
            self.iteration_tokens.observe(num_batched_tokens)
        self.generation_tokens.inc(num_tokens)
        for t in dispatch_times:
            self.dispatch_latency.observe(t)
        for t in combine_times:
            self.combine_latency.observe(t)

    def on_kv_transfers(self, transfers: Sequence[KVTransferStat]) -> None:
        for t in transfers:
            self._kv_transfer_tokens.labels(self.model_name, t.direction).inc(t.tokens)
            self._kv_transfer_bytes.labels(self.model_name, t.direction).inc(t.num_bytes)
            self._kv_transfer_time.labels(self.model_name, t.direction).observe(t.seconds)

    def on_cache_stats(
        self, kv_cache_usage: float, num_preemptions: int, prefix_cache_queries: int, prefix_cache_hits: int
    ) -> None:
        """The KV cache after an engine step, and its preemptions and prefix-cache lookups during it."""
        self.kv_cache_usage.set(kv_cache_usage)
        self.num_preemptions.inc(num_preemptions)
        self.prefix_cache_queries.inc(prefix_cache_queries)
        self.prefix_cache_hits.inc(prefix_cache_hits)

    def on_expert_load(self, loads: Mapping[int, Sequence[int]], num_lost_experts: int) -> None:
        """One step's rows received per live worker (``loads``: rank -> per MoE layer) and the experts lost."""
        self.experts_lost.set(num_lost_experts)
        if not loads:
            return
        self._load_window.append(loads)
        for rank, per_layer in loads.items():
            self._rank_load.labels(self.model_name, str(rank)).inc(sum(per_layer))
        ranks = sorted({rank for step in self._load_window for rank in step})
        totals = [[0] * len(per_layer) for _ in ranks]
        for step in self._load_window:
            for i, rank in enumerate(ranks):
                for layer, n in enumerate(step.get(rank, ())):
                    totals[i][layer] += n
        for layer in range(len(per_layer)):
            column = [t[layer] for t in totals]
            peak = max(column)
            value = sum(column) / len(column) / peak if peak else 1.0
            self._balancedness.labels(self.model_name, str(layer)).set(value)

    def set_queue_sizes(self, num_running: int, num_waiting: int) -> None:
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
