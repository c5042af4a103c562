"""The start-up warm-up (``engine.warmup``): its plan covers the scheduler's sizes, it leaves the
engine as a fresh one (same tokens, counters, prefix cache), and on a GPU no kernel compiles after
start-up on a mix of prompt lengths (a fresh process, Triton's compile hook counted)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import CompileLog, warmup_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("budget,seqs,max_len", [(8192, 16, 1 << 20), (512, 16, 4096), (64, 3, 300), (256, 64, 40)])
def test_plan_stays_inside_the_engine_limits_and_reaches_its_edges(budget, seqs, max_len):
    groups = warmup_plan(budget, seqs, max_len)
    lengths = [n for g in groups for n in g]
    assert all(1 <= n <= max_len - 2 for n in lengths)
    assert max(len(g) for g in groups) == seqs                       # a step with every slot busy
    assert all(len(g) <= seqs for g in groups)
    singles = {g[0] for g in groups if len(g) == 1}
    top = min(budget, max_len - 2)
    assert {1, top} <= singles                                      # one row and a full budget chunk
    p = 1                                                            # every power of two of rows
    while p <= top:
        assert p in singles
        p *= 2
    if max_len - 2 > 2 * budget:                                     # chunked prompts: later chunks see context
        assert max(lengths) > 2 * budget


def _counts(stats):
    return {k: v for k, v in stats.items() if k != "step_time"}     # step_time: wall time


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_warm_up_leaves_the_engine_as_a_fresh_one():
    kw = dict(max_num_batched_tokens=64, max_num_seqs=3, max_model_len=300, log=False, device="cpu")
    warm = LLM(**kw, warmup=True)
    cold = LLM(**kw, warmup=False)
    e = warm.engine
    assert e.warmup["requests"] == len([n for g in warmup_plan(64, 3, 300) for n in g])
    assert e.warmup["prompt_tokens"] > 300
    assert not e.requests and not e.has_unfinished_requests()
    assert e.prefix.num_cached_blocks == 0 and e.prefix.num_snapshots_held == 0
    assert e.cache.num_free_blocks == cold.engine.cache.num_free_blocks
    assert e.cache.num_free_slots == cold.engine.cache.num_free_slots
    assert e.stats == cold.engine.stats                              # all zero, step_time too
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = list(range(7, 7 + 260))                                 # a full block: a prefix-cache hit next
    prompts = [{"prompt_token_ids": p} for p in (list(range(5, 8)), list(range(9, 9 + 70)), shared)]
    assert _tokens(warm.generate(prompts, sp)) == _tokens(cold.generate(prompts, sp))
    again = [{"prompt_token_ids": shared[:256] + [11, 12, 13]}]
    assert _tokens(warm.generate(again, sp)) == _tokens(cold.generate(again, sp))
    assert _counts(e.stats) == _counts(cold.engine.stats)            # same steps, tokens, cache hits
    assert e.stats["prefix_cache_hits"] == 256


def test_compile_log_records_nothing_without_compiles():
    with CompileLog() as log:
        torch.ones(3).sum()
    assert len(log) == 0


_MIX = r"""
import json, random, sys, time
import torch
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.warmup import CompileLog
t0 = time.perf_counter()
llm = LLM(synthetic="flash", synthetic_layers=4, synthetic_experts=16, max_num_batched_tokens=1024,
          max_num_seqs=8, max_model_len=24576, log=False)
startup = time.perf_counter() - t0
rng = random.Random(1)
V = llm.engine.model_config.vocab_size
def prompt(n):
    return {"prompt_token_ids": [rng.randrange(3, 100000) for _ in range(n)]}
mixes = [[rng.randrange(1, 3000)] for _ in range(12)] + [[rng.randrange(1, 900) for _ in range(k)] for k in (2, 3, 5, 8)]
mixes += [[rng.randrange(4000, 22000)], [rng.randrange(1, 60) for _ in range(7)]]
sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
with CompileLog() as log:
    for m in mixes:
        llm.generate([prompt(n) for n in m], sp)
    torch.cuda.synchronize()
print(json.dumps({"startup_s": startup, "warmup": llm.engine.warmup, "mixes": mixes,
                  "compiled": [[e.name, e.signature] for e in log.entries]}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_kernel_compiles_after_start_up_on_a_mix_of_prompt_lengths():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _MIX], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({k: res[k] for k in ("startup_s", "warmup", "mixes")}))       # shown with -s
    assert res["warmup"]["variants"] > 0
    assert res["compiled"] == [], f"compiled after start-up: {res['compiled'][:10]} (mixes {res['mixes']})"


def test_scheduler_defaults_follow_the_device():
    from dsv4.engine.llm_engine import device_defaults
    assert device_defaults("cuda") == (128, 8192)                   # vLLM serve's budget on H100 / H200
    assert device_defaults("cpu") == (16, 512)
    e = LLM(max_model_len=64, kv_cache_memory="64MiB", log=False, device="cpu").engine     # nothing given
    assert (e.cfg.max_num_seqs, e.cfg.max_num_batched_tokens) == (16, 512)
    assert e.scheduler.cfg.max_num_seqs == 16 and e.scheduler.cfg.max_num_batched_tokens == 512
    assert e.warmup is None                                          # twins: nothing to compile
    e = LLM(max_model_len=64, kv_cache_memory="64MiB", log=False, device="cpu", max_num_seqs=3,
            max_num_batched_tokens=40).engine
    assert (e.scheduler.cfg.max_num_seqs, e.scheduler.cfg.max_num_batched_tokens) == (3, 40)
