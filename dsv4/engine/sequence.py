"""A sequence being generated, and the vLLM-shaped outputs the engine returns."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampler import StopChecker
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one entry of a per-token logprobs dict."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None          # 'stop' | 'length' | 'abort' | 'error' | None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # arrival, first_scheduled_time, first_token_time (time.monotonic(); of the first sample) and
    # max_tokens (the limit in force: the request's, clipped to what max_model_len leaves)
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list | None = None      # [None, {token id: Logprob}, ...] when asked for
    num_cached_tokens: int = 0               # prompt tokens read from the prefix cache (vLLM's name)


_seq_ids = itertools.count()


class Sequence:
    """One sample of a request. ``num_computed`` tokens of ``prompt + output`` are in the cache;
    the next model call feeds the rest (a prefill chunk, or the last sampled token)."""

    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_id: int, detokenizer=None, arrival: float = 0.0):
        self.seq_id = next(_seq_ids)
        self.request_id, self.index = request_id, index
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        self.slot: int | None = None
        self.block_table: list[int] = []
        self.state = None                       # the cache-backed model state while RUNNING
        # prefix caching (engine.prefix_cache): the hash chain of the full blocks, how many of the
        # table's blocks are registered, the tokens the first admission read from the cache, and
        # sample 0 of the request (the other samples wait for its prompt, then reuse it)
        self.block_hashes: list[bytes] = []
        self.num_registered = 0
        self.num_cached_tokens: int | None = None
        self.leader: Sequence = self
        seed = params.seed if params.seed is None else (params.seed + index) % 2 ** 64   # sample i: seed + i
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.draft_generator: torch.Generator | None = None   # spec_decode: the seeded drafts' on the GPU
        self.stop = StopChecker(params, eos_token_id, max_tokens)
        self.detok = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        # vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob given
        # the ones before it (plus the top ``params.prompt_logprobs``)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None and index == 0 else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None     # when a step first ran it (monotonic)
        self.num_preemptions = 0
        # structured outputs: this sample's llguidance matcher (set by the engine), advanced by
        # exactly the tokens appended to output_ids; a preempted sequence keeps both, so the
        # matcher matches the tokens its re-prefill recomputes
        self.matcher = None
        # speculative decoding: the tokens drafted for the next step (verified after the pending
        # token), and this sample's totals of drafted / accepted tokens
        self.draft_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def chunk_ids(self, p0: int, n: int) -> list[int]:
        """The ``n`` tokens fed from position ``p0``: prompt and output, then the draft tokens."""
        ids = self.all_ids
        if p0 + n > len(ids):
            ids = ids + self.draft_ids
        return ids[p0:p0 + n]

    def prompt_targets(self, p0: int, n: int) -> list[int]:
        """The prompt tokens that rows p0 .. p0+n-1 predict and that are not scored yet (a chunk
        recomputed after preemption is scored once)."""
        if self.prompt_logprobs is None or p0 + 1 != len(self.prompt_logprobs):
            return []
        return self.prompt_ids[p0 + 1:min(p0 + n + 1, len(self.prompt_ids))]

    def add_prompt_logprobs(self, p0: int, res) -> None:
        tl, rank, top_v, top_i = (x.tolist() for x in res)
        tt = self.detok.tokenizer.token_text if self.detok is not None else (lambda t: None)
        for j, (lp, rk) in enumerate(zip(tl, rank)):
            tok = self.prompt_ids[p0 + 1 + j]
            d = {a: Logprob(v, r + 1, tt(a)) for r, (a, v) in enumerate(zip(top_i[j], top_v[j]))}
            d[tok] = Logprob(lp, rk, tt(tok))
            self.prompt_logprobs.append(d)

    def token_slice(self, a: int, b: int) -> list[int]:
        """Tokens a .. b-1 of prompt + output."""
        P = len(self.prompt_ids)
        if b <= P:
            return self.prompt_ids[a:b]
        if a >= P:
            return self.output_ids[a - P:b - P]
        return self.prompt_ids[a:] + self.output_ids[:b - P]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def to_output(self) -> CompletionOutput:
        """While running, the text holds back a tail that may be the start of a stop string, so a
        stream never shows characters a stop string later removes (as vLLM does)."""
        text = self.text
        if not self.is_finished and self.params.stop:
            text = text[:len(text) - self.stop.holdback(text)]
        return CompletionOutput(self.index, text, list(self.output_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                self.logprobs, self.finish_reason, self.stop_reason, self.error)
