"""DeepSeek-V4 chat prompt encoding and completion parsing (spec §2.3).

V4 ships no Jinja template; the prompt is built by the rules of DeepSeek's reference encoder
(``encoding/encoding_dsv4.py`` in the HF release, vendored by vLLM as
``vllm/tokenizers/deepseek_v4_encoding.py``). This module re-implements those rules:

* ``encode_messages`` -> prompt string:
  ``BOS [effort paragraph] system [+ "\\n\\n" + tools section]`` then per turn
  ``<｜User｜>{user}<｜Assistant｜>`` + ``<think>`` (thinking) or ``</think>`` (chat), and past
  assistant turns as ``{reasoning}</think>{content}{DSML tool calls}<｜end▁of▁sentence｜>``.
  No newlines between roles. OpenAI ``tool`` messages become ``<tool_result>`` blocks of a user
  turn (sorted into the order of the preceding tool calls). ``developer`` renders like user;
  ``latest_reminder`` as ``<｜latest_reminder｜>{content}``.
* ``apply_chat_template`` -> token ids, reading ``thinking`` / ``enable_thinking`` /
  ``reasoning_effort`` / ``drop_thinking`` from ``chat_template_kwargs`` like vLLM's wrapper.
* ``parse_completion`` / ``StreamingParser`` split generated text into reasoning, content and
  DSML tool calls. Unlike the reference parser they never raise: malformed output stays content.

Invalid requests raise :class:`ChatEncodingError` (a ``ValueError``) naming the field, e.g.
``messages[2].tool_call_id: ...``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# --------------------------------------------------------------------------------------------
# Special strings (spec §2.2: ids 0, 1, 128803, 128804, 128821, 128822, 128825, 128828, ...)
# --------------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"

# "Quick instruction" task tokens of the reference encoder (DS_TASK_SP_TOKENS).
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")

# The strings below are what the model was trained on and must stay byte-exact. Source:
# encoding/encoding_dsv4.py (HF deepseek-ai/DeepSeek-V4-Pro release), as vendored in
# vllm-project/vllm vllm/tokenizers/deepseek_v4_encoding.py (REASONING_EFFORT_MAX,
# TOOLS_TEMPLATE, response_format_template); checked against golden test_output_1/3.txt.
REASONING_EFFORT_MAX_TEXT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

# The 0731 release generation (V4-Flash-0731, V4-Pro-0813) re-tiers the effort paragraphs: its
# encoder (encoding/encoding_dsv4.py, ``REASONING_EFFORT_PROMPTS``, ``DEFAULT_REASONING_EFFORT =
# "low"``) emits nothing for "low", April's "max" paragraph for "high", and a new paragraph for "max".
# Read from public transcriptions of that file (SGLang PR 33140's profile detection, SGLang issue
# 33185 and antirez/ds4 issue 635 quoting the encoder and the release's encoding/README.md); the
# release repository itself was not read.
REASONING_EFFORT_MAX_0731_TEXT = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# profile -> {normalised effort: paragraph}; 'preview' is the April encoder.
EFFORT_PROFILES = {
    "preview": {"low": "", "high": "", "max": REASONING_EFFORT_MAX_TEXT},
    "0731": {"low": "", "high": REASONING_EFFORT_MAX_TEXT, "max": REASONING_EFFORT_MAX_0731_TEXT},
}
ENCODER_FILE = "encoding/encoding_dsv4.py"


def detect_effort_profile(model_dir: str | None) -> tuple[str, str]:
    """(profile, why) for a checkpoint directory, read off the encoder it ships (``ENCODER_FILE``):
    '0731' when it defines ``REASONING_EFFORT_PROMPTS`` (the three-tier encoder of V4-Flash-0731 /
    V4-Pro-0813), else 'preview' (April's ``REASONING_EFFORT_MAX``, no encoder file, or one that
    says neither). The config cannot tell: V4-*-DSpark carry the same dspark_* keys as 0731 on
    April weights."""
    import os
    if not model_dir:
        return "preview", "no checkpoint directory"
    path = os.path.join(model_dir, ENCODER_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            src = fh.read()
    except OSError:
        return "preview", f"no {ENCODER_FILE}"
    if "REASONING_EFFORT_PROMPTS" in src:
        return "0731", f"{ENCODER_FILE} defines REASONING_EFFORT_PROMPTS"
    if "REASONING_EFFORT_MAX" in src:
        return "preview", f"{ENCODER_FILE} defines REASONING_EFFORT_MAX"
    return "preview", f"{ENCODER_FILE} defines neither effort table"


_TOOLS_SECTION_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_SECTION_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
_RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class ChatEncodingError(ValueError):
    """A chat request cannot be encoded; the message names the offending field."""


# --------------------------------------------------------------------------------------------
# Reasoning effort / thinking flags
# --------------------------------------------------------------------------------------------


#: the ``reasoning_effort`` values a request may give (vLLM's set, any case); the server refuses
#: others, and :func:`normalize_reasoning_effort` maps these onto the encoder's levels
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def normalize_reasoning_effort(effort: Any, profile: str = "preview") -> tuple[bool | None, str | None]:
    """Map a client ``reasoning_effort`` onto the encoder's levels, as vLLM's V4 wrapper does.

    Returns ``(thinking_override, level)``: ``"none"`` forces chat mode (``False``, None);
    ``None`` -> (None, None). ``profile`` 'preview' (April): ``"max"`` -> "max";
    ``"low" | "minimal" | "medium"`` -> "low"; any other string -> "high"; only "max" changes the
    prompt. '0731': ``"xhigh"`` -> "max"; "low", "high", "max" as given; any other -> "low" (the
    release's default); "high" and "max" each add their paragraph (``EFFORT_PROFILES``).
    """
    if profile not in EFFORT_PROFILES:
        raise ValueError(f"effort profile must be one of {', '.join(EFFORT_PROFILES)}, got {profile!r}")
    if effort is None:
        return None, None
    if not isinstance(effort, str):
        raise ChatEncodingError(f"reasoning_effort: expected a string, got {type(effort).__name__}")
    e = effort.strip().lower()
    if e == "none":
        return False, None
    if profile == "0731":
        e = "max" if e == "xhigh" else e
        return None, e if e in ("low", "high", "max") else "low"
    if e == "max":
        return None, "max"
    if e in ("low", "minimal", "medium"):
        return None, "low"
    return None, "high"


def _flag(value: Any, name: str) -> bool:
    # ``thinking`` may also arrive Anthropic/DeepSeek-API style: {"type": "enabled"|"disabled"}.
    if isinstance(value, dict):
        kind = value.get("type")
        if kind not in ("enabled", "disabled"):
            raise ChatEncodingError(f"{name}.type: expected 'enabled' or 'disabled', got {kind!r}")
        return kind == "enabled"
    if value is None or isinstance(value, bool):
        return bool(value)
    raise ChatEncodingError(f"{name}: expected a boolean, got {type(value).__name__}")


def resolve_chat_options(chat_template_kwargs: dict | None,
                         effort_profile: str = "preview") -> tuple[bool, str | None, bool]:
    """``(thinking, reasoning_effort, drop_thinking)`` from ``chat_template_kwargs``.

    ``thinking`` is on when ``thinking`` or ``enable_thinking`` is truthy (default off when
    neither is given); ``reasoning_effort="none"`` turns it off. The returned effort is the
    normalized level of :func:`normalize_reasoning_effort` (None in chat mode).
    """
    kw = dict(chat_template_kwargs or {})
    thinking = _flag(kw.get("thinking"), "chat_template_kwargs.thinking") or _flag(
        kw.get("enable_thinking"), "chat_template_kwargs.enable_thinking"
    )
    override, level = normalize_reasoning_effort(kw.get("reasoning_effort"), effort_profile)
    if override is False:
        thinking = False
    drop = kw.get("drop_thinking", True)
    if not isinstance(drop, bool):
        raise ChatEncodingError("chat_template_kwargs.drop_thinking: expected a boolean")
    return thinking, (level if thinking else None), drop


# --------------------------------------------------------------------------------------------
# Validation and normalization of OpenAI-style input
# --------------------------------------------------------------------------------------------


def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def _text_of(content: Any, where: str, *, allow_none: bool = False, sep: str = "\n") -> str | None:
    """OpenAI content (str or list of text parts) -> str, text parts joined with ``sep``.

    "\\n" for user turns (vLLM flattens text parts that way); tool results use "\\n\\n" as the
    reference encoder does for list-valued tool content."""
    if content is None:
        if allow_none:
            return None
        raise ChatEncodingError(f"{where}: content is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise ChatEncodingError(f"{where}[{j}]: expected a content part object")
            kind = part.get("type")
            if kind not in ("text", "input_text"):
                raise ChatEncodingError(f"{where}[{j}].type: unsupported content part {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatEncodingError(f"{where}[{j}].text: expected a string")
            texts.append(text)
        return sep.join(texts)
    raise ChatEncodingError(
        f"{where}: expected a string or a list of text parts, got {type(content).__name__}"
    )


def _validate_tools(tools: Any, where: str) -> list[dict]:
    """OpenAI ``tools`` -> list of function dicts (rendered as given, one JSON object a line)."""
    if not isinstance(tools, list):
        raise ChatEncodingError(f"{where}: expected a list of tools")
    functions = []
    for j, tool in enumerate(tools):
        w = f"{where}[{j}]"
        if not isinstance(tool, dict):
            raise ChatEncodingError(f"{w}: expected an object")
        if tool.get("type", "function") != "function":
            raise ChatEncodingError(
                f"{w}.type: only 'function' tools are supported, got {tool.get('type')!r}"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatEncodingError(f"{w}.function: expected an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatEncodingError(f"{w}.function.name: expected a non-empty string")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ChatEncodingError(f"{w}.function.description: expected a string")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise ChatEncodingError(f"{w}.function.parameters: expected a JSON schema object")
        functions.append(fn)
    return functions


def _tool_call_arguments(args: Any, where: str) -> dict:
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatEncodingError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ChatEncodingError(f"{where}: expected a JSON object")
    return args


def _validate_tool_calls(tool_calls: Any, where: str) -> list[dict]:
    """-> [{"id", "name", "arguments": dict}]."""
    if not isinstance(tool_calls, list):
        raise ChatEncodingError(f"{where}: expected a list")
    out = []
    for j, tc in enumerate(tool_calls):
        w = f"{where}[{j}]"
        if not isinstance(tc, dict):
            raise ChatEncodingError(f"{w}: expected an object")
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise ChatEncodingError(f"{w}.function: expected an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatEncodingError(f"{w}.function.name: expected a non-empty string")
        tc_id = tc.get("id")
        if tc_id is not None and not isinstance(tc_id, str):
            raise ChatEncodingError(f"{w}.id: expected a string")
        out.append(
            {
                "id": tc_id or "",
                "name": name,
                "arguments": _tool_call_arguments(fn.get("arguments"), f"{w}.function.arguments"),
            }
        )
    return out


def _normalize(messages: Any, tools: Any) -> list[dict]:
    """Validate OpenAI-style messages; return internal dicts (role + normalized fields).

    Internal fields: ``content`` (str), ``reasoning`` (str | None), ``tool_calls`` (list),
    ``tools`` (function dicts), ``response_format``, ``task``, ``prefix`` (continue without EOS),
    ``tool_call_id`` for tool messages.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatEncodingError("messages: expected a non-empty list")
    out: list[dict] = []
    open_call_ids: set[str] | None = None  # ids of the latest assistant tool calls
    for i, msg in enumerate(messages):
        w = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatEncodingError(f"{w}: expected an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatEncodingError(f"{w}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        m: dict[str, Any] = {"role": role}

        if role == "assistant":
            content = _text_of(msg.get("content"), f"{w}.content", allow_none=True)
            calls = msg.get("tool_calls")
            m["tool_calls"] = _validate_tool_calls(calls, f"{w}.tool_calls") if calls else []
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")  # vLLM's name for the same field
            if reasoning is not None and not isinstance(reasoning, str):
                raise ChatEncodingError(f"{w}.reasoning_content: expected a string")
            if content is None and not m["tool_calls"]:
                raise ChatEncodingError(f"{w}.content: assistant message needs content or tool_calls")
            m["content"] = content or ""
            m["reasoning"] = reasoning
            prefix = msg.get("prefix", msg.get("wo_eos", False))
            if prefix and i != len(messages) - 1:
                raise ChatEncodingError(f"{w}.prefix: only the last message may be a prefix to continue")
            m["prefix"] = bool(prefix)
            open_call_ids = {c["id"] for c in m["tool_calls"] if c["id"]} if m["tool_calls"] else None
            if m["tool_calls"] and not open_call_ids:
                open_call_ids = set()  # calls without ids: results cannot be checked by id
        elif role == "tool":
            if "content" not in msg:
                raise ChatEncodingError(f"{w}.content: content is required")
            m["content"] = _text_of(msg.get("content"), f"{w}.content", sep="\n\n")
            if open_call_ids is None:
                raise ChatEncodingError(
                    f"{w}: tool message without a preceding assistant message with tool_calls"
                )
            tc_id = msg.get("tool_call_id")
            if tc_id is not None and not isinstance(tc_id, str):
                raise ChatEncodingError(f"{w}.tool_call_id: expected a string")
            if tc_id and open_call_ids and tc_id not in open_call_ids:
                raise ChatEncodingError(
                    f"{w}.tool_call_id: {tc_id!r} does not match any tool call of the preceding "
                    f"assistant message ({', '.join(sorted(open_call_ids))})"
                )
            m["tool_call_id"] = tc_id or ""
        else:
            if "content" not in msg or msg.get("content") is None:
                if role == "system" and msg.get("tools"):
                    msg = {**msg, "content": ""}
                else:
                    raise ChatEncodingError(f"{w}.content: content is required for role {role!r}")
            m["content"] = _text_of(msg.get("content"), f"{w}.content")
            if role == "developer" and not m["content"]:
                raise ChatEncodingError(f"{w}.content: developer message must not be empty")

        if msg.get("tools"):
            if role not in ("system", "developer"):
                raise ChatEncodingError(
                    f"{w}.tools: tools may only be attached to a system or developer message"
                )
            m["tools"] = _validate_tools(msg["tools"], f"{w}.tools")
        if msg.get("response_format") is not None:
            if role not in ("system", "developer"):
                raise ChatEncodingError(f"{w}.response_format: only allowed on a system or developer message")
            m["response_format"] = msg["response_format"]
        task = msg.get("task")
        if task is not None:
            if task not in TASK_TOKENS:
                raise ChatEncodingError(f"{w}.task: unknown task {task!r}")
            m["task"] = task
        out.append(m)

    if tools:
        functions = _validate_tools(tools, "tools")
        # Request-level tools go to the leading system/developer message, as the reference test
        # does (messages[0]["tools"] = tools); without one, an empty system message carries them.
        if out[0]["role"] in ("system", "developer"):
            out[0]["tools"] = out[0].get("tools", []) + functions
        else:
            out.insert(0, {"role": "system", "content": "", "tools": functions})
    return out


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def render_tools(functions: list[dict]) -> str:
    """The ``## Tools`` section for a list of OpenAI function dicts (ends with a newline)."""
    return _TOOLS_SECTION_HEAD + "\n".join(_to_json(f) for f in functions) + _TOOLS_SECTION_TAIL


def render_tool_calls(tool_calls: list[dict]) -> str:
    """DSML block for ``[{"name", "arguments": dict}]`` (no leading blank line)."""
    invokes = []
    for tc in tool_calls:
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _to_json(v)}{PARAMETER_END}"
            for key, v in tc["arguments"].items()
        ]
        invokes.append(f'<{DSML}invoke name="{tc["name"]}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _merge_tool_results(msgs: list[dict]) -> list[dict]:
    """Fold ``tool`` messages into user turns of ``<tool_result>`` blocks (no tool role in V4).

    As in the reference ``merge_tool_messages``: a tool result joins the user turn being built
    (or starts one), and a user message directly after such a turn joins it too; blocks are
    later joined with "\\n\\n". Tool results are then put in the order of the preceding
    assistant's tool calls (``sort_tool_results_by_call_order``).
    """
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for m in msgs:
        role = m["role"]
        if role == "assistant" and m["tool_calls"]:
            call_order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c["id"]}
        if role == "tool":
            block = ("tool", m["content"], m["tool_call_id"])
            if merged and merged[-1]["role"] == "user" and "blocks" in merged[-1]:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block], "call_order": call_order})
        elif role == "user":
            block = ("text", m["content"], None)
            prev = merged[-1] if merged else None
            if prev is not None and prev["role"] == "user" and "blocks" in prev and prev.get("task") is None:
                prev["blocks"].append(block)
                if m.get("task") is not None:
                    prev["task"] = m["task"]
            else:
                merged.append({**m, "blocks": [block], "call_order": call_order})
        else:
            merged.append(m)

    for m in merged:
        blocks = m.get("blocks")
        if not blocks:
            continue
        results = [b for b in blocks if b[0] == "tool"]
        order = m.pop("call_order")
        if len(results) > 1 and order:
            # Stable sort; unknown ids sort as position 0, like the reference.
            results.sort(key=lambda b: order.get(b[2], 0))
            it = iter(results)
            m["blocks"] = [next(it) if b[0] == "tool" else b for b in blocks]
    return merged


