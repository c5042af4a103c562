"""Engine acceptance: the production model served batched / chunked / preempted gives the greedy
tokens and log-probs of the same model serving each request alone.

The official numerics are not batch invariant (on a CPU the twins' elementwise kernels round a
row's last ulp by where it sits in the batch; on a GPU the kernels pick tiles and splits by batch
size), and the tiny random model amplifies an ulp into up to a logit. So a greedy step is held
to the alone run's token wherever the alone run's top-1 leads its top-2 by ``MARGIN`` nats, and
the chosen token's log-prob to within ``LP_TOL``; the first step where the runs part (allowed
only below the margin) ends the comparison of that request. Closeness to the oracle is
tests/test_model.py's."""
from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.llm_engine import RequestRejected


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return LLM(None, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, log=False)


@pytest.fixture(scope="module")
def ref(llm):
    """The same model serving one request at a time, each prompt in one chunk."""
    return LLM(None, max_num_seqs=1, max_num_batched_tokens=1024, max_model_len=1024, log=False)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


MARGIN = 2.0
LP_TOL = 1.0


def _alone(ref: LLM, ids, n_out):
    """The greedy completion of the request on its own, with top-2 log-probs per step."""
    return ref.generate([{"prompt_token_ids": list(ids)}],
                        SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, logprobs=2))[0].outputs[0]


def _agree(c, alone) -> int:
    """Check completion ``c`` against the alone run (module doc); the number of equal steps."""
    for i, (a, b) in enumerate(zip(c.token_ids, alone.token_ids)):
        top = sorted((v.logprob for v in alone.logprobs[i].values()), reverse=True)
        margin = top[0] - top[1]
        if a != b:
            assert margin < MARGIN, f"step {i}: token {a} != {b} at a top-1 margin of {margin:.3f}"
            return i
        if c.logprobs is not None:
            assert abs(c.logprobs[i][a].logprob - alone.logprobs[i][b].logprob) < LP_TOL, i
    return len(c.token_ids)


def _free(cache):
    return cache.num_free_blocks, cache.num_free_slots


def test_eight_concurrent_greedy_requests_match_the_model_alone(llm, ref):
    lens = [705, 730, 300, 130, 64, 17, 5, 3]           # two > 700 tokens: CSA top-k and HCA entries
    n_out = 6
    prompts = [{"prompt_token_ids": _prompt(n, i)} for i, n in enumerate(lens)]
    start = _free(llm.engine.cache)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, logprobs=1))
    assert _free(llm.engine.cache) == start
    equal = 0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        equal += _agree(c, _alone(ref, p["prompt_token_ids"], n_out))
        assert c.finish_reason == "length" and o.finished and len(c.token_ids) == n_out
        assert all(len(d) >= 1 for d in c.logprobs)
    assert equal >= len(prompts) * n_out * 3 // 4         # parting runs are the exception


