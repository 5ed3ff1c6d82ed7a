"""issue 25, item 5: the server's request bodies, fuzzed (hypothesis) through FastAPI's TestClient.

Every body -- raw bytes, any JSON value, objects with the routes' own fields holding values of any
type, nested past json's recursion limit -- gets a JSON answer: 200 for a request that is valid, a
4xx with ``{"error": {"message": ...}}`` otherwise, never a 500 (the app turns an unexpected
exception into 500 "internal error", which is what this test hunts). The engine runs a tiny GPT-2
(50 ids, 32 positions) so valid requests finish in milliseconds.

CI runs 150 bodies per route (``FUZZ_SERVE_CASES``); the long run (tests/fuzz_targets.py, docs/guarantees.md)
runs each body in a bounded worker."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from test_serve_http import TEMPLATE, _tokenizer_folder  # noqa: E402

CASES = int(os.environ.get("FUZZ_SERVE_CASES", "150"))
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "stream",
          "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs", "ignore_eos", "echo",
          "suffix", "best_of", "max_completion_tokens"]


@contextmanager
def serving_client(folder):
    """A TestClient on a tiny GPT-2 server whose tokenizer lives in ``folder`` (also entered by
    tests/fuzz_targets.py's workers)."""
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    tok = _tokenizer_folder(folder, TEMPLATE)
    opts = ServeOptions(spec="gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50", "ctx=32"], tokenizer=str(tok),
                        max_batch=2, max_queue=4, model_name="tiny")
    engine, server = build_server(opts)
    engine.start()
    try:
        with TestClient(create_app(server)) as c:
            yield c
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serving_client(tmp_path_factory.mktemp("tok")) as c:
        yield c


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                    st.sampled_from(["w1 w2", "<|endoftext|>", "\ud800"[:0] + "w3", "tiny", "user", "text"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)
ids = st.lists(st.integers(min_value=-3, max_value=60), max_size=6)
prompts = st.one_of(values, ids, st.lists(ids, max_size=2), st.text(max_size=20))
messages = st.one_of(values, st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "robot"]), values),
     "content": st.one_of(st.text(max_size=20), values, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image"]), "text": st.one_of(st.text(max_size=8), values)}), max_size=2))}),
    max_size=3))


def body(main: str, main_values):
    small = st.one_of(values, st.integers(min_value=-2, max_value=40), st.floats(min_value=-1, max_value=3))
    return st.builds(lambda m, extra: {main: m, **extra}, main_values,
                     st.dictionaries(st.sampled_from(FIELDS + ["unknown"]), small, max_size=4))


raw = st.one_of(st.binary(max_size=40), st.just(b"[" * 100_000 + b"]" * 100_000),
                st.just(b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"), st.just(b"\xff\xfe{}"),
                values.map(lambda v: json.dumps(v).encode()))


def _check(response):
    assert response.status_code != 500, response.text
    assert response.status_code in (200, 400, 404, 413, 422, 429), response.status_code
    data = response.json() if not response.text.startswith("data:") else None
    if response.status_code != 200:
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]


SETTINGS = settings(max_examples=CASES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(b=body("prompt", prompts))
def test_completion_bodies(client, b):
    _check(client.post("/v1/completions", content=json.dumps(b).encode()))


@SETTINGS
@given(b=body("messages", messages))
def test_chat_bodies(client, b):
    _check(client.post("/v1/chat/completions", content=json.dumps(b).encode()))


@SETTINGS
@given(data=raw, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies(client, data, route):
    _check(client.post(route, content=data))


def test_a_valid_body_is_answered(client):
    """The fuzz above is not all refusals: a plain request generates."""
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"], ids=["list", "in a field"])
def test_a_body_nested_past_the_recursion_limit_is_a_400(client, data):
    """json's decoder raised RecursionError, which the app answered with 500 "internal error"."""
    r = client.post("/v1/completions", content=data)
    assert r.status_code == 400 and "nested too deep" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- issue 38: headers, chat templates, batch rows
header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
header_values = st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
                          st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", " "]),
                                    st.sampled_from([1, 1000, 70_000, 200_000])))