def _last_user_index(msgs: list[dict]) -> int:
    for idx in range(len(msgs) - 1, -1, -1):
        if msgs[idx]["role"] in ("user", "developer"):
            return idx
    return -1


def _drop_earlier_thinking(msgs: list[dict]) -> list[dict]:
    """Before the last user/developer turn: strip assistant reasoning, drop developer turns."""
    last_user = _last_user_index(msgs)
    out = []
    for idx, m in enumerate(msgs):
        if idx >= last_user or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({**m, "reasoning": None})
        # developer (and anything else) before the last user turn is dropped
    return out


def _render_user_body(m: dict) -> str:
    blocks = m.get("blocks")
    if not blocks:
        return m["content"]
    parts = [text if kind == "text" else f"<tool_result>{text}</tool_result>" for kind, text, _ in blocks]
    return "\n\n".join(parts)


def _render_extras(m: dict) -> str:
    s = ""
    if m.get("tools"):
        s += "\n\n" + render_tools(m["tools"])
    if m.get("response_format") is not None:
        s += "\n\n" + _RESPONSE_FORMAT_HEAD + _to_json(m["response_format"])
    return s


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    effort_profile: str = "preview",
) -> str:
    """Render an OpenAI-style conversation as a DeepSeek-V4 prompt string (starts with BOS).

    ``reasoning_effort`` takes client values (see :func:`normalize_reasoning_effort`; "none"
    switches to chat mode). ``drop_thinking`` removes reasoning of assistant turns before the
    last user turn (and developer turns there); it is ignored when any tools are defined.
    ``add_generation_prompt=False`` leaves out the ``<｜Assistant｜><think>`` (or ``</think>``)
    that normally follows a final user turn. A final assistant message with ``prefix: true``
    is rendered without EOS so generation continues it. ``effort_profile``: 'preview' (April
    checkpoints) or '0731' (see :func:`detect_effort_profile`).
    """
    override, effort = normalize_reasoning_effort(reasoning_effort, effort_profile)
    if override is False:
        thinking = False
    msgs = _merge_tool_results(_normalize(messages, tools))

    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_earlier_thinking(msgs)
    last_user = _last_user_index(msgs)

    prompt = [BOS]
    if thinking and effort is not None:
        prompt.append(EFFORT_PROFILES[effort_profile][effort])

    n = len(msgs)
    for idx, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            prompt.append(m["content"] + _render_extras(m))
        elif role == "developer":
            prompt.append(USER + m["content"] + _render_extras(m))
        elif role == "user":
            prompt.append(USER + _render_user_body(m))
        elif role == "latest_reminder":
            prompt.append(LATEST_REMINDER + m["content"])
        else:  # assistant
            after_task = idx > 0 and msgs[idx - 1].get("task") is not None
            think = ""
            if thinking and not after_task and (not drop or idx > last_user):
                think = (m["reasoning"] or "") + THINK_END
            calls = "\n\n" + render_tool_calls(m["tool_calls"]) if m["tool_calls"] else ""
            prompt.append(think + m["content"] + calls + ("" if m.get("prefix") else EOS))

        # Transition after the message: only when it is last or followed by assistant/reminder.
        nxt = msgs[idx + 1]["role"] if idx + 1 < n else None
        if nxt is not None and nxt not in ("assistant", "latest_reminder"):
            continue
        task = m.get("task")
        if nxt is None and not add_generation_prompt:
            continue
        if task is not None:
            if task == "action":
                prompt.append(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
            else:
                prompt.append(TASK_TOKENS[task])
        elif role in ("user", "developer"):
            open_think = thinking and (not drop or idx >= last_user)
            prompt.append(ASSISTANT + (THINK_START if open_think else THINK_END))
    return "".join(prompt)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    effort_profile: str = "preview",
) -> list[int]:
    """Encode ``messages`` with :func:`encode_messages` and tokenize (no extra special tokens).

    ``chat_template_kwargs``: ``thinking`` (bool or {"type": "enabled"|"disabled"}),
    ``enable_thinking``, ``reasoning_effort``, ``drop_thinking``.
    """
    thinking, effort, drop = resolve_chat_options(chat_template_kwargs, effort_profile)
    prompt = encode_messages(
        messages,
        tools=tools,
        thinking=thinking,
        reasoning_effort=effort,
        add_generation_prompt=add_generation_prompt,
        drop_thinking=drop,
        effort_profile=effort_profile,
    )
    return list(tokenizer.encode(prompt, add_special_tokens=False))


