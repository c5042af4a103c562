"""Lark grammars (llguidance's dialect) that force V4's DSML tool-call block, for
``tool_choice: "required"`` and a named function.

The grammar produces exactly the text the chat encoder renders for an assistant turn whose only
content is tool calls (``render_tool_calls`` after ``"\\n\\n"``; V4 writes that right after
``</think>``, which a non-thinking prompt already ends with), so ``parse_completion`` returns the
calls::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Arguments follow the function's ``parameters`` schema:

* the properties in ``properties`` order; the ``required`` ones always, the others optionally;
  properties outside ``properties`` are never written (valid whatever ``additionalProperties``
  says); a schema with no ``properties`` allows any parameters (name, then raw text or JSON),
  unless ``additionalProperties`` is false; a function without ``parameters`` takes none;
* a property that is a plain string (``{"type": "string"}``, no length / pattern / format) is
  written raw with ``string="true"``, as the model was trained to; a string ``enum`` / ``const``
  raw as one of its values (a local ``$ref`` is followed to see that); every other property with
  ``string="false"`` and its value as JSON constrained by the property's schema (``%json``, with
  the top-level ``$defs`` / ``definitions`` so that ``$ref`` resolves), which the parser reads
  back with ``json.loads``; a type list with ``"string"`` in it allows either form. JSON values
  are spaced as the encoder renders them (``json.dumps``: ", " and ": ", no other whitespace).

Keywords that relate properties to each other (``minProperties``, ``dependentRequired``, ...)
are not enforced. Names that the DSML parser could not read back (containing ``"``) are refused
with ``ValueError``.
"""
from __future__ import annotations

import json

from .chat_encoding import DSML, INVOKE_END, PARAMETER_END, TOOL_CALLS_END, TOOL_CALLS_START

__all__ = ["tool_call_grammar"]

# string keywords that raw text cannot express (a plain `string` property is written raw)
_CONSTRAINED_STRING = ("pattern", "format", "minLength", "maxLength", "enum", "const", "contentEncoding")


#: JSON parameter values as the chat encoder writes them (json.dumps's separators, nothing else)
ENCODER_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BLOCK_START = "\n\n" + TOOL_CALLS_START + "\n"     # after </think>: a blank line, then the block
ANY_PARAM_HEAD = f'<{DSML}parameter name="'
ANY_PARAM_STRING = '" string="true">'
ANY_PARAM_JSON = '" string="false">'


def _param_head(key: str, is_string: bool) -> str:
    return f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">'


def _lit(s: str) -> str:
    """A Lark string literal (JSON's escapes are valid in llguidance's Lark)."""
    return json.dumps(s, ensure_ascii=False)


def _check_name(name: str, what: str) -> None:
    if '"' in name:
        raise ValueError(f"{what} {name!r} cannot be written in a DSML tool call (it contains '\"')")


def _raw_choices(schema: dict) -> list[str] | None:
    """The values of a string ``enum`` / ``const`` property, or None."""
    if "const" in schema:
        vals = [schema["const"]]
    elif isinstance(schema.get("enum"), list) and schema["enum"]:
        vals = schema["enum"]
    else:
        return None
    if not all(isinstance(v, str) and PARAMETER_END not in v for v in vals):
        return None
    t = schema.get("type", "string")
    if t != "string" or any(k in schema for k in ("pattern", "format", "minLength", "maxLength")):
        return None
    return vals


def _is_plain_string(schema: dict) -> bool:
    return schema.get("type") == "string" and not any(k in schema for k in _CONSTRAINED_STRING)


def _resolve(schema, defs: dict, depth: int = 8):
    """``schema`` with local ``$ref``s (``#/$defs/x``, ``#/definitions/x``) followed, to see
    whether a property is a string; the schema itself when it is anything else."""
    while depth and isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and len(schema) == 1:
        parts = schema["$ref"].split("/")
        if len(parts) != 3 or parts[0] != "#" or not isinstance(defs.get(parts[1]), dict):
            break
        schema = defs[parts[1]].get(parts[2], schema)
        depth -= 1
    return schema


def _json_value(schema, defs: dict) -> str:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"a property schema must be an object, got {schema!r}")
    sub = {**defs, **schema, "x-guidance": ENCODER_JSON}
    return "%json " + json.dumps(sub, ensure_ascii=False)


