"""``POST /v1/responses`` (OpenAI's Responses API): its text and function-call subset, served by the
chat-completions path.

``to_chat(body)`` turns a Responses request into a chat-completions body: ``input`` (a string, or
a list of messages and of ``function_call`` / ``function_call_output`` items) and ``instructions``
(a system message first) become ``messages``; ``max_output_tokens`` -> ``max_tokens``; function
``tools`` (flat in the Responses shape) and ``tool_choice`` -> their chat shapes; ``text.format``
(``json_schema`` / ``json_object``) -> ``response_format``; ``temperature``, ``top_p``, ``seed``,
``parallel_tool_calls`` pass through. ``from_chat(chat, body)`` turns the chat response into a
``response`` object: reasoning, message (``output_text``) and ``function_call`` output items,
``status`` "incomplete" with ``incomplete_details`` when ``max_output_tokens`` cut it, usage as
input / output tokens.

Not supported, each a 400 naming the field: ``stream``, ``previous_response_id`` / ``conversation``
(the server keeps no state: ``store`` is accepted and ignored), ``background``, tools other than
functions, input parts other than text (images, files), ``n``-like fields the API does not have.
"""
from __future__ import annotations

import time
import uuid

from . import protocol as P

# fields accepted and without effect here (the server keeps no state, has one service tier)
_IGNORED = ("store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "include")
_UNSUPPORTED = {"stream": "streaming is not supported on /v1/responses (use /v1/chat/completions with stream)",
                "previous_response_id": "the server keeps no responses: send the whole conversation as input",
                "conversation": "the server keeps no conversations: send the whole conversation as input",
                "background": "background responses are not supported",
                "prompt": "stored prompt templates are not supported",
                "reasoning": "reasoning options are not supported (V4's thinking mode is chosen by the chat "
                             "template: use /v1/chat/completions with chat_template_kwargs)"}
_PASS = ("temperature", "top_p", "seed", "parallel_tool_calls", "top_logprobs")


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request(f"{where}.content must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise P.bad_request(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", where)
        if not isinstance(part.get("text"), str):
            raise P.bad_request(f"{where}.content[{j}].text must be a string", where)
        out.append(part["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    msgs = []
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise P.bad_request("instructions must be a string", "instructions")
        msgs.append({"role": "system", "content": instr})
    inp = body.get("input")
    if isinstance(inp, str):
        return msgs + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise P.bad_request("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise P.bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}", "input")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise P.bad_request(f"{where}.{k} must be a string", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)          # parallel calls of one turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(out, (str, list)):
                raise P.bad_request(f"{where}: function_call_output needs a call_id and a string output", "input")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(out, where)})
        else:
            raise P.bad_request(f"{where}: input items of type {kind!r} are not supported (message, "
                                f"function_call and function_call_output are)", "input")
    return msgs


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise P.bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise P.bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        if not isinstance(t.get("name"), str):
            raise P.bad_request(f"tools[{i}].name must be a string", "tools")
        fn = {"name": t["name"]}
        for k in ("description", "parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc):
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise P.bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                                "'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def to_chat(body: dict) -> dict:
    """The chat-completions body of a Responses request (module doc)."""
    if not isinstance(body, dict):
        raise P.bad_request("the request body must be a JSON object")
    for k, why in _UNSUPPORTED.items():
        if body.get(k) not in (None, False):
            raise P.bad_request(f"{k}: {why}", k)
    known = set(_IGNORED) | set(_UNSUPPORTED) | set(_PASS) | {
        "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "truncation"}
    extra = sorted(set(body) - known)
    if extra:
        raise P.bad_request(f"unsupported field(s) for /v1/responses: {', '.join(extra)}", extra[0])
    if body.get("truncation") not in (None, "disabled"):
        raise P.bad_request("truncation: only 'disabled' is supported (a prompt that does not fit is an error)",
                            "truncation")
    chat: dict = {"messages": _messages(body)}
    if "model" in body:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in _PASS:
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("top_logprobs") is not None:
        chat["logprobs"] = True
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
            raise P.bad_request("text must be an object with an optional format object", "text")
        kind = (fmt or {}).get("type", "text")
        if kind == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise P.bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                                "text")
    return chat


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def from_chat(chat: dict, body: dict) -> dict:
    """The ``response`` object of a chat-completions response to ``to_chat(body)`` (module doc)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if msg.get("reasoning_content"):
        output.append({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                       "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        output.append({"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": msg["content"], "annotations": []}]})
    for tc in msg.get("tool_calls") or []:
        output.append({"type": "function_call", "id": _item_id("fc"), "call_id": tc["id"],
                       "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                       "status": "completed"})
    cut = choice.get("finish_reason") == "length"
    use = chat.get("usage") or {}
    tools = body.get("tools") or []
    return {
        "id": _item_id("resp"), "object": "response", "created_at": int(chat.get("created", time.time())),
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": chat.get("model"), "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": tools,
        "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": use.get("prompt_tokens", 0), "input_tokens_details": {
                      "cached_tokens": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                  "output_tokens": use.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": use.get("total_tokens", 0)},
    }


__all__ = ["from_chat", "to_chat"]
