"""OpenAI / vLLM request parsing, parameter mapping, response shapes and errors.

Everything here is plain functions over dicts (no pydantic): each request field is checked by
hand so that a bad value gives a 400 whose message and ``param`` name the field exactly, in the
OpenAI error schema ``{"error": {"message", "type", "param", "code"}}``.

Status codes and error types used by the server:

======  ==============================  =====================================================
status  ``type``                        when
======  ==============================  =====================================================
400     ``invalid_request_error``       malformed JSON, wrong types, out-of-range values
                                        (``SamplingParams``), bad messages (``ChatEncodingError``),
                                        prompts over ``max_model_len`` (``RequestRejected``)
401     ``authentication_error``        missing or wrong bearer key (code ``invalid_api_key``)
404     ``invalid_request_error``       unknown model (code ``model_not_found``, as OpenAI)
404     ``not_found_error``             unknown route
405     ``invalid_request_error``       wrong HTTP method
415     ``invalid_request_error``       a POST body that is not ``application/json`` (code
                                        ``unsupported_media_type``), refused before it is read
503     ``service_unavailable_error``   bounded waiting queue full (code ``queue_full``) or
                                        engine dead (code ``engine_dead``)
500     ``server_error``                a request failed inside the engine
======  ==============================  =====================================================

Sampling fields are read under their OpenAI / vLLM names (spec §1.2) and passed to
:class:`~dsv4.engine.sampling_params.SamplingParams`, whose ``ValueError`` (message starting with
the parameter name) becomes a 400 with that ``param``.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from .chat_encoding import REASONING_EFFORTS

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

MAX_N = 128                # largest n (samples per prompt) one request may ask for
MAX_BATCH_PROMPTS = 256    # largest list of prompts in one /v1/completions request


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------
# Body and field checks
# --------------------------------------------------------------------------------------------


def parse_json_body(raw: bytes) -> dict:
    if not raw or not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:       # a lone UTF-16 surrogate ("\ud800") parses but is no text: refuse it here, by name
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body contains a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                          "valid Unicode text") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    return body


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def opt_bool(body: dict, name: str, default: bool | None = None) -> bool | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {_tname(v)}", name)
    return v


def opt_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"{name} must be a string, got {_tname(v)}", name)
    return v


def opt_dict(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad_request(f"{name} must be an object, got {_tname(v)}", name)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Request field -> SamplingParams field, for the fields passed through unchanged.
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                "skip_special_tokens", "include_stop_str_in_output")


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


def stream_options(body: dict, stream: bool) -> StreamOptions:
    so = opt_dict(body, "stream_options")
    if so is None:
        return StreamOptions()
    if not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    for k in ("include_usage", "continuous_usage_stats"):
        if so.get(k) is not None and not isinstance(so[k], bool):
            raise bad_request(f"stream_options.{k} must be a boolean", "stream_options")
    return StreamOptions(bool(so.get("include_usage")), bool(so.get("continuous_usage_stats")))


@dataclass
class ParsedSampling:
    params: SamplingParams
    max_tokens_given: bool          # the client set max_tokens / max_completion_tokens
    max_tokens_param: str           # which name it used (for error messages)
    top_logprobs: int | None = None  # chat: how many alternatives to list per token


def logit_bias(body: dict, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI ``logit_bias``: ``{"token id": bias}``, ids (as JSON object keys, so strings) in the
    vocabulary, biases numbers in [-100, 100]."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to biases, got {_tname(lb)}", "logit_bias")
    out: dict[int, float] = {}
    for k, v in lb.items():
        try:
            t = int(k)
        except ValueError:
            raise bad_request(f"logit_bias: key {k!r} is not a token id (an integer)", "logit_bias") from None
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad_request(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias: the bias of token {t} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}], got {v!r}", "logit_bias")
        out[t] = float(v)
    return out or None


def sampling_params(body: dict, kind: str, default_max_tokens: int | None,
                    vocab_size: int | None = None, defaults: dict | None = None) -> ParsedSampling:
    """Map an OpenAI/vLLM request onto ``SamplingParams``; ``kind`` is 'chat' or 'completion'.

    Unset or null fields take ``defaults`` (the model's generation config, ``--generation-config``),
    else vLLM's defaults (temperature 1, top_p 1, ...). ``max_tokens`` defaults to
    ``default_max_tokens`` (16 for completions), else to ``defaults``' max_tokens, else None = up to
    the model length (chat, as vLLM does). ``logit_bias`` ids are checked against ``vocab_size``. A
    ValueError from ``SamplingParams`` becomes a 400 naming the field. Structured outputs are read
    by :func:`structured_outputs`.
    """
    defaults = defaults or {}
    kw: dict[str, Any] = {}
    for name in _PASSTHROUGH:
        if body.get(name) is not None:
            kw[name] = body[name]
        elif name in defaults:
            kw[name] = defaults[name]
    n = body.get("n")
    if n is not None:
        if _is_int(n) and n > MAX_N:
            raise bad_request(f"n must be <= {MAX_N}, got {n}", "n")
        kw["n"] = n
    best_of = body.get("best_of")
    if best_of is not None and best_of != (n if n is not None else 1):
        raise bad_request("best_of is not supported (it must be null or equal to n)", "best_of")
    mt_name = "max_tokens"
    mt = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        mt_name, mt = "max_completion_tokens", body["max_completion_tokens"]
    given = mt is not None
    kw["max_tokens"] = mt if given else default_max_tokens if default_max_tokens is not None else \
        defaults.get("max_tokens")
    if mt == 0 and not isinstance(mt, bool) and not (kind == "completion" and body.get("echo") is True):
        raise bad_request(f"{mt_name} must be >= 1 (0 only with echo, to score the prompt without generating)",
                          mt_name)
    top_logprobs = None
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad_request(f"logprobs must be a boolean for chat completions (use top_logprobs for "
                              f"alternatives), got {_tname(lp)}", "logprobs")
        tl = body.get("top_logprobs")
        if tl is not None:
            if not _is_int(tl) or not 0 <= tl <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {tl!r}",
                                  "top_logprobs")
            if not lp:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if lp:
            top_logprobs = tl or 0
            kw["logprobs"] = top_logprobs
    else:
        lp = body.get("logprobs")
        if lp is not None:
            kw["logprobs"] = lp
            if body.get("echo") is True and _is_int(lp) and not isinstance(lp, bool):
                kw["prompt_logprobs"] = lp          # OpenAI: echo + logprobs scores the prompt too
    pl = body.get("prompt_logprobs")
    if pl is not None:
        if kind == "chat" and body.get("stream") is True:
            raise bad_request("prompt_logprobs is not available when stream is true (as vLLM)", "prompt_logprobs")
        if not _is_int(pl) or not 0 <= pl <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}], got {pl!r}", "prompt_logprobs")
        kw["prompt_logprobs"] = max(pl, kw.get("prompt_logprobs") or 0)
    lb = logit_bias(body, vocab_size)
    if lb is not None:
        kw["logit_bias"] = lb
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        param = msg.split(" ", 1)[0] if msg else None
        if param == "max_tokens":
            param = mt_name
        elif param == "logprobs" and kind == "chat":
            param = "top_logprobs"
        if param not in body:
            param = None
        raise bad_request(msg, param) from None
    return ParsedSampling(params, given, mt_name, top_logprobs)


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_VLLM_SWITCHES = ("disable_fallback", "disable_additional_properties")
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint on the generated text a request asks for, and the field that asked:

    * OpenAI ``response_format``: ``{"type": "json_object"}``, or ``{"type": "json_schema",
      "json_schema": {"name", "schema", "strict"}}`` (always enforced, whatever ``strict`` says);
      ``{"type": "text"}`` asks for nothing;
    * vLLM's ``structured_outputs`` object (one of json, json_object, regex, choice, grammar);
    * vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

    At most one of them may be given. None when the request asks for no constraint."""
    found: list[tuple[str, dict]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format.type must be one of 'text', 'json_object', 'json_schema'",
                              "response_format")
        if rf["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad_request("response_format.json_schema must be an object with the schema under 'schema'",
                                  "response_format")
            if not isinstance(js.get("schema"), dict):
                raise bad_request(f"response_format.json_schema.schema must be a JSON schema object, got "
                                  f"{_tname(js.get('schema'))}", "response_format")
            found.append(("response_format", {"json": js["schema"]}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request(f"structured_outputs must be an object, got {_tname(so)}", "structured_outputs")
        # vLLM's other switches are accepted when they ask for nothing (false), refused when they
        # ask for something this server does not do
        unknown = sorted(k for k, v in so.items() if k not in _STRUCTURED_KEYS + ("disable_any_whitespace",)
                         and v is not None and not (k in _VLLM_SWITCHES and v is False))
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported (supported: "
                              f"{', '.join(_STRUCTURED_KEYS)}, disable_any_whitespace)", "structured_outputs")
        found.append(("structured_outputs", {k: v for k, v in so.items()
                                             if k in _STRUCTURED_KEYS + ("disable_any_whitespace",) and v is not None}))
    for name, key in _GUIDED:
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output; give only one",
                          found[1][0])
    param, kw = found[0]
    try:
        spec = StructuredOutputsParams(**kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if param.startswith("guided_"):
            msg = msg.replace(f"structured_outputs.{next(iter(kw))}", param)
        raise bad_request(msg, param) from None
    return spec, param


def check_lengths(prompt_len: int, ps: ParsedSampling, max_model_len: int, param: str) -> None:
    """vLLM's context checks: the prompt must leave room for a token, and an explicit max_tokens
    must fit within the model length."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"prompt has {prompt_len} tokens (at least 1 token must be generated).", param,
                          "context_length_exceeded")
    mt = ps.params.max_tokens
    if ps.max_tokens_given and mt is not None and prompt_len + mt > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {prompt_len + mt} tokens ({prompt_len} in the prompt, {mt} in the "
                          f"completion). Please reduce the prompt or {ps.max_tokens_param}.",
                          ps.max_tokens_param, "context_length_exceeded")


def check_model(body: dict, served: str) -> None:
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad_request(f"model must be a string, got {_tname(m)}", "model")
    if m != served:
        raise APIError(404, f"The model `{m}` does not exist. This server serves `{served}`.",
                       INVALID_REQUEST, "model", "model_not_found")


def completion_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """``prompt``: str | list[str] | list[int] | list[list[int]] -> a list of prompts."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list):
        raise bad_request(f"prompt must be a string, a list of strings, a list of token ids or a list of "
                          f"token-id lists, got {_tname(p)}", "prompt")
    if not p:
        raise bad_request("prompt must not be an empty list", "prompt")
    if all(_is_int(t) for t in p):
        prompts: list = [p]
    elif all(isinstance(t, str) for t in p):
        prompts = list(p)
    elif all(isinstance(t, list) for t in p):
        prompts = list(p)
    else:
        raise bad_request("prompt: a list must hold only strings, only token ids, or only token-id lists",
                          "prompt")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
    for i, q in enumerate(prompts):
        if isinstance(q, list):
            if not q:
                raise bad_request(f"prompt[{i}] is empty", "prompt")
            bad = [t for t in q if not _is_int(t) or not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}",
                                  "prompt")
    return prompts


# --------------------------------------------------------------------------------------------
# Chat options
# --------------------------------------------------------------------------------------------


@dataclass
class ChatOptions:
    messages: list
    tools: list | None
    template_kwargs: dict
    add_generation_prompt: bool
    tool_choice: str = "auto"            # 'auto' | 'none' | 'required' | 'function' (named: tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True


def chat_options(body: dict, response_format_in_prompt: bool = True) -> ChatOptions:
    """The chat request's messages and options; ``response_format_in_prompt``: put a JSON
    ``response_format`` into the system message, where V4's encoder renders it (not for a Jinja
    ``--chat-template``)."""
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"tools must be a list, got {_tname(tools)}", "tools")
    choice = body.get("tool_choice")
    tool_name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise bad_request('tool_choice: a named tool is {"type": "function", "function": {"name": "..."}}',
                              "tool_choice")
        choice, tool_name = "function", fn["name"]
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                          "tool_choice")
    if choice == "none":
        tools = None
    if choice in ("required", "function") and not tools:
        raise bad_request(f"tool_choice {'required' if choice == 'required' else repr(tool_name)} needs tools "
                          f"to call, and the request has none", "tool_choice")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    kw = dict(opt_dict(body, "chat_template_kwargs") or {})
    for where, value in (("reasoning_effort", body.get("reasoning_effort")),
                         ("chat_template_kwargs", kw.get("reasoning_effort"))):
        if value is not None and (not isinstance(value, str) or value.strip().lower() not in REASONING_EFFORTS):
            name = "reasoning_effort" if where == "reasoning_effort" else "chat_template_kwargs.reasoning_effort"
            raise bad_request(f"{name} must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}", where)
    # Top-level spellings (OpenAI reasoning_effort; DeepSeek API thinking={"type": ...}). A client
    # that asks for a reasoning effort other than "none" gets thinking mode unless it says otherwise.
    effort = body.get("reasoning_effort")
    if effort is not None:
        kw.setdefault("reasoning_effort", effort)
        if "thinking" not in kw and "enable_thinking" not in kw and body.get("thinking") is None \
                and not (isinstance(effort, str) and effort.strip().lower() == "none"):
            kw["thinking"] = True
    if body.get("thinking") is not None:
        kw.setdefault("thinking", body["thinking"])
    rf = body.get("response_format")
    msgs = list(msgs)
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format.type must be one of 'text', 'json_object', 'json_schema'",
                              "response_format")
        if rf["type"] != "text" and response_format_in_prompt:
            # V4 renders a "## Response Format" section in the system prompt; structured_outputs() enforces it
            fmt = rf.get("json_schema", rf) if rf["type"] == "json_schema" else rf
            if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") in ("system", "developer"):
                msgs[0] = {**msgs[0], "response_format": fmt}
            else:
                msgs.insert(0, {"role": "system", "content": "", "response_format": fmt})
    agp = opt_bool(body, "add_generation_prompt", True)
    return ChatOptions(msgs, tools or None, kw, agp, choice, tool_name, body.get("parallel_tool_calls") is not False)


