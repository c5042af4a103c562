"""``POST /v1/responses``: the text and function-call subset through the real ``openai`` client, on
the in-process app with a scripted engine reply (tests/test_server.py's ``FakeEngine``)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from dsv4.server import responses as R
from test_server import DSML_REPLY, MODEL, _fake_app

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


def _run(reply: str, fn):
    app, eng = _fake_app(reply)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1") as h:
            return await fn(AsyncOpenAI(base_url="http://test/v1", api_key="EMPTY", http_client=h))
    try:
        return asyncio.run(go()), eng
    finally:
        app.state.server.aeng.shutdown()


def test_text_response_through_the_openai_client():
    async def fn(c):
        return await c.responses.create(model=MODEL, instructions="Be brief.", input="Capital of France?",
                                        max_output_tokens=50)
    r, _ = _run("Paris.", fn)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Paris."
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the instructions go in as the system turn, before the user's
    assert R.to_chat({"instructions": "Be brief.", "input": "Capital of France?"})["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def test_cut_response_is_incomplete():
    async def fn(c):
        return await c.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3)
    r, _ = _run("Once upon a time there was a model.", fn)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_function_call_round_trip():
    async def fn(c):
        r = await c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=200)
        call = [o for o in r.output if o.type == "function_call"][0]
        follow = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        return r, call, R.to_chat({"model": MODEL, "input": follow, "tools": TOOLS})
    (r, call, chat), _ = _run(DSML_REPLY, fn)
    assert r.status == "completed" and r.output_text == "I'll check."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    # the follow-up turn maps onto chat messages: the assistant's call, then the tool's output
    msgs = chat["messages"]
    assert msgs[1]["tool_calls"][0]["id"] == call.call_id and msgs[2] == {
        "role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    assert chat["tools"][0] == {"type": "function", "function": {k: TOOLS[0][k] for k in
                                                                 ("name", "description", "parameters")}}


def test_request_mapping():
    chat = R.to_chat({"model": MODEL, "input": [{"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                                                                  {"type": "input_text", "text": "b"}]}],
                      "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}},
                      "tool_choice": {"type": "function", "name": "f"}, "temperature": 0, "store": False})
    assert chat == {"model": MODEL, "messages": [{"role": "system", "content": "ab"}], "temperature": 0,
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}}


@pytest.mark.parametrize("body,msg", [
    ({"input": "x", "stream": True}, "streaming is not supported on /v1/responses"),
    ({"input": "x", "previous_response_id": "resp_1"}, "keeps no responses"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "only text parts"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "x", "frobnicate": 1}, "unsupported field(s) for /v1/responses: frobnicate"),
    ({"input": []}, "input must be a string or a non-empty list"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input items of type 'item_reference' are not supported"),
])
def test_unsupported_requests_are_400s_naming_the_field(body, msg):
    async def fn(c):
        with pytest.raises(BadRequestError) as e:
            await c.post("/responses", body={"model": MODEL, **body}, cast_to=object)
        return e.value
    err, _ = _run("x", fn)
    assert err.status_code == 400 and msg in err.message
