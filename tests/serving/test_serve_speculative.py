"""``tessera serve --speculative ngram``: the engine's speculative step gives plain greedy decoding's tokens.

References, independent of the code under test: transformers' ``generate(do_sample=False)`` on the
same Hugging Face checkpoint (GPT-2, and a Llama with grouped-query attention: 4 query heads, 2
key/value heads), and for sampled requests riding along the engine without speculation (whose own
tests hold it to ``generate``). A real server process (127.0.0.1, a free port) is driven by the
official ``openai`` client, its texts compared with ``tessera generate``'s, requests concurrent.
Prompts quote passages so that prompt lookup has something to draft; the tests also check that
drafts were made and accepted (counted, not timed).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import cli, hf_greedy, tiny_hf
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.speculation import Speculation, StepCosts, expected_tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 40
SHORT = 7  # check_tokens of the short-call variant: drafts of up to 6 tokens (the tests' largest k)



def _hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    return hf_greedy(hf, [prompt], new)[0]


class Case:
    def __init__(self, family, root):
        self.hf = tiny_hf(family)
        self.hf.save_pretrained(root, safe_serialization=True)
        self.root = root
        self.model = serving_model.load(str(root), threads=1, last_only=False)  # every call: every position
        self._short = None
        rng = np.random.default_rng(1)
        a, b = rng.integers(1, 300, 14).tolist(), rng.integers(1, 300, 6).tolist()
        own = _hf_greedy(self.hf, a, 12)  # the model's own continuation, quoted: its drafts are accepted
        self.prompts = [a + a + a[:5], b + [7] + b, (a + own) * 2 + a]
        self.reference = [_hf_greedy(self.hf, p, NEW) for p in self.prompts]

    @property
    def short(self):
        """The engine's variant as `serve --speculative` loads it on the CPU: the combined call, last-position
        logits, and every position's in calls of at most SHORT tokens (the checks of up to SHORT - 1 drafts)."""
        if self._short is None:
            self._short = serving_model.load(str(self.root), threads=1, check_tokens=SHORT)
        return self._short

    def layout(self, name):
        return self.model if name == "every" else self.short


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(f"serve_spec_{family}"))
        return made[family]
    return get


def _engine(model, k: int = 4, adaptive: bool = False, **kw) -> Engine:
    """Every draft checked (adaptive=False: no timing in the path), unless asked."""
    engine = Engine(model, **{"max_batch": 4, "prefill_chunk": 8, **kw})
    Speculation(k, adaptive=adaptive).attach(engine)
    return engine


def _run(engine, requests):
    handles = [engine.submit(r) for r in requests]
    while any(not h.finished for h in handles):
        assert engine.step()
    return handles


