"""``/v1/responses``: the text, reasoning and function-call subset through the real ``openai``
client, streamed and not, with the response store; on the in-process app with a scripted engine
reply (tests/test_server.py's ``FakeEngine``)."""
from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
from openai import AsyncOpenAI, BadRequestError, NotFoundError  # noqa: E402

from dsv4.server import responses as R  # noqa: E402
from test_server import DSML_REPLY, MODEL, _fake_app  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


def _run(reply: str, fn, **kw):
    app, eng = _fake_app(reply, **kw)

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
    assert R.to_chat({"instructions": "Be brief.", "input": "Capital of France?"})[0]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def test_cut_response_is_incomplete():
    async def fn(c):
        return await c.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3)
    r, _ = _run("Once upon a time there was a model.", fn)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    [msg] = r.output
    assert msg.type == "message" and msg.status == "incomplete"       # the item the cut fell in says so too


def test_function_call_round_trip():
    async def fn(c):
        r = await c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=200)
        call = [o for o in r.output if o.type == "function_call"][0]
        follow = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        return r, call, R.to_chat({"model": MODEL, "input": follow, "tools": TOOLS})[0]
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
    chat, _ = R.to_chat({"model": MODEL, "input": [{"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                                                                  {"type": "input_text", "text": "b"}]}],
                      "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}},
                      "tool_choice": {"type": "function", "name": "f"}, "temperature": 0, "store": False})
    assert chat == {"model": MODEL, "messages": [{"role": "system", "content": "ab"}], "temperature": 0,
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}}


@pytest.mark.parametrize("body,msg", [
    ({"input": "x", "conversation": "conv_1"}, "keeps no conversations"),
    ({"input": "x", "reasoning": "high"}, "reasoning must be an object"),
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


def _events(stream_events) -> list:
    return [e.type for e in stream_events]


def test_streamed_text_and_reasoning_with_the_openai_client():
    """``responses.create(stream=True)``: OpenAI's event sequence; the reasoning (effort high turns
    V4's thinking on) streams as a reasoning item, the answer as a message, and the final
    response equals the non-streamed one; the client's own accumulator (``responses.stream``)
    accepts the sequence."""
    async def fn(c):
        kw = dict(model=MODEL, input="Capital of France?", reasoning={"effort": "high"}, max_output_tokens=200)
        events = [e async for e in await c.responses.create(stream=True, **kw)]
        whole = await c.responses.create(**kw)
        async with c.responses.stream(**kw) as st:
            final = await st.get_final_response()
        return events, whole, final
    (events, whole, final), _ = _run("Paris is in France.</think>Paris.", fn)
    assert _events(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added"] + \
        ["response.reasoning_text.delta"] * _events(events).count("response.reasoning_text.delta") + [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"] + \
        ["response.output_text.delta"] * _events(events).count("response.output_text.delta") + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Paris is in France."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    done = events[-1].response
    assert done.status == "completed" and done.output_text == whole.output_text == final.output_text == "Paris."
    assert [o.type for o in done.output] == [o.type for o in whole.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == whole.output[0].content[0].text == "Paris is in France."
    assert done.reasoning.effort == "high" and done.usage.output_tokens == whole.usage.output_tokens > 0


def test_streamed_function_calls_and_a_cut_call():
    """Function calls stream as items with argument deltas; a stream cut by max_output_tokens
    inside its second call ends with ``response.incomplete``, the complete first call, and no
    DSML markup in any text."""
    two = DSML_REPLY.replace("</｜DSML｜tool_calls>", DSML_REPLY[DSML_REPLY.index('<｜DSML｜invoke'):])

    async def fn(c):
        full = [e async for e in await c.responses.create(model=MODEL, input="Weather?", tools=TOOLS,
                                                          max_output_tokens=300, stream=True)]
        n = len(DSML_REPLY) // 3           # tokens: well inside the second call
        cut = [e async for e in await c.responses.create(model=MODEL, input="Weather?", tools=TOOLS,
                                                         max_output_tokens=n, stream=True)]
        whole = await c.responses.create(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=n)
        return full, cut, whole
    (full, cut, whole), _ = _run(two, fn)
    assert full[-1].type == "response.completed"
    calls = [e for e in full if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in calls] == [{"city": "Paris", "days": 3}] * 2
    assert [e.delta for e in full if e.type == "response.function_call_arguments.delta"] == [e.arguments for e in calls]
    assert [o.type for o in full[-1].response.output] == ["message", "function_call", "function_call"]
    for r in (cut[-1].response, whole):
        assert r.status == "incomplete" and [o.type for o in r.output] == ["message", "function_call"]
        assert r.output[0].content[0].text == "I'll check." and r.output[1].status == "completed"
        assert json.loads(r.output[1].arguments) == {"city": "Paris", "days": 3}
    assert cut[-1].type == "response.incomplete"
    assert not any("DSML" in (getattr(e, "delta", "") or "") for e in cut)


def test_stored_responses_chain_and_are_evicted():
    """``store`` keeps a response for ``GET /v1/responses/{id}`` and ``previous_response_id`` (whose
    conversation, the earlier input and answer, comes before the new input); a response stored
    with ``store: false``, or pushed out of the bounded store, is a 404."""
    async def fn(c):
        first = await c.responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.")
        got = await c.responses.retrieve(first.id)
        second = await c.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id)
        loose = await c.responses.create(model=MODEL, input="x", store=False)
        errors = []
        for rid in (loose.id, first.id):
            try:
                await c.responses.retrieve(rid)
            except NotFoundError as e:
                errors.append(e)
        try:
            await c.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        except NotFoundError as e:
            errors.append(e)
        return first, got, second, errors
    (first, got, second, errors), eng = _run("Paris.", fn, max_stored_responses=1)
    assert got.id == first.id and got.output_text == "Paris." and got.instructions == "Be brief."
    assert second.previous_response_id == first.id and second.output_text == "Paris."
    # the second prompt holds the first turn (not its instructions) before the new input
    prompt = eng.tokenizer.decode(eng.prompts[1], skip_special_tokens=False)
    assert "Be brief." not in prompt and prompt.index("Capital of France?") < prompt.index("Paris.") \
        < prompt.index("And of Italy?")
    # store size 1: the second response pushed the first out; the store: false one was never kept
    assert len(errors) == 3 and all(e.status_code == 404 for e in errors)
    assert "not found" in errors[0].message and errors[2].body["param"] == "previous_response_id"