def test_preemption_leaves_outputs_unchanged_and_frees_everything(tmp_path, ref):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    # 6 blocks of 256 tokens for 4 sequences that need 2 blocks each at the end: must preempt
    small = LLM(None, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024, num_kv_blocks=6, log=False)
    eng = small.engine
    prompts = [{"prompt_token_ids": _prompt(n, 10 + i)} for i, n in enumerate((250, 240, 260, 200))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    start = _free(eng.cache)
    outs = small.generate(prompts, sp)
    assert eng.scheduler.num_preemptions > 0
    assert _free(eng.cache) == start
    for p, o in zip(prompts, outs):
        _agree(o.outputs[0], _alone(ref, p["prompt_token_ids"], 24))


def test_abort_and_rejections_free_blocks_while_others_complete(llm, ref):
    eng = llm.engine
    start = _free(eng.cache)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("keep", {"prompt_token_ids": _prompt(40, 21)}, sp)
    eng.add_request("drop", {"prompt_token_ids": _prompt(300, 22)}, SamplingParams(max_tokens=50))
    eng.step()
    with pytest.raises(RequestRejected, match="max_model_len"):
        eng.add_request("long", {"prompt_token_ids": _prompt(1024, 23)}, sp)
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request("empty", {"prompt_token_ids": []}, sp)
    with pytest.raises(RequestRejected, match=r"token ids must be integers in \[0, 129280\)"):
        eng.add_request("bad", {"prompt_token_ids": [1, 2, 10**7]}, sp)
    eng.abort_request("drop")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert done["drop"].outputs[0].finish_reason == "abort"
    _agree(done["keep"].outputs[0], _alone(ref, _prompt(40, 21), 5))
    assert "long" not in done and _free(eng.cache) == start


def test_prompt_that_cannot_fit_the_cache_is_rejected(tmp_path):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    small = LLM(None, max_num_seqs=2, max_model_len=4096, num_kv_blocks=2, log=False)
    with pytest.raises(RequestRejected, match="cannot fit the KV cache even alone"):
        small.generate([{"prompt_token_ids": _prompt(20, 1)}, {"prompt_token_ids": _prompt(600, 2)}])
    assert not small.engine.has_unfinished_requests()
    assert _free(small.engine.cache) == (2, 2)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    p = {"prompt_token_ids": _prompt(30, 5)}
    a = llm.generate([p], sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": _prompt(n, 40 + n)} for n in (7, 90, 300)]
    mixed = llm.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=5)] * 2 + [sp] + [SamplingParams(max_tokens=3)])
    assert mixed[2].outputs[0].token_ids == a
    assert llm.generate([p], sp)[0].outputs[0].token_ids == a
    unseeded = SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, seed=99)
    assert llm.generate([p], unseeded)[0].outputs[0].token_ids != a


