"""Offline API shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import sys
import time

from tqdm import tqdm

from .llm_engine import EngineConfig, LLMEngine, RequestRejected
from .sampling_params import SamplingParams
from .sequence import RequestOutput


_PROGRESS_S = 2.0         # the longest a running generate(use_tqdm=True) leaves its bar unchanged


class LLM:
    def __init__(self, model: str | None = None, **engine_kw):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kw))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Prompts are strings or ``{"prompt_token_ids": [...]}``; outputs come back in input order.
        Every prompt is validated before any runs: a bad one raises ``RequestRejected`` naming it.
        ``use_tqdm``: a bar of finished requests on stderr, with the steps and tokens done so far
        redrawn at least every ``_PROGRESS_S`` seconds while requests run (a batch of equal
        requests finishes all at once, and the count alone would sit at 0 until then). Without
        ``sampling_params`` the model's generation-config defaults apply (vLLM's
        ``get_default_sampling_params``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams(**self.engine.default_sampling)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        eng = self.engine
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for i, (rid, p, sp) in enumerate(zip(ids, prompts, params)):
                try:
                    eng.add_request(rid, p, sp)
                except RequestRejected as e:
                    raise RequestRejected(f"prompt {i}: {e}") from None
        except RequestRejected:
            for rid in ids:
                eng.abort_request(rid)
            while eng.has_unfinished_requests():
                eng.step()
            eng.step()
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), file=sys.stderr, disable=not use_tqdm, desc="requests")
        st = eng.stats
        s0, shown = dict(st), time.monotonic()
        while eng.has_unfinished_requests():
            done = 0
            for out in eng.step():
                if out.finished:
                    results[out.request_id] = out
                    done += 1
            if use_tqdm:
                bar.set_postfix_str(f"{st['steps'] - s0['steps']} steps, {st['prompt_tokens'] - s0['prompt_tokens']} "
                                    f"prompt + {st['generation_tokens'] - s0['generation_tokens']} output tokens",
                                    refresh=False)
                if done:
                    bar.update(done)
                if time.monotonic() - shown >= _PROGRESS_S:
                    bar.refresh()
                    shown = time.monotonic()
        for out in eng.step():                    # requests finished without a model step
            results[out.request_id] = out
        bar.close()
        return [results[r] for r in ids]


def benchmark_throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                         progress: bool = False) -> dict:
    """Offline throughput on random token prompts (``dsv4 bench throughput``); ``progress``: the
    requests' bar of ``LLM.generate`` on stderr (its drawing is inside the timed run)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    V = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(3, min(V, 128000), (input_len,), generator=g).tolist()}
               for _ in range(num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    st = llm.engine.stats
    s0, t0 = dict(st), time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=progress)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = st["steps"] - s0["steps"]
    return {"requests": num_prompts, "elapsed_s": dt, "requests_per_s": num_prompts / dt,
            "output_tokens_per_s": gen / dt, "total_tokens_per_s": (gen + num_prompts * input_len) / dt,
            "steps": steps, "mean_step_ms": 1e3 * (st["step_time"] - s0["step_time"]) / max(steps, 1),
            "preemptions": llm.engine.scheduler.num_preemptions}
