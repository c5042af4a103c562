"""Tensor parallelism through the engine on CPU (gloo, the tiny model): the engine starts its own
worker processes; world size 2 (from a script on stdin without a ``__main__`` guard) gives world
size 1's greedy tokens wherever the top-1 margin is clear, a prefix-cache hit gives the tokens
and log-probs of the same prompt computed without one on either world size (every rank restores
the snapshot rank 0 picked), ``generate`` and ``serve`` work with
``--tensor-parallel-size 2``, a worker dying at start-up fails it at once and a killed worker stops
the server, each with a message naming its rank, and rank counts the model cannot split are
refused before anything starts."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4 import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "1, 2, 3,", "def main():"]
LONG = {"prompt_token_ids": list(range(1000, 1303))}    # 303 tokens: sent again, its first block is a hit


def _run(tp):
    llm = LLM(None, tensor_parallel_size=tp, max_model_len=512, kv_cache_memory="64MiB", log=False)
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS + [LONG], sp)]
        hit = llm.generate([LONG], sp)[0]
        assert hit.num_cached_tokens == 256
        a, b = outs[-1], hit.outputs[0]
        assert a.token_ids == b.token_ids
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        return outs[:-1]
    finally:
        llm.engine.close()


def _env(**kw) -> dict:
    """This environment, with this checkout first on PYTHONPATH (for a script run elsewhere)."""
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, **kw)


# run as a script read from stdin, without a __main__ guard: the workers never import the caller's main
TWO_RANKS_FROM_STDIN = f"""
import json
from dsv4 import LLM, SamplingParams
llm = LLM(None, tensor_parallel_size=2, max_model_len=512, kv_cache_memory="64MiB", log=False)
outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
print(json.dumps([(o.outputs[0].token_ids, [{{t: v.logprob for t, v in d.items()}} for d in o.outputs[0].logprobs])
                  for o in outs]))
"""


@pytest.mark.slow
def test_two_ranks_from_a_stdin_script_give_one_rank_s_greedy_tokens(tmp_path, monkeypatch):
    """``LLM(tensor_parallel_size=2)`` in a script on stdin (``python - <<EOF``, no ``__main__``
    guard) works, and its greedy tokens are world size 1's wherever the top-1 margin is clear."""
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    one = _run(1)
    r = subprocess.run([sys.executable, "-"], input=TWO_RANKS_FROM_STDIN, cwd=str(tmp_path), env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads(r.stdout.strip().splitlines()[-1])
    compared = 0
    for a, (b_ids, b_lps) in zip(one, two):
        for s, (ta, tb) in enumerate(zip(a.token_ids, b_ids)):
            lps = sorted((v.logprob for v in a.logprobs[s].values()), reverse=True)
            if ta != tb:
                assert lps[0] - lps[1] < 1.0, (s, ta, tb, lps)      # only a near-tie may differ
                break
            compared += 1
            # the chosen token's log-prob within 0.3 (split sums round in another order)
            assert abs(a.logprobs[s][ta].logprob - b_lps[s][str(tb)]) < 0.3
    assert compared >= 12


def test_a_worker_dying_at_start_up_fails_at_once_naming_it(tmp_path):
    """A worker that exits while the ranks form their group (here: a bad DSV4_NUM_THREADS, which
    only the worker reads before joining) makes rank 0 raise naming the rank and its error,
    instead of waiting in the rendezvous for torch's 30-minute timeout."""
    script = ("from dsv4.engine.tp_workers import TPWorkers\n"
              "TPWorkers(2, 'cpu', {'path': None, 'synthetic': None, 'kernels': None})\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=_env(DSV4_NUM_THREADS="0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor-parallel worker rank 1 (pid ") and "exited with code 1: " \
        "ValueError: DSV4_NUM_THREADS must be a positive integer, got '0' (while forming the process group)" in last, last


def test_rank_counts_the_model_cannot_split_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 8 attention heads"):
        LLM(None, tensor_parallel_size=3, log=False)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 2 output groups"):
        LLM(None, tensor_parallel_size=4, log=False)
    with pytest.raises(ValueError, match="positive integer"):
        LLM(None, tensor_parallel_size=0, log=False)


@pytest.mark.slow
def test_generate_cli_with_two_ranks(tmp_path):
    env = dict(os.environ, DSV4_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "generate", "Hello", "--max-tokens", "4", "-tp", "2",
                        "--max-model-len", "256", "--kv-cache-memory", "64MiB"], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() and "tensor parallel 2" in r.stderr


@pytest.mark.slow
def test_serve_with_two_ranks_and_a_killed_worker_stops_it(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from serve_helpers import serve_process
    env = dict(os.environ, DSV4_CACHE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    log_path = tmp_path / "server.log"
    with serve_process(["-tp", "2", "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--disable-access-log",
                        "--uvicorn-log-level", "warning"], env, log_path, start_s=240) as (proc, base):
        r = httpx.post(base + "/v1/completions", json={"model": "dsv4-tiny", "prompt": "Hello", "max_tokens": 4,
                                                        "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        pid = int(re.search(r"rank 1 pid (\d+)", log_path.read_text()).group(1))
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30 and proc.returncode != 0
        assert f"tensor-parallel worker rank 1 (pid {pid}) exited" in log_path.read_text()
