"""Engine acceptance: batched/chunked/preempted generation equals the reference alone."""
from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.llm_engine import RequestRejected
from dsv4.reference.model import ReferenceModel


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return LLM(None, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, log=False)


@pytest.fixture(scope="module")
def ref(llm):
    return llm.engine.model          # the same weights, run alone on in-memory state


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


def _alone(ref: ReferenceModel, ids, n_out):
    """Greedy continuation and the log-prob of each chosen token, one sequence on its own."""
    st = ref.new_state()
    lg = ref.forward([(torch.tensor(ids), st)])[0]
    toks, lps = [], []
    for _ in range(n_out):
        t = int(lg.argmax())
        toks.append(t)
        lps.append(float(torch.log_softmax(lg.float(), -1)[t]))
        lg = ref.forward([(torch.tensor([t]), st)])[0]
    return toks, lps


def _free(cache):
    return cache.num_free_blocks, cache.num_free_slots


def test_eight_concurrent_greedy_requests_equal_the_reference_alone(llm, ref):
    lens = [705, 730, 300, 130, 64, 17, 5, 3]           # two > 700 tokens: CSA top-k and HCA entries
    n_out = 6
    prompts = [{"prompt_token_ids": _prompt(n, i)} for i, n in enumerate(lens)]
    start = _free(llm.engine.cache)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, logprobs=1))
    assert _free(llm.engine.cache) == start
    for p, o in zip(prompts, outs):
        toks, lps = _alone(ref, p["prompt_token_ids"], n_out)
        c = o.outputs[0]
        assert c.token_ids == toks
        assert c.finish_reason == "length" and o.finished
        got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert got == pytest.approx(lps, abs=0)             # invariant numerics: same bits
        assert all(len(d) >= 1 for d in c.logprobs)


def test_preemption_leaves_outputs_unchanged_and_frees_everything(tmp_path):
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
        assert o.outputs[0].token_ids == _alone(eng.model, p["prompt_token_ids"], 24)[0]


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
    assert done["keep"].outputs[0].token_ids == _alone(ref, _prompt(40, 21), 5)[0]
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
    orig = eng.runner.backend.forward

    def poisoned(chunks):
        out = orig(chunks)
        return [torch.full_like(o, float("nan")) for o in out]
    monkeypatch.setattr(eng.runner.backend, "forward", poisoned)
    start = _free(eng.cache)
    o = llm.generate([{"prompt_token_ids": _prompt(10, 1)}], SamplingParams(max_tokens=4))[0].outputs[0]
    assert o.finish_reason == "error" and "non-finite" in o.error and o.token_ids == []
    assert _free(eng.cache) == start


def test_fast_decode_path_is_bit_identical_on_cpu(tmp_path):
    """The tensorised decode step (what CUDA graphs capture) with the reference attention twin
    writes and reads the same cache contents as the reference ops: same tokens, same log-probs."""
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    fast = LLM(None, max_num_seqs=3, max_num_batched_tokens=200, max_model_len=1024, log=False, fast_decode=True)
    assert fast.engine.backend_name == "fast-decode/reference"
    prompts = [{"prompt_token_ids": _prompt(n, 60 + n)} for n in (262, 9, 3)]   # crosses a 256-token block
    start = _free(fast.engine.cache)
    outs = fast.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
    assert _free(fast.engine.cache) == start
    for p, o in zip(prompts, outs):
        toks, lps = _alone(fast.engine.model, p["prompt_token_ids"], 6)
        c = o.outputs[0]
        assert c.token_ids == toks
        assert [c.logprobs[i][t].logprob for i, t in enumerate(toks)] == lps


def test_fused_hotpath_numerics(tmp_path, monkeypatch):
    """fused_hotpath runs the kernels' rounding: numerics default to 'official' with it, and an
    explicit 'invariant' (a batch-invariance promise the kernels cannot keep) is refused by name."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    from dsv4.engine.llm_engine import EngineConfig, LLMEngine
    with pytest.raises(ValueError, match="fused_hotpath.*numerics='invariant'"):
        LLMEngine(EngineConfig(fused_hotpath=True, numerics="invariant", log=False))
    eng = LLMEngine(EngineConfig(log=False, max_num_seqs=2, kv_cache_memory="64MiB"))
    assert eng.cfg.numerics == "invariant" and eng.model.num.name == "invariant"
