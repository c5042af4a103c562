"""OpenAI-compatible HTTP server (FastAPI): ``build_app(engine_or_config, served_model_name, api_key, ...)``.

Routes (spec §1.1): ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
and ``GET /v1/responses/{id}`` (the text, reasoning and function-call subset of the Responses API
over the chat path, streamed or not, with a bounded store: :mod:`.responses`), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus, vLLM names), ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info`` (vLLM shapes; what lm-evaluation-harness's
``tokenizer_backend=remote`` calls), ``GET /version``, ``GET|POST /ping``.

* Streaming is OpenAI's SSE: ``data: {json}\\n\\n`` chunks (chat: the first delta of each choice
  carries ``role``), ``finish_reason`` on each choice's last chunk, an optional usage chunk
  (``stream_options.include_usage``, ``choices: []``), then ``data: [DONE]``.
* Chat prompts go through the V4 encoder, or a Jinja ``--chat-template`` (:mod:`.jinja_template`)
  (``apply_chat_template``; ``chat_template_kwargs``
  thinking / enable_thinking / reasoning_effort, or top-level ``reasoning_effort`` -- which turns
  thinking on unless it is "none" or thinking is given -- and DeepSeek's ``thinking: {"type"}``);
  reasoning comes back as
  ``reasoning_content`` (and vLLM's ``reasoning``), DSML tool calls as OpenAI ``tool_calls``
  (``finish_reason: "tool_calls"``).
* Structured outputs (``response_format``, vLLM's ``structured_outputs`` / ``guided_*``, and
  ``tool_choice`` "required" or a named function, whose DSML grammar comes from
  :mod:`.tool_grammar`) are compiled on a worker thread before the request reaches the engine, so
  a bad schema is a 400 naming its field; ``logit_bias`` ids are checked against the vocabulary.
* The engine runs on its own thread (:mod:`.async_engine`); the event loop only tokenizes (in a
  worker thread) and formats. A client that disconnects aborts its request, freeing its blocks.
* ``api_key`` (bearer) guards every route except ``/health``, ``/ping``, ``/version`` and
  ``/metrics``; ``max_waiting`` bounds the requests waiting for the engine (503 beyond it); a POST
  body that is not JSON is a 415 before it is read; ``allowed_origins`` (CORS) lists the origins
  browsers may call from (none by default). Errors use the schema of :mod:`.protocol`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine.llm_engine import EngineConfig, LLMEngine
from ..engine.sampling_params import StructuredOutputsParams
from ..formats.paging import BLOCK_TOKENS
from ..models import is_hub_id
from ..tokenizer import tokenizer_info
from . import protocol as P
from . import responses as R
from .async_engine import AsyncEngine, EngineError
from .chat_encoding import ChatEncodingError, StreamingParser, apply_chat_template, detect_effort_profile, \
    parse_completion, resolve_chat_options
from .jinja_template import ChatTemplateError, JinjaChatTemplate
from .metrics import ServerMetrics
from .tool_grammar import tool_call_grammar

DEFAULT_MODEL_NAME = "dsv4-tiny"
_TIMEOUT = object()
_POLL_S = 0.5          # how often a request waiting on the engine checks that its client is still there


class ClientGone(Exception):
    pass


class _Inbox:
    """The per-request ``asyncio.Queue`` the engine thread feeds, with a timeout-safe ``get``."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._getter: asyncio.Future | None = None
        self.checked = time.monotonic()      # last check that the client is still connected

    async def get(self, timeout: float):
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            return _TIMEOUT
        g, self._getter = self._getter, None
        return g.result()

    def get_nowait(self):
        return self.queue.get_nowait()

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator (so its ``finally`` aborts the engine
    request) and treats a vanished client as normal."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            await self.body_iterator.aclose()


def _encoding_error_param(msg: str) -> str | None:
    head = msg.split(":", 1)[0]
    for sep in ("[", "."):
        head = head.split(sep, 1)[0]
    return head if head in ("messages", "tools", "chat_template_kwargs", "reasoning_effort") else None


