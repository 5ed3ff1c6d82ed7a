"""``tessera serve --speculative ngram`` on the row engine: Mamba (state only, one batched call per step)
and Jamba (attention + Mamba layers, one decoder per row) -- issue 39 item 1.

References, independent of the code under test: transformers' greedy ``generate`` with the same
weights (tiny checkpoints written here), each prompt ALONE (no padding), and for a sampled request
riding along the row engine without speculation (whose own tests, test_serve_hybrid.py, hold it to
transformers). Three prompts of different lengths repeat a passage, and the tiny vocabulary makes
the greedy output fall into loops, so prompt lookup drafts: the tests count drafts made, drafts
accepted AND rows whose state was put back and their kept tokens run again, so both the kept and
the rejected paths ran (counted, not timed; every draft is checked, so the counts do not depend on
timing). A real server process answers concurrent requests equal to ``tessera generate``'s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import cli, hf_greedy, tiny_recurrent_hf
from tessera.runtime.generation.sampling import Sampling
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Request
from tessera.runtime.serving.row_engine import RowEngine, engine_for
from tessera.runtime.serving.row_speculation import RowSpeculation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, NEW, K = 12, 30, 4
PASSAGE = [3, 7, 1, 9, 4, 10]
PROMPTS = [PASSAGE * 3 + [3, 7], [5, 2, 8] * 2, [6, 11] + PASSAGE * 2 + [3, 7, 1]]


@pytest.fixture(scope="module", params=["jamba", "mamba"])
def case(request, tmp_path_factory):
    """(name, checkpoint folder, the model as serve --speculative loads it, transformers' tokens of each prompt alone)."""
    hf = tiny_recurrent_hf(request.param, VOCAB)
    folder = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf.save_pretrained(folder, safe_serialization=True)
    want = [hf_greedy(hf, [p], NEW)[0] for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want), want
    model = serving_model.load(str(folder), threads=1, check_tokens=K + 1)
    return request.param, folder, model, want


def _run(engine, requests):
    handles = [engine.submit(r) for r in requests]
    while any(not h.finished for h in handles):
        assert engine.step()
    return handles


def _speculating(model) -> RowEngine:
    engine = engine_for(model, max_batch=3)
    assert isinstance(engine, RowEngine)
    RowSpeculation.check(engine, K)
    RowSpeculation(K).attach(engine)
    return engine


def test_concurrent_greedy_requests_equal_transformers_alone(case):
    name, _, model, want = case
    assert not model.info.last_only  # every position's logits: the drafts' checks
    engine = _speculating(model)
    assert engine.batched == (name == "mamba")
    handles = _run(engine, [Request(p, NEW) for p in PROMPTS])
    assert [h.tokens for h in handles] == want, name
    s = engine.speculation
    assert s.calls > 0 and 0 < s.accepted <= s.drafted  # drafts checked, some kept
    assert s.replayed_rows > 0 and s.replays > 0  # some rejected: a state put back, the kept tokens run again
    text = engine.metrics.render()
    assert f"tessera_speculative_drafted_tokens_total {s.drafted}" in text
    assert f"tessera_speculative_accepted_tokens_total {s.accepted}" in text
    assert f"tessera_speculative_replayed_rows_total {s.replayed_rows}" in text
    assert "every draft checked" in engine.describe()


def test_a_sampled_request_riding_along_gets_its_tokens_without_speculation(case):
    """A sampled request (and a penalised one) in the steps that check the greedy rows' drafts: the tokens
    the row engine gives them without speculation, same seeds; the greedy rows still transformers'."""
    name, _, model, want = case
    reqs = lambda: [Request(PROMPTS[0], NEW),  # noqa: E731
                    Request(PROMPTS[1], NEW, Sampling(temperature=0.9, top_k=6, seed=3)),
                    Request(PROMPTS[2], NEW, Sampling(repetition_penalty=1.3))]
    plain = _run(engine_for(model, max_batch=3), reqs())
    engine = _speculating(model)
    spec = _run(engine, reqs())
    assert [h.tokens for h in spec] == [h.tokens for h in plain], name
    assert spec[0].tokens == want[0]
    assert spec[1].tokens != want[1] and spec[2].tokens != want[2]  # they are not greedy: they did ride along
    assert engine.speculation.drafted > 0 and engine.speculation.calls > 0


def test_an_encoder_decoder_is_refused_naming_why(capsys):
    tiny = ["--set", "vocab=64", "--set", "d=32", "--set", "d_kv=8", "--set", "d_ff=48", "--set", "layers=1",
            "--set", "heads=4"]
    rc, _, err = cli(capsys, "serve", "t5", *tiny, "--start-token", "0", "--speculative", "ngram", "--explain")
    assert rc == 2 and "not built for encoder-decoders" in err and "drop --speculative" in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------- a real server process
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _metric(text: str, name: str) -> int:
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_serve_process_answers_concurrent_requests_as_tessera_generate(case, capsys, tmp_path):
    from test_serve_http import ServerProcess

    name, folder, _, want = case
    expected = []
    for p in PROMPTS:  # each alone, plain greedy decoding (no --speculative)
        rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([p])}", "--max-new-tokens",
                           NEW, "--format", "json", "-q")
        assert rc == 0, err
        expected.append(json.loads(out)["outputs"][0]["tokens"])
    assert expected == want  # generate itself is transformers' (tests/generation)
    server = ServerProcess([folder, "--max-batch", 3, "--speculative", "ngram", "--draft-tokens", K],
                           tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: server.greedy_token_ids(p, NEW), PROMPTS))
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        assert server.stop() == 0, server.output()
    assert got == expected, (name, server.output())
    drafted = _metric(metrics, "tessera_speculative_drafted_tokens_total")
    accepted = _metric(metrics, "tessera_speculative_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert _metric(metrics, "tessera_speculative_replayed_rows_total") > 0


def test_a_stop_token_and_a_short_budget_end_a_row_inside_its_drafts(case):
    """A stop token the model emits mid-way, and max_tokens shorter than the drafts: the output is the
    reference cut there (tokens after the end are never emitted, whatever the drafts held)."""
    name, _, model, want = case
    stop = want[0][12]
    engine = _speculating(model)
    handles = _run(engine, [Request(PROMPTS[0], NEW, stop_tokens=(stop,)), Request(PROMPTS[2], 3),
                            Request(PROMPTS[1], NEW)])
    assert handles[0].tokens == want[0][:want[0].index(stop) + 1] and handles[0].finish_reason == "stop", name
    assert handles[1].tokens == want[2][:3] and handles[1].finish_reason == "length"
    assert handles[2].tokens == want[1]
