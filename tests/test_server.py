"""The OpenAI-compatible server (``dsv4 serve``) and ``dsv4 bench serve``.

Most tests talk to a REAL server process (``python -m dsv4.cli serve``) on 127.0.0.1, started
once for the module on the default tiny model (invariant numerics: greedy text is the same alone
or batched, so streamed and non-streamed results can be compared). Parsing of reasoning / DSML
tool calls and the bounded waiting queue are tested in-process with a scripted fake engine,
because the random tiny model does not emit well-formed ``</think>`` or DSML.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from dsv4.engine.sampling_params import SamplingParams  # noqa: E402
from serve_helpers import serve_process  # noqa: E402
from dsv4.parallel import free_port  # noqa: E402
from dsv4.engine.sequence import CompletionOutput, Logprob, RequestOutput  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
MODEL = "dsv4-tiny"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    env = dict(os.environ, PYTHONUNBUFFERED="1")        # the session's default model (conftest)
    env.pop("DSV4_API_KEY", None)
    log_path = tmp / "server.log"
    with serve_process(["--api-key", KEY, "--max-num-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN),
                        "--disable-access-log", "--uvicorn-log-level", "warning"], env, log_path) as (proc, base):
        yield SimpleNamespace(base=base, port=int(base.rsplit(":", 1)[1]), log=log_path, proc=proc, tmp=tmp)
    text = log_path.read_text()
    assert "Traceback" not in text and "internal error" not in text, text[-4000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _h():
    return {"Authorization": f"Bearer {KEY}"}


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def _metric(m: dict, name: str, **labels) -> float:
    for k, v in m.items():
        if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()):
            return v
    return 0.0


def _sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects, '[DONE]' kept as the string."""
    events = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ============================================================================ CLI / README


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``dsv4 *args`` in this process (``cli.main``: the command line's parser and exit codes, without a
    process start-up of torch per call): (exit code, stdout, stderr)."""
    from dsv4.cli import main
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:                   # argparse: --help, usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_serve_help_and_readme(capsys):
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", "--help"], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--api-key", "--kv-cache-memory", "--gpu-memory-utilization",
                 "--enforce-eager", "--max-waiting", "--device", "--enable-prefix-caching",
                 "--no-enable-prefix-caching"):
        assert flag in r.stdout, flag
    rc, out, _ = _cli(capsys, "bench", "serve", "--help")
    assert rc == 0 and "--request-rate" in out and "--max-concurrency" in out
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install -q torch==2.13.0 -e . && dsv4 serve\n" in readme
    test_cmd = "python3 -m pip install -q torch==2.13.0 -e '.[test]' && python3 -m pytest -q -n 2 --dist loadfile -m \"not slow\"\n"
    assert test_cmd in readme and test_cmd in (ROOT / ".ci" / "run").read_text()
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in readme
    assert "from openai import OpenAI" in readme
    assert "lm_eval --model local-completions" in readme and "tokenizer_backend=remote" in readme


# ============================================================================ real server: basics


def test_models_health_tokenize(server, client):
    assert httpx.get(server.base + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(server.base + "/v1/models", headers=_h()).json()
    assert raw["object"] == "list" and raw["data"][0]["root"] and raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.base + f"/v1/models/{MODEL}", headers=_h()).json() == raw["data"][0]
    assert client.models.retrieve(MODEL).id == MODEL
    missing = httpx.get(server.base + "/v1/models/gpt-4", headers=_h())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    t = httpx.post(server.base + "/tokenize", headers=_h(), json={"prompt": "Hello world"}).json()
    assert t["tokens"][0] == 0 and t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(server.base + "/detokenize", headers=_h(), json={"tokens": t["tokens"][1:]}).json()
    assert d == {"prompt": "Hello world"}
    t = httpx.post(server.base + "/tokenize", headers=_h(), json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "return_token_strs": True}).json()
    assert t["tokens"] == [0, 128803, t["tokens"][2], 128804, 128822]       # BOS User Hi Assistant </think>
    assert t["token_strs"][1] == "<｜User｜>"
    m = _metrics(server.base)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:iteration_tokens_total_count",
                 "vllm:request_params_n_count", "vllm:request_params_max_tokens_count"):
        assert any(k.split("{")[0] == name for k in m), name
    [info] = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert 'block_size="256"' in info and 'cache_dtype="fp8"' in info and m[info] == 1.0


def test_chat_and_completions_streamed_and_not(server, client):
    msgs = [{"role": "user", "content": "The capital of France is"}]
    with ThreadPoolExecutor(4) as ex:
        f_chat = ex.submit(client.chat.completions.create, model=MODEL, messages=msgs, max_tokens=6, temperature=0)
        f_cmpl = ex.submit(client.completions.create, model=MODEL, prompt="The capital of France is", max_tokens=6,
                           temperature=0)
        f_chat_s = ex.submit(lambda: list(client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True})))
        f_cmpl_s = ex.submit(lambda: list(client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True})))
        chat, cmpl, chat_s, cmpl_s = f_chat.result(), f_cmpl.result(), f_chat_s.result(), f_cmpl_s.result()

    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")
    c0 = chat.choices[0]
    assert c0.message.role == "assistant" and isinstance(c0.message.content, str) and c0.message.content
    assert c0.finish_reason in ("length", "stop")
    n_chat = httpx.post(server.base + "/tokenize", headers=_h(), json={"messages": msgs}).json()["count"]
    n_cmpl = httpx.post(server.base + "/tokenize", headers=_h(), json={"prompt": "The capital of France is"}).json()["count"]
    assert chat.usage.prompt_tokens == n_chat and 1 <= chat.usage.completion_tokens <= 6
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert cmpl.object == "text_completion" and cmpl.choices[0].text and cmpl.usage.prompt_tokens == n_cmpl

    # streamed chat: role first, finish_reason on the last content chunk, then the usage chunk
    assert chat_s[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chat_s if c.choices]
    assert content_chunks[-1].choices[0].finish_reason == c0.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == c0.message.content
    assert chat_s[-1].choices == [] and chat_s[-1].usage.completion_tokens == chat.usage.completion_tokens
    text = "".join(c.choices[0].text for c in cmpl_s if c.choices)
    assert text == cmpl.choices[0].text
    assert [c for c in cmpl_s if c.choices][-1].choices[0].finish_reason == cmpl.choices[0].finish_reason
    assert cmpl_s[-1].usage.prompt_tokens == n_cmpl

    # the raw wire format: data: {json}\n\n ... data: [DONE]\n\n
    with httpx.stream("POST", server.base + "/v1/completions", headers=_h(), timeout=300,
                      json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
                            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    assert body.endswith("data: [DONE]\n\n")
    assert all(part.startswith("data: ") for part in body.split("\n\n") if part)


def test_n_stop_logprobs_seed(server, client):
    prompt = "Once upon a time"
    with ThreadPoolExecutor(6) as ex:
        f_ref = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        f_n2 = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
        f_chat_n2 = ex.submit(client.chat.completions.create, model=MODEL, n=2, max_tokens=4, temperature=1.0,
                              seed=3, messages=[{"role": "user", "content": prompt}])
        f_lp = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                         logprobs=3)
        f_clp = ex.submit(client.chat.completions.create, model=MODEL, max_tokens=4, temperature=0,
                          logprobs=True, top_logprobs=2, messages=[{"role": "user", "content": prompt}])
        seeded = [ex.submit(client.chat.completions.create, model=MODEL, max_tokens=6, temperature=1.0, seed=1234,
                            messages=[{"role": "user", "content": "Tell me a story"}]) for _ in range(2)]
        ref, n2, chat_n2, lp, clp = f_ref.result(), f_n2.result(), f_chat_n2.result(), f_lp.result(), f_clp.result()
        seeded = [f.result() for f in seeded]

    # n=2 greedy: two identical choices
    assert [c.index for c in n2.choices] == [0, 1]
    assert n2.choices[0].text == n2.choices[1].text == ref.choices[0].text
    assert n2.usage.completion_tokens == 2 * ref.usage.completion_tokens
    assert [c.index for c in chat_n2.choices] == [0, 1]
    # seed reproducibility (sampled, temperature 1)
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content

    # completions logprobs: one entry per token, top-3 alternatives
    L = lp.choices[0].logprobs
    assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == lp.usage.completion_tokens
    assert "".join(L.tokens) == lp.choices[0].text and L.text_offset[0] == 0
    assert all(len(t) >= 3 and max(t.values()) <= 0 for t in L.top_logprobs)
    assert all(lp_ == max(t.values()) for lp_, t in zip(L.token_logprobs, L.top_logprobs))   # greedy = top-1
    # chat logprobs
    C = clp.choices[0].logprobs.content
    assert len(C) == clp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes == list(e.token.encode()) for e in C)

    # stop strings: cut the greedy text at a chosen substring
    text = ref.choices[0].text
    assert len(text) >= 4, text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text[:text.index(stop)]
    with ThreadPoolExecutor(2) as ex:
        f1 = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                       stop=[stop])
        f2 = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                       stop=stop, extra_body={"include_stop_str_in_output": True})
        r1, r2 = f1.result(), f2.result()
    assert r1.choices[0].text == cut and r1.choices[0].finish_reason == "stop"
    assert r1.choices[0].model_extra["stop_reason"] == stop
    assert r2.choices[0].text == cut + stop


def test_vllm_request_metrics_add_up(server):
    """The per-request phase histograms split a request's time as vLLM's do (inference = prefill +
    decode, one queue time per request the engine served), and the per-step token histogram sums
    to the prompt and generation token counters."""
    m = _metrics(server.base)
    steps = _metric(m, "vllm:iteration_tokens_total_sum")
    assert steps > 0 and steps == _metric(m, "vllm:prompt_tokens_total") + _metric(m, "vllm:generation_tokens_total")
    pre, dec, inf = (_metric(m, f"vllm:request_{k}_time_seconds_sum") for k in ("prefill", "decode", "inference"))
    assert inf > 0 and abs(inf - pre - dec) < 1e-6 * max(1.0, inf)
    served = _metric(m, "vllm:request_queue_time_seconds_count")
    assert served >= 10 and _metric(m, "vllm:request_params_n_count") == served
    assert _metric(m, "vllm:request_params_max_tokens_count") == served
    assert _metric(m, "vllm:request_params_n_sum") > served                 # the n=2 requests count twice


def test_thinking_and_tool_messages_on_the_real_server(server, client):
    # thinking mode: the prompt opens <think>; everything generated before </think> is reasoning
    t = httpx.post(server.base + "/tokenize", headers=_h(), json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "chat_template_kwargs": {"thinking": True}}).json()
    assert t["tokens"][-1] == 128821                                     # <think>
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}]
    with ThreadPoolExecutor(3) as ex:
        f_think = ex.submit(client.chat.completions.create, model=MODEL, max_tokens=4, temperature=0,
                            messages=[{"role": "user", "content": "Hi"}],
                            extra_body={"chat_template_kwargs": {"thinking": True}})
        f_effort = ex.submit(client.chat.completions.create, model=MODEL, max_tokens=2, temperature=0,
                             messages=[{"role": "user", "content": "Hi"}], reasoning_effort="high")
        f_tool = ex.submit(client.chat.completions.create, model=MODEL, max_tokens=3, temperature=0,
                           messages=msgs, tools=tools)
        think, effort, tool = f_think.result(), f_effort.result(), f_tool.result()
    m = think.choices[0].message
    extra = m.model_extra
    assert isinstance(extra["reasoning_content"], str) and extra["reasoning_content"] == extra["reasoning"]
    assert extra["reasoning_content"] + (m.content or "") != ""
    assert isinstance(effort.choices[0].message.model_extra["reasoning_content"], str)   # top-level effort
    assert tool.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool round trip is encoded: tools section, the DSML call, the result in the next user turn
    t = httpx.post(server.base + "/tokenize", headers=_h(), json={"messages": msgs, "tools": tools}).json()
    prompt = httpx.post(server.base + "/detokenize", headers=_h(), json={"tokens": t["tokens"]}).json()["prompt"]
    assert "## Tools" in prompt and '"name": "get_weather"' in prompt
    assert '<｜DSML｜invoke name="get_weather">' in prompt
    assert '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>' in prompt
    assert "<｜User｜><tool_result>22C and sunny</tool_result><｜Assistant｜></think>" in prompt


# ============================================================================ bad input


_DROP = object()     # remove this field from the good base request
BAD = [
    # (name, method, path, body (dict | raw str | None), headers override, status, error type, param)
    ("malformed json", "POST", "/v1/chat/completions", "{bad", None, 400, "invalid_request_error", None),
    ("body is a list", "POST", "/v1/chat/completions", "[1, 2]", None, 400, "invalid_request_error", None),
    ("empty body", "POST", "/v1/completions", "", None, 400, "invalid_request_error", None),
    ("missing messages", "POST", "/v1/chat/completions", {"messages": _DROP}, None, 400, "invalid_request_error",
     "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, None, 400, "invalid_request_error",
     "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, None, 400,
     "invalid_request_error", "messages"),
    ("unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None,
     400, "invalid_request_error", "messages"),
    ("user without content", "POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, None, 400,
     "invalid_request_error", "messages"),
    ("orphan tool message", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, None, 400,
     "invalid_request_error", "messages"),
    ("temperature < 0", "POST", "/v1/chat/completions", {"temperature": -1}, None, 400, "invalid_request_error",
     "temperature"),
    ("temperature str", "POST", "/v1/chat/completions", {"temperature": "hot"}, None, 400,
     "invalid_request_error", "temperature"),
    ("top_p 0", "POST", "/v1/chat/completions", {"top_p": 0}, None, 400, "invalid_request_error", "top_p"),
    ("top_p > 1", "POST", "/v1/completions", {"top_p": 1.5}, None, 400, "invalid_request_error", "top_p"),
    ("top_k -2", "POST", "/v1/completions", {"top_k": -2}, None, 400, "invalid_request_error", "top_k"),
    ("min_p 2", "POST", "/v1/completions", {"min_p": 2}, None, 400, "invalid_request_error", "min_p"),
    ("n 0", "POST", "/v1/chat/completions", {"n": 0}, None, 400, "invalid_request_error", "n"),
    ("n str", "POST", "/v1/completions", {"n": "2"}, None, 400, "invalid_request_error", "n"),
    ("max_tokens 0", "POST", "/v1/chat/completions", {"max_tokens": 0}, None, 400, "invalid_request_error",
     "max_tokens"),
    ("max_completion_tokens str", "POST", "/v1/chat/completions", {"max_completion_tokens": "x"}, None, 400,
     "invalid_request_error", "max_completion_tokens"),
    ("max_tokens over context", "POST", "/v1/completions", {"max_tokens": MAX_MODEL_LEN + 10}, None, 400,
     "invalid_request_error", "max_tokens"),
    ("presence_penalty 3", "POST", "/v1/chat/completions", {"presence_penalty": 3}, None, 400,
     "invalid_request_error", "presence_penalty"),
    ("frequency_penalty -3", "POST", "/v1/completions", {"frequency_penalty": -3}, None, 400,
     "invalid_request_error", "frequency_penalty"),
    ("repetition_penalty 0", "POST", "/v1/completions", {"repetition_penalty": 0}, None, 400,
     "invalid_request_error", "repetition_penalty"),
    ("stop int", "POST", "/v1/chat/completions", {"stop": 5}, None, 400, "invalid_request_error", "stop"),
    ("stop empty string", "POST", "/v1/completions", {"stop": [""]}, None, 400, "invalid_request_error", "stop"),
    ("stop_token_ids -1", "POST", "/v1/completions", {"stop_token_ids": [-1]}, None, 400,
     "invalid_request_error", "stop_token_ids"),
    ("seed str", "POST", "/v1/chat/completions", {"seed": "abc"}, None, 400, "invalid_request_error", "seed"),
    ("min_tokens > max_tokens", "POST", "/v1/completions", {"min_tokens": 10, "max_tokens": 5}, None, 400,
     "invalid_request_error", "min_tokens"),
    ("ignore_eos int", "POST", "/v1/completions", {"ignore_eos": 1}, None, 400, "invalid_request_error",
     "ignore_eos"),
    ("skip_special_tokens str", "POST", "/v1/completions", {"skip_special_tokens": "no"}, None, 400,
     "invalid_request_error", "skip_special_tokens"),
    ("chat logprobs str", "POST", "/v1/chat/completions", {"logprobs": "yes"}, None, 400,
     "invalid_request_error", "logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", {"top_logprobs": 3}, None, 400,
     "invalid_request_error", "top_logprobs"),
    ("top_logprobs 50", "POST", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, None, 400,
     "invalid_request_error", "top_logprobs"),
    ("completion logprobs 21", "POST", "/v1/completions", {"logprobs": 21}, None, 400, "invalid_request_error",
     "logprobs"),
    ("stream str", "POST", "/v1/chat/completions", {"stream": "yes"}, None, 400, "invalid_request_error",
     "stream"),
    ("stream_options without stream", "POST", "/v1/completions", {"stream_options": {"include_usage": True}},
     None, 400, "invalid_request_error", "stream_options"),
    ("tools not a list", "POST", "/v1/chat/completions", {"tools": "x"}, None, 400, "invalid_request_error",
     "tools"),
    ("tool without name", "POST", "/v1/chat/completions", {"tools": [{"type": "function", "function": {}}]},
     None, 400, "invalid_request_error", "tools"),
    ("tool_choice required", "POST", "/v1/chat/completions", {"tool_choice": "required"}, None, 400,
     "invalid_request_error", "tool_choice"),
    ("chat_template_kwargs str", "POST", "/v1/chat/completions", {"chat_template_kwargs": "x"}, None, 400,
     "invalid_request_error", "chat_template_kwargs"),
    ("reasoning_effort int", "POST", "/v1/chat/completions", {"reasoning_effort": 5}, None, 400,
     "invalid_request_error", "reasoning_effort"),
    ("logit_bias out of range", "POST", "/v1/completions", {"logit_bias": {"1": 500}}, None, 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias id out of vocab", "POST", "/v1/chat/completions", {"logit_bias": {"999999": 1}}, None, 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias key not an id", "POST", "/v1/completions", {"logit_bias": {"abc": 1}}, None, 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias list", "POST", "/v1/completions", {"logit_bias": [1, 2]}, None, 400, "invalid_request_error",
     "logit_bias"),
    ("response_format bogus", "POST", "/v1/chat/completions", {"response_format": {"type": "xml"}}, None, 400,
     "invalid_request_error", "response_format"),
    ("response_format bad schema", "POST", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, None,
     400, "invalid_request_error", "response_format"),
    ("response_format without schema", "POST", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None, 400, "invalid_request_error",
     "response_format"),
    ("guided_regex unclosed", "POST", "/v1/completions", {"guided_regex": "[0-9"}, None, 400,
     "invalid_request_error", "guided_regex"),
    ("structured_outputs unknown key", "POST", "/v1/completions", {"structured_outputs": {"xml": "a"}}, None, 400,
     "invalid_request_error", "structured_outputs"),
    ("two constraints", "POST", "/v1/completions", {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
     None, 400, "invalid_request_error", "guided_choice"),
    ("reasoning_effort bogus", "POST", "/v1/chat/completions", {"reasoning_effort": "bogus"}, None, 400,
     "invalid_request_error", "reasoning_effort"),
    ("chat_template_kwargs.reasoning_effort bogus", "POST", "/v1/chat/completions",
     {"chat_template_kwargs": {"reasoning_effort": "huge"}}, None, 400, "invalid_request_error",
     "chat_template_kwargs"),
    ("tool_choice names no tool", "POST", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, 400, "invalid_request_error",
     "tool_choice"),
    ("tool_choice malformed", "POST", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, None, 400,
     "invalid_request_error", "tool_choice"),
    ("tool_choice and response_format", "POST", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, None, 400, "invalid_request_error", "tool_choice"),
    ("prompt too long", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]}, None, 400,
     "invalid_request_error", "messages"),
    ("completion prompt too long", "POST", "/v1/completions", {"prompt": list(range(1000, 1000 + MAX_MODEL_LEN))},
     None, 400, "invalid_request_error", "prompt"),
    ("missing prompt", "POST", "/v1/completions", {"prompt": _DROP}, None, 400, "invalid_request_error", "prompt"),
    ("prompt float", "POST", "/v1/completions", {"prompt": 3.5}, None, 400, "invalid_request_error", "prompt"),
    ("prompt mixed list", "POST", "/v1/completions", {"prompt": [1, "a"]}, None, 400, "invalid_request_error",
     "prompt"),
    ("prompt id out of vocab", "POST", "/v1/completions", {"prompt": [5, 999999]}, None, 400,
     "invalid_request_error", "prompt"),
    ("prompt empty list", "POST", "/v1/completions", {"prompt": []}, None, 400, "invalid_request_error", "prompt"),
    ("suffix", "POST", "/v1/completions", {"suffix": "x"}, None, 400, "invalid_request_error", "suffix"),
    ("best_of", "POST", "/v1/completions", {"best_of": 3}, None, 400, "invalid_request_error", "best_of"),
    ("echo str", "POST", "/v1/completions", {"echo": "x"}, None, 400, "invalid_request_error", "echo"),
    ("model int", "POST", "/v1/completions", {"model": 5}, None, 400, "invalid_request_error", "model"),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-4"}, None, 404, "invalid_request_error",
     "model"),
    ("unknown model (completions)", "POST", "/v1/completions", {"model": "nope"}, None, 404,
     "invalid_request_error", "model"),
    ("missing key", "POST", "/v1/chat/completions", {}, {}, 401, "authentication_error", None),
    ("wrong key", "POST", "/v1/completions", {}, {"Authorization": "Bearer nope"}, 401, "authentication_error",
     None),
    ("models without key", "GET", "/v1/models", None, {}, 401, "authentication_error", None),
    ("detokenize str", "POST", "/detokenize", {"tokens": "x"}, None, 400, "invalid_request_error", "tokens"),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [-1]}, None, 400, "invalid_request_error", "tokens"),
    ("tokenize without prompt", "POST", "/tokenize", {}, None, 400, "invalid_request_error", "prompt"),
    ("unknown route", "GET", "/v1/nope", None, None, 404, "not_found_error", None),
    ("wrong method", "GET", "/v1/completions", None, None, 405, "invalid_request_error", None),
]
_GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_GOOD_CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_bad_inputs_table(server):
    assert len(BAD) >= 25
    failures = []
    with httpx.Client(base_url=server.base, timeout=120) as c:
        for name, method, path, body, headers, status, etype, param in BAD:
            hdr = _h() if headers is None else headers
            if isinstance(body, dict) and path in ("/v1/chat/completions", "/v1/completions"):
                base = _GOOD_CHAT if "chat" in path else _GOOD_CMPL
                body = {k: v for k, v in {**base, **body}.items() if v is not _DROP}
            content = body if isinstance(body, str) else (json.dumps(body) if body is not None else None)
            r = c.request(method, path, content=content, headers={**hdr, "Content-Type": "application/json"})
            try:
                err = r.json()["error"]
                ok = (r.status_code == status and err["type"] == etype and (param is None or err["param"] == param)
                      and isinstance(err["message"], str) and err["message"] and set(err) == {
                          "message", "type", "param", "code"})
            except Exception as e:  # noqa: BLE001
                ok, err = False, f"{type(e).__name__}: {r.text[:200]}"
            if not ok:
                failures.append(f"{name}: got {r.status_code} {err}")
    assert not failures, "\n".join(failures)
    # the server keeps serving
    r = httpx.post(server.base + "/v1/chat/completions", headers=_h(), json=_GOOD_CHAT, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(server.base + "/health").status_code == 200


# ============================================================================ structured outputs

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"}}, "required": ["city", "days"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def _check_person(v) -> None:
    """PERSON's schema, checked by hand."""
    assert isinstance(v, dict) and {"name", "age"} <= set(v) <= {"name", "age", "pet"}, v
    assert isinstance(v["name"], str) and len(v["name"]) <= 8, v
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool) and 0 <= v["age"] <= 120, v
    assert v.get("pet") in ("cat", "dog", None), v


