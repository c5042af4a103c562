"""A vLLM user's launch line, model id and checks work unchanged: ``dsv4 serve`` started with
README's V4 launch line as vLLM takes it (section Coming from vLLM), on a Hugging Face Hub id resolved
offline from a cache laid out as the Hub's, with the model's generation_config.json as default
sampling parameters, a Jinja ``--chat-template``, CORS, and the model length held on every route.
The flags' parsing, the Hub resolution and the template are also tested in-process."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serve_helpers import serve_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "deepseek-ai/DeepSeek-V4-Flash"
MAX_LEN = 64
GEN_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.0, "top_p": 1.0,
              "max_new_tokens": 5}
# V4's chat mode for system / user / assistant turns, with "[sys] " before the system prompt
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}[sys] {{ m.content }}"
            "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
            "{% else %}<｜Assistant｜></think>{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory, default_model_dir):
    """A Hugging Face cache holding HUB_ID at two revisions (main, and the tag v1 whose generation
    config differs), the files linked to one tiny checkpoint (the session's default model, read only), as the
    Hub's cache links blobs."""
    tmp = tmp_path_factory.mktemp("hub")
    src = Path(default_model_dir)
    repo = tmp / "cache" / ("models--" + HUB_ID.replace("/", "--"))
    for ref, commit, gen in (("main", "a" * 40, GEN_CONFIG), ("v1", "b" * 40, {**GEN_CONFIG, "max_new_tokens": 3})):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in src.iterdir():
            if f.name != "generation_config.json":
                (snap / f.name).symlink_to(f)
        (snap / "generation_config.json").write_text(json.dumps(gen))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return SimpleNamespace(cache=tmp / "cache", repo=repo, tmp=tmp)


@pytest.fixture
def offline_hub(hub, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def test_hub_ids_resolve_offline_at_a_revision(offline_hub):
    from dsv4.models import generation_defaults, resolve_model
    main = resolve_model(HUB_ID)
    assert main == str(offline_hub.repo / "snapshots" / ("a" * 40))
    v1 = resolve_model(HUB_ID, revision="v1")
    assert v1 == str(offline_hub.repo / "snapshots" / ("b" * 40))
    assert generation_defaults("auto", main) == {"temperature": 0.0, "max_tokens": 5}     # top_p 1.0 is the default
    assert generation_defaults("auto", v1)["max_tokens"] == 3
    assert generation_defaults("vllm", main) == {}
    assert generation_defaults(v1, main)["max_tokens"] == 3                            # a directory's file
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("nobody/no-such-model")
    assert "'nobody/no-such-model'" in str(e.value) and str(offline_hub.cache) in str(e.value)
    assert "HF_HUB_OFFLINE=1" in str(e.value)
    with pytest.raises(FileNotFoundError, match="at revision 'v9'"):
        resolve_model(HUB_ID, revision="v9")
    with pytest.raises(FileNotFoundError, match="does not exist, and it is not a Hugging Face Hub id"):
        resolve_model("/no/such/dir")
    with pytest.raises(ValueError, match="--revision applies to a Hugging Face Hub id"):
        resolve_model(str(offline_hub.tmp), revision="v1")
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        generation_defaults(str(offline_hub.tmp), main)


def test_launch_flags_are_parsed_with_vllm_s_meaning_and_errors_name_the_command(capsys):
    from dsv4.cli import build_parser, main
    a = build_parser().parse_args(["serve", HUB_ID, "--disable-log-requests", "--dtype", "bfloat16",
                                   "--allowed-origins", "https://a.example, https://b.example", "--revision", "v1"])
    assert (a.model, a.revision, a.enable_log_requests, a.dtype) == (HUB_ID, "v1", False, "bfloat16")
    assert a.allowed_origins == ["https://a.example", "https://b.example"] and a.generation_config == "auto"
    for argv, words in ((["serve", "--bogus"], "unrecognized arguments: --bogus"),
                        (["serve", "--tool-call-parser", "hermes"], "accepted: deepseek_v4"),
                        (["serve", "--kv-cache-dtype", "fp16"], "V4's KV cache is FP8"),
                        (["serve", "--block-size", "16"], "256-token blocks"),
                        (["serve", "--dtype", "float16"], "accepted: auto, bfloat16"),
                        (["serve", "--allowed-origins", "[1]"], "JSON list of origin strings"),
                        (["bench", "serve", "--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        usage = "dsv4 bench serve" if argv[0] == "bench" else "dsv4 serve"
        assert e.value.code == 2 and err.startswith(f"usage: {usage}") and words in err, err


def test_readme_documents_every_serve_flag():
    from dsv4.cli import _command_parser, build_parser
    p = build_parser()
    serve = _command_parser(p, p.parse_args(["serve"]))
    readme = (ROOT / "README.md").read_text()
    flags = [o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert len(flags) > 30 and [f for f in flags if f"`{f}" not in readme] == []


def test_chat_template_renders_as_transformers_does():
    """The template sees the messages (text parts joined), tools, add_generation_prompt, the special
    tokens and chat_template_kwargs; tojson keeps non-ASCII; raise_exception is a 400-able error."""
    from dsv4.server.jinja_template import ChatTemplateError, JinjaChatTemplate, load_chat_template
    t = JinjaChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% if greeting %}{{ greeting }}\n{% endif %}"
        "{% if add_generation_prompt %}assistant:{% endif %}", {"bos_token": "<s>", "eos_token": "</s>"})
    msgs = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "x"}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert t.render(msgs, tools, True, {"greeting": "hi"}) == \
        '<s>user: héllo\nx\ntools: [{"type": "function", "function": {"name": "f"}}]\nhi\nassistant:'
    assert t.render(msgs, None, False, {}) == "<s>user: héllo\nx\n"
    bad = JinjaChatTemplate("{{ raise_exception('only user turns') }}", {})
    with pytest.raises(ChatTemplateError, match="messages: the chat template refused the request: only user turns"):
        bad.render(msgs, None, True, {})
    with pytest.raises(ValueError, match="chat template: .* \\(line 1\\)"):
        load_chat_template("{% for x in %}")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_chat_template("no_such_template.jinja")


def readme_launch_line() -> list[str]:
    """The arguments after ``dsv4`` of README's launch line (section "Coming from vLLM")."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Coming from vLLM"):]
    [line] = [ln for ln in section.splitlines() if ln.startswith("dsv4 serve ")][:1]
    return shlex.split(line)[1:]


@pytest.fixture(scope="module")
def vllm_server(hub):
    """``dsv4 serve`` started with README's launch line, on the Hub id, offline."""
    (hub.tmp / "template.jinja").write_text(TEMPLATE)
    env = dict(os.environ, HF_HUB_CACHE=str(hub.cache), HF_HUB_OFFLINE="1", DSV4_CACHE_DIR=str(hub.tmp / "dsv4"),
               PYTHONUNBUFFERED="1")
    env.pop("DSV4_API_KEY", None)
    line = readme_launch_line()
    assert line[:2] == ["serve", HUB_ID] and "--disable-log-requests" in line, line
    # for this machine (a CPU, one rank, a short model length; serve_process adds a free local
    # port), and the two flags the README line does not carry (a later flag replaces an earlier one)
    line += ["--tensor-parallel-size", "1", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "4",
             "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
             "--chat-template", str(hub.tmp / "template.jinja"), "--allowed-origins", '["http://localhost:3000"]']
    log_path = hub.tmp / "server.log"
    with serve_process(line[1:], env, log_path) as (_, base):
        yield SimpleNamespace(base=base, log=log_path, client=openai.OpenAI(base_url=base + "/v1", api_key="EMPTY",
                                                                            max_retries=0, timeout=120))
    text = log_path.read_text()
    assert "Traceback" not in text, text[-4000:]


def test_the_launch_line_serves_the_hub_id_with_its_generation_config(vllm_server):
    """A chat through the openai client under the Hub id; without temperature / max_tokens the
    model's generation config holds (greedy, 5 tokens), a request's own values come first; the
    start-up log states the defaults."""
    c = vllm_server.client
    assert [m.id for m in c.models.list().data] == [HUB_ID]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France is"}]
    r = c.chat.completions.create(model=HUB_ID, messages=msgs, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    greedy = c.chat.completions.create(model=HUB_ID, messages=msgs, temperature=0, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy.choices[0].message.content
    assert c.chat.completions.create(model=HUB_ID, messages=msgs, max_tokens=2).usage.completion_tokens == 2
    log = vllm_server.log.read_text()
    assert "default sampling parameters (--generation-config auto): temperature=0.0, max_tokens=5" in log
    assert "request chatcmpl-" not in log                     # --disable-log-requests
    # the --chat-template rendered the prompt: V4's encoding of the system prompt with "[sys] " before it
    from dsv4.server.chat_encoding import apply_chat_template
    from dsv4.tokenizer import load_tokenizer
    ids = httpx.post(vllm_server.base + "/tokenize", json={"model": HUB_ID, "messages": msgs}).json()["tokens"]
    want = apply_chat_template(load_tokenizer(None), [{**msgs[0], "content": "[sys] Be brief."}, msgs[1]])
    assert ids == want and r.usage.prompt_tokens == len(ids)


def test_the_model_length_holds_on_every_route(vllm_server):
    """Without max_tokens, prompt + output stop at --max-model-len with finish_reason length:
    completions (whose default max_tokens is 16), chat and responses (the generation config's 5)."""
    c = vllm_server.client
    prompt = list(range(1000, 1055))                      # 55 tokens: 9 left of 64
    r = c.completions.create(model=HUB_ID, prompt=prompt, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_LEN - 55
    text = ""
    for k in range(100):                                  # a prompt that leaves fewer than the config's 5 tokens
        text += f" {k}"
        msgs = [{"role": "user", "content": text}]
        n = len(httpx.post(vllm_server.base + "/tokenize", json={"messages": msgs}).json()["tokens"])
        if n > MAX_LEN - 5:
            break
    assert n < MAX_LEN, n
    r = c.chat.completions.create(model=HUB_ID, messages=msgs, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == MAX_LEN
    r = c.responses.create(model=HUB_ID, input=text)
    assert r.status == "incomplete" and r.output[0].status == "incomplete"
    assert r.usage.input_tokens + r.usage.output_tokens == MAX_LEN


def test_cors_allows_only_the_allowed_origins(vllm_server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(vllm_server.base + "/v1/chat/completions", headers={"Origin": "http://localhost:3000", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    evil = httpx.options(vllm_server.base + "/v1/chat/completions", headers={"Origin": "https://evil.example", **pre})
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    r = httpx.get(vllm_server.base + "/v1/models", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