@pytest.mark.parametrize("layout", ["every", "short"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_concurrent_greedy_requests_equal_transformers(cases, family, k, layout):
    """Three prompts of uneven lengths in one batch, prefilled in chunks while others decode; the model
    giving every position's logits in every call ("every", as on CUDA), or only in the short calls that
    check drafts, with the combined call for the iterations that check none ("short", the CPU's)."""
    case = cases(family)
    engine = _engine(case.layout(layout), k)
    assert engine.combined == (layout == "short")
    handles = _run(engine, [Request(p, NEW) for p in case.prompts])
    assert [h.tokens for h in handles] == case.reference
    spec = engine.speculation
    assert spec.calls > 0 and 0 < spec.accepted <= spec.drafted
    assert engine.steps < sum(len(h.tokens) for h in handles)  # accepted drafts saved calls


def _first_chunk_logits(model, tokens: list[int]) -> np.ndarray:
    """A prompt's first chunk alone through the engine's variant, fed as the engine feeds it (no past; mask,
    positions and cache_length as Engine._prefill_chunk's): the logits that come back, [1, positions, vocab]."""
    info, t = model.info, len(tokens)
    feeds = {info.tokens: np.array([tokens], dtype=np.int64), "position_ids": np.arange(t, dtype=np.int64)[None],
             "attention_mask": np.ones((1, t), dtype=np.int64), info.length_input: np.array([0], dtype=np.int64)}
    for layer in info.layers:
        feeds[layer.past_key] = np.zeros((1, layer.kv_heads, 0, layer.head_size), dtype=np.float32)
        feeds[layer.past_value] = np.zeros((1, layer.kv_heads, 0, layer.value_size), dtype=np.float32)
    return model.run(feeds)[info.logits]


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_short_calls_give_every_position_and_longer_ones_the_last(cases, family):
    """Where the short-call variant's behaviour switches: a call of SHORT tokens gives SHORT positions' logits,
    equal to the every-position model's (itself held to transformers above); SHORT + 1 tokens give the last
    position's only, equal to that model's last."""
    case = cases(family)
    assert serving_model.short_call_logits(case.short) == SHORT and case.short.info.last_only
    assert serving_model.short_call_logits(case.model) == 0
    tokens = case.prompts[0]
    for t in (2, SHORT):
        short, every = _first_chunk_logits(case.short, tokens[:t]), _first_chunk_logits(case.model, tokens[:t])
        assert short.shape == every.shape == (1, t, case.model.vocab)
        np.testing.assert_allclose(short, every, rtol=0, atol=2e-5)
    short, every = _first_chunk_logits(case.short, tokens[:SHORT + 1]), _first_chunk_logits(case.model, tokens[:SHORT + 1])
    assert short.shape == (1, 1, case.model.vocab) and every.shape[1] == SHORT + 1
    np.testing.assert_allclose(short[:, 0], every[:, -1], rtol=0, atol=2e-5)


def test_more_drafts_than_the_short_calls_take_is_refused(cases):
    """A model whose short calls are too short for the drafts asked (its checks would get one position's
    logits) is refused before serving, not run wrong."""
    case = cases("gpt2")
    Speculation.check(case.short, SHORT - 1)
    with pytest.raises(gen.UsageError, match="needs the logits of every position"):
        Speculation.check(case.short, SHORT)


def test_sampled_and_penalised_requests_decode_as_without_speculation(cases):
    """Rows that may not speculate (sampled, repetition penalty) share the verifying calls and get the
    tokens the engine gives them without speculation (same seeds)."""
    case = cases("llama_gqa")
    reqs = lambda: [Request(case.prompts[0], NEW),  # noqa: E731
                    Request(case.prompts[1], NEW, gen.Sampling(temperature=0.8, top_k=20, seed=3)),
                    Request(case.prompts[2], NEW, gen.Sampling(repetition_penalty=1.3)),
                    Request(case.prompts[2], NEW)]
    plain = _run(Engine(case.model, max_batch=4, prefill_chunk=8), reqs())
    engine = _engine(case.model)
    spec = _run(engine, reqs())
    assert [h.tokens for h in spec] == [h.tokens for h in plain]
    assert spec[0].tokens == case.reference[0] and spec[3].tokens == case.reference[2]
    assert engine.speculation.drafted > 0


def test_stop_token_among_accepted_drafts_and_the_context_end(cases):
    case = cases("gpt2")
    prompt, ref = case.prompts[2], case.reference[2]
    stop = ref[9]
    engine = _engine(case.model, 6)
    h = _run(engine, [Request(prompt, NEW, stop_tokens=(stop,))])[0]
    assert h.tokens == ref[:ref.index(stop) + 1] and h.finish_reason == "stop"
    # a slot exactly as long as prompt + max_tokens: drafts are cut to the columns left
    engine = _engine(case.model, 6, capacity=len(prompt) + NEW, max_batch=2)
    h = _run(engine, [Request(prompt, NEW)])[0]
    assert h.tokens == ref and h.finish_reason == "length"


def test_describe_and_metrics_count_the_drafts(cases):
    case = cases("gpt2")
    engine = _engine(case.model, 3)
    _run(engine, [Request(case.prompts[2], NEW)])
    assert "speculative decoding: prompt lookup (ngram), up to 3 drafted tokens" in engine.describe()
    text = engine.metrics.render()
    s = engine.speculation
    assert f"tessera_speculative_drafted_tokens_total {s.drafted}" in text
    assert f"tessera_speculative_accepted_tokens_total {s.accepted}" in text and s.accepted > 0


def test_step_costs_interpolate_between_the_sizes_measured():
    c = StepCosts()
    assert not c
    c.observe(4, 0.010)
    assert c(1) == c(16) == 0.010  # one size: flat
    c.observe(16, 0.030)
    assert c(10) == pytest.approx(0.020) and c(28) == pytest.approx(0.050) and c(1) == pytest.approx(0.005)
    c.observe(4, 0.020)  # an exponential average: 0.7 of the old, 0.3 of the new
    assert c(4) == pytest.approx(0.013)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875) and expected_tokens(1.0, 4) == 5


def _priced(plain, verify, k=4) -> Speculation:
    """A Speculation whose prices are given: plain(rows) and verify(rows x positions) seconds."""
    s = Speculation(k)
    s.EXPLORE = 10**9
    for rows in (1, 16):
        s.plain_cost.observe(rows, plain(rows))
    for tokens in (1, 256):
        s.verify_cost.observe(tokens, verify(tokens))
    s.plain_cost.observe = s.verify_cost.observe = lambda size, seconds: None  # the engine's timings ignored
    return s


def test_the_choice_follows_the_price_of_a_verifying_call():
    """One stream, the call bound by reading the weights (a token more costs little): every draft is
    checked. 16 streams, each token of a call costing what a plain row does: the plain step, unless
    the drafts are nearly always accepted; a request whose drafts were rejected is worth less."""
    weight_bound = _priced(lambda n: 0.020 + 0.0005 * n, lambda t: 0.020 + 0.0005 * t)
    assert weight_bound.choose(1, {0: [1, 2, 3, 4]}, {0: 0.5}) == 4
    compute_bound = _priced(lambda n: 0.020 + 0.002 * n, lambda t: 0.020 + 0.0022 * t)
    drafts = {r: [1, 2, 3, 4] for r in range(16)}
    assert compute_bound.choose(16, drafts, {r: 0.5 for r in range(16)}) == 0
    assert compute_bound.choose(16, drafts, {r: 1.0 for r in range(16)}) > 0
    middle = _priced(lambda n: 0.010 + 0.001 * n, lambda t: 0.010 + 0.0012 * t)
    assert middle.choose(4, {0: [1, 2, 3, 4]}, {0: 0.9}) == 0  # one row of four drafts: not worth 4 x 5 tokens
    assert middle.choose(1, {0: [1, 2, 3, 4]}, {0: 0.9}) == 4
    unmeasured = Speculation(4)
    assert unmeasured.choose(1, {0: [1, 2]}, {0: 0.5}) == 0  # the plain step's price first
    unmeasured.observe_plain(1, 0.01)
    assert unmeasured.choose(1, {0: [1, 2]}, {0: 0.5}) == 2  # then a verifying call's


def test_declined_drafts_run_the_plain_step_with_the_same_tokens(cases):
    """Priced so that checking never pays: every step runs the plain step (none verifies), the tokens
    are transformers'; priced so that it always pays: drafts are checked and accepted, same tokens.
    The acceptance rates are kept per request and dropped when it leaves."""
    case = cases("llama_gqa")
    for model in (case.model, case.short):
        never = Engine(model, max_batch=4, prefill_chunk=8)
        _priced(lambda n: 0.001 * n, lambda t: 1.0 + t).attach(never)
        handles = _run(never, [Request(p, NEW) for p in case.prompts])
        assert [h.tokens for h in handles] == case.reference
        s = never.speculation
        assert s.calls == 0 and s.declined > 0 and s.drafted == 0
        assert "tessera_speculative_declined_steps_total" in never.metrics.render()
        assert "adaptive" in never.describe()
        # the short-call variant: the iterations that prefill beside decoding rows are combined calls
        assert (never.combined_calls > 0) == (model is case.short)
    always = Engine(case.short, max_batch=4, prefill_chunk=8)
    _priced(lambda n: 1.0, lambda t: 0.001).attach(always)
    handles = _run(always, [Request(p, NEW) for p in case.prompts])
    assert [h.tokens for h in handles] == case.reference
    s = always.speculation
    assert s.calls > 0 and s.declined == 0 and s.accepted > 0
    assert s.rates == {} or set(s.rates) <= {h.id for h in handles}


def test_last_only_file_is_refused(tmp_path, capsys):
    out = tmp_path / "t.onnx"
    rc, _, err = cli(capsys, "compile", "gpt2", *SETS, "--kv-cache", "--decode", "plain", "-o", out)
    assert rc == 0, err
    rc, _, err = cli(capsys, "serve", out, "--speculative", "ngram", "--explain")
    assert rc == 2 and "needs the logits of every position" in err


SETS = ["--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=50", "--set", "ctx=128"]


@pytest.mark.parametrize("args, message", [
    (["--speculative", "model.tsr"], "the server drafts by prompt lookup only"),
    (["--draft-tokens", "3"], "--draft-tokens applies with --speculative ngram"),
    (["--speculative", "ngram", "--draft-tokens", "0"], "--draft-tokens must be an integer >= 1"),
])
def test_bad_options(capsys, args, message):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, *args, "--explain")
    assert rc == 2 and message in err