class _Builder:
    def __init__(self):
        self.rules: list[str] = []
        self.n = 0

    def rule(self, body: str, prefix: str = "r") -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def param(self, key: str, schema, defs: dict) -> str:
        shape = _resolve(schema, defs)
        if isinstance(shape, dict) and _is_plain_string(shape):
            return self.rule(f"{_lit(_param_head(key, True))} raw_value", "p")
        vals = _raw_choices(shape) if isinstance(shape, dict) else None
        if vals is not None:
            alts = " | ".join(_lit(v + PARAMETER_END) for v in vals)
            return self.rule(f"{_lit(_param_head(key, True))} ({alts})", "p")
        as_json = f"{_lit(_param_head(key, False))} {_json_value(schema, defs)} {_lit(PARAMETER_END)}"
        types = shape.get("type") if isinstance(shape, dict) else None
        if isinstance(types, list) and "string" in types and not any(k in shape for k in _CONSTRAINED_STRING):
            # e.g. ["string", "null"]: a string raw, as the encoder writes it, anything else as JSON
            return self.rule(f"{_lit(_param_head(key, True))} raw_value | {as_json}", "p")
        return self.rule(as_json, "p")

    def invoke(self, fn: dict, where: str) -> str:
        name = fn["name"]
        _check_name(name, f"{where}.name")
        params = fn.get("parameters")
        if params is None:              # OpenAI: a function without parameters takes none
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.parameters must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.parameters must describe an object (type 'object'), got type "
                             f"{params.get('type')!r}")
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            raise ValueError(f"{where}.parameters.properties must be an object")
        required = params.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"{where}.parameters.required must be a list of property names")
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        keys = list(props) + [r for r in required if r not in props]
        parts, any_required = [], False
        for key in keys:
            _check_name(key, f"{where}.parameters property")
            p = self.param(key, props.get(key, {}), defs)
            if key in required:
                parts.append(f'{p} "\\n"')
                any_required = True
            else:
                parts.append(f'({p} "\\n")?')
        if not props and not required and params.get("additionalProperties", True) is not False:
            parts = ['(any_param "\\n")*']
        # no parameter written: render_tool_calls leaves an empty line
        args = " ".join(parts) if any_required else ('"\\n"' + (f" | {' '.join(parts)}" if parts else ""))
        head = _lit(f'<{DSML}invoke name="{name}">\n')
        return self.rule(f"{head} ({args}) {_lit(INVOKE_END)}", "f")


def tool_call_grammar(functions: list[dict], parallel: bool = True) -> str:
    """The Lark grammar for one DSML tool-call block calling any of ``functions`` (OpenAI function
    dicts: name, parameters): one call, or one or more when ``parallel``."""
    if not functions:
        raise ValueError("a tool call needs at least one function")
    b = _Builder()
    invokes = [b.invoke(fn, f"tools[{i}].function") for i, fn in enumerate(functions)]
    call = b.rule(" | ".join(invokes), "call")
    # every call is followed by its own "\n" lexeme: no literal is a prefix of another that may
    # come at the same place (the lexer is greedy and would not come back to the shorter one)
    calls = f'({call} "\\n")+' if parallel else f'{call} "\\n"'
    lines = [f"start: {_lit(BLOCK_START)} {calls} {_lit(TOOL_CALLS_END)}",
             *b.rules,
             # a raw string value: the shortest text ending at the first parameter end tag, which is
             # where the DSML parser ends the value
             f"raw_value[lazy]: /(?s:.*){_regex_escape(PARAMETER_END)}/",
             # a parameter of a function whose schema lists no properties
             f"any_param: {_lit(ANY_PARAM_HEAD)} PARAM_NAME ({_lit(ANY_PARAM_STRING)} raw_value | "
             f"{_lit(ANY_PARAM_JSON)} {_json_value({}, {})} {_lit(PARAMETER_END)})",
             "PARAM_NAME: /[A-Za-z0-9_.\\-]{1,64}/"]
    return "\n".join(lines) + "\n"


def _regex_escape(s: str) -> str:
    """``s`` as a literal inside a Lark ``/.../`` regex."""
    out = []
    for ch in s:
        if ch in "\\.^$|?*+()[]{}/":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)