def test_text_prompts_n_samples_stop_strings(llm):
    outs = llm.generate(["Hello world", "DeepSeek"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6))
    assert len(outs) == 2 and all(len(o.outputs) == 2 for o in outs)
    assert outs[0].prompt == "Hello world" and outs[0].prompt_token_ids[0] == 0
    a, b = outs[0].outputs
    assert a.index == 0 and b.index == 1 and a.token_ids != b.token_ids
    tok = llm.get_tokenizer()
    for c in a, b:
        assert c.text == tok.decode(c.token_ids)
    # a stop string taken from the greedy text is removed, and the request stops there
    g = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = g.text[len(g.text) // 2:len(g.text) // 2 + 3]
    if stop.strip():
        s = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
        assert s.finish_reason == "stop" and stop not in s.text and g.text.startswith(s.text)


def test_nan_logits_fail_the_request_not_token_zero(llm, monkeypatch):
    eng = llm.engine
    orig = eng.runner.forward

    def poisoned(*args, **kw):
        out = orig(*args, **kw)
        return [torch.full_like(o, float("nan")) for o in out]
    monkeypatch.setattr(eng.runner, "forward", poisoned)
    start = _free(eng.cache)
    o = llm.generate([{"prompt_token_ids": _prompt(10, 1)}], SamplingParams(max_tokens=4))[0].outputs[0]
    assert o.finish_reason == "error" and "non-finite" in o.error and o.token_ids == []
    assert _free(eng.cache) == start


def test_engine_serves_the_native_weight_model_on_cpu(llm):
    """The engine holds the production model (no reference object), on its checkpoint's native
    formats, with the torch twins on a CPU; max_model_len follows the config, capped by the cache."""
    from dsv4.model.deepseek_v4 import DeepseekV4
    eng = llm.engine
    assert isinstance(eng.model, DeepseekV4) and not eng.model.ops.kernels
    assert eng.backend_name == "torch twins"
    assert eng.model.layers[0].attn.wq_a_wkv.weight.dtype == torch.float8_e4m3fn
    assert eng.model.layers[0].moe.w13.dtype == torch.uint8           # packed MXFP4 codes
    assert eng.max_model_len == 1024


def test_a_dropped_engine_frees_its_kv_cache_without_the_cycle_collector():
    """The KV cache (on a GPU sized to most of the free memory) goes with the last reference to the LLM,
    after requests ran with prefix caching on: no reference cycle holds it (the prefix cache's eviction
    hook and the sequence states' back-references are weak)."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        llm = LLM(None, max_num_seqs=2, max_model_len=512, kv_cache_memory="64MiB", log=False,
                  enable_prefix_caching=True)
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = llm.generate(["a first prompt", {"prompt_token_ids": list(range(3, 300))}], sp)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
        assert llm.engine.prefix is not None and llm.engine.cache.evict_hook is not None
        cache, engine = weakref.ref(llm.engine.cache), weakref.ref(llm.engine)
        del llm, outs
        assert engine() is None and cache() is None
    finally:
        gc.enable()


def test_default_max_model_len_is_the_config_limit_capped_by_the_kv_cache():
    from dsv4.engine.llm_engine import EngineConfig, LLMEngine
    eng = LLMEngine(EngineConfig(log=False, max_num_seqs=2, num_kv_blocks=40))
    assert eng.max_model_len == min(eng.model_config.max_position_embeddings, 40 * 256)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(log=False, max_num_seqs=2, num_kv_blocks=4,
                               max_model_len=eng.model_config.max_position_embeddings + 1))


def test_prompt_logprobs_are_the_reference_s_in_any_chunking():
    """``prompt_logprobs``: every prompt token's logprob given the ones before it (None for the
    first), the same whatever the prefill chunks, equal to the oracle's log-softmax over all
    positions; ``max_tokens=0`` scores without generating."""
    from dsv4.models import resolve_model
    from dsv4.reference.model import ReferenceModel
    ids = [0] + torch.randint(3, 128000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = ReferenceModel.from_pretrained(resolve_model(None))
    lp = torch.log_softmax(ref.forward([(torch.tensor(ids), ref.new_state())], all_logits=True)[0], -1)
    for chunk in (512, 64):
        llm = LLM(None, max_num_batched_tokens=chunk, max_model_len=1024, kv_cache_memory="64MiB", log=False)
        o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
        assert o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length"
        pl = o.prompt_logprobs
        assert len(pl) == len(ids) and pl[0] is None
        for i in range(1, len(ids)):
            d = pl[i]
            assert abs(d[ids[i]].logprob - float(lp[i - 1, ids[i]])) < 1e-4
            top = lp[i - 1].topk(2)
            assert [t for t, v in d.items() if v.rank in (1, 2) and t in top.indices.tolist()]


def test_engine_thread_rule(monkeypatch):
    """torch threads of an engine: DSV4_NUM_THREADS when set (a bad value is an error naming it);
    else 1 on a GPU and the usable cores, split over the machine's ranks, on a CPU."""
    import os

    from dsv4.engine.llm_engine import engine_threads
    monkeypatch.setenv("DSV4_NUM_THREADS", "3")
    assert engine_threads("cpu") == 3 and engine_threads("cuda") == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("DSV4_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="DSV4_NUM_THREADS must be a positive integer"):
            engine_threads("cpu")
    monkeypatch.delenv("DSV4_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    assert engine_threads("cuda") == 1
    assert engine_threads("cpu") == 9 and engine_threads("cpu", world=2) == 4 and engine_threads("cpu", world=16) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert engine_threads("cpu") == 2


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """An engine whose model length is 64 tokens, seeded (``--seed``); ``first_draw``: the tokens
    of the first request without a seed it served."""
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    torch.manual_seed(12345)                 # whatever the global RNG held before, the engine reseeds it
    llm = LLM(None, max_num_seqs=4, max_model_len=64, kv_cache_memory="16MiB", log=False, seed=7)
    llm.first_draw = llm.generate([{"prompt_token_ids": _prompt(8, 6)}], UNSEEDED)[0].outputs[0].token_ids
    return llm


UNSEEDED = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)


def test_prompt_plus_output_never_exceed_max_model_len(short):
    """``max_tokens`` larger than what the model length leaves, or none at all: the output stops at
    ``max_model_len`` with finish_reason 'length' (each sample of n)."""
    ids = _prompt(60, 3)
    for sp in (SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=None, ignore_eos=True)):
        for o in short.generate([{"prompt_token_ids": ids}], sp)[0].outputs:
            assert len(ids) + len(o.token_ids) == 64 and o.finish_reason == "length", (sp, len(o.token_ids))
    o = short.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 2


