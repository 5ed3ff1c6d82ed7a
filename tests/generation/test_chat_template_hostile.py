"""issue 38: a chat template is untrusted code. Before, `{{ 1/0 }}`, a recursive macro, 2,000 nested
ifs or the sandbox's own range refusal escaped runtime/io/chat_template.py as tracebacks (in the
server, at `tessera serve` start and in `tessera generate --chat`); a 10^8-step loop held the event
loop (every client) for 20 s and `{{ 'x' * 10000000000 }}` took 8.9 GiB. Now every one is a
ChatTemplateError naming the template (the server's 400), within a time and output budget, and the
server answers others meanwhile."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("jinja2")

from conftest import cli  # noqa: E402

from tessera.runtime.io.chat_template import TEMPLATE_SECONDS, ChatTemplate, ChatTemplateError  # noqa: E402

RUNTIME = {
    "div0": "{{ 1/0 }}",
    "recursive_macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "sandbox_range": "{{ range(10**9)|list|length }}",
    "silent_loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "printing_loop": "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}x"
                     "{% endfor %}{% endfor %}{% endfor %}",
    "string_times": "{{ 'x' * 10000000000 }}",
    "list_times": "{{ ([1] * 10000000000)|length }}",
    "power": "{{ 7 ** 100000000 }}",
    "doubling": "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                "{{ ns.s|length }}",
    "undefined_call": "{{ nothing() }}",
    "attribute": "{{ messages.__class__.__mro__ }}",
}
PARSE = {
    "nested_ifs": "{% if true %}" * 2000 + "x" + "{% endif %}" * 2000,
    "unclosed": "{% for m in messages %}",
    "nested_parens": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
}
MESSAGES = [{"role": "user", "content": "w1 w2"}]


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_a_template_that_fails_while_rendering_is_a_clear_error(name):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="the chat template could not render these messages"):
        ChatTemplate(RUNTIME[name]).render(MESSAGES)
    assert time.monotonic() - t0 < TEMPLATE_SECONDS + 3


@pytest.mark.parametrize("name", sorted(PARSE))
def test_a_template_that_does_not_parse_is_a_clear_error(name):
    with pytest.raises(ChatTemplateError, match="the chat template does not parse"):
        ChatTemplate(PARSE[name])


def test_an_ordinary_template_renders_as_before():
    src = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}{% if add_generation_prompt " \
          "%}<assistant>{% endif %}{{ range(3)|join(',') }}"
    assert ChatTemplate(src).render(MESSAGES + [{"role": "assistant", "content": " w3 "}]) == \
        "<user>w1 w2<assistant>w3<assistant>0,1,2"


def _folder(tmp_path, template: str):
    from test_serve_http import _tokenizer_folder

    return _tokenizer_folder(tmp_path, template)


SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=32"]


@pytest.mark.parametrize("name", ["div0", "nested_ifs", "silent_loop"])
def test_generate_chat_with_a_hostile_template_exits_2(tmp_path, capsys, name):
    tok = _folder(tmp_path, {**RUNTIME, **PARSE}[name])
    rc, out, err = cli(capsys, "generate", "gpt2", *SETS, "--tokenizer", tok, "--chat", "--prompt", "w1 w2",
                       "--max-new-tokens", 2)
    assert rc == 2, err
    assert "Traceback" not in err and err.startswith("error: ") and "chat template" in err, err


# one server whose template misbehaves as the user's message asks
SERVED = "{% set c = messages[0]['content'] %}" + "".join(
    f"{{% {'if' if i == 0 else 'elif'} c == '{name}' %}}{RUNTIME[name]}" for i, name in enumerate(sorted(RUNTIME))) + \
    "{% else %}{% for m in messages %}{{ m['content'] }} {% endfor %}w9{% endif %}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    tok = _folder(tmp_path_factory.mktemp("tok"), SERVED)
    opts = ServeOptions(spec="gpt2", sets=[s for s in SETS if s != "--set"], tokenizer=str(tok), max_batch=2,
                        max_queue=4, model_name="tiny")
    engine, server = build_server(opts)
    engine.start()
    try:
        with TestClient(create_app(server)) as c:
            yield c
    finally:
        engine.close()


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_the_server_answers_400_naming_the_template(client, name):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": name}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "tokenizer_config.json" in err["message"], err
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_health_answers_while_a_template_runs(client):
    done = {}

    def slow():
        done["r"] = client.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "silent_loop"}], "max_tokens": 2})
        done["t"] = time.monotonic()

    t = threading.Thread(target=slow)
    start = time.monotonic()
    t.start()
    time.sleep(0.3)
    health = client.get("/health")
    answered = time.monotonic()
    t.join(30)
    assert health.status_code == 200
    assert answered < done["t"], "health waited for the template"
    assert answered - start < TEMPLATE_SECONDS
    assert done["r"].status_code == 400


def test_serve_starts_with_an_unparsable_template_and_says_why(tmp_path, capsys):
    from tessera.runtime.serving.server import ServeOptions, build_server

    tok = _folder(tmp_path, PARSE["nested_ifs"])
    opts = ServeOptions(spec="gpt2", sets=[s for s in SETS if s != "--set"], tokenizer=str(tok), max_batch=1,
                        model_name="tiny")
    engine, server = build_server(opts)
    try:
        assert server.chat_template is None and "does not parse" in server.chat_template_error
        assert "warning:" in capsys.readouterr().err
    finally:
        engine.close()


def test_a_deeply_nested_tokenizer_config_is_a_clear_error(tmp_path):
    _folder(tmp_path, None)
    (tmp_path / "tokenizer_config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ChatTemplateError, match="nested too deep"):
        ChatTemplate.from_tokenizer_folder(tmp_path / "tokenizer.json")
    assert json.dumps  # (json imported for the fixtures' files)
