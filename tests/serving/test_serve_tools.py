"""Tool calls on /v1/chat/completions (issue 41): the ``openai`` client's tool-calling loop against a real
``tessera serve`` on 127.0.0.1 (a tiny seeded GPT-2, the byte-level tokenizer of test_structured.py
with a chat template that renders ``tools``, assistant ``tool_calls`` and ``role: tool`` messages).
tool_choice "required" and a named function constrain the reply to a call (always parsed, arguments
valid against the function's parameters); the tool's answer goes back into the template; "none"
answers in text; streamed calls arrive as ``tool_calls`` deltas. The parser alone: Hermes blocks and
bare JSON calls.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_structured import VOCAB, make_tokenizer  # noqa: E402

SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", f"vocab={VOCAB}", "--set", "ctx=1024"]
TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: "
            "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} "
            "{{ c['function']['arguments']['city'] }};{% endfor %}"
            "{% elif m['role'] == 'tool' %}result {{ m['tool_call_id'] }} {{ m['content'] }}"
            "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "rome", "oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}},
                                       "required": ["city"], "additionalProperties": False}}}


def _folder(path):
    make_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve_http import ServerProcess

    folder = _folder(tmp_path_factory.mktemp("tok"))
    s = ServerProcess(["gpt2", *SETS, "--tokenizer", folder / "tokenizer.json", "--max-batch", 4],
                      tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_calling_loop(client):
    messages = [{"role": "user", "content": "weather in paris?"}]
    for seed in range(4):
        r = client.chat.completions.create(model="gpt2", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=1.0, seed=seed, max_tokens=500)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
        for c in calls:
            args = json.loads(c.function.arguments)
            allowed = ["paris", "rome", "oslo"] if c.function.name == "get_weather" else ["paris", "rome"]
            assert c.function.name in ("get_weather", "get_time") and args["city"] in allowed
    # the loop: the calls and the tool's answers go back; tool_choice none answers in text
    history = messages + [choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    r2 = client.chat.completions.create(model="gpt2", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                        temperature=0, max_tokens=8)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the calls and results are in the prompt


def test_named_function_one_call_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "time?"}],
                                       tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False,
                                       temperature=1.0, seed=5, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["city"] in ("paris", "rome")
    stream = client.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "time?"}],
                                            tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False,
                                            temperature=1.0, seed=5, max_tokens=60, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_time" and deltas[0].function.arguments == call.function.arguments


def test_auto_is_text_or_calls(client):
    r = client.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER], temperature=0, max_tokens=10)
    m = r.choices[0].message
    assert (m.tool_calls is None) == (r.choices[0].finish_reason != "tool_calls")


def test_bad_tool_requests_are_400s(server):
    user = [{"role": "user", "content": "x"}]
    bad = [({"messages": user, "tool_choice": "required"}, "tool_choice"),
           ({"messages": user, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice"),
           ({"messages": user, "tools": [WEATHER, WEATHER]}, "tools"),
           ({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
             "tool_choice": "required"}, "tools"),
           ({"messages": user, "tools": [WEATHER], "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "tool_choice"),
           ({"messages": user + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
           ({"messages": [{"role": "user"}]}, "messages[0].content")]
    for body, param in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_parser():
    from tessera.runtime.serving.tools import parse

    fns = [WEATHER["function"]]
    content, calls = parse('ok <tool_call>{"name": "get_weather", "arguments": {"city": "rome"}}</tool_call>', fns)
    assert content == "ok" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "rome"}
    _, calls = parse('[{"name": "get_weather", "parameters": {"city": "oslo"}}, '
                     '{"name": "get_weather", "arguments": "{\\"city\\": \\"paris\\"}"}]', fns)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["oslo", "paris"]
    assert parse('{"name": "other", "arguments": {}}', fns) == ('{"name": "other", "arguments": {}}', [])
    assert parse("<tool_call>not json</tool_call>", fns)[1] == []


def test_hermes_template_gets_tool_call_blocks(tmp_path):
    """A template that writes Hermes/Qwen's <tool_call> form: a required call is constrained to that form
    (parallel: one or more blocks), and the reply parses into tool_calls."""
    from tessera.runtime.io.chat_template import ChatTemplate
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.app import Server
    from tessera.runtime.serving.engine import Engine

    tok = make_tokenizer()
    hermes = ("{% if tools %}<tools>{{ tools | tojson }}</tools> answer with <tool_call>{json}</tool_call>\n{% endif %}"
              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
    model = serving_model.load("gpt2", sets=["layers=1", "d=32", "heads=2", f"vocab={VOCAB}", "ctx=1024"], threads=1)
    engine = Engine(model, max_batch=4, capacity=1024, tokenizer=tok, eos_ids=[0])
    server = Server(engine, "gpt2", tok, ChatTemplate(hermes))
    for parallel in (True, False):
        for seed in range(3):
            body, req = server.chat_request({"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
                                             "tool_choice": "required", "parallel_tool_calls": parallel,
                                             "temperature": 1.0, "seed": seed, "max_tokens": 300})
            h = engine.submit(req)
            for _ in range(400):
                if not engine.step():
                    break
            text = tok.decode([t for t in h.tokens if t != 0])
            assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>"), text
            assert parallel or text.count("<tool_call>") == 1
            message, finish = server.chat_reply(body, h)
            assert finish == "tool_calls" and len(message["tool_calls"]) == text.count("<tool_call>")
            assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] in ("paris", "rome", "oslo")
