"""Structured outputs without a model: grammars compiled by ``engine.structured`` (JSON schema,
choice, regex, the thinking-mode wrapper) and the DSML tool-call grammar of
``server.tool_grammar``, checked against V4's tokenizer. A "random walk" samples a token the
grammar mask allows, uniformly (as the argmax of the random tiny model's logits would), until the
grammar completes; its text must parse (JSON, or the chat encoder's DSML parser) and satisfy the schema, checked by
hand. The served path (real server, real ``openai`` client) is in ``test_server.py``."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from dsv4.engine.sampling_params import StructuredOutputsParams as S  # noqa: E402
from dsv4.engine.structured import GrammarCompiler, fill_bitmask  # noqa: E402
from dsv4.server.chat_encoding import parse_completion, render_tool_calls  # noqa: E402
from dsv4.server.tool_grammar import tool_call_grammar  # noqa: E402
from dsv4.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def gc():
    tok = load_tokenizer(None)
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_id)


def walk(gc, spec: S, seed: int, max_steps: int = 400, prefix: list[int] | None = None) -> str:
    """Text of a random walk under ``spec``'s mask until the grammar completes: each step a token
    drawn uniformly from those the mask allows (what the argmax of random logits gives; numpy
    keeps the walk cheap)."""
    m = gc.compile(spec).matcher()
    assert m.consume_tokens(prefix or [])
    rng = np.random.default_rng(seed)
    out = list(prefix or [])
    for _ in range(max_steps):
        bm, err = fill_bitmask([m], gc.vocab_size)
        assert err == [None]
        allowed = np.flatnonzero(np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:gc.vocab_size])
        t = int(rng.choice(allowed))
        assert m.consume_token(t), m.get_error()
        if t == gc.eos_token_id:
            break
        out.append(t)
        if m.is_stopped():
            break
    assert m.is_stopped(), f"the grammar did not complete in {max_steps} steps"
    return gc.tokenizer.decode(out, skip_special_tokens=False)


def accepts(gc, spec: S, text: str) -> bool:
    m = gc.compile(spec).matcher()
    return m.consume_tokens(gc.tokenizer.encode(text)) and m.is_accepting()


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]}},
          "required": ["name", "age"], "additionalProperties": False}


def check_person(v) -> None:
    assert isinstance(v, dict) and set(v) <= {"name", "age", "pet"} and {"name", "age"} <= set(v), v
    assert isinstance(v["name"], str) and len(v["name"]) <= 8, v
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool) and 0 <= v["age"] <= 120, v
    assert v.get("pet", "cat") in ("cat", "dog", None), v


def test_json_schema_walks_give_valid_json(gc):
    for seed in range(4):
        check_person(json.loads(walk(gc, S(json=PERSON), seed)))
    assert json.loads(walk(gc, S(json=json.dumps(PERSON)), 9)) is not None       # the schema as JSON text
    assert accepts(gc, S(json_object=True), '{"a":[1,{"b":null}],"c":"d"}')
    assert not accepts(gc, S(json_object=True), "[1]") and not accepts(gc, S(json_object=True), "x")
    assert accepts(gc, S(json=PERSON), '{"name":"Al","age":7}')
    assert not accepts(gc, S(json=PERSON), '{"name":"Al","age":700}')
    assert not accepts(gc, S(json=PERSON), '{"name":"Al","age":7,"x":1}')


def test_json_is_compact_by_default_and_flexible_on_request(gc):
    """By default JSON has no whitespace between its tokens (OpenAI's and vLLM's
    ``disable_any_whitespace``); ``disable_any_whitespace=False`` allows one space or a newline
    with up to 20 blanks of indentation wherever JSON allows whitespace, and never longer runs."""
    for text in ('{"name":"Al","age":7}', '{"name":"Al b","age":7,"pet":null}'):
        assert accepts(gc, S(json=PERSON), text), text
    for text in ('{"name": "Al", "age": 7}', '{"name":"Al",\n"age":7}', "{ }", '{"a":\n            \t       "no"}'):
        assert not accepts(gc, S(json=PERSON if "Al" in text else {"type": "object"}), text), text
        assert not accepts(gc, S(json_object=True), text) or "Al" in text, text
    flexible = dict(disable_any_whitespace=False)
    for text in ('{"name": "Al", "age": 7}', '{"name":"Al","age":7}', '{\n  "name": "Al",\n\t"age": 7\n}',
                 "{ }", "{\n" + " " * 20 + "}"):
        assert accepts(gc, S(json=PERSON if "Al" in text else {"type": "object"}, **flexible), text), text
    for text in ("{  }", "{\n\n}", "{ \n}", "{\n" + " " * 21 + "}", " {}", "{} "):
        assert not accepts(gc, S(json_object=True, **flexible), text), text
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        S(json_object=True, disable_any_whitespace="yes")


def test_choice_and_regex(gc):
    choices = ['say "hi"\n', "back\\slash", "Reykjavík"]
    for c in choices:
        assert accepts(gc, S(choice=choices), c)
    assert not accepts(gc, S(choice=choices), "say")
    assert walk(gc, S(choice=choices), 0) in choices
    text = walk(gc, S(regex="[0-9]{3}-[a-z]{2}"), 0)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text


def test_thinking_wrapper_puts_the_constraint_after_think_end(gc):
    tok = gc.tokenizer
    spec = S(json=PERSON, thinking=True)
    assert accepts(gc, spec, 'I think {so}.</think>{"name":"Al","age":7}')
    assert accepts(gc, spec, '</think>{"name":"Al","age":7}')
    assert not accepts(gc, spec, '{"name":"Al","age":7}')                 # the reasoning must be closed
    # "</think>" spelled with ordinary tokens is not the end of the reasoning, nor allowed in it
    m = gc.compile(spec).matcher()
    assert not m.consume_tokens(tok.encode("x </") + tok.encode("think>"))
    text = walk(gc, spec, 1, max_steps=600, prefix=tok.encode("Let me see.</think>"))
    reasoning, _, answer = text.partition("</think>")
    assert reasoning == "Let me see." and parse_completion(text, True).content == answer
    check_person(json.loads(answer))


def test_bad_schemas_and_grammars_are_value_errors(gc):
    for spec, words in ((S(json={"type": "bogus"}), "Invalid type"),
                        (S(json={"type": "object", "properties": 5}), "properties"),
                        (S(json="{not json"), "not valid JSON"),
                        (S(regex="[0-9"), "unclosed character class"),
                        (S(grammar="start: missing_rule"), "missing_rule")):
        with pytest.raises(ValueError) as e:
            gc.compile(spec)
        assert words in str(e.value), str(e.value)
    for kw, words in ((dict(), "exactly one"), (dict(json={}, regex="a"), "exactly one"),
                      (dict(choice=[]), "choice"), (dict(choice=["a", 1]), "choice"), (dict(json=5), "json")):
        with pytest.raises(ValueError, match=words):
            S(**kw)


def test_compiled_grammars_are_cached_and_matchers_independent(gc):
    a = gc.compile(S(regex="[a-z]+"))
    assert gc.compile(S(regex="[a-z]+")) is a
    m1, m2 = a.matcher(), a.matcher()
    assert m1.consume_tokens(gc.tokenizer.encode("abc"))
    assert not m2.consume_tokens(gc.tokenizer.encode("1"))             # m2 fails on its own ...
    assert not m1.is_error() and m1.consume_tokens(gc.tokenizer.encode("d"))    # ... m1 is unaffected


# ---------------------------------------------------------------------------------- tool calls

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "New York"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"$ref": "#/$defs/unit"},
                   "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}}
PING = {"name": "ping"}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                           "required": ["query"]}}


def check_weather(args: dict) -> None:
    assert set(args) <= {"city", "days", "unit", "hourly"} and {"city", "days"} <= set(args), args
    assert args["city"] in ("Paris", "Rome", "New York"), args
    assert isinstance(args["days"], int) and not isinstance(args["days"], bool) and 1 <= args["days"] <= 7, args
    assert args.get("unit", "celsius") in ("celsius", "fahrenheit"), args
    assert isinstance(args.get("hourly", True), bool), args


def calls_of(text: str, thinking: bool = False) -> list[tuple[str, dict]]:
    parsed = parse_completion(text, thinking)
    assert parsed.content == "", parsed
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_tool_grammar_accepts_what_the_encoder_renders(gc):
    spec = S(grammar=tool_call_grammar([WEATHER, PING, SEARCH], parallel=True))
    for calls in ([{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}],
                  [{"name": "ping", "arguments": {}},
                   {"name": "get_weather", "arguments": {"city": "New York", "days": 7, "unit": "fahrenheit",
                                                         "hourly": True}}],
                  [{"name": "search", "arguments": {"query": 'a "quoted" <b>query</b>\nwith lines'}}]):
        text = "\n\n" + render_tool_calls(calls)
        m = gc.compile(spec).matcher()
        assert m.consume_tokens(gc.tokenizer.encode(text)) and m.is_stopped(), m.get_error()
        assert calls_of(text) == [(c["name"], c["arguments"]) for c in calls]
    # out of the schema: a city not in the enum, days out of range, an unknown function
    for bad in ({"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}},
                {"name": "get_weather", "arguments": {"city": "Rome", "days": 9}},
                {"name": "get_weather", "arguments": {"days": 3}},
                {"name": "nope", "arguments": {}}):
        m = gc.compile(spec).matcher()
        assert not m.consume_tokens(gc.tokenizer.encode("\n\n" + render_tool_calls([bad]))), bad
    # a schema without properties takes any parameters, raw strings or JSON
    free = S(grammar=tool_call_grammar([{"name": "free", "parameters": {"type": "object"}}]))
    call = [{"name": "free", "arguments": {"text": "hi there", "n": [1, {"a": None}], "ok": False}}]
    m = gc.compile(free).matcher()
    assert m.consume_tokens(gc.tokenizer.encode("\n\n" + render_tool_calls(call))) and m.is_stopped()
    # JSON values are spaced as the encoder writes them, without runs of whitespace
    spaced = render_tool_calls(call).replace('[1, {"a": null}]', '[1,\n        {"a":   null}]')
    assert not gc.compile(free).matcher().consume_tokens(gc.tokenizer.encode("\n\n" + spaced))
    # one call only unless parallel
    two = "\n\n" + render_tool_calls([{"name": "ping", "arguments": {}}] * 2)
    m = gc.compile(S(grammar=tool_call_grammar([PING], parallel=False))).matcher()
    assert not m.consume_tokens(gc.tokenizer.encode(two))


def test_tool_grammar_random_walks_parse_to_valid_calls(gc):
    one = S(grammar=tool_call_grammar([WEATHER, PING], parallel=False))
    seen = set()
    for seed in range(6):
        [(name, args)] = calls_of(walk(gc, one, seed))
        seen.add(name)
        if name == "get_weather":
            check_weather(args)
        else:
            assert name == "ping" and args == {}
    assert "get_weather" in seen
    named = S(grammar=tool_call_grammar([WEATHER], parallel=False), thinking=True)
    text = walk(gc, named, 0, prefix=gc.tokenizer.encode("I need the weather.</think>"))
    assert parse_completion(text, True).reasoning_content == "I need the weather."
    [(name, args)] = calls_of(text, thinking=True)
    assert name == "get_weather"
    check_weather(args)


def test_tool_grammar_refuses_what_dsml_cannot_carry():
    with pytest.raises(ValueError, match="contains"):
        tool_call_grammar([{"name": 'say"hi'}])
    with pytest.raises(ValueError, match="contains"):
        tool_call_grammar([{"name": "f", "parameters": {"type": "object", "properties": {'a"b': {}}}}])
    with pytest.raises(ValueError, match="type 'object'"):
        tool_call_grammar([{"name": "f", "parameters": {"type": "array"}}])