def _check_tool_call(call) -> None:
    """One OpenAI tool call whose arguments satisfy its tool's parameters schema."""
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "get_weather":
        assert {"city", "days"} <= set(args) <= {"city", "days", "hourly"}, args
        assert args["city"] in ("Paris", "Rome", "Oslo") and isinstance(args["days"], int), args
        assert 1 <= args["days"] <= 7 and isinstance(args.get("hourly", False), bool), args
    else:
        assert call.function.name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"}), args


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_structured_outputs_with_the_openai_client(server, client):
    """response_format json_object / json_schema, tool_choice required / named (streamed), vLLM's
    structured_outputs / guided_json on completions, n=3 (a matcher per sample): the near-random
    tiny model's unconstrained text is not JSON; the constrained text parses and follows the
    schema, and the forced tool calls come back as OpenAI tool_calls whose arguments satisfy the
    tool's schema. (Kept to ~150 generated tokens: on the CI CPU every token costs the same
    whether batched or not.)"""
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    tmsgs = [{"role": "user", "content": "What time is it in Paris?"}]
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create
    choices = ["yes", "no", "maybe not"]
    with ThreadPoolExecutor(8) as ex:
        f_free = ex.submit(chat, model=MODEL, messages=msgs, max_tokens=8, temperature=0)
        f_obj = ex.submit(chat, model=MODEL, messages=msgs, max_tokens=100, temperature=0,
                          response_format={"type": "json_object"})
        f_schema = ex.submit(chat, model=MODEL, messages=msgs, max_tokens=100, temperature=0,
                             response_format=schema_fmt)
        f_req = ex.submit(chat, model=MODEL, messages=tmsgs, max_tokens=100, temperature=0,
                          tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False)
        f_named = ex.submit(lambda: list(chat(
            model=MODEL, messages=tmsgs, max_tokens=100, temperature=0, stream=True, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_time"}})))
        f_choice = ex.submit(client.completions.create, model=MODEL, prompt="Yes or no?", max_tokens=20,
                             temperature=1.0, seed=3, n=3, extra_body={"structured_outputs": {"choice": choices}})
        f_int = ex.submit(client.completions.create, model=MODEL, prompt="A number:", max_tokens=20, temperature=0,
                          extra_body={"guided_json": {"type": "integer", "minimum": 0, "maximum": 999}})
        free, obj, schema, req, named, choice, num = (f.result() for f in (
            f_free, f_obj, f_schema, f_req, f_named, f_choice, f_int))

    assert not _is_json(free.choices[0].message.content), free.choices[0].message.content
    c = obj.choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content
    c = schema.choices[0]
    assert c.finish_reason == "stop", c.message.content
    _check_person(json.loads(c.message.content))
    for text in (obj.choices[0].message.content, c.message.content):      # compact: no whitespace outside strings
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text
    assert [c.index for c in choice.choices] == [0, 1, 2]
    assert all(c.text in choices and c.finish_reason == "stop" for c in choice.choices), choice.choices
    n = json.loads(num.choices[0].text)
    assert num.choices[0].finish_reason == "stop" and isinstance(n, int) and 0 <= n <= 999, num.choices[0].text

    c = req.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content, c.message
    [call] = c.message.tool_calls
    _check_tool_call(call)
    # streamed, named: the call arrives as tool_calls deltas, finish_reason tool_calls
    deltas = [ch.choices[0] for ch in named if ch.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(d.delta.content or "" for d in deltas).strip()
    [call] = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert call.function.name == "get_time"
    _check_tool_call(call)

    # bad input: a 400 whose message says what is wrong
    with pytest.raises(openai.BadRequestError) as e:
        chat(model=MODEL, messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "bogus"}}}}})
    assert e.value.status_code == 400 and "Invalid type" in e.value.message and "response_format" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"5": 101})
    assert "[-100, 100]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"129280": 1})
    assert "outside the vocabulary" in e.value.message


