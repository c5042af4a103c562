"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` (OpenAI's Responses API): its text,
reasoning and function-call subset, served by the chat-completions path.

``to_chat(body, prior)`` turns a Responses request into a chat-completions body: ``input`` (a
string, or a list of messages and of ``reasoning`` / ``function_call`` / ``function_call_output``
items) after the stored conversation ``prior`` of ``previous_response_id``, and ``instructions`` (a
system message first; a previous response's instructions are not carried over, as OpenAI does)
become ``messages``; ``max_output_tokens`` -> ``max_tokens``; ``reasoning.effort`` ->
``reasoning_effort`` (V4's thinking modes: "none" answers directly, "max" is Think Max, every
other effort thinks; the reasoning comes back as a ``reasoning`` item); function ``tools`` (flat
in the Responses shape) and ``tool_choice`` -> their chat shapes; ``text.format``
(``json_schema`` / ``json_object``) -> ``response_format``; ``temperature``, ``top_p``, ``seed``,
``parallel_tool_calls``, ``top_logprobs`` pass through.

``from_chat`` turns the chat response into a ``response`` object; :class:`ResponseStream` turns
the chat stream's chunks into the Responses events, in OpenAI's order: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added``, its content
(``response.content_part.added``, ``response.reasoning_text.delta`` / ``.done`` or
``response.output_text.delta`` / ``.done``, ``response.content_part.done``; a function call's
``response.function_call_arguments.delta`` / ``.done``) and ``response.output_item.done``, then
``response.completed``, ``response.incomplete`` (cut by ``max_output_tokens``) or
``response.failed``. Statuses agree: a response cut by the length limit is "incomplete" and so is
the text item the cut fell in; complete function calls before the cut are "completed".

:class:`ResponseStore`: ``store`` (default true) keeps the response and its conversation in a
bounded in-memory LRU (``--max-stored-responses``) for ``previous_response_id`` and
``GET /v1/responses/{id}``; a response evicted or never stored is a 404.

Not supported, each a 400 naming the field: ``conversation`` (use ``previous_response_id``),
``background``, stored ``prompt`` templates, tools other than functions, input parts other than
text (images, files).
"""
from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import OrderedDict

from . import protocol as P

# fields accepted and without effect here (one service tier, no prompt cache, nothing to include)
_IGNORED = ("metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "include")
_UNSUPPORTED = {"conversation": "the server keeps no conversations: chain responses with previous_response_id "
                                "or send the whole conversation as input",
                "background": "background responses are not supported",
                "prompt": "stored prompt templates are not supported"}
_PASS = ("temperature", "top_p", "seed", "parallel_tool_calls", "top_logprobs")
_OWN = ("model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "truncation",
        "reasoning", "stream", "store", "previous_response_id")


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request(f"{where}.content must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text",
                                                                  "reasoning_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise P.bad_request(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", where)
        if not isinstance(part.get("text"), str):
            raise P.bad_request(f"{where}.content[{j}].text must be a string", where)
        out.append(part["text"])
    return "".join(out)


def _input_messages(body: dict) -> list[dict]:
    """The chat messages of ``input`` (without the instructions)."""
    inp = body.get("input")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise P.bad_request("input must be a string or a non-empty list of items", "input")
    msgs: list[dict] = []
    reasoning = None            # a reasoning item's text, for the assistant turn that follows it

    def assistant() -> dict:
        nonlocal reasoning
        if msgs and msgs[-1]["role"] == "assistant" and reasoning is None:
            return msgs[-1]
        msgs.append({"role": "assistant", "content": None})
        if reasoning is not None:
            msgs[-1]["reasoning_content"], reasoning = reasoning, None
        return msgs[-1]

    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise P.bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}", "input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                m = assistant()
                m["content"] = (m["content"] or "") + text
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            reasoning = _text_of(item.get("content") or [], where)
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise P.bad_request(f"{where}.{k} must be a string", "input")
            assistant().setdefault("tool_calls", []).append(   # parallel calls of one turn share it
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(out, (str, list)):
                raise P.bad_request(f"{where}: function_call_output needs a call_id and a string output", "input")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(out, where)})
        else:
            raise P.bad_request(f"{where}: input items of type {kind!r} are not supported (message, reasoning, "
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


def reasoning_effort(body: dict) -> str | None:
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict) or not isinstance(r.get("effort"), (str, type(None))):
        raise P.bad_request("reasoning must be an object with an optional effort string", "reasoning")
    return r.get("effort")


def to_chat(body: dict, prior: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """(the chat-completions body of a Responses request, the conversation to store with its
    answer: ``prior`` and the input, without the instructions); module doc."""
    if not isinstance(body, dict):
        raise P.bad_request("the request body must be a JSON object")
    for k, why in _UNSUPPORTED.items():
        if body.get(k) not in (None, False):
            raise P.bad_request(f"{k}: {why}", k)
    extra = sorted(set(body) - set(_IGNORED) - set(_UNSUPPORTED) - set(_PASS) - set(_OWN))
    if extra:
        raise P.bad_request(f"unsupported field(s) for /v1/responses: {', '.join(extra)}", extra[0])
    if body.get("truncation") not in (None, "disabled"):
        raise P.bad_request("truncation: only 'disabled' is supported (a prompt that does not fit is an error)",
                            "truncation")
    conv = list(prior or []) + _input_messages(body)
    msgs = list(conv)
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise P.bad_request("instructions must be a string", "instructions")
        msgs.insert(0, {"role": "system", "content": instr})
    chat: dict = {"messages": msgs}
    if "model" in body:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in _PASS:
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("top_logprobs") is not None:
        chat["logprobs"] = True
    effort = reasoning_effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
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
    return chat, conv


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item_statuses(output: list[dict], cut: bool) -> None:
    """A response cut by the length limit ended inside its last item when that is text (reasoning
    or message): that item is "incomplete"; every other item (complete function calls included)
    is "completed"."""
    for i, item in enumerate(output):
        last_text = cut and i == len(output) - 1 and item["type"] != "function_call"
        item["status"] = "incomplete" if last_text else "completed"


def response_object(body: dict, rid: str, created: int, model: str, output: list[dict], status: str,
                    usage: dict | None, error: dict | None = None) -> dict:
    """The ``response`` object (``status``: in_progress | completed | incomplete | failed)."""
    use = usage or {}
    tools = body.get("tools") or []
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning_effort(body), "summary": None},
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": tools,
        "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": None if usage is None else {
            "input_tokens": use.get("prompt_tokens", 0), "input_tokens_details": {
                "cached_tokens": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": use.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": use.get("total_tokens", 0)},
    }


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str) -> dict:
    return {"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(tc: dict) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": tc["id"], "name": tc["function"]["name"],
            "arguments": tc["function"]["arguments"], "status": "completed"}


def from_chat(chat: dict, body: dict, rid: str) -> dict:
    """The ``response`` object of a chat-completions response to ``to_chat(body)`` (module doc)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        output.append(_message_item(msg["content"]))
    output += [_call_item(tc) for tc in msg.get("tool_calls") or []]
    cut = choice.get("finish_reason") == "length"
    _item_statuses(output, cut)
    return response_object(body, rid, int(chat.get("created", time.time())), chat.get("model"), output,
                           "incomplete" if cut else "completed", chat.get("usage"))


def assistant_message(response: dict) -> dict | None:
    """The assistant turn of a response's output, as a chat message (for its stored conversation)."""
    m: dict = {"role": "assistant", "content": None}
    for item in response["output"]:
        if item["type"] == "reasoning":
            m["reasoning_content"] = "".join(c["text"] for c in item.get("content") or [])
        elif item["type"] == "message":
            m["content"] = (m["content"] or "") + "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            m.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return m if m["content"] is not None or m.get("tool_calls") else None


class ResponseStream:
    """The Responses events of one streamed answer, from the chat stream's chunks (module doc).
    ``start()`` first, ``feed(chunk)`` per chat chunk, then ``finish()`` or ``fail(message)``;
    ``response`` is the final response object."""

    def __init__(self, body: dict, rid: str, model: str):
        self.body, self.rid, self.model = body, rid, model
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None        # the reasoning / message item receiving text deltas
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.response: dict | None = None

    def _ev(self, kind: str, **kw) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **kw}

    def _snapshot(self, status: str, error: dict | None = None) -> dict:
        return response_object(self.body, self.rid, self.created, self.model, copy.deepcopy(self.output), status,
                               self.usage if status != "in_progress" else None, error)

    def start(self) -> list[dict]:
        r = self._snapshot("in_progress")
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def feed(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        ev: list[dict] = []
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                ev += self._text("reasoning", d["reasoning_content"])
            if d.get("content"):
                ev += self._text("message", d["content"])
            for tc in d.get("tool_calls") or []:
                ev += self._call(tc)
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
        return ev

    def _text(self, kind: str, delta: str) -> list[dict]:
        ev: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            ev += self._close("completed")
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output.append(item)
            self.open, self.text = item, ""
            idx = len(self.output) - 1
            ev.append(self._ev("response.output_item.added", output_index=idx, item=copy.deepcopy(item)))
            ev.append(self._ev("response.content_part.added", item_id=item["id"], output_index=idx,
                               content_index=0, part=part))
        self.text += delta
        where = dict(item_id=self.open["id"], output_index=len(self.output) - 1, content_index=0, delta=delta)
        if kind == "reasoning":
            ev.append(self._ev("response.reasoning_text.delta", **where))
        else:
            ev.append(self._ev("response.output_text.delta", logprobs=[], **where))
        return ev

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        where = dict(item_id=item["id"], output_index=idx, content_index=0)
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            ev = [self._ev("response.reasoning_text.done", text=self.text, **where)]
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            ev = [self._ev("response.output_text.done", text=self.text, logprobs=[], **where)]
        item["content"] = [part]
        item["status"] = status
        ev.append(self._ev("response.content_part.done", part=part, **where))
        ev.append(self._ev("response.output_item.done", output_index=idx, item=copy.deepcopy(item)))
        return ev

    def _call(self, tc: dict) -> list[dict]:
        ev = self._close("completed")
        done = _call_item(tc)
        self.output.append(done)
        idx = len(self.output) - 1
        ev.append(self._ev("response.output_item.added", output_index=idx,
                           item={**done, "arguments": "", "status": "in_progress"}))
        ev.append(self._ev("response.function_call_arguments.delta", item_id=done["id"], output_index=idx,
                           delta=done["arguments"]))
        ev.append(self._ev("response.function_call_arguments.done", item_id=done["id"], output_index=idx,
                           name=done["name"], arguments=done["arguments"]))
        ev.append(self._ev("response.output_item.done", output_index=idx, item=copy.deepcopy(done)))
        return ev

    def finish(self) -> list[dict]:
        cut = self.finish_reason == "length"
        ev = self._close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        self.response = self._snapshot(status)
        return ev + [self._ev(f"response.{status}", response=self.response)]

    def fail(self, message: str) -> list[dict]:
        ev = self._close("incomplete")
        self.response = self._snapshot("failed", {"code": "server_error", "message": message})
        return ev + [self._ev("response.failed", response=self.response)]


def sse(event: dict) -> str:
    """One Responses server-sent event (``event:`` names its type, as OpenAI sends it)."""
    return f"event: {event['type']}\n" + P.sse(event)


class ResponseStore:
    """Stored responses and their conversations (the chat messages up to and including the
    answer), the ``size`` most recently stored or read; thread-safe."""

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"the responses store size must be >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.size == 0:
            return
        turn = assistant_message(response)
        with self._lock:
            self._items[response["id"]] = (response, conversation + ([turn] if turn else []))
            self._items.move_to_end(response["id"])
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            hit = self._items.get(rid)
            if hit is not None:
                self._items.move_to_end(rid)
            return hit


def not_found(rid: str, size: int, param: str | None = None) -> P.APIError:
    return P.APIError(404, f"Response with id {rid!r} not found: it was not stored (store: false), or is no longer "
                           f"among the {size} most recent responses this server keeps (--max-stored-responses)",
                      P.INVALID_REQUEST, param, "response_not_found")


__all__ = ["ResponseStore", "ResponseStream", "from_chat", "new_id", "not_found", "sse", "to_chat"]
