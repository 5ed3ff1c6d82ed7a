"""Structured output over HTTP (issue 41): a real ``tessera serve`` on 127.0.0.1 driven by the ``openai``
client -- ``response_format`` (json_schema, json_object) on the chat route, ``guided_regex`` /
``guided_grammar`` / ``guided_json`` on the completions route, streamed and not, sampled with many
seeds: every output parses and matches; bad schemas and grammars are 400s with OpenAI's error body.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")

from test_structured import SCHEMAS, VOCAB, make_tokenizer  # noqa: E402

SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", f"vocab={VOCAB}", "--set", "ctx=256"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve_http import ServerProcess

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    s = ServerProcess(["gpt2", *SETS, "--tokenizer", folder / "tokenizer.json", "--max-batch", 8],
                      tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            c = chunk.choices[0]
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text += piece or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    for i, schema in enumerate(SCHEMAS):
        for seed in range(6):
            kw = dict(model="gpt2", messages=[{"role": "user", "content": "give me JSON"}], temperature=1.0, seed=seed,
                      max_tokens=120, response_format={"type": "json_schema",
                                                       "json_schema": {"name": f"s{i}", "schema": schema}})
            if stream:
                text, finish = _stream_text(client.chat.completions.create(stream=True, **kw))
            else:
                r = client.chat.completions.create(**kw)
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_chat_json_object(client):
    for seed in range(8):
        r = client.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "JSON"}],
                                           temperature=1.0, seed=seed, max_tokens=200,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_guided_regex_grammar_json(client, stream):
    regex = r"[a-c]{1,4}-[0-9]{2,3}"
    lark = 'start: "yes" | "no" | "maybe" " " NUM\nNUM: /[0-9]{1,2}/'
    cases = [({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"guided_grammar": lark}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]{1,2}", t)),
             ({"guided_json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) is None)]
    for extra, ok in cases:
        for seed in range(6):
            kw = dict(model="gpt2", prompt="hello", temperature=1.0, seed=seed, max_tokens=60, extra_body=extra)
            if stream:
                text, finish = _stream_text(client.completions.create(stream=True, **kw))
            else:
                r = client.completions.create(**kw)
                text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert finish == "stop" and ok(text), (extra, text)


def test_bad_grammars_are_400s(server):
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format"),
           ({"guided_regex": "(ab"}, "guided_regex"),
           ({"guided_grammar": "start: foo"}, "guided_grammar"),
           ({"guided_json": "{not json"}, "guided_json"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
           ({"response_format": {"type": "xml"}}, "response_format.type"),
           ({"guided_regex": "a", "guided_grammar": "start: \"a\""}, "guided_grammar")]
    for extra, param in bad:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param, (extra, err)
    # text: no constraint
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                         "response_format": {"type": "text"}}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_random_schemas_through_the_openai_client(client):
    """Issue 41's check at the HTTP surface: 200 random JSON schemas (test_structured's generator, bounded
    instances), each sent twice through the ``openai`` client on the chat route with temperature 1.5
    (far from the model's favourites), once streamed and once not, eight requests in flight: every
    reply finishes with "stop" and is JSON valid against its schema."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from test_structured import _random_schema

    rng = np.random.default_rng(4101)
    schemas = [_random_schema(rng) for _ in range(200)]

    def ask(job):
        i, stream = job
        kw = dict(model="gpt2", messages=[{"role": "user", "content": "JSON"}], temperature=1.5, seed=i,
                  max_tokens=200, response_format={"type": "json_schema",
                                                   "json_schema": {"name": f"r{i}", "schema": schemas[i]}})
        if stream:
            return _stream_text(client.chat.completions.create(stream=True, **kw))
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    jobs = [(i, stream) for i in range(len(schemas)) for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, jobs))
    bad = []
    for (i, stream), (text, finish) in zip(jobs, replies):
        try:
            assert finish == "stop"
            jsonschema.validate(json.loads(text), schemas[i])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((i, stream, finish, text, schemas[i], str(e)[:200]))
    assert not bad, f"{len(bad)} of {len(jobs)} replies invalid; first: {bad[0]}"
