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