def test_row_engine_model_takes_speculation(capsys):
    """A recurrent-state decoder is served by the row engine, which checks drafts with its state replayed
    after a rejection (tests/serving/test_serve_row_speculative.py holds its tokens to transformers; an
    encoder-decoder is refused there)."""
    rc, _, err = cli(capsys, "serve", "mamba", "--variant", "tiny", "--speculative", "ngram", "--draft-tokens", "3",
                     "--explain")
    assert rc == 0 and "RowEngine" in err and "up to 3 drafted tokens per greedy request" in err
    assert "runs the kept tokens again after a rejection" in err


def test_explain_names_speculation(capsys):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--speculative", "ngram", "--draft-tokens", "5", "--explain")
    assert rc == 0 and "up to 5 drafted tokens per greedy request" in err


# ---------------------------------------------------------------- a real server process
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from test_serve_http import ServerProcess, _tokenizer_folder

    tok = _tokenizer_folder(tmp_path_factory.mktemp("tok"), None)
    s = ServerProcess(["gpt2", *SETS, "--tokenizer", tok, "--max-batch", 4, "--prefill-chunk", 16,
                       "--speculative", "ngram"], tmp_path_factory.mktemp("log") / "server.log")
    yield s, tok
    assert s.stop() == 0, s.output()