MAX_REQUEST_BYTES = 8 << 20     # default request-body limit (--max-request-bytes)
MAX_TOKEN_CHARS = 128           # the longest token of the V4 vocabulary, in characters (tests/test_server.py)
MAX_STORED_RESPONSES = 1000     # default of --max-stored-responses (the /v1/responses store)


def _text_chars(value) -> int:
    """Characters of every string inside a JSON value (messages, their parts, tool calls)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _default_name(engine) -> str:
    cfg = getattr(engine, "cfg", None)
    if getattr(cfg, "synthetic", None):
        return f"dsv4-synthetic-{cfg.synthetic}"
    model = getattr(cfg, "model", None)
    if model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(str(model)):
        return str(model)               # served under its Hub id, as vLLM serves it
    return os.path.basename(os.path.normpath(str(model))) or DEFAULT_MODEL_NAME


class OpenAIServer:
    def __init__(self, engine, served_model_name: str | None, api_key: str | None, max_waiting: int | None,
                 log: bool = True, max_stored_responses: int = MAX_STORED_RESPONSES, chat_template: str | None = None,
                 log_requests: bool = False):
        self.engine = engine
        self.name = served_model_name or _default_name(engine)
        self.api_key = api_key or None
        self.max_waiting = max_waiting
        self.tokenizer = engine.tokenizer
        self.tt = P.TokenText(engine.tokenizer)
        self.tokenizer_info = tokenizer_info(engine.tokenizer)
        self.template = None if chat_template is None else JinjaChatTemplate(
            chat_template, {"bos_token": engine.tokenizer.bos_token, "eos_token": engine.tokenizer.eos_token})
        if chat_template is not None:
            self.tokenizer_info["chat_template"] = chat_template
        self.log_requests = log_requests
        self.vocab_size = int(engine.model_config.vocab_size)
        self.bos = int(engine.model_config.bos_token_id)
        self.max_model_len = int(engine.max_model_len)
        self.defaults = dict(getattr(engine, "default_sampling", None) or {})     # --generation-config
        self.metrics = ServerMetrics(self.name)
        cfg = getattr(engine, "cfg", None)
        self.metrics.cache_config(block_size=BLOCK_TOKENS, cache_dtype="fp8", num_gpu_blocks=engine.cache.num_blocks,
                                  gpu_memory_utilization=getattr(cfg, "gpu_memory_utilization", None),
                                  enable_prefix_caching=bool(getattr(cfg, "enable_prefix_caching", False)))
        self.aeng = AsyncEngine(engine, self.metrics, log=log)
        self.created = int(time.time())
        self.root = str(getattr(engine, "model_path", None) or self.name)
        self.stored = R.ResponseStore(max_stored_responses)
        self.effort_profile, why = detect_effort_profile(getattr(engine, "model_path", None))
        if log:
            print(f"dsv4: chat encoding: reasoning-effort profile {self.effort_profile!r} ({why})", file=sys.stderr)

    # ------------------------------------------------------------------ common checks
    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                             P.AUTHENTICATION, None, "invalid_api_key")

    def precheck_chars(self, n_chars: int, param: str) -> None:
        """Refuse, before tokenising, text that cannot fit: no V4 token is longer than
        ``MAX_TOKEN_CHARS`` characters, so more than that many per position of the model length is
        certainly too long (a 10 MB prompt is refused in microseconds, not after seconds of BPE)."""
        if n_chars > MAX_TOKEN_CHARS * self.max_model_len:
            raise P.bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"prompt has {n_chars} characters, more than {MAX_TOKEN_CHARS} per token.", param,
                                "context_length_exceeded")

    def check_capacity(self) -> None:
        if not self.aeng.alive:
            raise P.APIError(503, f"the engine is not running ({self.aeng.dead})", P.UNAVAILABLE, None,
                             "engine_dead")
        if self.max_waiting is not None and self.aeng.num_waiting() >= self.max_waiting:
            raise P.APIError(503, f"the server is overloaded: {self.aeng.num_waiting()} requests are waiting "
                                  f"(--max-waiting {self.max_waiting}); retry later", P.UNAVAILABLE, None,
                             "queue_full")

    def encode_chat(self, opts: P.ChatOptions) -> list[int]:
        """The prompt ids of a chat request: V4's encoding, or the ``--chat-template``'s rendering
        (the messages and tools are checked by V4's encoder either way, for the same 400s)."""
        ids = apply_chat_template(self.tokenizer, opts.messages, opts.tools, opts.template_kwargs,
                                  opts.add_generation_prompt, self.effort_profile)
        if self.template is None:
            return ids
        return self.template.encode(self.tokenizer, opts.messages, opts.tools, opts.template_kwargs,
                                    opts.add_generation_prompt)

    async def chat_ids(self, opts: P.ChatOptions) -> list[int]:
        try:
            return await asyncio.to_thread(self.encode_chat, opts)
        except (ChatEncodingError, ChatTemplateError) as e:
            raise P.bad_request(str(e), _encoding_error_param(str(e))) from None

    async def constrain(self, ps: P.ParsedSampling, spec: StructuredOutputsParams, param: str) -> None:
        """Compile ``spec`` (off the event loop; the engine's compile of it is then a cache hit) and
        put it into the request's sampling parameters; a bad schema or grammar is a 400 naming
        ``param``, the field that asked for it."""
        compiler = getattr(self.engine, "grammars", None)
        if compiler is None:
            raise P.bad_request(f"{param}: this engine does not support structured outputs", param)
        try:
            await asyncio.to_thread(compiler.compile, spec)
        except ValueError as e:
            raise P.bad_request(f"{param}: {e}", param) from None
        ps.params = replace(ps.params, structured_outputs=spec)

    async def submit(self, rids: list[str], prompts: list, params, arrival: float, inbox: _Inbox,
                     param: str) -> None:
        """Add sub-requests (tag = position); on any rejection abort the ones accepted and raise 400."""
        k = 0
        if self.log_requests:
            for rid, prompt in zip(rids, prompts):
                print(f"dsv4 serve: request {rid}: {len(prompt)} prompt tokens {prompt[:16]}"
                      f"{'...' if len(prompt) > 16 else ''}; {params}", file=sys.stderr, flush=True)
        try:
            for k, (rid, prompt) in enumerate(zip(rids, prompts)):
                await self.aeng.add(rid, prompt, params, arrival, inbox.queue, tag=k, prompt_tokens=len(prompt))
        except BaseException as e:
            for rid in rids[:k + 1]:      # aborting one that was never added is a no-op
                self.aeng.abort(rid)
            inbox.close()
            if isinstance(e, EngineError):
                raise P.APIError(503, str(e), P.UNAVAILABLE, None, "engine_dead") from None
            if isinstance(e, ValueError):     # RequestRejected and friends
                raise P.bad_request(str(e), param) from None
            raise

    async def _next(self, inbox: _Inbox, request: Request):
        """Everything queued for this request (at least one ``(tag, output)``); raises ClientGone
        when the client went away (checked every ``_POLL_S`` seconds)."""
        while True:
            now = time.monotonic()
            if now - inbox.checked >= _POLL_S:
                inbox.checked = now
                if await request.is_disconnected():
                    raise ClientGone()
            item = await inbox.get(_POLL_S)
            if item is _TIMEOUT:
                continue
            items = [item]
            while True:
                try:
                    items.append(inbox.get_nowait())
                except asyncio.QueueEmpty:
                    break
            return items

    async def _collect(self, inbox: _Inbox, rids: list[str], request: Request) -> list:
        finals: dict[int, Any] = {}
        try:
            while len(finals) < len(rids):
                for tag, out in await self._next(inbox, request):
                    if isinstance(out, Exception):
                        raise P.APIError(500, str(out), P.SERVER_ERROR)
                    if out.finished:
                        finals[tag] = out
        finally:
            inbox.close()
            if len(finals) < len(rids):
                for rid in rids:
                    self.aeng.abort(rid)
        outs = [finals[k] for k in range(len(rids))]
        errors = [o.error for out in outs for o in out.outputs if o.finish_reason == "error"]
        if errors:
            raise P.APIError(500, errors[0], P.SERVER_ERROR)
        return outs

    # ------------------------------------------------------------------ chat
    async def chat(self, body: dict, request: Request):
        arrival = time.monotonic()
        P.check_model(body, self.name)
        stream = P.opt_bool(body, "stream", False)
        so = P.stream_options(body, stream)
        opts = P.chat_options(body, self.template is None)
        ps = P.sampling_params(body, "chat", None, self.vocab_size, self.defaults)
        constraint = P.structured_outputs(body)
        self.precheck_chars(_text_chars(opts.messages), "messages")
        try:
            thinking = resolve_chat_options(opts.template_kwargs, self.effort_profile)[0]
        except ChatEncodingError as e:
            raise P.bad_request(str(e), _encoding_error_param(str(e))) from None
        ids = await self.chat_ids(opts)
        P.check_lengths(len(ids), ps, self.max_model_len, "messages")
        functions = P.forced_tool_functions(opts)
        if functions is not None:
            if constraint is not None:
                raise P.bad_request(f"tool_choice and {constraint[1]} both constrain the output; give only one",
                                    "tool_choice")
            try:
                grammar = tool_call_grammar(functions, opts.parallel_tool_calls and opts.tool_choice == "required")
            except ValueError as e:
                raise P.bad_request(f"tool_choice: {e}", "tools") from None
            constraint = (StructuredOutputsParams(grammar=grammar), "tool_choice")
        if constraint is not None:
            # in thinking mode the prompt ends inside <think>: the constraint starts after </think>
            await self.constrain(ps, replace(constraint[0], thinking=thinking), constraint[1])
        self.check_capacity()
        h = P.ResponseHeader(P.random_id("chatcmpl"), self.name)
        inbox = _Inbox()
        await self.submit([h.id], [ids], ps.params, arrival, inbox, "messages")
        n = ps.params.n
        if stream:
            return _SSEResponse(self._chat_stream(h, ids, n, thinking, ps, so, inbox, request),
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = (await self._collect(inbox, [h.id], request))[0]
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for o in out.outputs:
            parsed = parse_completion(o.text, thinking)
            lp = P.chat_logprobs(o.token_ids, o.logprobs, ps.top_logprobs, self.tt) \
                if ps.top_logprobs is not None and o.logprobs is not None else None
            choices.append({"index": o.index,
                            "message": P.chat_message(parsed.reasoning_content, parsed.content, parsed.tool_calls),
                            "logprobs": lp, "finish_reason": P.finish_reason(o.finish_reason, parsed.tool_calls),
                            "stop_reason": o.stop_reason})
        use = P.usage(len(ids), sum(len(o.token_ids) for o in out.outputs), out.num_cached_tokens)
        plp = P.vllm_prompt_logprobs(out.prompt_logprobs, self.tt) if ps.params.prompt_logprobs is not None else None
        return JSONResponse(P.chat_response(h, choices, use, plp))

    async def _chat_stream(self, h, ids, n, thinking, ps, so: P.StreamOptions, inbox: _Inbox, request: Request):
        done = False
        ntok = [0] * n
        cached = [0]
        with_usage = so.include_usage

        def cont_usage():
            return P.usage(len(ids), sum(ntok), cached[0]) if so.continuous_usage_stats else None

        try:
            for i in range(n):
                yield P.sse(P.chat_chunk(h, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], cont_usage(), with_usage))
            parsers = [StreamingParser(thinking) for _ in range(n)]
            text_len = [0] * n
            finished = [False] * n
            error = None
            while not all(finished) and error is None:
                try:
                    items = await self._next(inbox, request)
                except ClientGone:
                    return
                latest = None
                for _, out in items:
                    if isinstance(out, Exception):
                        error = out
                        break
                    latest = out
                if latest is None:
                    continue
                cached[0] = latest.num_cached_tokens
                for o in latest.outputs:
                    i = o.index
                    if finished[i]:
                        continue
                    new = o.text[text_len[i]:]
                    text_len[i] = len(o.text)
                    r, c = parsers[i].feed(new) if new else ("", "")
                    calls: list = []
                    fin = o.finish_reason is not None
                    if fin:
                        r2, c2, calls = parsers[i].finish()
                        r, c = r + r2, c + c2
                        finished[i] = True
                        if o.finish_reason == "error":
                            error = EngineError(o.error or "request failed")
                    delta: dict[str, Any] = {}
                    if r:
                        delta["reasoning_content"] = delta["reasoning"] = r
                    if c:
                        delta["content"] = c
                    if calls:
                        delta["tool_calls"] = P.tool_call_deltas(calls)
                    lp = None
                    if ps.top_logprobs is not None and o.logprobs is not None and len(o.token_ids) > ntok[i]:
                        lp = P.chat_logprobs(o.token_ids[ntok[i]:], o.logprobs[ntok[i]:], ps.top_logprobs, self.tt)
                    ntok[i] = len(o.token_ids)
                    if not delta and lp is None and not fin:
                        continue
                    ch = {"index": i, "delta": delta, "logprobs": lp,
                          "finish_reason": P.finish_reason(o.finish_reason, calls)}
                    if fin:
                        ch["stop_reason"] = o.stop_reason
                    yield P.sse(P.chat_chunk(h, [ch], cont_usage(), with_usage))
            if error is not None:
                yield P.sse(P.error_body(str(error), P.SERVER_ERROR))
            elif so.include_usage:
                yield P.sse(P.chat_chunk(h, [], P.usage(len(ids), sum(ntok), cached[0]), True))
            yield P.sse("[DONE]")
            done = True
        finally:
            inbox.close()
            if not done:
                self.aeng.abort(h.id)

    # ------------------------------------------------------------------ completions
    async def completions(self, body: dict, request: Request):
        arrival = time.monotonic()
        P.check_model(body, self.name)
        stream = P.opt_bool(body, "stream", False)
        so = P.stream_options(body, stream)
        if body.get("suffix") is not None:
            raise P.bad_request("suffix is not supported", "suffix")
        echo = P.opt_bool(body, "echo", False)
        prompts = P.completion_prompts(body, self.vocab_size)
        for p in prompts:
            if isinstance(p, str):
                self.precheck_chars(len(p), "prompt")
        ps = P.sampling_params(body, "completion", 16, self.vocab_size, self.defaults)
        constraint = P.structured_outputs(body)
        if constraint is not None:
            await self.constrain(ps, *constraint)
        add_special = P.opt_bool(body, "add_special_tokens", True)

        def tokenize():
            return [list(p) if isinstance(p, list) else ([self.bos] if add_special else []) + self.tokenizer.encode(p)
                    for p in prompts]

        ids = await asyncio.to_thread(tokenize)
        for k, p in enumerate(ids):
            if not p:
                raise P.bad_request(f"prompt {k} is empty", "prompt")
            P.check_lengths(len(p), ps, self.max_model_len, "prompt")
        echo_text = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if echo else "" for p in prompts]
        self.check_capacity()
        h = P.ResponseHeader(P.random_id("cmpl"), self.name)
        rids = [h.id if len(ids) == 1 else f"{h.id}-{k}" for k in range(len(ids))]
        inbox = _Inbox()
        await self.submit(rids, ids, ps.params, arrival, inbox, "prompt")
        n = ps.params.n
        ptoks = sum(len(p) for p in ids)
        if stream:
            return _SSEResponse(self._completion_stream(h, rids, ptoks, n, echo_text, ps, so, inbox, request,
                                                        ids if echo and ps.params.logprobs is not None else None),
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outs = await self._collect(inbox, rids, request)
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for k, out in enumerate(outs):
            head = None
            if echo and ps.params.logprobs is not None and out.prompt_logprobs is not None:
                head = P.prompt_completion_logprobs(ids[k], out.prompt_logprobs, ps.params.logprobs, self.tt)
            for o in out.outputs:
                lp = P.completion_logprobs(o.token_ids, o.logprobs, self.tt, len(echo_text[k])) \
                    if o.logprobs is not None else None
                if head is not None:
                    lp = P.merge_completion_logprobs(head, lp or {"tokens": [], "token_logprobs": [],
                                                                  "top_logprobs": [], "text_offset": []})
                choices.append({"index": k * n + o.index, "text": echo_text[k] + o.text, "logprobs": lp,
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                                "prompt_logprobs": P.vllm_prompt_logprobs(out.prompt_logprobs, self.tt)
                                if body.get("prompt_logprobs") is not None else None})
        use = P.usage(ptoks, sum(len(o.token_ids) for out in outs for o in out.outputs),
                      sum(out.num_cached_tokens for out in outs))
        return JSONResponse(P.completion_response(h, choices, use))

    async def _completion_stream(self, h, rids, ptoks, n, echo_text, ps, so, inbox: _Inbox, request: Request,
                                 scored=None):
        """SSE chunks of a completion. Echoed prompts go first; with ``scored`` (the prompts' ids:
        echo with logprobs) each echo chunk waits for its prompt's scores (the prefill's) and carries
        them, as the non-streamed response does."""
        done = False
        m = len(rids)
        ntok = [0] * (m * n)
        text_len = [0] * (m * n)
        offsets = [len(echo_text[k]) for k in range(m) for _ in range(n)]
        finished = [False] * (m * n)
        cached = [0] * m
        with_usage = so.include_usage

        def cont_usage():
            return P.usage(ptoks, sum(ntok), sum(cached)) if so.continuous_usage_stats else None

        echoed = [not echo_text[k] for k in range(m)]

        def echo_chunks(k, lp=None):
            echoed[k] = True
            for j in range(n):
                yield P.sse(P.completion_chunk(h, [{"index": k * n + j, "text": echo_text[k], "logprobs": lp,
                                                    "finish_reason": None}], cont_usage(), with_usage))

        try:
            if scored is None:
                for k in range(m):
                    if not echoed[k]:
                        for c in echo_chunks(k):
                            yield c
            error = None
            while not all(finished) and error is None:
                try:
                    items = await self._next(inbox, request)
                except ClientGone:
                    return
                latest: dict[int, Any] = {}
                for tag, out in items:
                    if isinstance(out, Exception):
                        error = out
                        break
                    latest[tag] = out
                for tag, out in sorted(latest.items()):
                    cached[tag] = out.num_cached_tokens
                    if not echoed[tag]:
                        plps = out.prompt_logprobs
                        if plps is not None and len(plps) >= len(scored[tag]):
                            lp = P.prompt_completion_logprobs(scored[tag], plps, ps.params.logprobs, self.tt)
                        elif any(o.finish_reason is not None for o in out.outputs):
                            lp = None                     # ended before its prompt was scored (an error)
                        else:
                            continue                      # the prefill has not scored the whole prompt yet
                        for c in echo_chunks(tag, lp):
                            yield c
                    for o in out.outputs:
                        i = tag * n + o.index
                        if finished[i]:
                            continue
                        new = o.text[text_len[i]:]
                        text_len[i] = len(o.text)
                        fin = o.finish_reason is not None
                        lp = None
                        if o.logprobs is not None and len(o.token_ids) > ntok[i]:
                            lp = P.completion_logprobs(o.token_ids[ntok[i]:], o.logprobs[ntok[i]:], self.tt, offsets[i])
                            offsets[i] += sum(len(t) for t in lp["tokens"])
                        ntok[i] = len(o.token_ids)
                        if fin:
                            finished[i] = True
                            if o.finish_reason == "error":
                                error = EngineError(o.error or "request failed")
                        if not new and lp is None and not fin:
                            continue
                        ch = {"index": i, "text": new, "logprobs": lp, "finish_reason": o.finish_reason}
                        if fin:
                            ch["stop_reason"] = o.stop_reason
                        yield P.sse(P.completion_chunk(h, [ch], cont_usage(), with_usage))
            if error is not None:
                yield P.sse(P.error_body(str(error), P.SERVER_ERROR))
            elif so.include_usage:
                yield P.sse(P.completion_chunk(h, [], P.usage(ptoks, sum(ntok), sum(cached)), True))
            yield P.sse("[DONE]")
            done = True
        finally:
            inbox.close()
            if not done:
                for rid in rids:
                    self.aeng.abort(rid)

    # ------------------------------------------------------------------ responses
    async def responses(self, body: dict, request: Request):
        """``POST /v1/responses`` over the chat path (:mod:`.responses`)."""
        prior = None
        pid = body.get("previous_response_id") if isinstance(body, dict) else None
        if pid is not None:
            if not isinstance(pid, str):
                raise P.bad_request("previous_response_id must be a string", "previous_response_id")
            hit = self.stored.get(pid)
            if hit is None:
                raise R.not_found(pid, self.stored.size, "previous_response_id")
            prior = hit[1]
        chat, conv = R.to_chat(body, prior)
        stream = P.opt_bool(body, "stream", False)
        store = P.opt_bool(body, "store", True)
        rid = R.new_id("resp")
        if not stream:
            r = await self.chat(chat, request)
            if not isinstance(r, JSONResponse):            # the client went away
                return r
            resp = R.from_chat(json.loads(r.body), body, rid)
            if store:
                self.stored.put(resp, conv)
            return JSONResponse(resp)
        r = await self.chat({**chat, "stream": True, "stream_options": {"include_usage": True}}, request)
        if not isinstance(r, _SSEResponse):
            return r
        return _SSEResponse(self._responses_stream(r.body_iterator, R.ResponseStream(body, rid, self.name),
                                                   conv if store else None),
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _responses_stream(self, chunks, rs: "R.ResponseStream", conv: list | None):
        """The chat stream's SSE chunks re-told as Responses events; the answer is stored at the end
        (``conv``: its conversation, None when ``store`` is false)."""
        try:
            for e in rs.start():
                yield R.sse(e)
            async for raw in chunks:
                data = raw[len("data: "):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    for e in rs.fail(obj["error"]["message"]):
                        yield R.sse(e)
                    return
                for e in rs.feed(obj):
                    yield R.sse(e)
            else:
                return                  # the chat stream ended without [DONE]: the client went away
            for e in rs.finish():
                yield R.sse(e)
            if conv is not None:
                self.stored.put(rs.response, conv)
        finally:
            await chunks.aclose()

    # ------------------------------------------------------------------ tokenizer routes
    async def tokenize(self, body: dict) -> dict:
        P.check_model(body, self.name)
        return_strs = P.opt_bool(body, "return_token_strs", False)
        if "messages" in body:
            ids = await self.chat_ids(P.chat_options(body, self.template is None))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise P.bad_request("prompt (a string) or messages is required", "prompt")
            add_special = P.opt_bool(body, "add_special_tokens", True)
            ids = ([self.bos] if add_special else []) + await asyncio.to_thread(self.tokenizer.encode, prompt)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tt(t) for t in ids] if return_strs else None}

    def detokenize(self, body: dict) -> dict:
        P.check_model(body, self.name)
        toks = body.get("tokens")
        if not isinstance(toks, list):
            raise P.bad_request("tokens must be a list of token ids", "tokens")
        bad = [t for t in toks if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise P.bad_request(f"tokens must be integers in [0, {self.vocab_size}); got {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(toks, skip_special_tokens=False)}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "dsv4", "root": self.root,
            "parent": None, "max_model_len": self.max_model_len, "permission": []}]}

    def metrics_response(self) -> Response:
        s = self.aeng.snapshot
        self.metrics.set_state(s.running, s.waiting, s.kv_usage, s.blocks)
        data, ctype = self.metrics.render()
        return Response(data, media_type=ctype)


