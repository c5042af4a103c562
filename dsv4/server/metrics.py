"""Prometheus metrics with vLLM's names (spec §1.4), labelled ``model_name``.

Each server gets its own ``CollectorRegistry`` (several apps can live in one process, e.g. tests).
Histograms and counters are fed from the engine thread (prometheus-client is thread-safe); the
gauges are set from the engine thread's latest snapshot when ``/metrics`` is scraped.

=================================================  =========  ======================================
name                                               kind       meaning
=================================================  =========  ======================================
``vllm:num_requests_running``                      gauge      requests with a sequence running
``vllm:num_requests_waiting``                      gauge      requests waiting to be scheduled
``vllm:kv_cache_usage_perc``                       gauge      fraction of KV blocks in use (0..1)
``vllm:prompt_tokens_total``                       counter    prefill tokens computed
``vllm:generation_tokens_total``                   counter    tokens generated
``vllm:num_preemptions_total``                     counter    sequences preempted (recompute)
``vllm:prefix_cache_queries_total``                counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``                   counter    of those, tokens found cached
``dsv4:kv_cache_blocks{state}``                    gauge      KV blocks ``used`` by sequences, ``cached``
                                                              (idle, holding a reusable prefix), ``free``
``vllm:request_success_total{finished_reason}``    counter    finished requests (stop/length/abort)
``vllm:request_failure_total``                     counter    requests failed in the engine
``vllm:time_to_first_token_seconds``               histogram  arrival -> first token
``vllm:inter_token_latency_seconds``               histogram  gap between a request's token steps
``vllm:time_per_output_token_seconds``             histogram  (deprecated vLLM alias of the above)
``vllm:request_time_per_output_token_seconds``     histogram  per request (e2e - ttft) / (gen - 1)
``vllm:e2e_request_latency_seconds``               histogram  arrival -> finish
``vllm:request_prompt_tokens``                     histogram  prompt length per request
``vllm:request_generation_tokens``                 histogram  generated tokens per request
``vllm:request_queue_time_seconds``                histogram  arrival -> first scheduled
``vllm:request_prefill_time_seconds``              histogram  first scheduled -> first token
``vllm:request_decode_time_seconds``               histogram  first token -> last token
``vllm:request_inference_time_seconds``            histogram  first scheduled -> last token
``vllm:request_params_n``                          histogram  ``n`` per request
``vllm:request_params_max_tokens``                 histogram  max_tokens in force per request
``vllm:iteration_tokens_total``                    histogram  tokens (prefill + decode) per step
``vllm:cache_config_info``                         gauge      1, the KV cache's configuration as labels
``vllm:spec_decode_num_drafts``                    counter    verify steps that carried drafts
``vllm:spec_decode_num_draft_tokens``              counter    draft tokens proposed
``vllm:spec_decode_num_accepted_tokens``           counter    draft tokens accepted
``vllm:spec_decode_num_accepted_tokens_per_pos``   counter    accepted, by draft position (``position``)
=================================================  =========  ======================================

The mean acceptance length (tokens emitted per verify step) is
``1 + num_accepted_tokens / num_drafts``, as vLLM's ``bench serve`` computes it.

Times are ``time.monotonic()`` differences taken in this process; TTFT counts from the HTTP
handler's arrival stamp, so it includes tokenization and queueing (as vLLM's does).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
                  200000, 500000, 1000000)

_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.model_name = model_name
        L = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "Requests running on the engine", L,
                             registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", L,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (fraction of blocks in use, 0..1)",
                              L, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", L,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", L,
                                         registry=r).labels(model_name)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted", L,
                                   registry=r).labels(model_name)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", L,
                                      registry=r).labels(model_name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens", L,
                                   registry=r).labels(model_name)
        self._blocks = Gauge("dsv4:kv_cache_blocks", "KV blocks: used by sequences, cached (idle, reusable "
                             "prefixes, evicted least recently used first) or free", L + ["state"], registry=r)
        self._success = Counter("vllm:request_success", "Finished requests", L + ["finished_reason"],
                                registry=r)
        self.failures = Counter("vllm:request_failure", "Requests failed in the engine", L,
                                registry=r).labels(model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s)", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency (s)", _ITL_BUCKETS)
        self.tpot_alias = hist("vllm:time_per_output_token_seconds",
                               "Inter-token latency (s) (deprecated name)", _ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Per-request time per output token (s)",
                         _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (s)", _E2E_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verify steps with drafts", L,
                                   registry=r).labels(model_name)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", L,
                                         registry=r).labels(model_name)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", L,
                                     registry=r).labels(model_name)
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position", L + ["position"], registry=r)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time waiting before the first step (s)",
                               _E2E_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "First step to first token (s)", _E2E_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to last token (s)", _E2E_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds", "First step to last token (s)",
                                   _E2E_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "n of each request", (1, 2, 5, 10, 20, 50, 100, 128))
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "max_tokens in force per request",
                                      _TOKEN_BUCKETS)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step", _STEP_BUCKETS)

    def cache_config(self, **info) -> None:
        """``vllm:cache_config_info``: 1, labelled with the cache's configuration (set once)."""
        Gauge("vllm:cache_config_info", "Information of the KV cache configuration", ["model_name", *info],
              registry=self.registry).labels(self.model_name, *(str(v) for v in info.values())).set(1)

    # -- fed from the engine thread
    def first_token(self, ttft: float) -> None:
        self.ttft.observe(max(ttft, 0.0))

    def inter_token(self, dt: float) -> None:
        self.itl.observe(max(dt, 0.0))
        self.tpot_alias.observe(max(dt, 0.0))

    def finished(self, reason: str | None, e2e: float, prompt_tokens: int, gen_tokens: int,
                 ttft: float | None, phases: dict | None = None, n: int | None = None,
                 max_tokens: int | None = None) -> None:
        """``phases``: the request's queue / prefill / decode / inference times (s) that it has."""
        if reason == "error":
            self.failures.inc()
            return
        self._success.labels(self.model_name, reason or "abort").inc()
        self.e2e.observe(max(e2e, 0.0))
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(gen_tokens)
        if ttft is not None and gen_tokens > 1:
            self.tpot.observe(max(e2e - ttft, 0.0) / (gen_tokens - 1))
        hists = {"queue": self.queue_time, "prefill": self.prefill_time, "decode": self.decode_time,
                 "inference": self.inference_time}
        for k, v in (phases or {}).items():
            hists[k].observe(max(v, 0.0))
        if n is not None:
            self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def iteration(self, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)

    def tokens(self, prompt: int, generation: int, preemptions: int = 0) -> None:
        if prompt > 0:
            self.prompt_tokens.inc(prompt)
        if generation > 0:
            self.generation_tokens.inc(generation)
        if preemptions > 0:
            self.preemptions.inc(preemptions)

    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        if drafts > 0:
            self.spec_drafts.inc(drafts)
        if draft_tokens > 0:
            self.spec_draft_tokens.inc(draft_tokens)
        if accepted > 0:
            self.spec_accepted.inc(accepted)
        for pos, n in enumerate(per_pos):
            if n > 0:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(n)

    def prefix_cache(self, queries: int, hits: int) -> None:
        if queries > 0:
            self.prefix_queries.inc(queries)
        if hits > 0:
            self.prefix_hits.inc(hits)

    # -- at scrape time
    def set_state(self, running: int, waiting: int, kv_usage: float, blocks: dict | None = None) -> None:
        """``blocks``: {"used" | "cached" | "free": count}."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        for state, n in (blocks or {}).items():
            self._blocks.labels(self.model_name, state).set(n)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
