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


@pytest.fixture
def one_rank_nccl():
    """A one-rank NCCL process group (the session's, under DSV4_TEST_PROCESS_GROUP=nccl, else its own)."""
    import torch.distributed as dist

    from dsv4.parallel import one_rank_group
    own = not dist.is_initialized()
    if own:
        one_rank_group("cuda")
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    yield dist.group.WORLD
    if own:
        dist.destroy_process_group()


def test_one_rank_nccl_collectives_in_cuda_graphs_change_no_bit(tmp_path, one_rank_nccl):
    """The tensor-parallel forward at one rank with its collectives run (``Group(always=True)``:
    the wo_b all-reduces, the MoE's fp32 expert partials all-reduced then the shared expert added,
    the head's all-gather), NCCL calls captured in the decode CUDA graphs: every collective is the
    identity at one rank and the partial MoE combine rounds to the fused one's bits, so tokens and
    log-probs equal the run without a process group, bit for bit."""
    from dsv4.parallel import Group, default_group, set_default_group
    before = default_group()
    try:
        set_default_group(None)
        _, base = _run(tmp_path)
        set_default_group(Group(one_rank_nccl, always=True))
        llm, tp = _run(tmp_path)
        assert llm.engine.model.group.active and llm.engine.runner.graphs is not None
    finally:
        set_default_group(before)
    for a, b in zip(tp, base):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert [sorted(d.items()) for d in x.logprobs] == [sorted(d.items()) for d in y.logprobs]
