"""The engine: requests in, vLLM-shaped ``RequestOutput`` out, one ``step()`` at a time."""
from __future__ import annotations

import dataclasses
import gc
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

from ..formats.paging import BLOCK_TOKENS
from .kv_cache import CacheConfig, KVCache, bytes_per_slot, bytes_per_snapshot
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Logprob, RequestOutput, Sequence
from .spec_decode import accept_greedy_draft
from .structured import GrammarCompiler, first_line


class RequestRejected(ValueError):
    """A request the engine cannot serve (too long, cannot fit the cache, bad prompt)."""


def parse_bytes(v: str | int | float) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    if isinstance(v, (int, float)):
        return int(v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", v, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse a memory size from {v!r} (examples: 512MiB, 2GiB, 1000000)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    return int(num * base ** " KMGT".index(unit or " "))


@dataclass
class EngineConfig:
    model: str | None = None                 # checkpoint dir; None = the embedded default tiny model
    # None: the device's default (``device_defaults``)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # vLLM's flag: > 0 caps every prefill chunk of one sequence at this many tokens (engine.scheduler)
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None         # None: the config's max_position_embeddings, capped by the KV cache
    kv_cache_memory: str | int | None = None  # bytes for the KV caches (CPU default 256MiB)
    gpu_memory_utilization: float = 0.9      # on CUDA when kv_cache_memory is not given
    num_kv_blocks: int | None = None         # override: exact number of 256-token KV blocks
    cuda_graphs: bool = True                 # capture the decode step per batch-size bucket (CUDA); False = eager
    kernels: bool | None = None              # None: the op table's choice per device; False: torch twins;
                                             # op names: those ops' kernels only (tests, debugging)
    kernel_check: str = "fast"               # the start-up self-check of the ops (engine.build): fast | full | off
    device: str | None = None                # None: cuda if available else cpu
    log: bool = True
    # random weights at real shapes instead of a checkpoint (``dsv4 serve --synthetic flash``):
    # ``checkpoint.synthetic``'s generator writes them straight into the model on its device
    synthetic: str | None = None             # 'flash' | 'pro'
    synthetic_layers: int = 4
    synthetic_experts: int | None = None     # None: all of the preset's routed experts
    synthetic_seed: int = 0
    tensor_parallel_size: int = 1            # ranks, one process each (engine.tp_workers)
    # vLLM's speculative_config: {"method": "mtp", "num_speculative_tokens": K} (engine.spec_decode)
    speculative_config: dict | str | None = None
    seed: int | None = None                  # seeds torch's global RNG, which requests without a seed sample from
    revision: str | None = None              # of a Hugging Face Hub id given as ``model``
    generation_config: str = "auto"          # default sampling parameters: auto | vllm | DIR (models.generation_defaults)
    enable_prefix_caching: bool = True       # reuse cached prefixes (engine.prefix_cache), as vLLM's flag
    # prefix-cache snapshots of the window / compressor state at block boundaries; None: 4 per
    # sequence slot, at most a quarter of a memory budget after the slots (engine.prefix_cache)
    prefix_cache_snapshots: int | None = None
    # requests over the size buckets the scheduler can produce before serving, so that no kernel
    # compiles at request time (engine.warmup); None: on when the ops run compiled kernels (CUDA)
    warmup: bool | None = None


# Scheduler defaults per device. On a GPU the step budget is vLLM's `vllm serve` default on GPUs of
# >= 70 GiB (8192): a prefill chunk of 8192 rows runs the expert GEMMs at 32-192 rows per expert,
# 3.7x the tokens per second of 512-row chunks (BENCHMARKS.md, benchmarks/prefill.py, 2026-12-04);
# 128 sequences is the largest decode batch with a CUDA graph (``CudaGraphDecoder``'s buckets; vLLM
# defaults to 1024 there). On a CPU the tiny model's steps stay short.
GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS = 128, 8192
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 16, 512


def device_defaults(device) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) an engine on ``device`` takes when they are not given."""
    if torch.device(device).type == "cuda":
        return GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS
    return CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS


def engine_threads(device, world: int = 1) -> int:
    """torch intra-op threads of an engine process (every entry point: ``serve``, ``generate``,
    ``bench``, ``validate``, ``LLM()``, and each tensor-parallel rank; the server's engine thread
    sets it on itself). ``DSV4_NUM_THREADS`` if set; on a GPU 1 (the host only launches kernels and
    samples; vLLM's workers likewise); on a CPU the usable cores split over the ``world`` ranks of
    the machine, at least 1. Measured on the idle 2-core CI machine (tiny model, ``bench
    throughput`` 4 x 64 in / 16 out, 2026-12-02): 2 threads 4.3-4.7 output tok/s, 1 thread 3.7-3.9.
    With another process busy on the cores the order flips (2 threads 0.4-1.0, 1 thread 0.9):
    OpenMP workers spin on cores someone else needs; on a shared machine set DSV4_NUM_THREADS."""
    env = os.environ.get("DSV4_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"DSV4_NUM_THREADS must be a positive integer, got {env!r}")
        return n
    if torch.device(device).type == "cuda":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:            # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world))


class LLMEngine:
    """Serves ``model.deepseek_v4.DeepseekV4``: the checkpoint's native weights streamed onto the
    device, every op from the op table (kernels on a GPU, torch twins on a CPU)."""

    def __init__(self, cfg: EngineConfig | None = None, *, prebuilt=None, **kw):
        """``prebuilt``: a loaded ``DeepseekV4`` to serve as it is (``dsv4 validate`` passes the model
        it has just compared with the reference); otherwise the model comes from ``cfg.model`` (a
        checkpoint directory, streamed in) or ``cfg.synthetic``."""
        cfg = cfg or EngineConfig(**kw)
        from ..tokenizer import load_tokenizer

        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.num_threads = engine_threads(self.device)
        torch.set_num_threads(self.num_threads)
        seqs, budget = device_defaults(self.device)
        cfg = dataclasses.replace(cfg, max_num_seqs=seqs if cfg.max_num_seqs is None else cfg.max_num_seqs,
                                  max_num_batched_tokens=budget if cfg.max_num_batched_tokens is None
                                  else cfg.max_num_batched_tokens)
        self.cfg = cfg
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not isinstance(cfg.long_prefill_token_threshold, int) or cfg.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: off), "
                             f"got {cfg.long_prefill_token_threshold!r}")
        if cfg.max_model_len is not None and cfg.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {cfg.max_model_len}")
        if cfg.synthetic is not None and cfg.model is not None:
            raise ValueError("give either a checkpoint directory or --synthetic, not both")
        t0 = time.perf_counter()
        disk_bytes, source = None, None
        tp = cfg.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        from ..models import generation_defaults, resolve_model
        from .build import KERNEL_CHECKS, build_model
        from .spec_decode import SpeculativeConfigError, check_draft, parse_speculative_config, resolve
        if cfg.kernel_check not in KERNEL_CHECKS:
            raise ValueError(f"kernel_check must be one of {', '.join(KERNEL_CHECKS)}, got {cfg.kernel_check!r}")
        self.spec = parse_speculative_config(cfg.speculative_config)
        draft = None if self.spec is None else self.spec.method
        self.workers, group = None, None
        spec = dict(path=None if cfg.synthetic or prebuilt is not None else resolve_model(cfg.model, cfg.revision),
                    synthetic=cfg.synthetic, synthetic_layers=cfg.synthetic_layers,
                    synthetic_experts=cfg.synthetic_experts, synthetic_seed=cfg.synthetic_seed, kernels=cfg.kernels,
                    draft=draft, kernel_check=cfg.kernel_check, log=cfg.log)
        log = (lambda line: print(f"dsv4: {line}", file=sys.stderr, flush=True)) if cfg.log else None
        if tp > 1:
            if prebuilt is not None:
                raise ValueError("a prebuilt model cannot be split over tensor-parallel ranks")
            from .tp_workers import TPWorkers
            if self.device.type == "cuda":
                self.device = torch.device("cuda:0")
            self._check_split(spec, tp)
            self.workers = TPWorkers(tp, self.device.type, spec)
            group = self.workers.group
        draft_note = None
        if prebuilt is not None:
            if prebuilt.device != self.device:
                raise ValueError(f"the prebuilt model is on {prebuilt.device}, the engine on {self.device}")
            self.model, path, source = prebuilt, cfg.model, "a prebuilt model"
            if draft is not None and prebuilt.draft != draft:
                raise SpeculativeConfigError(f"speculative_config.method: {draft!r} needs the prebuilt model built "
                                             f"with that draft; it has draft={prebuilt.draft!r}")
        elif cfg.synthetic is not None:
            self.model = build_model(spec, self.device, group, log=log)
            mc, path = self.model.cfg, None
            source = (f"synthetic {cfg.synthetic} ({mc.num_hidden_layers} layers, {mc.n_routed_experts} experts, "
                      f"seed {cfg.synthetic_seed})")
        else:
            from ..checkpoint.loader import open_checkpoint
            path = spec["path"]
            reader = open_checkpoint(path)
            if self.spec is not None:
                check_draft(self.spec, reader.draft)
            self.model = build_model(dict(spec, progress=cfg.log), self.device, group, reader=reader, log=log)
            disk_bytes = reader.total_bytes
            source = f"{path} ({reader.layout}, {disk_bytes / 1e9:.2f} GB on disk)"
            draft_note = reader.describe_draft() + (
                "" if reader.draft == "none" else
                "; not loaded (speculative decoding is off)" if self.spec is None else
                f"; loaded for speculative decoding ({self.spec.describe()})")
        self.model_config = mc = self.model.cfg
        if self.spec is not None:
            self.spec = resolve(self.spec, mc)
        self.model_path = path if path is not None else source
        load_s = time.perf_counter() - t0
        weights_mem = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.tokenizer = load_tokenizer(path)
        #: vLLM's default sampling parameters (SamplingParams names): what a request leaves unset
        self.default_sampling = generation_defaults(cfg.generation_config, path)
        try:
            SamplingParams(**self.default_sampling)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config.json of {path}: {e}") from None
        budget = None if cfg.num_kv_blocks is not None else self._kv_budget()
        # speculative decoding: the drafter's rings are snapshotted too, and the MTP block's row at
        # a boundary is recomputed from the target's streams the snapshot keeps (kv_cache module doc)
        draft_layers = 0 if self.model.draft is None else mc.num_draft_stages
        draft_row = (mc.hc_mult, mc.hidden_size) if self.model.draft == "mtp" else ()
        snaps = self._num_snapshots(budget, bytes_per_snapshot(mc, draft_layers, draft_row),
                                    (cfg.max_num_seqs + 1) * bytes_per_slot(mc, draft_layers))
        # the model keeps one private scratch slot and block for padding / non-completing rows
        self.cache = KVCache(mc, CacheConfig(max_num_seqs=cfg.max_num_seqs + 1,
                                             num_blocks=None if cfg.num_kv_blocks is None else cfg.num_kv_blocks + 1,
                                             memory_bytes=budget, device=str(self.device), num_snapshots=snaps,
                                             draft_layers=draft_layers, draft_row=draft_row))
        self.prefix = PrefixCache(self.cache) if snaps else None
        self.seq_blocks = self.cache.num_blocks - 1      # blocks sequences can hold (one is the model's scratch)
        cap = self.seq_blocks * BLOCK_TOKENS
        limit = min(mc.max_position_embeddings, cap)
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}")
        self.max_model_len = cfg.max_model_len or limit
        self.model.attach_cache(self.cache, self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                                   cfg.long_prefill_token_threshold), self.cache,
                                   self.prefix)
        verify_rows = 1 if self.spec is None else self.spec.num_speculative_tokens + 1
        if self.workers is not None:
            self.workers.setup(self.cache.num_blocks, cfg.max_num_seqs, self.max_model_len, cfg.cuda_graphs, snaps,
                               self.spec, draft_layers, draft_row)
        self.runner = ModelRunner(self.model, cfg.max_num_seqs, cfg.cuda_graphs,
                                  None if self.workers is None else self.workers.broadcast_step, verify_rows)
        self.backend_name = f"{'kernels' if self.model.ops.kernels else 'torch twins'}" + \
            ("+cuda-graphs" if self.runner.graphs is not None else "") + (f", tensor parallel {tp}" if tp > 1 else "")
        self.sampler = Sampler(mc.eos_token_id)
        self.drafter = None
        if self.spec is not None:
            from .spec_decode import make_drafter
            self.drafter = make_drafter(self.model, self.spec, self.runner, cfg.max_num_seqs)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, mc.eos_token_id)
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.stats = {"steps": 0, "step_time": 0.0, "prompt_tokens": 0, "generation_tokens": 0,
                      # speculative decoding (vLLM's spec_decode metrics): verify steps with drafts,
                      # draft tokens, accepted ones, and accepted ones by draft position
                      "spec_num_drafts": 0, "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
                      "spec_accepted_per_pos": [0] * (0 if self.spec is None else self.spec.num_speculative_tokens),
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        if cfg.log:
            wb = self.model.weight_bytes()
            extra = f"; weights / checkpoint bytes {wb / disk_bytes:.3f}" if disk_bytes else ""
            if self.device.type == "cuda":
                extra += f"; device memory in use after load {weights_mem / 2**30:.2f} GiB"
            print(f"dsv4: loaded {source} in {load_s:.1f} s; {self.model.describe()}{extra}", file=sys.stderr)
            if draft_note is not None:
                print(f"dsv4: draft: {draft_note}", file=sys.stderr)
            if self.workers is not None:
                print(f"dsv4: tensor parallel {tp}: rank 0 pid {os.getpid()}, " +
                      ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.workers.procs, start=1)),
                      file=sys.stderr)
            print(f"dsv4: {self.cache.describe()}; max_model_len {self.max_model_len} (model "
                  f"{mc.max_position_embeddings}, KV cache {cap} tokens); backend {self.backend_name}",
                  file=sys.stderr)
            if self.spec is not None:
                print(f"dsv4: speculative decoding: {self.spec.describe()}", file=sys.stderr)
            gen = ", ".join(f"{k}={v}" for k, v in self.default_sampling.items()) or "none (vLLM's defaults)"
            print(f"dsv4: default sampling parameters (--generation-config {cfg.generation_config}): {gen}",
                  file=sys.stderr)
            print(f"dsv4: {self.describe_prefix_caching()}", file=sys.stderr)
        self.warmup = None
        if cfg.warmup or (cfg.warmup is None and self.device.type == "cuda" and self.model.ops.kernels):
            from .warmup import warm_up
            self.warmup = warm_up(self, log)
            if cfg.seed is not None:                # the warm-up must not move the global RNG
                torch.manual_seed(cfg.seed)

    def _num_snapshots(self, budget: int | None, snap_bytes: int, slots_bytes: int = 0) -> int:
        """Prefix-cache snapshots to allocate: 0 with caching off; else ``prefix_cache_snapshots``,
        by default 4 per sequence slot and at most a quarter of what a memory budget leaves after
        the sequence slots (``slots_bytes``; at least 1)."""
        cfg = self.cfg
        if not cfg.enable_prefix_caching:
            return 0
        n = cfg.prefix_cache_snapshots
        if n is not None:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"prefix_cache_snapshots must be a positive integer, got {n!r}")
            return n
        n = 4 * cfg.max_num_seqs
        if budget is not None:
            n = min(n, max(0, budget - slots_bytes) // 4 // snap_bytes)
        return max(1, n)

    def describe_prefix_caching(self) -> str:
        if self.prefix is None:
            return "prefix caching off"
        c = self.cache
        return (f"prefix caching on: cached prefixes share the {self.seq_blocks} KV blocks "
                f"({self.seq_blocks * BLOCK_TOKENS} tokens), unused ones evicted least recently used first; "
                f"{c.num_snapshots} snapshots of the window / compressor state at block boundaries "
                f"x {c.bytes_per_snapshot / 2**20:.2f} MiB")

    @staticmethod
    def _check_split(spec: dict, tp: int) -> None:
        """Refuse, before any process starts, a rank count the model's shapes cannot split."""
        if spec["synthetic"]:
            from ..checkpoint.synthetic import synthetic_config
            mc = synthetic_config(spec["synthetic"], spec["synthetic_layers"], spec["synthetic_experts"])
        else:
            from ..checkpoint.loader import open_checkpoint
            mc = open_checkpoint(spec["path"]).config
        for what, n in (("attention heads", mc.num_attention_heads), ("output groups", mc.o_groups),
                        ("routed experts", mc.n_routed_experts)):
            if n % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {n} {what}")

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank)."""
        if self.workers is not None:
            self.workers.stop()

    def _kv_budget(self) -> int:
        if self.cfg.kv_cache_memory is not None:
            return parse_bytes(self.cfg.kv_cache_memory)
        if self.device.type == "cuda":
            # memory of dead objects still in reference cycles counts as free only once they are collected
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.cfg.gpu_memory_utilization)
        return 256 * 2**20

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival: float | None = None) -> None:
        """Queue a request. Raises ``RequestRejected`` (nothing queued) when it cannot be served."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        n = len(ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestRejected(f"the prompt has {n} tokens; max_model_len is {self.max_model_len} "
                                  f"(prompt + at least 1 generated token must fit)")
        if self.cache.blocks_needed(n + 1) > self.seq_blocks:
            raise RequestRejected(f"the prompt has {n} tokens and cannot fit the KV cache even alone "
                                  f"({self.seq_blocks * BLOCK_TOKENS} tokens); raise kv_cache_memory")
        limit = min(self.max_model_len, self.seq_blocks * BLOCK_TOKENS) - n
        max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        V = self.model_config.vocab_size
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < V]
        if bad:
            raise RequestRejected(f"logit_bias: token ids must be in [0, {V}); got {bad[:5]}")
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.grammars.compile(params.structured_outputs)
            except ValueError as e:
                raise RequestRejected(f"structured_outputs: {e}") from None
        now = time.monotonic() if arrival is None else arrival
        seqs = [Sequence(request_id, i, ids, params, max_tokens, self.model_config.eos_token_id,
                         self.tokenizer.incremental_detokenizer(params.skip_special_tokens), now)
                for i in range(params.n)]
        for s in seqs:
            s.leader = seqs[0]
        if grammar is not None:
            for s in seqs:              # each sample walks the grammar on its own
                s.matcher = grammar.matcher()
        self.requests[request_id] = seqs
        self.prompts[request_id] = text
        for s in seqs:
            self.scheduler.add(s)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = [self.model_config.bos_token_id] + self.tokenizer.encode(prompt)
            V = self.model_config.vocab_size
            if max(ids) >= V:
                raise RequestRejected(f"the prompt encodes to token id {max(ids)}, outside the model's vocabulary "
                                      f"of {V} (tokenizer and model do not match)")
            return prompt, ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RequestRejected("a dict prompt needs 'prompt_token_ids'")
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt)
        V = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise RequestRejected(f"prompt token ids must be integers in [0, {V}); got {bad[:5]}")
        return None, ids

    def abort_request(self, request_id: str) -> None:
        for s in self.requests.get(request_id, []):
            if not s.is_finished:
                s.finish_reason = "abort"
                self.scheduler.finish(s)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the outputs of every request touched
        (finished requests are returned once and forgotten)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        touched: dict[str, None] = {}
        now = time.monotonic()
        for c in batch:
            if c.seq.first_scheduled_time is None:
                c.seq.first_scheduled_time = now
        if batch:
            # speculative decoding (engine.spec_decode): every chunk of a speculating sequence keeps
            # its residual streams for the drafter; a verify chunk returns every row's logits, and
            # what its positions overwrite in the per-slot rings is saved, to put back for the
            # rejected positions
            # (with prefix caching, every sequence's rows go to the drafter: its rings are part of
            # the snapshots the sequence takes, which sequences that do speculate may restore)
            keep = {i for i, c in enumerate(batch)
                    if self.drafter is not None and (c.seq.matcher is None or self.prefix is not None)}
            verify = {i for i, c in enumerate(batch) if c.num_draft}
            p0 = [c.seq.num_computed for c in batch]
            saved = {i: self.cache.save_positions(batch[i].seq.slot, p0[i], p0[i] + batch[i].num_tokens)
                     for i in verify}
            try:
                logits = self.runner.run(batch, verify, keep)
            except BaseException:
                if self.prefix is not None:
                    self.prefix.cancel([x for c in batch for x in c.captures])
                raise
            if self.prefix is not None:     # before any release below: finished blocks stay cached
                for c in batch:
                    self.prefix.commit(c.seq, c.captures)
                self.stats["prefix_cache_queries"] = self.prefix.queries
                self.stats["prefix_cache_hits"] = self.prefix.hits
            rows = [i for i, c in enumerate(batch) if c.samples]
            for i in [i for i in rows if batch[i].seq.max_tokens == 0]:     # scoring only: no token
                s = batch[i].seq
                if not s.is_finished:
                    s.finish_reason = "length"
                    self.scheduler.finish(s)
            rows = [i for i in rows if batch[i].seq.max_tokens > 0]
            self._cuts = []             # (verify chunk, accepted end) of those still running
            if rows:
                self._sample(batch, rows, logits, p0, saved)
            if self.drafter is not None:
                self._draft(batch, keep, p0)
            for c in batch:
                touched[c.seq.request_id] = None
                if c.seq.num_computed <= len(c.seq.prompt_ids):
                    self.stats["prompt_tokens"] += c.num_tokens
            self.stats["steps"] += 1
            self.stats["step_time"] += time.perf_counter() - t0
        for rid, seqs in list(self.requests.items()):
            if all(s.is_finished for s in seqs):
                touched[rid] = None
        outputs = [self._output(rid) for rid in touched if rid in self.requests]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id], self.prompts[o.request_id]
        return outputs

    def _sample(self, batch, rows: list[int], logits: list, p0: list[int], saved: dict) -> None:
        """Sample the chunks ``rows``: one row each, or for a verify chunk one row per position,
        row j seeing the first j draft tokens as output; append the accepted tokens and cut a
        verify chunk's sequence back to them (engine.spec_decode)."""
        R_logits, R_out, R_seq, first = [], [], [], {}
        for i in rows:
            c, s = batch[i], batch[i].seq
            first[i] = len(R_logits)
            for j in range(c.num_draft + 1):
                R_logits.append(logits[i][j] if c.num_draft else logits[i])
                R_out.append(s.output_ids + s.draft_ids[:j])
                R_seq.append(s)
        forced = self._reject(batch, rows, first, R_logits, R_seq, R_out)
        out = self.sampler(torch.stack(R_logits), [s.params for s in R_seq], [s.prompt_ids for s in R_seq], R_out,
                           [s.generator for s in R_seq], [s.matcher for s in R_seq], forced)
        for i in rows:
            c, s, r0 = batch[i], batch[i].seq, first[i]
            drafts = s.draft_ids[:c.num_draft]
            sampled = out.token_ids[r0:r0 + c.num_draft + 1]
            a = accept_greedy_draft(sampled, drafts)
            for j in range(a + 1):
                self._append(s, sampled[j], out.logprobs[r0 + j], out.errors[r0 + j], out.ranks[r0 + j])
                if s.is_finished:
                    break
            s.draft_ids = []
            if not c.num_draft:
                continue
            st = self.stats
            st["spec_num_drafts"] += 1
            st["spec_num_draft_tokens"] += c.num_draft
            st["spec_num_accepted_tokens"] += a
            for j in range(a):
                st["spec_accepted_per_pos"][j] += 1
            s.num_draft_tokens += c.num_draft
            s.num_accepted_tokens += a
            if not s.is_finished:
                end = p0[i] + a + 1
                self.cache.restore_positions(s.slot, p0[i], p0[i] + c.num_tokens, saved[i], end)
                self._cuts.append((i, end))
                s.state.advance_to(end)
                s.num_computed = end

    def _reject(self, batch, rows, first, R_logits, R_seq, R_out) -> list | None:
        """Probabilistic drafts (``DSparkDrafter.probs``): standard rejection sampling of each such
        verify chunk against the target's distributions of its rows (``spec_decode.rejection_sample``);
        returns the tokens its rows must take (accepted drafts, then the resampled or bonus token),
        None elsewhere, or None when no chunk has such drafts."""
        from .spec_decode import rejection_sample
        probs = getattr(self.drafter, "probs", None)
        chunks = [i for i in rows if batch[i].num_draft and probs and batch[i].seq in probs]
        if not chunks:
            return None
        idx = [first[i] + j for i in chunks for j in range(batch[i].num_draft + 1)]
        tgt = self.sampler(torch.stack([R_logits[r] for r in idx]), [R_seq[r].params for r in idx],
                           [R_seq[r].prompt_ids for r in idx], [R_out[r] for r in idx],
                           [R_seq[r].generator for r in idx], None, want_probs=True)
        forced, at = [None] * len(R_logits), 0
        for i in chunks:
            s, k = batch[i].seq, batch[i].num_draft
            q = probs.pop(s)
            n = k + 1
            if all(at + j in tgt.probs for j in range(n)):
                g = s.generator
                dev = g.device if g is not None else q.device
                target = torch.stack([tgt.probs[at + j] for j in range(n)]).to(dev)
                a, nxt = rejection_sample(target, q[:k].to(dev), torch.tensor(s.draft_ids[:k]), g)
                for j, t in enumerate(s.draft_ids[:a] + [nxt]):
                    forced[first[i] + j] = t
            at += n
        for s in [s for s in probs if s.is_finished]:      # drafts of sequences that ended elsewhere
            probs.pop(s)
        return forced

    def _draft(self, batch, keep: set, p0: list[int]) -> None:
        """Give the drafter the rows each kept sequence committed this step (with the token that
        follows each) and let the speculating ones draft for the next step. With prefix caching the
        snapshots this step took get their draft part (``spec_decode.draft_step``); those that did not
        (their sequence ended) are dropped. After a prefix-cache hit, MTP's row before the hit is
        recomputed first, from the streams the snapshot kept and this sequence's next token."""
        from .spec_decode import draft_step
        items, k_of, msg = [], {}, []
        for i in sorted(keep):
            c, s = batch[i], batch[i].seq
            if s.is_finished or s.state is None:
                continue
            n = s.num_computed - p0[i]                      # rows committed (a verify chunk: accepted + 1)
            nxt = s.all_ids[p0[i] + 1:p0[i] + n + 1]
            if n <= 0 or len(nxt) != n:
                continue
            h, p = self.runner.hidden[i][:n], p0[i]
            pre = c.restore is not None and s.slot in self.cache.restored_rows
            if pre:
                h, nxt, p = torch.cat([self.cache.restored_rows[s.slot][None], h]), [s.all_ids[p]] + nxt, p - 1
            caps = [(x.pos, x.snap) for x in c.captures]
            items.append((s, p, h, nxt, caps))
            if s.num_computed >= len(s.prompt_ids) and s.matcher is None:
                k_of[s] = self._k_of(s)
            msg.append((i, p, len(nxt), nxt, s.slot, list(s.block_table), k_of.get(s, 0), s.params.is_greedy,
                        float(s.params.temperature), caps, pre))
        if self.workers is not None:        # every rank mirrors the cut-backs and runs the draft (tp_workers)
            self.workers.broadcast_draft(self._cuts, msg)
        done = draft_step(self.drafter, self.cache, items, k_of)
        self.cache.restored_rows.clear()
        if self.prefix is not None:
            self.prefix.drop([x for c in batch for x in c.captures if x.snap not in done])

    def _k_of(self, s: Sequence) -> int:
        """Draft tokens ``s`` carries next step: the configured number, clipped so that the verify
        chunk's tokens fit ``max_tokens`` and its positions ``max_model_len``. With prefix caching,
        a verify chunk never puts a draft token on the last position before a block boundary: the
        pending token ``N`` reaches it itself, so the snapshot there (taken at ``N + 1``) and its
        block's hash hold committed tokens only."""
        left = s.max_tokens - len(s.output_ids)
        room = self.max_model_len - 1 - s.num_computed
        k = max(0, min(self.spec.num_speculative_tokens, left - 1, room))
        if self.prefix is not None:
            N = s.num_computed
            b = (N // BLOCK_TOKENS + 1) * BLOCK_TOKENS     # the next boundary
            if N < b - 1:
                k = min(k, b - 2 - N)
        return k

    def _append(self, s: Sequence, tok: int, lps: dict | None, err: str | None, rank: int | None = None) -> None:
        if s.is_finished:
            return
        if err is not None:
            s.error, s.finish_reason = f"request failed: {err}", "error"
            self.scheduler.finish(s)
            return
        if s.matcher is not None and not s.matcher.consume_token(tok):
            # the sampler only offers allowed tokens, so this is the matcher failing (e.g. a limit)
            s.error = f"request failed: structured output: the grammar matcher rejected token {tok}: " \
                      f"{first_line(s.matcher.get_error())}"
            s.finish_reason = "error"
            self.scheduler.finish(s)
            return
        if s.first_token_time is None:
            s.first_token_time = time.monotonic()
        s.output_ids.append(tok)
        self.stats["generation_tokens"] += 1
        if s.logprobs is not None and lps is not None:
            # the sampler lists the top tokens best first, then the chosen one when it is not among them
            tt = self.tokenizer.token_text
            s.logprobs.append({t: Logprob(lp, rank if t == tok else r + 1, tt(t))
                               for r, (t, lp) in enumerate(lps.items())})
            s.cumulative_logprob += lps[tok]
        delta = s.detok.add(tok)
        s.text += delta
        r = s.stop.check(s.text, tok, len(s.output_ids), new_text_len=len(delta))
        if r.finished:
            s.text = r.text + (s.detok.flush() if r.finish_reason == "length" else "")
            s.finish_reason, s.stop_reason = r.finish_reason, r.stop_reason
            self.scheduler.finish(s)
        elif s.matcher is not None and s.matcher.is_stopped():
            # the grammar is complete and allows no further token (EOS aside): done
            s.text += s.detok.flush()
            s.finish_reason = "stop"
            self.scheduler.finish(s)

    def _output(self, rid: str) -> RequestOutput:
        seqs = self.requests[rid]
        finished = all(s.is_finished for s in seqs)
        pl = seqs[0].prompt_logprobs
        metrics = {"arrival": seqs[0].arrival, "first_token_time": seqs[0].first_token_time,
                   "first_scheduled_time": seqs[0].first_scheduled_time, "max_tokens": seqs[0].max_tokens}
        if self.spec is not None:
            metrics["num_draft_tokens"] = sum(s.num_draft_tokens for s in seqs)
            metrics["num_accepted_tokens"] = sum(s.num_accepted_tokens for s in seqs)
        return RequestOutput(rid, self.prompts[rid], list(seqs[0].prompt_ids), [s.to_output() for s in seqs],
                             finished, metrics, None if pl is None else list(pl), seqs[0].num_cached_tokens or 0)