def _error(status: int, message: str, type: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status)


class _InternalErrors:
    """ASGI middleware: an unexpected exception of a route becomes a 500 in the OpenAI error shape
    and ends there. Left to Starlette's outermost handler it would be re-raised after the response,
    and uvicorn closes the connection then: a client's next request on that pooled keep-alive
    connection could meet the close. After the response has started (a stream) nothing can be
    sent, and the exception goes on to uvicorn."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)
        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - the point: any route bug is answered, not propagated
            if started:
                raise
            print(f"dsv4 serve: internal error on {scope.get('path')}: {type(e).__name__}: {e}", file=sys.stderr)
            await _error(500, f"internal server error: {type(e).__name__}: {e}", P.SERVER_ERROR)(scope, receive, send)


def build_app(engine_or_config: LLMEngine | EngineConfig | Any = None, served_model_name: str | None = None,
              api_key: str | None = None, max_waiting: int | None = None, log: bool = True,
              max_request_bytes: int = MAX_REQUEST_BYTES,
              max_stored_responses: int = MAX_STORED_RESPONSES, chat_template: str | None = None,
              allowed_origins: list[str] | None = None, log_requests: bool = False) -> FastAPI:
    """The FastAPI app. ``engine_or_config``: an ``LLMEngine`` (or any object with its interface),
    an ``EngineConfig`` (the engine is built now), or None (the default model, default config).
    The engine thread starts with the app (lifespan) or on the first request. ``chat_template``:
    Jinja text replacing V4's chat encoding (:mod:`.jinja_template`); ``allowed_origins``: the
    origins browsers may call the API from (CORS; none by default); ``log_requests``: one line per
    request on stderr."""
    if engine_or_config is None or isinstance(engine_or_config, EngineConfig):
        engine = LLMEngine(engine_or_config or EngineConfig(log=log))
    else:
        engine = engine_or_config
    if max_waiting is not None and max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    srv = OpenAIServer(engine, served_model_name, api_key, max_waiting, log=log,
                       max_stored_responses=max_stored_responses, chat_template=chat_template,
                       log_requests=log_requests)
    srv.max_request_bytes = int(max_request_bytes)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.aeng.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.aeng.shutdown)

    app = FastAPI(title="dsv4", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = P.NOT_FOUND if e.status_code == 404 else P.INVALID_REQUEST
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error(400, str(e), P.INVALID_REQUEST)

    app.add_middleware(_InternalErrors)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    async def _json(request: Request) -> dict:
        """The JSON body: refused with 415 unless its Content-Type is JSON and with 413 past
        ``max_request_bytes`` (both by the headers, before reading; the size also while reading),
        parsed off the event loop. A cross-site page can POST ``text/plain`` without a CORS
        preflight; that body is never read, so it cannot start a generation."""
        ctype = request.headers.get("content-type")
        media = (ctype or "").split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise P.APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json'; got "
                                  f"{'no Content-Type' if ctype is None else repr(ctype)}", P.INVALID_REQUEST, None,
                             "unsupported_media_type")
        limit = srv.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise P.APIError(413, f"the request body has {int(declared)} bytes, more than the server's limit of "
                                  f"{limit} (--max-request-bytes)", P.INVALID_REQUEST, None, "request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise P.APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                                          f"(--max-request-bytes)", P.INVALID_REQUEST, None, "request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise P.bad_request("the client disconnected while sending the body") from None
        raw = b"".join(chunks)
        return await asyncio.to_thread(P.parse_json_body, raw) if len(raw) > 65536 else P.parse_json_body(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        srv.auth(request)
        return await srv.chat(await _json(request), request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.auth(request)
        return await srv.completions(await _json(request), request)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.auth(request)
        return srv.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        srv.auth(request)
        P.check_model({"model": model_id}, srv.name)
        return srv.models()["data"][0]

    @app.get("/health")
    async def health():
        if not srv.aeng.alive:
            return _error(503, f"the engine is not running ({srv.aeng.dead})", P.UNAVAILABLE, None, "engine_dead")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        from .. import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return srv.metrics_response()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        srv.auth(request)
        return await srv.tokenize(await _json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        srv.auth(request)
        return srv.detokenize(await _json(request))

    @app.post("/v1/responses")
    async def responses(request: Request):
        srv.auth(request)
        return await srv.responses(await _json(request), request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        srv.auth(request)
        hit = srv.stored.get(response_id)
        if hit is None:
            raise R.not_found(response_id, srv.stored.size)
        return hit[0]

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request):
        srv.auth(request)
        return srv.tokenizer_info

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(rest: str, request: Request):
        if rest in ("chat/completions", "completions", "models", "responses"):
            raise P.APIError(405, f"{request.method} is not allowed on /v1/{rest}", P.INVALID_REQUEST)
        srv.auth(request)
        raise P.APIError(404, f"/v1/{rest} is not supported by this server; it serves /v1/chat/completions, "
                              f"/v1/completions, /v1/responses and /v1/models", P.NOT_FOUND, None,
                         "unsupported_route")

    return app
