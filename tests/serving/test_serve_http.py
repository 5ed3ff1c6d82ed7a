"""``tessera serve``: a real server process on 127.0.0.1 (a random free port), driven by the official
``openai`` client and by raw HTTP (httpx).

Reference texts come from ``tessera generate`` on the same spec, weights and tokenizer (run in this
process through the command's entry point), so the server's text must equal what the one-caller
command prints. The servers are stopped at teardown (SIGTERM, which drains: exit status 0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import cli  # noqa: E402

SETS = ["--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=50", "--set", "ctx=128"]
WORDS = ["<|endoftext|>"] + [f"w{i}" for i in range(1, 50)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def _tokenizer_folder(path, template: str | None):
    """A word-level tokenizer over the tiny model's 50 ids; <|endoftext|> (id 0) is special and the
    end-of-sequence token; with ``template``, a chat template in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path / "tokenizer.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        code = "import sys; from tessera.runtime.cli import main; sys.exit(main())"
        self.proc = subprocess.Popen([sys.executable, "-c", code, "serve", *map(str, args), "--port", str(self.port),
                                      "--threads", "1"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.output()}")
            time.sleep(0.1)

    def greedy_token_ids(self, prompt, max_tokens: int) -> list[int]:
        """One greedy /v1/completions request's token ids (asserts a 200)."""
        r = httpx.post(self.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def output(self) -> str:
        self.log.flush()
        return open(self.log.name).read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _tokenizer_folder(tmp_path_factory.mktemp("tok"), TEMPLATE)


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    s = ServerProcess(["gpt2", *SETS, "--tokenizer", tokenizer, "--max-batch", 8, "--max-queue", 64,
                       "--prefill-chunk", 16], tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _generate_text(capsys, tokenizer, prompt: str, n: int) -> str:
    rc, out, err = cli(capsys, "generate", "gpt2", *SETS, "--tokenizer", tokenizer, "--prompt", prompt,
                       "--max-new-tokens", n, "--stop-token", 0, "--format", "json", "--quiet")
    assert rc == 0, err
    return json.loads(out)["outputs"][0]["text"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["gpt2"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


PROMPTS = ["w1 w2 w3", "w7", "w4 w4 w8 w30 w2 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_generate(client, tokenizer, capsys, prompt):
    want = _generate_text(capsys, tokenizer, prompt, 12)
    r = client.completions.create(model="gpt2", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(prompt.split())
    assert r.usage.completion_tokens == len(r.choices[0].model_extra["token_ids"])
    streamed = client.completions.create(model="gpt2", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_uses_the_template_and_equals_generate(client, tokenizer, capsys):
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w5 w6"}]
    want = _generate_text(capsys, tokenizer, "w3 w5 w6 w9", 10)  # as the template renders them
    r = client.chat.completions.create(model="gpt2", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == 4
    chunks = list(client.chat.completions.create(model="gpt2", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_and_max_tokens(client, tokenizer, capsys):
    free = _generate_text(capsys, tokenizer, "w2 w40", 20).split()
    r = client.completions.create(model="gpt2", prompt="w2 w40", max_tokens=5, temperature=0, stop=None)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].text.split() == free[:5]
    if len(free) > 3:
        stop = free[3]
        cut = free.index(stop)
        r = client.completions.create(model="gpt2", prompt="w2 w40", max_tokens=20, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text.split() == free[:cut]
        chunks = list(client.completions.create(model="gpt2", prompt="w2 w40", max_tokens=20, temperature=0,
                                                stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks).split() == free[:cut]


def test_seeded_sampling_repeats(client):
    kw = dict(model="gpt2", prompt="w1 w2", max_tokens=10, temperature=0.9, top_p=0.9, seed=5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def test_concurrent_streams_equal_their_texts_alone(client):
    prompts = [" ".join(f"w{1 + (i * 7 + j) % 49}" for j in range(1 + i % 9)) for i in range(16)]
    alone = [client.completions.create(model="gpt2", prompt=p, max_tokens=4 + i % 11, temperature=0).choices[0].text
             for i, p in enumerate(prompts)]

    def streamed(i):
        chunks = client.completions.create(model="gpt2", prompt=prompts[i], max_tokens=4 + i % 11, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(streamed, range(16))) == alone


MALFORMED = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 4, "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "w1", "unknown_field": 1}, 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 500}, 400),
    ("/v1/completions", {"prompt": " ".join(["w1"] * 200), "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": [1, 99], "max_tokens": 4}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "w1", "n": 2}, 400),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "w1", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "w1", "stop": ["w1", "w2", "w3", "w4", "w5"]}, 400),
    ("/v1/completions", {"prompt": "w1", "stream": "yes"}, 400),
    ("/v1/completions", {"prompt": [1, True]}, 400),
    ("/v1/completions", {"prompt": "w1", "frequency_penalty": 0.5}, 400),
    ("/v1/completions", {"prompt": "w1", "seed": -1}, 400),
    ("/v1/completions", b'{"prompt": "w1", "temperature": NaN}', 400),
    ("/v1/completions", {"prompt": "w1", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, 400),
    ("/v1/chat/completions", {"messages": "w1"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2,
                              "max_completion_tokens": 2}, 400),
    ("/v1/nowhere", {"prompt": "w1"}, 404),
]


@pytest.mark.parametrize("path, body, status", MALFORMED)
def test_malformed_requests_get_openai_errors(server, path, body, status):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in r.text
    assert set(err) == {"message", "type", "param", "code"}


def test_still_serving_after_malformed_requests_and_metrics(server, client):
    for path, body, _ in MALFORMED:
        httpx.post(server.url + path, json=body if not isinstance(body, bytes) else None, timeout=30)
    r = client.completions.create(model="gpt2", prompt="w1", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("tessera_queue_depth ", "tessera_running_sequences ", "tessera_generated_tokens_total ",
                 "tessera_time_to_first_token_seconds_bucket", "tessera_inter_token_latency_seconds_count"):
        assert name in text
    generated = int(next(line for line in text.splitlines() if line.startswith("tessera_generated_tokens_total "))
                    .split()[1])
    assert generated >= r.usage.completion_tokens


def _wait_for_metric(server, line: str, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while line not in httpx.get(server.url + "/metrics").text:
        assert time.monotonic() < end, f"no '{line}' in /metrics within {timeout} s"
        time.sleep(0.05)


def test_bounds_disconnect_and_drain(tmp_path, capsys):
    """One slot, one place in the queue: a third request gets 429; a queued client that goes away
    leaves the queue; a running one that goes away frees the slot for the queued one; SIGTERM drains
    (503 for new requests, the running one finishes) and the process exits 0. The chat route without
    a template says so."""
    tok = _tokenizer_folder(tmp_path / "tok", None)
    sets = ["--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=50", "--set", "ctx=4096"]
    s = ServerProcess(["gpt2", *sets, "--tokenizer", tok, "--max-batch", 1, "--max-queue", 1], tmp_path / "log")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        long = {"prompt": "w1 w2", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as ca, httpx.Client(timeout=60) as cb:
            with ca.stream("POST", s.url + "/v1/completions", json=long) as a:
                lines = a.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))  # a is running
                with cb.stream("POST", s.url + "/v1/completions", json={**long, "max_tokens": 2000}) as b:
                    assert b.status_code == 200  # queued behind a
                    over = httpx.post(s.url + "/v1/completions", json={"prompt": "w3", "max_tokens": 2})
                    assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded"
                _wait_for_metric(s, 'tessera_finished_requests_total{reason="cancelled"} 1')  # the queued one left
                with cb.stream("POST", s.url + "/v1/completions", json={**long, "max_tokens": 2000}) as b:
                    assert b.status_code == 200  # queued behind a, in the place the first b left
                    a.close()  # the running client goes away
                    start = time.monotonic()
                    blines = b.iter_lines()
                    first = next(line for line in blines if line.startswith("data:"))
                    assert json.loads(first[5:])["choices"][0]["text"]
                    assert time.monotonic() - start < 10
                    _wait_for_metric(s, 'tessera_finished_requests_total{reason="cancelled"} 2')
                    s.proc.send_signal(signal.SIGTERM)  # b still has thousands of tokens to go
                    time.sleep(0.3)
                    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "w3", "max_tokens": 2})
                    assert refused.status_code == 503
                    rest = [json.loads(line[5:]) for line in blines if line.startswith("data:") and "[DONE]" not in line]
                    assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0, s.output()
    finally:
        s.stop()


def test_serve_without_the_extra_names_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS)
    assert rc == 2 and "pip install 'tessera[serve]'" in err and "uvicorn" in err


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "--max-batch must be an integer >= 1"),
    (["--port", "70000"], "--port must be in"),
    (["--max-context", "1000"], "past the model's context"),
])
def test_bad_options(capsys, args, message):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, *args, "--explain")
    assert rc == 2 and message in err


def test_a_taken_port_is_a_clear_error(server, capsys):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--port", server.port)
    assert rc == 2 and f"cannot listen on 127.0.0.1:{server.port}" in err


def test_explain_states_the_budget_and_the_kernel(capsys):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--max-batch", 4, "--explain")
    assert rc == 0
    assert "4 slots x 128 positions" in err and "memory budget" in err and "plain" in err
    assert "GroupQueryAttention" in err
    assert "weights: float (no --quantize)" in err


def test_serve_takes_quantize_and_explain_says_so(capsys):
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--quantize", "w8a8", "--explain")
    assert rc == 0, err
    assert "weights: w8a8 (one scale per output row, each activation row quantised at run time; the output " \
           "head in float; the embedding float)" in err
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--quantize", "int4", "--quantize-head", "--explain")
    assert rc == 0 and "weights: int4 (one scale per 32 input features, activations int8 in the product; the " \
                       "output head at 4 bits; the embedding at 8 bits)" in err, err  # the old flag alone
    rc, out, err = cli(capsys, "serve", "gpt2", *SETS, "--quantize", "int4", "--explain")
    assert rc == 0 and "the output head at 8 bits; the embedding at 8 bits)" in err, err  # int4's default


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "wordlevel"])
def test_incremental_detokenizer_equals_one_decode(kind, tmp_path):
    """The stream's text, decoded a window at a time, is the text of one decode of all the tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tessera.runtime.serving.app import Detokenizer

    corpus = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé text, façade café 東京 ok?",
              "Serving many callers at once with one model, step by step."] * 20
    if kind == "wordlevel":
        tok = Tokenizer.from_file(str(_tokenizer_folder(tmp_path, None)))
    else:
        tok = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
        if kind == "bytelevel":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
            tok.decoder = decoders.Metaspace()
            trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"])
        tok.train_from_iterator(corpus, trainer)
    for text in (corpus[0] + " " + corpus[1], corpus[2]) if kind != "wordlevel" else ("w1 w2 w30 w4 w5",):
        ids = tok.encode(text).ids
        detok = Detokenizer(tok)
        for n in range(1, len(ids) + 1):
            streamed = detok.update(ids[:n])
            assert tok.decode(ids[:n], skip_special_tokens=True).startswith(streamed)
        assert streamed == tok.decode(ids, skip_special_tokens=True)
