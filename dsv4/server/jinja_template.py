"""A Jinja chat template (``dsv4 serve --chat-template``) rendered as transformers'
``apply_chat_template`` renders one, in place of the built-in V4 encoding.

The environment is transformers': a sandbox with ``trim_blocks`` / ``lstrip_blocks`` and the
``loopcontrols`` extension, its ``tojson`` filter (``ensure_ascii=False``; ``indent``,
``separators``, ``sort_keys``), ``raise_exception(message)`` and ``strftime_now(format)``. The
template sees ``messages`` (content made of text parts joined into one string, as vLLM passes them
to a string-content template), ``tools`` (the request's OpenAI tool list, or None),
``add_generation_prompt``, the tokenizer's special tokens (``bos_token``, ``eos_token``) and the
request's ``chat_template_kwargs``. The text is tokenized without added special tokens (the
template writes BOS itself), as vLLM does for chat.

Output parsing is unchanged: V4's reasoning (``thinking`` / ``enable_thinking`` in
``chat_template_kwargs``) and DSML tool-call parsers read the generated text.
"""
from __future__ import annotations

import json
import os
from datetime import datetime


class ChatTemplateError(ValueError):
    """The template cannot render the request (``raise_exception`` or a template error); the
    message says why."""


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or (as vLLM accepts) the template itself when the value
    is not a path and holds Jinja syntax. Raises naming the problem; the template is compiled."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            source = fh.read()
    elif any(c in value for c in "{}\n"):
        source = value
    else:
        raise FileNotFoundError(f"--chat-template {value!r}: no such file (give a Jinja template file or the "
                                f"template text)")
    JinjaChatTemplate(source, {})       # compile now: a syntax error is a start-up error
    return source


class JinjaChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template: {e.message} (line {e.lineno})") from None
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._errors = jinja2.exceptions.TemplateError

    def render(self, messages: list, tools: list | None, add_generation_prompt: bool, kwargs: dict) -> str:
        msgs = [{**m, "content": _flat(m.get("content"))} if isinstance(m, dict) and isinstance(m.get("content"), list)
                else m for m in messages]
        try:
            return self.template.render(**{**self.special_tokens, **kwargs, "messages": msgs, "tools": tools,
                                           "add_generation_prompt": add_generation_prompt})
        except self._errors as e:
            raise ChatTemplateError(f"messages: the chat template refused the request: {e}") from None

    def encode(self, tokenizer, messages: list, tools: list | None, kwargs: dict | None,
               add_generation_prompt: bool) -> list[int]:
        return tokenizer.encode(self.render(messages, tools, add_generation_prompt, dict(kwargs or {})),
                                add_special_tokens=False)


def _flat(parts: list) -> str:
    """Content parts as one string: the text parts joined by newlines (vLLM's string format)."""
    out = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise ChatTemplateError(f"messages: content part {j} is not a text part; the chat template takes text only")
        out.append(p["text"])
    return "\n".join(out)