def test_logit_bias_with_the_openai_client(server, client, llm):
    """+100 on one token makes greedy decoding emit only that token; -100 on the greedy choice
    makes the model pick another one."""
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    assert llm.get_tokenizer().decode([first]) == base.choices[0].logprobs.tokens[0]     # the server's greedy token
    tid = 4000
    text = httpx.post(server.base + "/detokenize", headers=_h(), json={"tokens": [tid]}).json()["prompt"]
    assert tid != first and base.choices[0].text != text * 4
    with ThreadPoolExecutor(3) as ex:
        f_up = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                         logit_bias={str(tid): 100})
        f_chat = ex.submit(client.chat.completions.create, model=MODEL, max_tokens=3, temperature=0,
                           messages=[{"role": "user", "content": prompt}], logit_bias={str(tid): 100})
        f_down = ex.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                           logit_bias={str(first): -100}, logprobs=0)
        up, chat, down = f_up.result(), f_chat.result(), f_down.result()
    assert up.choices[0].text == text * 4
    assert chat.choices[0].message.content == text * 3
    assert down.choices[0].logprobs.tokens[0] != base.choices[0].logprobs.tokens[0]


def test_structured_output_survives_preemption(llm):
    """A constrained sequence preempted mid-way re-prefills prompt + output; its matcher stays
    with its tokens, so it finishes as an undisturbed run does, inside the grammar."""
    from dsv4.engine.sampling_params import StructuredOutputsParams
    eng = llm.engine
    sp = SamplingParams(max_tokens=20, temperature=0,
                        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,10}\.[0-9]{2}"))
    ref = llm.generate(["Once upon a time"], sp)[0].outputs[0]
    assert ref.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,10}\.[0-9]{2}", ref.text), ref.text
    assert len(ref.token_ids) > 2, ref.token_ids
    eng.add_request("preempted", "Once upon a time", sp)
    seq = eng.requests["preempted"][0]
    final = None
    while final is None:
        for out in eng.step():
            if out.finished:
                final = out.outputs[0]
        if len(seq.output_ids) == 2 and seq.num_preemptions == 0 and seq in eng.scheduler.running:
            eng.scheduler._preempt(seq)
    assert seq.num_preemptions == 1
    assert (final.text, final.token_ids, final.finish_reason) == (ref.text, ref.token_ids, "stop")