def test_offline_logprobs_carry_rank_and_decoded_token(short):
    """vLLM's ``Logprob``: the rank of each listed token in the distribution (1 = the most
    likely; a sampled token outside the top keeps its own rank) and its text."""
    tok = short.get_tokenizer()
    ids = _prompt(12, 4)
    o = short.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=1.0, seed=5, max_tokens=8,
                                                                   ignore_eos=True, logprobs=1, prompt_logprobs=1))[0]
    outside = 0
    for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)
        assert best[0][1].rank == 1 and all(v.decoded_token == tok.decode([a], skip_special_tokens=False)
                                            for a, v in d.items())
        if len(best) == 2:                    # sampled outside the top 1
            assert best[1][0] == t and best[1][1].rank >= 2
            outside += 1
    assert outside, "temperature 1 on the random model picks a token outside the top 1 within 8 steps"
    for t, d in zip(ids[1:], o.prompt_logprobs[1:]):
        assert d[t].decoded_token == tok.decode([t], skip_special_tokens=False) and d[t].rank >= 1
        assert [v.rank for _, v in sorted(d.items(), key=lambda kv: -kv[1].logprob)][0] == 1


def test_seed_seeds_the_sampling_of_requests_without_their_own(short):
    """``LLM(seed=7)`` (``dsv4 serve --seed 7``): requests without a seed draw from torch's global
    RNG, which the engine seeds at start; reseeding it with 7 replays the first request's draws."""
    p = {"prompt_token_ids": _prompt(8, 6)}
    torch.manual_seed(7)
    assert short.generate([p], UNSEEDED)[0].outputs[0].token_ids == short.first_draw
    torch.manual_seed(8)
    assert short.generate([p], UNSEEDED)[0].outputs[0].token_ids != short.first_draw


def test_long_prefill_token_threshold_caps_each_prompt_s_chunk(monkeypatch, ref):
    """vLLM's ``long_prefill_token_threshold``: no sequence takes more prefill tokens in a step than
    the threshold, so two prompts share each step's budget (their chunks side by side) while another
    decodes; the outputs stay the alone run's. 0 is off; a negative or non-integer value is refused."""
    from dsv4.cli import _engine_kw, build_parser
    a = build_parser().parse_args(["generate", "x", "--long-prefill-token-threshold", "64"])
    kw = _engine_kw(a)
    assert kw["long_prefill_token_threshold"] == 64
    llm = LLM(None, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024, log=False,
              enable_prefix_caching=False, long_prefill_token_threshold=32)
    sched = llm.engine.scheduler
    steps = []
    plain = sched.schedule

    def recording():
        out = plain()
        steps.append([(c.seq.seq_id, c.num_tokens, c.seq.num_computed < len(c.seq.prompt_ids)) for c in out])
        return out
    monkeypatch.setattr(sched, "schedule", recording)
    prompts = [_prompt(n, 40 + i) for i, n in enumerate((10, 150, 100))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1))
    prefill_chunks = [n for s in steps for _, n, pre in s if pre]
    assert max(prefill_chunks) == 32 and sum(prefill_chunks) == 260
    # the 150- and 100-token prompts' chunks share steps (32 each), beside the first one's decodes
    shared = [s for s in steps if sum(pre for _, _, pre in s) >= 2]
    assert shared and any(any(not pre for _, _, pre in s) for s in steps[1:6])
    for p, o in zip(prompts, outs):
        _agree(o.outputs[0], _alone(ref, p, 3))
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            LLM(None, max_num_seqs=2, log=False, long_prefill_token_threshold=bad)