def forced_tool_functions(opts: ChatOptions) -> list[dict] | None:
    """The functions one of which the reply must call (``tool_choice`` "required": any of the
    tools; a named function: that one), or None when the model may answer in text. Call after the
    chat encoder has validated ``opts.tools``."""
    if opts.tool_choice == "required":
        return [t["function"] for t in opts.tools]
    if opts.tool_choice == "function":
        fns = [t["function"] for t in opts.tools if t["function"].get("name") == opts.tool_name]
        if not fns:
            names = ", ".join(repr(t["function"].get("name")) for t in opts.tools)
            raise bad_request(f"tool_choice names the function {opts.tool_name!r}, which is not among the tools "
                              f"({names})", "tool_choice")
        return fns[:1]
    return None


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens read from
    the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM clamps the same way).
    return x if math.isfinite(x) else -9999.0


class TokenText:
    """Decodes single token ids for logprobs (the tokenizer's cached ``token_text``)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __call__(self, tid: int) -> str:
        return self._tok.token_text(tid)


def chat_logprobs(token_ids: list[int], lps: list[dict], top: int, tt: TokenText) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`` for the given tokens."""
    content = []
    for tid, d in zip(token_ids, lps):
        s = tt(tid)
        lp = d.get(tid)
        alts = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({
            "token": s, "logprob": _finite(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": tt(a), "logprob": _finite(v.logprob), "bytes": list(tt(a).encode("utf-8"))}
                             for a, v in alts],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], lps: list[dict], tt: TokenText, offset: int = 0) -> dict:
    """Legacy completions shape: ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, d in zip(token_ids, lps):
        s = tt(tid)
        tokens.append(s)
        lp = d.get(tid)
        token_lps.append(_finite(lp.logprob) if lp is not None else -9999.0)
        tops.append({tt(a): _finite(v.logprob) for a, v in sorted(d.items(), key=lambda kv: -kv[1].logprob)})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_completion_logprobs(prompt_ids: list[int], plps: list, k: int, tt: TokenText) -> dict:
    """The echoed prompt's part of the legacy logprobs: every prompt token, its logprob given the
    ones before it (null for the first, as OpenAI and vLLM give it) and the top ``k``."""
    tokens, token_lps, tops, offsets, pos = [], [], [], [], 0
    for tid, d in zip(prompt_ids, plps):
        s = tt(tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(d[tid].logprob))
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:max(k, 1)]
        tops.append({tt(a): _finite(v.logprob) for a, v in best})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(plps: list | None, tt: TokenText) -> list | None:
    """vLLM's ``prompt_logprobs`` field: [null, {token id: {logprob, rank, decoded_token}}, ...]."""
    if plps is None:
        return None
    return [None if d is None else {str(t): {"logprob": _finite(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token if v.decoded_token is not None
                                             else tt(t)} for t, v in d.items()} for d in plps]


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    return [{"index": i, "id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for i, c in enumerate(calls)]


def chat_message(reasoning: str | None, content: str, tool_calls: list[dict]) -> dict:
    return {"role": "assistant", "content": content if (content or not tool_calls) else None,
            "reasoning_content": reasoning, "reasoning": reasoning, "tool_calls": tool_calls, "refusal": None}


def finish_reason(engine_reason: str | None, tool_calls: list | None) -> str | None:
    """'tool_calls' for an output that ended after its calls; one cut by the length limit says
    'length' whatever calls were complete before the cut."""
    if engine_reason is None:
        return None
    if tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


@dataclass
class ResponseHeader:
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def chat_response(h: ResponseHeader, choices: list[dict], use: dict, prompt_logprobs: list | None = None) -> dict:
    return {"id": h.id, "object": "chat.completion", "created": h.created, "model": h.model,
            "choices": choices, "usage": use, "system_fingerprint": None, "prompt_logprobs": prompt_logprobs}


def chat_chunk(h: ResponseHeader, choices: list[dict], use: dict | None = None, with_usage: bool = False) -> dict:
    d = {"id": h.id, "object": "chat.completion.chunk", "created": h.created, "model": h.model,
         "choices": choices}
    if with_usage:
        d["usage"] = use
    return d


def completion_response(h: ResponseHeader, choices: list[dict], use: dict) -> dict:
    return {"id": h.id, "object": "text_completion", "created": h.created, "model": h.model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_chunk(h: ResponseHeader, choices: list[dict], use: dict | None = None,
                     with_usage: bool = False) -> dict:
    d = {"id": h.id, "object": "text_completion", "created": h.created, "model": h.model, "choices": choices}
    if with_usage:
        d["usage"] = use
    return d


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: {json}\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    if isinstance(obj, str):
        return f"data: {obj}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
