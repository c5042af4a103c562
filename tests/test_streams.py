"""The decode step's side stream (``dsv4.streams``, ``DSV4_STREAMS``): the switch, inline branches where
there is no side stream, per-stream arrival counters, and on a GPU the same bits with it on as off."""
import pytest
import torch

from dsv4 import streams


@pytest.mark.parametrize("value,expect", [(None, True), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_switch(monkeypatch, value, expect):
    if value is None:
        monkeypatch.delenv("DSV4_STREAMS", raising=False)
    else:
        monkeypatch.setenv("DSV4_STREAMS", value)
    assert streams.streams_mode() is expect


def test_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("DSV4_STREAMS", "both")
    with pytest.raises(ValueError, match="DSV4_STREAMS='both'"):
        streams.streams_mode()


def test_a_cpu_branch_runs_inline():
    dev = torch.device("cpu")
    assert streams.side_stream(dev, 1) is None
    f = streams.Fork(dev, 1)
    with f.side():
        y = torch.ones(3) * 2
    f.sync()
    f.join()
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_cpu_counters_are_one_buffer_per_device():
    from dsv4.kernels.counters import arrival_counters
    a = arrival_counters("cpu", 8)
    f = streams.Fork(torch.device("cpu"), 1)
    with f.side():
        b = arrival_counters("cpu", 8)
    f.join()
    assert a is b and int(a.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_side_branch_has_its_own_counters_and_is_ordered_by_the_join(monkeypatch):
    from dsv4.kernels.counters import arrival_counters
    monkeypatch.setattr(streams, "STREAMS_ON", True)
    dev = torch.device("cuda")
    main = arrival_counters(dev, 16)
    x = torch.randn(1 << 22, device=dev)
    assert streams.Fork(dev, streams.MAX_ROWS + 1).s is None      # large steps run their branches inline
    f = streams.Fork(dev, streams.MAX_ROWS)
    assert f.s is not None and f.s != torch.cuda.current_stream()
    with f.side():
        assert torch.cuda.current_stream() == streams.side_stream(dev, 1) and streams.on_side_stream(dev)
        side = arrival_counters(dev, 16)
        y = (x * 3).sum()                 # long enough to still run when the join is enqueued
    f.join()
    assert not streams.on_side_stream(dev)
    z = y + 1
    assert side is not main and side.data_ptr() != main.data_ptr()
    assert arrival_counters(dev, 16) is main
    torch.testing.assert_close(z, x.sum() * 3 + 1, rtol=1e-4, atol=1e-2)


_PROMPTS = (5, 300, 1500, 17)


def _engine_run():
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams
    llm = LLM(synthetic="flash", synthetic_layers=4, synthetic_experts=16, max_num_batched_tokens=1024,
              max_num_seqs=8, max_model_len=4096, log=False)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 100000, (n,), generator=g).tolist()} for n in _PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
    res = [[list(o.outputs[0].token_ids), [[(k, v.logprob) for k, v in sorted(d.items())]
                                           for d in o.outputs[0].logprobs]] for o in outs]
    graphs = llm.engine.runner.graphs is not None
    del llm
    torch.cuda.empty_cache()
    return graphs, res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_same_tokens_and_logprobs_with_the_side_stream_on_and_off(monkeypatch):
    """The engine (CUDA-graph decode with the branches captured, chunked prefill) with the side stream on
    (the CSA layers' indexer queries on either stream, the shared expert forked before or after the router) and off:
    the branches read and write disjoint state, so the bits are the same."""
    from dsv4.kernels import moe
    from dsv4.layers.attention import Attention
    runs = {}
    monkeypatch.setattr(streams, "MAX_ROWS", 1 << 30)      # every captured bucket forks
    for mode, early in ((True, False), (True, True), (False, False)):
        monkeypatch.setattr(streams, "STREAMS_ON", mode)
        monkeypatch.setattr(Attention, "INDEX_Q_MAIN", early)
        monkeypatch.setattr(moe, "SHARED_EARLY", early)
        runs[mode, early] = _engine_run()
    assert all(r[0] for r in runs.values())
    assert runs[True, False][1] == runs[False, False][1]
    assert runs[True, True][1] == runs[False, False][1]
