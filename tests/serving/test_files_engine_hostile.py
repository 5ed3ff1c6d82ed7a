"""issue 38: checkpoint files and the serving engine's Python API. Before: config.json's
``model_type`` as a list was a TypeError, generation_config.json nested 100,000 deep a
RecursionError, ``engine.submit`` of a dict or of a Request whose sampling is None an
AttributeError, ``Request("abc", 2)`` said "the prompt is empty", and ``serving.model.load(threads=0)``
was accepted where the command line refuses ``--threads 0``."""

from __future__ import annotations

import json

import pytest

from tessera.runtime.errors import UsageError
from tessera.runtime.generation.sampling import Sampling
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request, RequestError

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("model_type", [["llama"], {"a": 1}, 3, None])
def test_model_type_of_any_type_is_a_clear_error(tmp_path, model_type):
    from tessera.runtime.io import checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UsageError, match="model_type"):
        checkpoint.spec_for(tmp_path)


def test_a_deep_generation_config_is_a_clear_error(tmp_path):
    from tessera.runtime.io import generation_config

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ' + DEEP + "}")
    with pytest.raises(UsageError, match="nested too deep"):
        generation_config.read([tmp_path])


def test_a_deep_tokenizer_config_does_not_stop_eos_lookup(tmp_path):
    pytest.importorskip("tokenizers")
    from test_serve_http import _tokenizer_folder

    tok_path = _tokenizer_folder(tmp_path, None)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ' + DEEP + "}")
    tok = serving_model.load_tokenizer(str(tok_path))
    assert serving_model.eos_ids(tok, str(tok_path)) == []


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_load_refuses_bad_threads(threads):
    with pytest.raises(UsageError, match="threads must be an integer >= 1"):
        serving_model.load("gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50"], threads=threads)


@pytest.fixture(scope="module")
def engine():
    m = serving_model.load("gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50", "ctx=32"], threads=1)
    e = Engine(m, max_batch=1, max_queue=2)
    yield e
    e.close()


@pytest.mark.parametrize("req, error, message", [
    ({"prompt": [1, 2], "max_tokens": 2}, TypeError, "submit takes a Request"),
    ([1, 2], TypeError, "submit takes a Request"),
    (Request([1, 2], 2, None), RequestError, "sampling must be a Sampling"),
    (Request([1, 2], 2, {"temperature": 0}), RequestError, "sampling must be a Sampling"),
    (Request("abc", 2), RequestError, "got text"),
    (Request(b"abc", 2), RequestError, "got text"),
    (Request(None, 2), RequestError, "must be a list of integer token ids, got NoneType"),
    (Request([1, 2], 2, Sampling(), stop_tokens=5), RequestError, "stop_tokens must be a tuple or list"),
    (Request([1, 2], 2, Sampling(), stop_tokens=("a",)), RequestError, "stop_tokens must be integer"),
    (Request([1, 2], 2, Sampling(), stop_strings="w1"), RequestError, "stop_strings must be a tuple or list"),
    (Request([1, 2], 2, Sampling(), stop_strings=("\ud800",)), RequestError, "not valid Unicode"),
    (Request([1, 2], 2, Sampling(), ignore_eos="yes"), RequestError, "ignore_eos must be a bool"),
    (Request([1, 2], 2, Sampling(temperature=float("nan"))), RequestError, "temperature"),
])
def test_submit_refuses_bad_types_clearly(engine, req, error, message):
    with pytest.raises(error, match=message):
        engine.submit(req)
    assert engine.queued == 0


def test_a_good_request_still_runs(engine):
    h = engine.submit(Request([1, 2], 3, Sampling(temperature=1e-40, seed=0)))
    while not h.finished:
        engine.step()
    assert len(h.tokens) == 3