@SETTINGS
@given(headers=st.dictionaries(header_names, header_values, max_size=4),
       route=st.sampled_from(["/health", "/v1/completions"]))
def test_header_sets(client, headers, route):
    """Any header block: served (200, or the route's 4xx for an empty body), or refused past the
    header limit (431), never a 500."""
    headers = {k: v.encode("utf-8") for k, v in headers.items()
               if k not in ("content-length", "transfer-encoding", "host", "connection", "content-type")}
    if route == "/health":
        r = client.get(route, headers=headers)
    else:
        r = client.post(route, headers=headers, content=b'{"prompt": [1], "max_tokens": 1}')
    assert r.status_code in (200, 400, 431), (r.status_code, r.text[:200])
    if r.status_code != 200:
        assert r.json()["error"]["message"]


SNIPPETS = ["{{ 1/0 }}", "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}{% endfor %}",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "{{ 'x' * 10000000000 }}", "{{ [1] * 99999999999 }}", "{{ 7 ** 10000000 }}",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{{ raise_exception('no') }}",
            "{{ nothing() }}", "{{ messages.__class__ }}", "{{ ''.__class__.__mro__ }}", "{% if true %}",
            "{% endif %}", "{{ range(10**9)|list }}", "{{ bos_token }}", "{{ messages|tojson }}",
            "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "{{ '%s' % messages }}", "{{ (messages|length) // 0 }}", "{{ x.y.z }}", "{{ }}", "{#", "}}"]


@settings(max_examples=max(20, CASES // 3), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(SNIPPETS), max_size=4), text=st.text(max_size=10))
def test_chat_templates(parts, text):
    """A template made of hostile pieces renders or is a ChatTemplateError (the server's 400),
    within the time budget (shortened here: the budget's size is not what is fuzzed)."""
    import time

    from tessera.runtime.io import chat_template
    from tessera.runtime.io.chat_template import ChatTemplate, ChatTemplateError

    saved, chat_template.TEMPLATE_SECONDS = chat_template.TEMPLATE_SECONDS, 0.3
    try:
        start = time.monotonic()
        try:
            ChatTemplate("".join(parts) + text).render([{"role": "user", "content": "w1 w2"}])
        except ChatTemplateError:
            pass
        assert time.monotonic() - start < 5
    finally:
        chat_template.TEMPLATE_SECONDS = saved


_BATCH_ENGINE = []


def batch_engine():
    """One engine (not started) over the tiny GPT-2 with a tokenizer, for the batch rows' checks."""
    if not _BATCH_ENGINE:
        import tempfile
        from pathlib import Path

        from tessera.runtime.serving.batch import BatchOptions, load_engine

        tok = _tokenizer_folder(Path(tempfile.mkdtemp(prefix="tessera-fuzz-tok-")), None)
        _BATCH_ENGINE.append(load_engine(BatchOptions(spec="gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50",
                                                                          "ctx=32"], tokenizer=str(tok), threads=1,
                                                      input="rows.jsonl", output="results.jsonl")))
    return _BATCH_ENGINE[0]


ROW_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "min_p",
              "no_repeat_ngram_size", "min_tokens", "unknown"]
huge = st.sampled_from([10 ** 400, -10 ** 400, 1e308, -1e-320, 1e-40, float("nan"), float("inf")])
row_values = st.one_of(values, huge, st.sampled_from(["w1 \ud800", "\udfff", ["\ud800"]]))


@SETTINGS
@given(row=st.dictionaries(st.sampled_from(ROW_FIELDS), row_values, max_size=5), prompt=prompts)
def test_batch_rows(row, prompt):
    """A row of any values is a request the engine accepts or its own RowError, RequestError or
    UsageError line (never an exception that would stop the run)."""
    from tessera.runtime.errors import UsageError
    from tessera.runtime.serving.batch import RowError, row_request
    from tessera.runtime.serving.engine import check_request_types

    engine = batch_engine()
    row = {"prompt": prompt, **row}
    try:
        req = row_request(row, engine, 4)
        check_request_types(req)
        engine.check(req)
    except (RowError, UsageError):
        pass