# --------------------------------------------------------------------------------------------
# Parsing model output
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedMessage:
    reasoning_content: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "role": "assistant",
            "reasoning_content": self.reasoning_content,
            "content": self.content,
            "tool_calls": self.tool_calls,
        }


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_INVOKE_OPEN = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_PARAM_OPEN = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')
_WS = re.compile(r"\s*")


def _param_value(raw: str, is_string: str) -> Any:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw  # not JSON after all: keep the text rather than lose it


def _parse_tool_block(text: str, make_id: Callable[[], str]) -> list[dict] | None:
    """Parse one or more consecutive DSML tool_calls blocks filling ``text`` (which starts with
    ``<｜DSML｜tool_calls>``). Returns None unless the whole text is well-formed."""
    pos = 0
    calls: list[dict] = []
    n = len(text)
    while True:
        if not text.startswith(TOOL_CALLS_START, pos):
            return None
        pos += len(TOOL_CALLS_START)
        block_calls = 0
        while True:
            pos = _WS.match(text, pos).end()
            if text.startswith(TOOL_CALLS_END, pos):
                pos += len(TOOL_CALLS_END)
                break
            m = _INVOKE_OPEN.match(text, pos)
            if m is None:
                return None
            name, pos = m.group(1), m.end()
            args: dict[str, Any] = {}
            while True:
                pos = _WS.match(text, pos).end()
                if text.startswith(INVOKE_END, pos):
                    pos += len(INVOKE_END)
                    break
                p = _PARAM_OPEN.match(text, pos)
                if p is None:
                    return None
                end = text.find(PARAMETER_END, p.end())
                if end < 0:
                    return None
                args[p.group(1)] = _param_value(text[p.end() : end], p.group(2))
                pos = end + len(PARAMETER_END)
            if not name:
                return None
            calls.append(
                {
                    "id": make_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
            block_calls += 1
        if block_calls == 0:
            return None
        pos = _WS.match(text, pos).end()
        if pos >= n:
            return calls


def _tool_calls_of(block: str, make_id: Callable[[], str]) -> list[dict] | None:
    """The calls of ``block`` (the text from the first ``<｜DSML｜tool_calls>`` on). A block closed
    by ``</｜DSML｜tool_calls>``: its calls, or None when it is malformed. Generation ended inside
    the last block (no closing tag after it; cut by max_tokens or an end of sentence): the calls
    whose invoke was complete before the cut; the partial one is dropped, and nothing of the
    block is returned as text ([] when no call was complete or the complete part is malformed)."""
    start = block.rfind(TOOL_CALLS_START)
    if block.find(TOOL_CALLS_END, start) >= 0:
        return _parse_tool_block(block, make_id)
    k = block.rfind(INVOKE_END)
    head = block[: k + len(INVOKE_END)] + TOOL_CALLS_END if k > start else block[:start].rstrip()
    return (_parse_tool_block(head, make_id) or []) if head else []


def _strip_block_separator(head: str) -> str:
    # The model writes "\n\n" between content and the tool-call block (reference encoder).
    if head.endswith("\n\n"):
        return head[:-2]
    if head.endswith("\n"):
        return head[:-1]
    return head


def _split_content(rest: str, make_id: Callable[[], str]) -> tuple[str, list[dict]]:
    j = rest.find(TOOL_CALLS_START)
    if j < 0:
        return rest, []
    calls = _tool_calls_of(rest[j:], make_id)
    if calls is None:
        return rest, []  # a closed but malformed block: leave everything as content
    return _strip_block_separator(rest[:j]), calls


def parse_completion(
    text: str, thinking: bool, make_id: Callable[[], str] = new_tool_call_id
) -> ParsedMessage:
    """Split generated text (what follows the prompt) into reasoning, content and tool calls.

    * Text from the first ``<｜end▁of▁sentence｜>`` on is ignored.
    * ``thinking``: reasoning is the text before the first ``</think>`` (all of it when
      ``</think>`` never came, e.g. generation hit the length limit); chat mode gives
      ``reasoning_content=None``.
    * A well-formed DSML block (``<｜DSML｜tool_calls>`` ... ``</｜DSML｜tool_calls>`` closing the
      output) becomes OpenAI tool calls: ``string="true"`` values as-is, others parsed as JSON;
      the "\\n\\n" before the block is dropped. A closed block that is malformed stays in
      ``content``; a block the output ends inside gives its complete calls and no text.
    Never raises.
    """
    eos = text.find(EOS)
    if eos >= 0:
        text = text[:eos]
    reasoning: str | None = None
    rest = text
    if thinking:
        k = text.find(THINK_END)
        if k < 0:
            return ParsedMessage(reasoning_content=text, content="", tool_calls=[])
        reasoning, rest = text[:k], text[k + len(THINK_END) :]
    content, calls = _split_content(rest, make_id)
    return ParsedMessage(reasoning_content=reasoning, content=content, tool_calls=calls)


def _held_suffix(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``."""
    best = 0
    for mk in markers:
        for k in range(min(len(mk) - 1, len(buf)), best, -1):
            if buf.endswith(mk[:k]):
                best = k
                break
    return best


class StreamingParser:
    """Incremental :func:`parse_completion`: feed text deltas, get (reasoning, content) deltas.

    Text that may be the start of ``</think>``, ``<｜DSML｜tool_calls>`` or EOS is held back until
    it is decided, and so are up to two newlines before a possible tool-call block. Once a block
    starts nothing more is emitted; :meth:`finish` returns the tool calls (or, if the block turns
    out malformed, the held text as content). The concatenated deltas equal ``parse_completion``
    of the concatenated input.
    """

    def __init__(self, thinking: bool, make_id: Callable[[], str] = new_tool_call_id):
        self.thinking = thinking
        self._make_id = make_id
        self._state = "reasoning" if thinking else "content"
        self._buf = ""
        self._tool_text = ""  # separator newlines + DSML block, parsed at finish
        self.reasoning = "" if thinking else None
        self.content = ""
        self.tool_calls: list[dict] = []
        self.finished = False

    def feed(self, delta: str) -> tuple[str, str]:
        """Consume a text delta; return ``(reasoning_delta, content_delta)``."""
        r_out: list[str] = []
        c_out: list[str] = []
        if self._state in ("done", "tools_done") or not delta:
            return "", ""
        if self._state == "tools":
            start = max(0, len(self._tool_text) - len(EOS) + 1)
            self._tool_text += delta
            self._cut_tool_text_at_eos(start)
            return "", ""
        self._buf += delta
        while True:
            if self._state == "reasoning":
                k = self._buf.find(THINK_END)
                e = self._buf.find(EOS)
                if e >= 0 and (k < 0 or e < k):
                    r_out.append(self._buf[:e])
                    self._buf, self._state = "", "done"
                    break
                if k >= 0:
                    r_out.append(self._buf[:k])
                    self._buf = self._buf[k + len(THINK_END) :]
                    self._state = "content"
                    continue
                hold = _held_suffix(self._buf, (THINK_END, EOS))
                r_out.append(self._buf[: len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold :]
                break
            if self._state == "content":
                j = self._buf.find(TOOL_CALLS_START)
                e = self._buf.find(EOS)
                if e >= 0 and (j < 0 or e < j):
                    c_out.append(self._buf[:e])
                    self._buf, self._state = "", "done"
                    break
                if j >= 0:
                    head = self._buf[:j]
                    kept = _strip_block_separator(head)
                    c_out.append(kept)
                    self._tool_text = head[len(kept) :] + self._buf[j:]
                    self._buf, self._state = "", "tools"
                    self._cut_tool_text_at_eos()
                    break
                hold = _held_suffix(self._buf, (TOOL_CALLS_START, EOS))
                body = self._buf[: len(self._buf) - hold]
                # Also hold up to two newlines that may separate content from a tool block.
                nl = len(body) - len(_strip_block_separator(body))
                cut = len(body) - nl
                c_out.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            break
        return self._emit("".join(r_out), "".join(c_out))

    def _cut_tool_text_at_eos(self, start: int = 0) -> None:
        e = self._tool_text.find(EOS, start)
        if e >= 0:
            self._tool_text = self._tool_text[:e]
            self._state = "tools_done"

    def _emit(self, r: str, c: str) -> tuple[str, str]:
        if r:
            self.reasoning = (self.reasoning or "") + r
        self.content += c
        return r, c

    def finish(self) -> tuple[str, str, list[dict]]:
        """End of generation: flush held text; return ``(reasoning_delta, content_delta, tool_calls)``."""
        if self.finished:
            return "", "", []
        self.finished = True
        r, c = "", ""
        if self._state == "reasoning":
            r = self._buf
        elif self._state == "content":
            c = self._buf
        elif self._state in ("tools", "tools_done"):
            sep = self._tool_text[: len(self._tool_text) - len(self._tool_text.lstrip("\n"))]
            calls = _tool_calls_of(self._tool_text[len(sep) :], self._make_id)
            if calls is None:
                c = self._tool_text
            else:
                self.tool_calls = calls
        self._buf = ""
        self._state = "done"
        self._emit(r, c)
        return r, c, list(self.tool_calls)

    def result(self) -> ParsedMessage:
        """The accumulated message (call after :meth:`finish`)."""
        return ParsedMessage(
            reasoning_content=self.reasoning, content=self.content, tool_calls=list(self.tool_calls)
        )
