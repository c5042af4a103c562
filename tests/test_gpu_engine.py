"""GPU: the engine's production model on the kernels (decode in CUDA graphs) against the same
model on its torch twins on the same GPU. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

LENS = [705, 730, 300, 130, 64, 17, 5, 3]        # 8 mixed-length requests, two > 700 tokens
N_OUT = 12


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 128000, (n,), generator=g).tolist()} for n in LENS]


def _run(tmp_path, **kw):
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    llm = LLM(None, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024, log=False,
              kv_cache_memory="2GiB", device="cuda", **kw)
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=2)
    return llm, llm.generate(_prompts(), sp)


def _margin_agree(a, b, min_margin=0.5):
    """Greedy steps of a (under test) equal b's wherever b's top-1 leads by min_margin nats, up to
    the first step below it (the runs may part there)."""
    compared = 0
    for ca, cb in zip(a, b):
        x, y = ca.outputs[0], cb.outputs[0]
        for i, t in enumerate(y.token_ids):
            top = sorted((v.logprob for v in y.logprobs[i].values()), reverse=True)
            if top[0] - top[1] < min_margin:
                break
            assert x.token_ids[i] == t, (len(ca.prompt_token_ids), i)
            compared += 1
    return compared


def test_kernels_with_cuda_graphs_match_the_twins(tmp_path):
    """The engine on the GPU (kernels, decode in CUDA graphs) against the same model with the
    torch twins (eager) on the same GPU: greedy tokens wherever the top-1 margin is clear."""
    llm, tri = _run(tmp_path)
    eng = llm.engine
    assert eng.model.ops.kernels and eng.runner.graphs is not None and eng.backend_name == "kernels+cuda-graphs"
    twin_llm, twin = _run(tmp_path, kernels=False)
    assert not twin_llm.engine.model.ops.kernels
    assert _margin_agree(tri, twin) >= len(LENS) * N_OUT * 2 // 5      # steps before a near-tie


def test_decode_step_profile_has_no_unfused_hot_ops(tmp_path):
    """One fused decode step of the tiny model under the profiler: no gather + SDPA attention, no
    complex-number RoPE (its rows come from tables), no data-dependent expert loop (nonzero / per-expert GEMMs), only kernels."""
    import os
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path))
    from torch.profiler import ProfilerActivity, profile
    llm = LLM(None, max_num_seqs=4, max_model_len=1024, log=False, kv_cache_memory="1GiB", device="cuda",
              cuda_graphs=False)
    eng = llm.engine
    eng.add_request("p", {"prompt_token_ids": _prompts()[2]["prompt_token_ids"]},
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()                                   # prefill (fused kernels)
    eng.step()                                   # first decode: compiles the kernels
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()                               # one decode step
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    for bad in ("aten::scaled_dot_product_attention", "aten::_efficient_attention_forward",
                "aten::_flash_attention_forward", "aten::view_as_complex", "aten::nonzero", "aten::polar"):
        assert bad not in names, bad
    n_exp = eng.model_config.n_routed_experts * eng.model_config.num_hidden_layers
    n_mm = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::matmul", "aten::addmm"))
    assert n_mm < n_exp, n_mm                    # no GEMM per expert
    assert any("moe" in n.lower() or "fp4" in n.lower() for n in names)