# ============================================================================ concurrency + disconnects


@pytest.mark.slow
def test_64_concurrent_streams_with_disconnects(server):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def main():"]
    rng = random.Random(20260731)
    n_clients = 64
    quitters = set(rng.sample(range(n_clients), round(n_clients / 5)))      # 13 of 64
    quit_after = {i: rng.randint(0, 3) for i in quitters}        # data chunks read before hanging up

    def payload(i: int, stream: bool) -> tuple[str, dict]:
        p = prompts[(i // 2) % len(prompts)]
        long = stream and i in quitters
        body = {"model": MODEL, "max_tokens": 300 if long else 5, "temperature": 0, "stream": stream}
        if long:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        if i % 2 == 0:
            return "/v1/completions", {**body, "prompt": p}
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p}]}

    async def reference(c, i):
        path, body = payload(i, False)
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return ch["text"] if "text" in ch else ch["message"]["content"], ch["finish_reason"]

    async def one(c, i):
        path, body = payload(i, True)
        events = []
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                if i in quitters and len(events) >= quit_after[i]:
                    return i, None                                 # hang up mid-stream
                events.append(line)
        return i, _sse_events(events)

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, headers=_h(), timeout=600, limits=limits) as c:
            refs = await asyncio.gather(*[reference(c, i) for i in range(2 * len(prompts))])
            m0 = _metrics(server.base)
            results = await asyncio.gather(*[one(c, i) for i in range(n_clients)])
        return refs, m0, results

    refs, m0, results = asyncio.run(main())
    checked = 0
    for i, events in results:
        if i in quitters:
            assert events is None
            continue
        assert events[-1] == "[DONE]", (i, events[-3:])
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
        chunks = [e for e in events[:-2]]
        assert all(e["choices"] and e["choices"][0]["index"] == 0 for e in chunks)
        finals = [e["choices"][0]["finish_reason"] for e in chunks]
        assert finals[-1] in ("stop", "length") and all(f is None for f in finals[:-1]), finals
        if i % 2 == 0:
            text = "".join(e["choices"][0]["text"] for e in chunks)
        else:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
        ref_text, ref_finish = refs[i % (2 * len(prompts))]
        assert text == ref_text and finals[-1] == ref_finish, (i, text, ref_text)
        checked += 1
    assert checked == n_clients - len(quitters)

    # every disconnect aborted its request: nothing runs, the KV cache is empty again
    deadline = time.monotonic() + 60
    while True:
        m = _metrics(server.base)
        idle = (_metric(m, "vllm:num_requests_running") == 0 and _metric(m, "vllm:num_requests_waiting") == 0
                and _metric(m, "vllm:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, {k: v for k, v in m.items() if "num_requests" in k or "kv_cache" in k}
    aborts = _metric(m, "vllm:request_success_total", finished_reason="abort") - \
        _metric(m0, "vllm:request_success_total", finished_reason="abort")
    assert aborts == len(quitters)
    assert _metric(m, "vllm:time_to_first_token_seconds_count") > _metric(m0, "vllm:time_to_first_token_seconds_count")
    r = httpx.post(server.base + "/v1/completions", headers=_h(), json=_GOOD_CMPL, timeout=300)
    assert r.status_code == 200


def test_prefix_cache_hits_are_reported(server):
    """A prompt sent again reads its first block from the prefix cache: usage's
    ``prompt_tokens_details.cached_tokens`` (completions, streamed chat's usage chunk),
    ``vllm:prefix_cache_queries`` / ``_hits`` and the cached blocks gauge say so; the start-up log
    says caching is on and how much it can hold."""
    assert "prefix caching on" in server.log.read_text()
    ids = [0] + list(range(2000, 2299))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    m0 = _metrics(server.base)
    r1 = httpx.post(server.base + "/v1/completions", headers=_h(), json=body, timeout=120).json()
    r2 = httpx.post(server.base + "/v1/completions", headers=_h(), json=body, timeout=120).json()
    assert r1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r2["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert r2["choices"][0]["text"] == r1["choices"][0]["text"]
    m = _metrics(server.base)
    d = {k: _metric(m, f"vllm:prefix_cache_{k}_total") - _metric(m0, f"vllm:prefix_cache_{k}_total")
         for k in ("queries", "hits")}
    assert d == {"queries": 600, "hits": 256}
    assert _metric(m, "dsv4:kv_cache_blocks", state="cached") >= 1
    msgs = [{"role": "user", "content": " ".join(["word"] * 300)}]
    for want in (0, 256):
        r = httpx.post(server.base + "/v1/chat/completions", headers=_h(), timeout=120, json={
            "model": MODEL, "messages": msgs, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
        ev = _sse_events(r.text.split("\n\n"))
        assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == want


# ============================================================================ bench serve


def test_bench_serve(server):
    out = server.tmp / "bench.json"
    png = server.tmp / "bench.png"
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--port", str(server.port),
                        "--api-key", KEY, "--num-prompts", "6", "--random-input-len", "8", "--random-output-len",
                        "4", "--ignore-eos", "--max-concurrency", "3", "--seed", "1", "--save-result",
                        "--result-file", str(out), "--plot", str(png)],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout and "Mean TTFT (ms)" in r.stdout and "P99 ITL (ms)" in r.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0 and res["model_id"] == MODEL     # found by GET /v1/models
    assert res["total_input_tokens"] == 6 * 8 and res["total_output_tokens"] == 6 * 4
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
              "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p50_itl_ms",
              "mean_e2el_ms", "p99_e2el_ms"):
        assert res[k] > 0, k
    assert res["max_concurrent_requests"] <= 3
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    if png.exists():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_shared_prefix_and_multi_turn_workloads(server, capsys):
    """``prefix_repetition``: prompts sharing a 300-token prefix read its first block from the
    cache (the test request computed it); ``multi_turn``: each later turn resends the conversation
    and reads the earlier turns' blocks; the report gives the mean TTFT per turn. (The bench runs in
    this process, ``cli.main``; test_bench_serve runs the command as its own process.)"""
    def bench(*args):
        out = server.tmp / f"bench-{args[1]}.json"
        rc, stdout, stderr = _cli(capsys, "bench", "serve", "--port", str(server.port), "--api-key", KEY,
                                  "--ignore-eos", "--max-concurrency", "2", "--seed", "3", "--disable-tqdm",
                                  "--result-file", str(out), *args)
        assert rc == 0, stdout + stderr
        return json.loads(out.read_text()), stdout

    res, _ = bench("--dataset-name", "prefix_repetition", "--num-prompts", "3", "--prefix-repetition-prefix-len",
                   "300", "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "1",
                   "--prefix-repetition-output-len", "2")
    assert res["completed"] == 3 and res["total_input_tokens"] == 3 * 308 and res["total_output_tokens"] == 6
    assert res["total_cached_tokens"] == 3 * 256 and res["dataset_name"] == "prefix_repetition"
    res, text = bench("--dataset-name", "multi_turn", "--num-prompts", "2", "--multi-turn-turns", "2",
                      "--random-input-len", "260", "--random-output-len", "2", "--multi-turn-user-len", "8")
    assert res["completed"] == 4 and len(res["mean_ttft_ms_by_turn"]) == 2 and "Mean TTFT turn 2 (ms)" in text
    assert res["total_cached_tokens"] >= 3 * 256          # both second turns, and conversation 0's first
    rc, _, err = _cli(capsys, "bench", "serve", "--port", str(server.port), "--dataset-name", "prefix_repetition",
                      "--num-prompts", "5")
    assert rc == 2 and "multiple of --prefix-repetition-num-prefixes" in err


def test_bench_serve_chat_counts_tokens_after_the_chat_template(server, capsys):
    """On /v1/chat/completions the input tokens are the templated prompt's (BOS, role tokens, the
    re-tokenised text), as the server's /tokenize of the messages counts them; the bench's own
    count (used when a server sends no usage) is the same. (The bench in this process, ``cli.main``.)"""
    from dsv4.server.bench import chat_messages, make_prompts
    from dsv4.tokenizer import load_tokenizer
    out = server.tmp / "bench-chat.json"
    rc, stdout, stderr = _cli(capsys, "bench", "serve", "--port", str(server.port), "--api-key", KEY, "--endpoint",
                              "/v1/chat/completions", "--num-prompts", "3", "--random-input-len", "8",
                              "--random-output-len", "2", "--ignore-eos", "--seed", "2", "--result-file", str(out),
                              "--disable-tqdm")
    assert rc == 0, stdout + stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["model_id"] == MODEL and res["backend"] == "openai-chat"
    tok = load_tokenizer(None)
    want = 0
    for ids, _ in make_prompts(3, 8, 2, 0.0, 2):
        msgs, n = chat_messages(ids, tok)
        t = httpx.post(server.base + "/tokenize", headers=_h(), json={"model": MODEL, "messages": msgs}).json()
        assert n == t["count"]
        want += n
    assert res["total_input_tokens"] == want and want > 3 * 8


# ============================================================================ in-process: fake engine


class _FakeCache:
    def __init__(self):
        self.num_blocks, self.used = 100, 0

    def usage(self):
        return self.used / self.num_blocks

    @property
    def num_free_blocks(self):
        return self.num_blocks - self.used


class _FakeSeq:
    def __init__(self, rid, index, params, detok):
        self.request_id, self.index, self.params = rid, index, params
        self.token_ids: list[int] = []
        self.text = ""
        self.detok = detok
        self.finish_reason = None
        self.logprobs = [] if params.logprobs is not None else None


class FakeEngine:
    """Engine stand-in that 'generates' a fixed reply, one token per step, with the real tokenizer
    and incremental detokenizer. ``go`` unset: requests are admitted but make no progress."""

    def __init__(self, reply: str, max_running: int = 4):
        from dsv4.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(None)
        self.model_config = SimpleNamespace(vocab_size=129280, eos_token_id=1, bos_token_id=0)
        self.max_model_len = 4096
        self.cfg = SimpleNamespace(model=None)
        self.reply_ids = self.tokenizer.encode(reply)
        self.scheduler = SimpleNamespace(running=[], waiting=deque(), num_preemptions=0)
        self.cache = _FakeCache()
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.max_running = max_running
        self.requests: dict[str, tuple[list, list[_FakeSeq]]] = {}
        self.go = threading.Event()
        self.go.set()
        self.thread_ids: set[int] = set()
        self.prompts: list[list[int]] = []          # every prompt added, in order

    def add_request(self, rid, prompt, params, arrival=None):
        self.thread_ids.add(threading.get_ident())
        seqs = [_FakeSeq(rid, i, params, self.tokenizer.incremental_detokenizer(params.skip_special_tokens))
                for i in range(params.n)]
        self.requests[rid] = (list(prompt), seqs)
        self.prompts.append(list(prompt))
        self.scheduler.waiting.extend(seqs)

    def abort_request(self, rid):
        for s in self.requests.get(rid, ([], []))[1]:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self._drop(s)

    def _drop(self, s):
        if s in self.scheduler.running:
            self.scheduler.running.remove(s)
            self.cache.used -= 1
        elif s in self.scheduler.waiting:
            self.scheduler.waiting.remove(s)

    def has_unfinished_requests(self):
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(0.002)
        touched = set()
        while self.scheduler.waiting and len(self.scheduler.running) < self.max_running:
            s = self.scheduler.waiting.popleft()
            self.scheduler.running.append(s)
            self.cache.used += 1
        if self.go.is_set():
            for s in list(self.scheduler.running):
                k = len(s.token_ids)
                if k >= len(self.reply_ids) or k >= (s.params.max_tokens or 10**9):
                    continue
                tok = self.reply_ids[k]
                s.token_ids.append(tok)
                if s.logprobs is not None:
                    s.logprobs.append({tok: Logprob(-0.25), 5: Logprob(-2.0)})
                s.text += s.detok.add(tok)
                self.stats["generation_tokens"] += 1
                if len(s.token_ids) == len(self.reply_ids):
                    s.finish_reason = "stop"
                elif len(s.token_ids) == s.params.max_tokens:
                    s.finish_reason = "length"
                if s.finish_reason:
                    self._drop(s)
                touched.add(s.request_id)
            self.stats["steps"] += 1
        for rid, (_, seqs) in self.requests.items():
            if all(s.finish_reason for s in seqs):
                touched.add(rid)
        outs = []
        for rid in touched:
            prompt, seqs = self.requests[rid]
            fin = all(s.finish_reason for s in seqs)
            outs.append(RequestOutput(rid, None, prompt, [
                CompletionOutput(s.index, s.text, list(s.token_ids), None,
                                 list(s.logprobs) if s.logprobs is not None else None, s.finish_reason)
                for s in seqs], fin, {"arrival": 0.0, "first_token_time": None}))
            if fin:
                del self.requests[rid]
        return outs


async def _asgi_call(app, fn):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
        return await fn(c)


def _fake_app(reply: str, **kw):
    from dsv4.server.app import build_app
    eng = FakeEngine(reply, max_running=kw.pop("max_running", 4))
    app = build_app(eng, served_model_name=MODEL, **kw)
    return app, eng


DSML_REPLY = ("I'll check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
              "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
              "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
              "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


def test_tool_calls_and_reasoning_are_parsed_in_process():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    async def run(app, body):
        async def go(c):
            r1 = await c.post("/v1/chat/completions", json=body)
            r2 = await c.post("/v1/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}})
            return r1, r2
        try:
            return await _asgi_call(app, go)
        finally:
            app.state.server.aeng.shutdown()

    # DSML tool call -> OpenAI tool_calls, finish_reason tool_calls
    app, eng = _fake_app(DSML_REPLY)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": tools, "max_tokens": 200}
    r1, r2 = asyncio.run(run(app, body))
    assert r1.status_code == 200, r1.text
    ch = r1.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["content"] == "I'll check."
    [call] = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    ev = _sse_events(r2.text.split("\n\n"))
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] > 10
    deltas = [e["choices"][0] for e in ev[:-2]]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "I'll check."
    assert deltas[-1]["finish_reason"] == "tool_calls"
    [tc] = deltas[-1]["delta"]["tool_calls"]
    assert tc["index"] == 0 and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert not any("｜DSML｜" in (d["delta"].get("content") or "") for d in deltas)
    assert eng.thread_ids and len(eng.thread_ids) == 1 and threading.get_ident() not in eng.thread_ids

    # thinking: reasoning before </think>, content after; both spellings of the field
    app, _ = _fake_app("Let me think. 2+2=4.</think>The answer is 4.")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200,
            "chat_template_kwargs": {"thinking": True}, "logprobs": True, "top_logprobs": 1}
    r1, r2 = asyncio.run(run(app, body))
    msg = r1.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me think. 2+2=4."
    assert msg["content"] == "The answer is 4." and msg["tool_calls"] == []
    assert r1.json()["choices"][0]["finish_reason"] == "stop"
    assert len(r1.json()["choices"][0]["logprobs"]["content"]) == r1.json()["usage"]["completion_tokens"]
    ev = _sse_events(r2.text.split("\n\n"))
    deltas = [e["choices"][0]["delta"] for e in ev[:-2]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me think. 2+2=4."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    assert ev[-3]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_cut_by_max_tokens_keep_the_complete_calls():
    """Parallel calls cut by max_tokens inside the second: the first (complete) call comes back in
    ``tool_calls``, streamed and not; no DSML reaches ``content``; finish_reason stays 'length'."""
    two = DSML_REPLY.replace("</｜DSML｜tool_calls>", DSML_REPLY[DSML_REPLY.index("<｜DSML｜invoke"):])
    app, eng = _fake_app(two)
    n = len(eng.tokenizer.encode(DSML_REPLY)) + 8            # tokens: inside the second call
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": n,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}

    async def go(c):
        return (await c.post("/v1/chat/completions", json=body),
                await c.post("/v1/chat/completions", json={**body, "stream": True}))
    try:
        r1, r2 = asyncio.run(_asgi_call(app, go))
    finally:
        app.state.server.aeng.shutdown()
    ch = r1.json()["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["content"] == "I'll check."
    assert [json.loads(c["function"]["arguments"]) for c in ch["message"]["tool_calls"]] == [{"city": "Paris", "days": 3}]
    deltas = [e["choices"][0] for e in _sse_events(r2.text.split("\n\n"))[:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "I'll check."
    assert deltas[-1]["finish_reason"] == "length"
    [tc] = deltas[-1]["delta"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris",
                                                                                                 "days": 3}


def test_posts_that_are_not_json_get_415_before_the_body_is_read():
    """A body sent as text/plain, form data or without a Content-Type (what a cross-site page can
    send without a CORS preflight) is refused with 415 before the server reads it: nothing reaches
    the engine; JSON (any charset, or an ``application/*+json`` type) is served."""
    app, eng = _fake_app("Hi.")
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    read = []

    async def tracked():
        read.append(True)
        yield body.encode()

    async def go(c):
        out = []
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            out.append(await c.post("/v1/completions", content=body, headers={} if ctype is None else
                                    {"Content-Type": ctype}))
        out.append(await c.post("/v1/chat/completions", content=tracked(),
                                headers={"Content-Type": "text/plain", "Content-Length": str(1 << 30)}))
        for ctype in ("application/json; charset=utf-8", "application/vnd.api+json"):
            out.append(await c.post("/v1/completions", content=body, headers={"Content-Type": ctype}))
        return out
    try:
        *bad, ok1, ok2 = asyncio.run(_asgi_call(app, go))
    finally:
        app.state.server.aeng.shutdown()
    for r, got in zip(bad, ("'text/plain'", "'application/x-www-form-urlencoded'", "no Content-Type",
                            "'text/plain'")):
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert "application/json" in r.json()["error"]["message"] and got in r.json()["error"]["message"]
    assert not read and len(eng.prompts) == 2
    assert ok1.status_code == ok2.status_code == 200


def test_enable_log_requests_logs_each_request(capsys):
    """``--enable-log-requests``: one stderr line per request, with its id, prompt length and
    sampling parameters; nothing without it."""
    for on in (True, False):
        app, _ = _fake_app("Hi.", log_requests=on)

        async def go(c):
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
        try:
            r = asyncio.run(_asgi_call(app, go))
        finally:
            app.state.server.aeng.shutdown()
        err = capsys.readouterr().err
        assert r.status_code == 200
        line = f"dsv4 serve: request {r.json()['id']}: 3 prompt tokens [5, 6, 7]; SamplingParams("
        assert (line in err and "max_tokens=2" in err) == on, err


def test_waiting_queue_bound_gives_503_and_recovers():
    app, eng = _fake_app("Hello there, friend.", max_running=1, max_waiting=1)
    srv = app.state.server
    eng.go.clear()

    async def go(c):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        a = asyncio.create_task(c.post("/v1/completions", json=body))      # runs (but makes no progress)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if srv.aeng.snapshot.running == 1:
                break
        b = asyncio.create_task(c.post("/v1/completions", json=body))      # waits
        for _ in range(500):
            await asyncio.sleep(0.01)
            if srv.aeng.snapshot.waiting == 1:
                break
        assert srv.aeng.snapshot.waiting == 1
        full = await c.post("/v1/completions", json=body)                  # over the bound
        full_chat = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "x"}]})
        eng.go.set()
        ra, rb = await a, await b
        ok = await c.post("/v1/completions", json=body)                    # serving again
        metrics = (await c.get("/metrics")).text
        return full, full_chat, ra, rb, ok, metrics

    try:
        full, full_chat, ra, rb, ok, metrics = asyncio.run(_asgi_call(app, go))
    finally:
        srv.aeng.shutdown()
    for r in (full, full_chat):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error" and r.json()["error"]["code"] == "queue_full"
    for r in (ra, rb, ok):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == eng.tokenizer.decode(eng.reply_ids[:3])
    assert re.search(r'vllm:request_success_total\{finished_reason="length",model_name="dsv4-tiny"\} 3\.0', metrics)
    assert 'vllm:num_requests_running{model_name="dsv4-tiny"} 0.0' in metrics


def test_sampling_param_mapping_unit():
    from dsv4.server import protocol as P
    ps = P.sampling_params({"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
                            "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
                            "stop": "x", "stop_token_ids": [7], "max_completion_tokens": 9, "max_tokens": 4,
                            "min_tokens": 2, "ignore_eos": True, "n": 2, "logprobs": True, "top_logprobs": 4,
                            "skip_special_tokens": False, "include_stop_str_in_output": True}, "chat", None)
    p = ps.params
    assert isinstance(p, SamplingParams)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.stop == ["x"] and p.stop_token_ids == [7] and p.max_tokens == 9 and p.min_tokens == 2
    assert p.ignore_eos and p.n == 2 and p.logprobs == 4 and ps.top_logprobs == 4
    assert not p.skip_special_tokens and p.include_stop_str_in_output
    assert P.sampling_params({}, "completion", 16).params.max_tokens == 16
    assert P.sampling_params({}, "chat", None).params.max_tokens is None
    assert P.sampling_params({"logprobs": 2}, "completion", 16).params.logprobs == 2
    with pytest.raises(P.APIError) as e:
        P.sampling_params({"max_completion_tokens": 0}, "chat", None)
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"
    o = P.chat_options({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"})
    assert o.template_kwargs == {"reasoning_effort": "max", "thinking": True}
    o = P.chat_options({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"})
    assert "thinking" not in o.template_kwargs
    o = P.chat_options({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}})
    assert o.template_kwargs["thinking"] == {"type": "enabled"}
    # served model name: dsv4-tiny for the default model, else the checkpoint directory's name
    from dsv4.server.app import _default_name
    assert _default_name(SimpleNamespace(cfg=SimpleNamespace(model=None))) == "dsv4-tiny"
    assert _default_name(SimpleNamespace(cfg=SimpleNamespace(model="/ckpts/DeepSeek-V4-Flash/"))) == "DeepSeek-V4-Flash"


def test_structured_outputs_and_logit_bias_mapping_unit():
    from dsv4.engine.sampling_params import StructuredOutputsParams as S
    from dsv4.server import protocol as P
    assert P.sampling_params({"logit_bias": {"5": 10, "7": -100}}, "chat", None, 100).params.logit_bias == \
        {5: 10.0, 7: -100.0}
    assert P.sampling_params({"logit_bias": {}}, "chat", None, 100).params.logit_bias is None
    assert P.structured_outputs({}) is None and P.structured_outputs({"response_format": {"type": "text"}}) is None
    assert P.structured_outputs({"response_format": {"type": "json_object"}}) == (S(json_object=True),
                                                                                   "response_format")
    assert P.structured_outputs({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON}}}) == (S(json=PERSON), "response_format")
    assert P.structured_outputs({"guided_json": '{"type": "integer"}'}) == (S(json='{"type": "integer"}'),
                                                                            "guided_json")
    assert P.structured_outputs({"structured_outputs": {"regex": "a+", "grammar": None, "disable_fallback": False}}) \
        == (S(regex="a+"), "structured_outputs")
    for flag in (True, False):          # vLLM's switch; compact (True) is the default here
        assert P.structured_outputs({"structured_outputs": {"json_object": True, "disable_any_whitespace": flag}}) \
            == (S(json_object=True, disable_any_whitespace=flag), "structured_outputs")
    assert S(json_object=True).disable_any_whitespace
    with pytest.raises(P.APIError) as e:
        P.structured_outputs({"guided_choice": []})
    assert e.value.param == "guided_choice" and "guided_choice must be a non-empty list" in e.value.message
    tools = [WEATHER_TOOL, TIME_TOOL]
    base = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    o = P.chat_options({**base, "tool_choice": "required", "parallel_tool_calls": False})
    assert (o.tool_choice, o.parallel_tool_calls) == ("required", False)
    assert P.forced_tool_functions(o) == [WEATHER_TOOL["function"], TIME_TOOL["function"]]
    o = P.chat_options({**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert (o.tool_choice, o.tool_name) == ("function", "get_time")
    assert P.forced_tool_functions(o) == [TIME_TOOL["function"]]
    assert P.forced_tool_functions(P.chat_options(base)) is None
    assert P.chat_options({**base, "tool_choice": "none"}).tools is None


@pytest.fixture(scope="module")
def llm(server):
    """The server's model in this process (the default model of the session's cache directory, which
    the server was started with), for the engine's own prompt scoring."""
    from dsv4 import LLM
    return LLM(None, max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB", log=False)


def _prompt_scores(llm, ids: list[int], top: int = 1) -> list:
    """The engine's own scoring of a token-id prompt (no generation): per position, the prompt
    token's and the top ``top`` alternatives' Logprob (None first)."""
    return llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=top))[0] \
        .prompt_logprobs


def test_echo_logprobs_score_the_prompt_as_lm_eval_asks(server, client, llm):
    """lm-eval's loglikelihood request (token-id prompts, echo, logprobs 1, max_tokens 1) and the
    scoring-only form (max_tokens 0): one logprob per prompt token, null for the first, and the
    summed continuation logprob equals the engine's own prompt scoring."""
    ctx = [0] + list(range(1000, 1040))
    cont = [2000, 2001, 2002]
    r = httpx.post(server.base + "/v1/completions", headers=_h(), timeout=120, json={
        "model": MODEL, "prompt": [ctx + cont, ctx], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
        "seed": 1234})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    lp = ch[0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    got = sum(lp["token_logprobs"][len(ctx):-1])                  # lm-eval's slice
    pl = _prompt_scores(llm, ctx + cont, top=0)
    want = sum(pl[len(ctx) + j][cont[j]].logprob for j in range(len(cont)))
    assert abs(got - want) < 1e-3, (got, want)
    assert len(ch[1]["logprobs"]["token_logprobs"]) == len(ctx) + 1
    # streamed: the echo chunk carries the prompt's scores, then the generated token its own; together
    # the non-streamed logprobs
    r = httpx.post(server.base + "/v1/completions", headers=_h(), timeout=120, json={
        "model": MODEL, "prompt": ctx + cont, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
        "seed": 1234, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [e["choices"][0] for e in _sse_events(r.text.split("\n\n"))[:-1] if e["choices"]]
    assert chunks[0]["text"] == ch[0]["text"][:len(chunks[0]["text"])] and chunks[0]["logprobs"] is not None
    assert len(chunks[0]["logprobs"]["token_logprobs"]) == len(ctx) + len(cont)
    merged = {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in ("tokens", "token_logprobs")}
    assert merged["tokens"] == lp["tokens"]
    assert all((a is None and b is None) or abs(a - b) < 1e-4 for a, b in zip(merged["token_logprobs"],
                                                                               lp["token_logprobs"]))
    r = httpx.post(server.base + "/v1/completions", headers=_h(), timeout=120, json={
        "model": MODEL, "prompt": ctx + cont, "max_tokens": 0, "logprobs": 0, "echo": True, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert len(c["logprobs"]["token_logprobs"]) == len(ctx) + len(cont)
    assert abs(sum(c["logprobs"]["token_logprobs"][len(ctx):]) - want) < 1e-3
    pl = c["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ctx) + len(cont) and str(cont[0]) in pl[len(ctx)]
    tok = llm.get_tokenizer()
    assert all(v["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False) for d in pl[1:]
               for t, v in d.items())
    # chat (vLLM's top-level prompt_logprobs): the chat prompt's tokens scored as the engine scores them
    msgs = [{"role": "user", "content": "hi there"}]
    r = httpx.post(server.base + "/v1/chat/completions", headers=_h(), timeout=60, json={
        "model": MODEL, "messages": msgs, "prompt_logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text
    ids = httpx.post(server.base + "/tokenize", headers=_h(), json={"messages": msgs}).json()["tokens"]
    pl, want = r.json()["prompt_logprobs"], _prompt_scores(llm, ids)
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        v = pl[i][str(ids[i])]
        assert abs(v["logprob"] - want[i][ids[i]].logprob) < 1e-3 and v["rank"] == want[i][ids[i]].rank
        assert v["decoded_token"] == tok.decode([ids[i]], skip_special_tokens=False)
    r = httpx.post(server.base + "/v1/chat/completions", headers=_h(), timeout=60, json={
        "model": MODEL, "messages": msgs, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def _lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's ``LocalCompletionsAPI.parse_logprobs``: the continuation's logprob is the sum
    of ``token_logprobs[ctxlen:-1]`` (the last entry is the one generated token); it is greedy when
    each of its tokens' logprob is the best of its ``top_logprobs``."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))))
    return res


def test_lm_eval_remote_tokenizer_and_loglikelihood_requests(server, llm):
    """lm-eval's ``local-completions`` with ``tokenizer_backend=remote``, request for request (its
    ``RemoteTokenizer`` and ``check_remote_tokenizer_support``, ``TemplateLM._encode_pair``,
    ``LocalCompletionsAPI._create_payload``): GET /tokenizer_info, POST /tokenize with
    ``add_special_tokens: false``, POST /detokenize, then one batched /v1/completions of token-id
    prompts. Each summed continuation logprob equals the engine's own prompt scoring, and
    is_greedy, computed as lm-eval does, is the engine's verdict: true for the model's greedy
    continuation, false for a text continuation."""
    base, h = server.base, _h()
    assert httpx.get(base + "/tokenizer_info").status_code == 401
    r = httpx.get(base + "/tokenizer_info", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert info["tokenizer_class"] and info["add_bos_token"] is False and "chat_template" not in info

    def encode(text: str) -> list[int]:
        r = httpx.post(base + "/tokenize", headers=h, json={"prompt": text, "add_special_tokens": False})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def decode(tokens: list[int]) -> str:
        r = httpx.post(base + "/detokenize", headers=h, json={"tokens": tokens})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]

    assert isinstance(encode("test"), list)                 # lm-eval's auto-detection probe
    assert encode(info["eos_token"])[0] == 1 and encode(info["bos_token"])[0] == 0     # eos / prefix token ids
    context, continuation = "Question: What is the capital of France?\nAnswer:", " Paris"
    whole, ctx_text = encode(context + continuation), encode(context)
    assert decode(whole) == context + continuation and whole[:len(ctx_text)] == ctx_text
    pairs = [(ctx_text, whole[len(ctx_text):])]

    # the model's greedy continuation of another context, token by token from the engine's prompt
    # scores (each step scores the context so far plus a placeholder token)
    ctx = encode("The capital of France is")
    greedy: list[int] = []
    for _ in range(3):
        last = _prompt_scores(llm, ctx + greedy + [ctx[-1]], top=2)[-1]
        (t1, a), (_, b) = sorted(last.items(), key=lambda kv: -kv[1].logprob)[:2]
        assert a.logprob - b.logprob > 1e-3, "a near-tie: the greedy token is not well defined here"
        greedy.append(t1)
    pairs.append((ctx, greedy))

    payload = {"model": MODEL, "prompt": [c + k for c, k in pairs], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(base + "/v1/completions", headers=h, json=payload, timeout=120)
    assert r.status_code == 200, r.text
    got = _lm_eval_parse_logprobs(r.json(), [len(c) for c, _ in pairs])
    for (c, k), (lp, is_greedy) in zip(pairs, got):
        pl = _prompt_scores(llm, c + k)
        want = [pl[len(c) + j][t] for j, t in enumerate(k)]
        assert abs(lp - sum(w.logprob for w in want)) < 1e-3, (lp, want)
        assert is_greedy == all(w.rank == 1 for w in want)
    assert [g for _, g in got] == [False, True]


# lm-eval task bodies of the three request kinds (multiple choice, rolling perplexity, generation);
# the test prepends each one's name and its local JSONL data file: no dataset download.
_LM_EVAL_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid", "Rome"], "answer": 0},
    {"question": "Which planet is known as the Red Planet?", "choices": ["Venus", "Mars", "Jupiter"], "answer": 1},
    {"question": "What do bees make?", "choices": ["Milk", "Silk", "Honey", "Wool"], "answer": 2},
]
_LM_EVAL_TASKS = {
    "dsv4_mc": """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]""",
    "dsv4_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}} {{choices[answer]}}."
metric_list: [{metric: word_perplexity}]""",
    "dsv4_gen": """output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices[answer]}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]""",
}


def test_lm_eval_runs_local_tasks_against_the_server(server, llm, tmp_path):
    """lm-evaluation-harness itself (``pip install -e '.[eval]'``; skipped where it is not installed)
    runs README's ``local-completions`` command (its model_args, pointed at this server) with
    batched requests on local task files of every request kind. Each sample it logs is the engine's own
    answer: a choice's loglikelihood and is_greedy from the engine's prompt scoring of lm-eval's
    context / continuation split, a document's rolling loglikelihood from scoring it after the BOS
    (``custom_prefix_token_id=0``), a generation the engine's greedy text; and acc is the mean of the
    choices' argmax being the answer."""
    pytest.importorskip("lm_eval")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in _LM_EVAL_DOCS))
    for name, body in _LM_EVAL_TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
            f"test_split: test\n{body}\n")
    env = dict(os.environ, OPENAI_API_KEY=KEY, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    # README's command, pointed at this server (num_concurrent=1: --batch_size puts 4 prompts in a request)
    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("OPENAI_API_KEY=KEY lm_eval")]
    readme_args = dict(kv.split("=", 1) for kv in line.split("--model_args ")[1].split()[0].split(","))
    assert readme_args["tokenizer_backend"] == "remote" and readme_args["custom_prefix_token_id"] == "0"
    readme_args.update(model=MODEL, base_url=f"{server.base}/v1/completions", auth_token=KEY,
                       max_length=str(MAX_MODEL_LEN), num_concurrent="1")
    args = ",".join(f"{k}={v}" for k, v in readme_args.items())
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                        "--tasks", ",".join(_LM_EVAL_TASKS), "--include_path", str(tmp_path), "--batch_size", "4",
                        "--log_samples", "--output_path", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    def samples(task: str) -> list[dict]:
        (path,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])

    tok = llm.get_tokenizer()
    hits = []
    for s, doc in zip(samples("dsv4_mc"), _LM_EVAL_DOCS):
        ctx = f"Question: {doc['question']}\nAnswer:"
        c = tok.encode(ctx)                                       # TemplateLM._encode_pair
        lls = []
        for choice, ((ll, greedy),) in zip(doc["choices"], s["resps"]):
            k = tok.encode(ctx + " " + choice)[len(c):]
            pl = _prompt_scores(llm, c + k)
            want = [pl[len(c) + j][t] for j, t in enumerate(k)]
            assert abs(float(ll) - sum(w.logprob for w in want)) < 1e-3, (doc, choice, ll, want)
            assert (greedy == "True") == all(w.rank == 1 for w in want)
            lls.append(float(ll))
        hits.append(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert results["dsv4_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits))

    for s, doc in zip(samples("dsv4_ppl"), _LM_EVAL_DOCS):
        ids = tok.encode(f"{doc['question']} {doc['choices'][doc['answer']]}.")
        pl = _prompt_scores(llm, [0] + ids)
        assert abs(float(s["resps"][0][0]) - sum(pl[1 + j][t].logprob for j, t in enumerate(ids))) < 1e-3

    for s, doc in zip(samples("dsv4_gen"), _LM_EVAL_DOCS):
        o = llm.generate([{"prompt_token_ids": tok.encode(f"Question: {doc['question']}\nAnswer:")}],
                         SamplingParams(temperature=0, max_tokens=6, stop=["\n", tok.eos_token], seed=1234))[0]
        assert s["resps"][0][0] == o.outputs[0].text


def test_tokenizer_info_reads_the_tokenizer_config(tmp_path):
    from dsv4.tokenizer import tokenizer_info
    tok = SimpleNamespace(path=str(tmp_path / "tokenizer.json"), bos_token="<b>", eos_token="<e>")
    assert tokenizer_info(tok) == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<b>",
                                   "eos_token": "<e>", "add_bos_token": False, "add_eos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "X", "vocab_file": "/abs/vocab", "model_max_length": 77,
        "eos_token": {"__type": "AddedToken", "content": "<eos>", "lstrip": False}}))
    info = tokenizer_info(tok)
    assert info["tokenizer_class"] == "X" and info["eos_token"] == "<eos>" and info["bos_token"] == "<b>"
    assert info["model_max_length"] == 77 and "vocab_file" not in info
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: cannot read it as JSON"):
        tokenizer_info(tok)


def test_longest_token_constant_matches_the_vocabulary():
    from dsv4.server.app import MAX_TOKEN_CHARS
    from dsv4.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    assert max(len(tok.decode([i])) for i in range(129280)) == MAX_TOKEN_CHARS


def test_bad_and_huge_input_gets_4xx_and_never_stalls_health(server):
    base = server.base
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    cases = [
        ('{"model": "%s", "prompt": "\\ud800 x", "max_tokens": 1}' % MODEL, 400, "surrogate"),
        ('{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL, 400, "surrogate"),
        ("[" * 50000 + "]" * 50000, 400, "nested too deeply"),
        (json.dumps({**ok, "seed": 2 ** 70}), 400, "seed must fit in 64 bits"),
    ]
    for raw, status, text in cases:
        path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        r = httpx.post(base + path, content=raw, headers={**_h(), "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == status and text in r.text, (raw[:60], r.status_code, r.text[:300])
        assert r.json()["error"]["type"] == "BadRequestError" or r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/tokenize", content='{"prompt": "\\ud800"}', headers={**_h(), "Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.text
    # the tokenizer routes need the key like every /v1 route
    assert httpx.post(base + "/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(base + "/detokenize", json={"tokens": [1]}).status_code == 401
    r = httpx.post(base + "/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=_h())
    assert r.status_code == 404 and "not supported" in r.json()["error"]["message"]
    # huge input while /health is polled: a 10 MB body (413 before reading) and a 7 MB prompt (refused before
    # tokenising: more characters than the model length can hold)
    lat, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(base + "/health", timeout=5).status_code == 200
            lat.append(time.monotonic() - t0)
            time.sleep(0.05)
    th = threading.Thread(target=poll)
    th.start()
    try:
        r = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
                       headers={**_h(), "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "--max-request-bytes" in r.text
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={**ok, "prompt": "ab " * ((7 << 20) // 3)}, headers=_h(),
                       timeout=60)
        assert r.status_code == 400 and "maximum context length" in r.text and time.monotonic() - t0 < 5
    finally:
        stop.set()
        th.join()
    assert lat and max(lat) < 0.5, max(lat)


def test_a_500_keeps_the_keep_alive_connection_usable(monkeypatch):
    """An unexpected exception in a route is a 500 in the OpenAI error shape, and the same keep-alive
    connection then serves the next request (uvicorn closes a connection whose app raised: an
    ``http.client`` connection does not reconnect by itself, so the close would fail the second
    request)."""
    import http.client

    import uvicorn
    app, _ = _fake_app("x")
    srv = app.state.server

    def boom(body):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(srv, "detokenize", boom)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/detokenize", body=json.dumps({"tokens": [1]}), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 500 and "RuntimeError: injected fault" in err["message"] and err["type"] == "server_error"
        for _ in range(2):
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            assert r.status == 200
    finally:
        server.should_exit = True
        th.join(10)
        srv.aeng.shutdown()