PROMPTS = ["w3 w4 w5 w6 w7 w3 w4 w5 w6 w7 w3 w4", "w10 w11 w12 w13 w10 w11", "w20 w21 w22 w23 w24 w25 w20 w21 w22",
           "w1 w2 w1 w2 w1"]


def _generate_text(capsys, tok, prompt: str, n: int) -> str:
    rc, out, err = cli(capsys, "generate", "gpt2", *SETS, "--tokenizer", tok, "--prompt", prompt,
                       "--max-new-tokens", n, "--ignore-eos", "--format", "json", "--quiet")
    assert rc == 0, err
    return json.loads(out)["outputs"][0]["text"]


def test_server_greedy_equals_generate_concurrently(served, capsys):
    """Four concurrent greedy completions through the openai client, each equal to `tessera generate`
    alone; the server's /metrics then shows drafts made and accepted."""
    s, tok = served
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = [_generate_text(capsys, tok, p, 30) for p in PROMPTS]

    def one(p):
        r = client.completions.create(model="gpt2", prompt=p, max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == expected
    metrics = httpx.get(s.url + "/metrics", timeout=10).text
    drafted = int(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("tessera_speculative_drafted_tokens_total ")))
    accepted = int(next(line.split()[-1] for line in metrics.splitlines()
                        if line.startswith("tessera_speculative_accepted_tokens_total ")))
    assert drafted > 0 and 0 < accepted <= drafted
