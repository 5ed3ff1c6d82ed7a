"""Scale-out: `tessera serve --ray` (Ray Serve replicas) and `tessera batch` (local, and on Ray Data).

The Ray tests start their own local two-node cluster (``ray.cluster_utils.Cluster``: a head and a
worker node, one CPU each, on this machine) and shut it down at the end; they are skipped only
where Ray is not installed. The references are independent of the code under test: ``generate``
run alone on each prompt over the same spec and seeded weights (tokens), the tokenizer decoding
those tokens (text), and one `tessera generate` command run for a text.

The local `tessera batch` tests (per-row errors, atomic output, bad input files) need no Ray.
"""

from __future__ import annotations

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import cli, cli_error
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model

SETS = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=128"]
SET_ARGS = [a for s in SETS for a in ("--set", s)]
EOS = 0  # <|endoftext|>, the tokenizer folder's eos_token


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The word-level tokenizer (w1 ... w49, <|endoftext|> = 0) of the HTTP server's tests."""
    pytest.importorskip("tokenizers")
    from test_serve_http import _tokenizer_folder

    return _tokenizer_folder(tmp_path_factory.mktemp("tok"), None)


@pytest.fixture(scope="module")
def model():
    return serving_model.load("gpt2", sets=SETS, threads=1)


def alone(model, prompt: list[int], n: int) -> list[int]:
    """``generate`` on one prompt, greedy, stopping at the end-of-sequence token (the reference)."""
    return gen.generate(model, [prompt], n, gen.Sampling(), (EOS,)).tokens[0]


def text_of(tokenizer_path, tokens: list[int]) -> str:
    """The completion text of generated tokens: a final end-of-sequence token left out, decoded."""
    tok = serving_model.load_tokenizer(str(tokenizer_path))
    return tok.decode(tokens[:-1] if tokens and tokens[-1] == EOS else tokens, skip_special_tokens=True)


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]  # "w7 w3" -> [7, 3] in the word-level vocabulary


def prompts(n: int, seed: int) -> list[tuple[str, int]]:
    """n text prompts of 1 to 12 words with their max_tokens (4 to 19)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(" ".join(f"w{int(t)}" for t in rng.integers(1, 50, int(rng.integers(1, 13)))), int(rng.integers(4, 20)))
            for _ in range(n)]


# ------------------------------------------------------------------------------------ Ray


@pytest.fixture(scope="module")
def cluster():
    """A local two-node Ray cluster (head + worker, 1 CPU each), connected; gone at the end, with
    every process it started."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessera[serve]')")
    if not hasattr(ray, "init"):  # e.g. a checkout in a folder named ray, its parent put on sys.path by pytest
        pytest.fail(f"'import ray' finds {ray.__file__}, not Ray; run pytest with --import-mode=append")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tessera[serve]')")
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'tessera[serve]')")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    try:
        ray.init(address=c.address, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield c
    finally:
        pids = [p.process.pid for node in c.list_all_nodes() for ps in node.all_processes.values() for p in ps]
        ray.shutdown()
        c.shutdown()
        alive = [pid for pid in pids if _alive(pid)]
        assert not alive, f"Ray processes left running: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="class")
def url(cluster, tokenizer):
    """Two replicas (one per node: each takes the node's one CPU) of the `serve run` app, behind one
    HTTP proxy on 127.0.0.1."""
    from ray import serve

    from tessera.runtime.serving import ray_serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        app = ray_serve.app({"model": "gpt2", "set": ",".join(SETS), "tokenizer": str(tokenizer),
                             "replicas": "2", "max_batch": "4", "max_queue": "32"})
        serve.run(app, name=ray_serve.APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


class TestRayServe:
    """Torn down (Serve shut down) before the Ray Data test, which needs the nodes' CPUs."""

    def test_streams_equal_generate_and_requests_land_on_both_replicas(self, url, model, tokenizer):
        """16 concurrent streams through the official client: each stream's text equals the text of
        ``generate`` alone on its prompt. A replica takes max_batch (4) requests at once and Serve's
        router sends the rest to the other, so both replicas -- on both nodes -- answer."""
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        work = prompts(16, seed=3)

        def streamed(i):
            text, n = work[i]
            raw = client.completions.with_raw_response.create(model="gpt2", prompt=text, max_tokens=n,
                                                               temperature=0, stream=True)
            chunks = list(raw.parse())
            return ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason,
                    raw.headers["x-tessera-replica"], raw.headers["x-tessera-node"])

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(streamed, range(16)))
        for (text, n), (streamed_text, finish, _, _) in zip(work, got):
            want = alone(model, ids_of(text), n)
            assert streamed_text == text_of(tokenizer, want), text
            assert finish == ("stop" if want[-1] == EOS else "length")
        assert len({g[2] for g in got}) == 2, "all requests landed on one replica"
        assert len({g[3] for g in got}) == 2, "both replicas are on one node"

    def test_completion_tokens_equal_tessera_generate(self, url, tokenizer, capsys):
        """Not streamed: the text equals what the `tessera generate` command prints for the prompt."""
        httpx = pytest.importorskip("httpx")
        rc, out, err = cli(capsys, "generate", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--prompt", "w4 w8 w15",
                           "--max-new-tokens", 12, "--stop-token", EOS, "--format", "json", "--quiet")
        assert rc == 0, err
        want = json.loads(out)["outputs"][0]
        r = httpx.post(url + "/v1/completions", json={"prompt": "w4 w8 w15", "max_tokens": 12, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["text"]
        assert r.json()["choices"][0]["token_ids"] == want["tokens"]

    def test_bad_requests_get_openai_errors_through_serve(self, url):
        httpx = pytest.importorskip("httpx")
        for body, status in ((b"{not json", 400), (json.dumps({"prompt": "w1", "max_tokens": "ten"}).encode(), 400),
                             (json.dumps({"prompt": [1] * 200}).encode(), 400)):
            r = httpx.post(url + "/v1/completions", content=body, timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == status, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(url + "/health", timeout=60).json()["status"] == "ok"


def _rows_file(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _results(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_ray_data_batch_200_rows_equal_generate(cluster, model, tokenizer, tmp_path, capsys):
    """200 rows (text and token-id prompts, two that cannot run) through `tessera batch --ray` with two
    actors: every row equals the local `tessera batch`, a sample of rows equals ``generate`` alone
    token by token, and the failing rows carry their error at their own line."""
    work = prompts(198, seed=11)
    rows = [{"prompt": text if i % 3 else ids_of(text), "max_tokens": n} for i, (text, n) in enumerate(work)]
    rows.insert(57, {"prompt": [1] * 130})  # past the 128-position context
    rows.insert(140, {"prompt": "w1 w2", "max_tokens": 127})  # max_tokens past the context
    src = _rows_file(tmp_path / "prompts.jsonl", rows)
    common = ["batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src, "--threads", 1]
    rc, _, err = cli(capsys, *common, "--output", tmp_path / "ray.jsonl", "--ray", "--concurrency", 2)
    assert rc == 0, err
    rc, _, err = cli(capsys, *common, "--output", tmp_path / "local.jsonl")
    assert rc == 0, err
    on_ray, local = _results(tmp_path / "ray.jsonl"), _results(tmp_path / "local.jsonl")
    assert len(on_ray) == 200
    assert on_ray == local
    assert [i for i, r in enumerate(on_ray) if "error" in r] == [57, 140]
    assert "context is 128 positions" in on_ray[57]["error"]
    for i in range(0, 200, 9):
        if i in (57, 140):
            continue
        row = rows[i]
        ids = row["prompt"] if isinstance(row["prompt"], list) else ids_of(row["prompt"])
        want = alone(model, ids, row["max_tokens"])
        assert on_ray[i]["tokens"] == want, i
        assert on_ray[i]["text"] == text_of(tokenizer, want)


def test_ray_data_batch_with_a_bad_model_is_a_clear_error(cluster, tmp_path, capsys):
    """The actors build the engine; their failure reaches the command as one line, not a traceback."""
    src = _rows_file(tmp_path / "in.jsonl", [{"prompt": [1]}])
    err = cli_error(capsys, "batch", "nosuch.tsr", "--input", src, "--output", tmp_path / "o.jsonl", "--ray")
    assert "no spec file or bundled spec named 'nosuch.tsr'" in err.splitlines()[-1]
    assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------------------------ local batch


def test_local_batch_rows_and_per_row_errors(model, tokenizer, tmp_path, capsys):
    rows = [
        {"prompt": "w3 w9 w27", "max_tokens": 10},
        {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0},
        {"prompt": "w3 w9 w27", "max_tokens": 10, "stop": "STOP"},  # replaced below by a real stop word
        {"prompt": [1] * 128},  # the prompt fills the context: no room for a new token
        {"prompt": [3, 99]},  # outside the vocabulary
        {"prompt": "w1", "max_tokens": "ten"},
        {"prompt": "w1", "temperature": "hot"},
        {"prompt": 5},
        {"max_tokens": 3},
        {"prompt": "w1", "n": 2},
        {"prompt": ""},
        {"prompt": "w2 w40", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 4},
        {"prompt": "w2 w40", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 4},
    ]
    free = alone(model, ids_of("w3 w9 w27"), 10)
    stop_word = text_of(tokenizer, free).split()[3]
    rows[2]["stop"] = stop_word
    src = _rows_file(tmp_path / "in.jsonl", rows)
    rc, _, err = cli(capsys, "batch", "gpt2", *SET_ARGS, "--tokenizer", tokenizer, "--input", src,
                     "--output", tmp_path / "out.jsonl", "--max-tokens", 5, "--threads", 1)
    assert rc == 0, err
    assert "13 rows" in err and "8 failed" in err
    out = _results(tmp_path / "out.jsonl")
    assert len(out) == len(rows)
    assert out[0] == {"text": text_of(tokenizer, free), "tokens": free,
                      "finish_reason": "stop" if free[-1] == EOS else "length"}
    assert out[1]["tokens"] == alone(model, [5, 6, 7], 6) and "text" in out[1]
    words = text_of(tokenizer, free).split()
    assert out[2]["finish_reason"] == "stop"
    assert out[2]["text"].split() == words[:words.index(stop_word)]
    errors = {i: r["error"] for i, r in enumerate(out) if "error" in r}
    assert sorted(errors) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert "context" in errors[3] and "vocabulary" in errors[4]
    assert "max_tokens" in errors[5] and "temperature" in errors[6]
    assert "prompt" in errors[7] and "no prompt" in errors[8] and "'n'" in errors[9] and "empty" in errors[10]
    assert out[11]["tokens"] == out[12]["tokens"] and len(out[11]["tokens"]) <= 8  # seeded: repeatable


def test_default_max_tokens_and_prompt_ids_without_tokenizer(model, tmp_path, capsys):
    src = _rows_file(tmp_path / "in.jsonl", [{"prompt": [8, 9]}, {"prompt": "w1"}, {"prompt": [8], "stop": "w1"}])
    rc, _, err = cli(capsys, "batch", "gpt2", *SET_ARGS, "--input", src, "--output", tmp_path / "o.jsonl",
                     "--max-tokens", 7, "--threads", 1)
    assert rc == 0, err
    out = _results(tmp_path / "o.jsonl")
    assert out[0] == {"tokens": gen.generate(model, [[8, 9]], 7).tokens[0], "finish_reason": "length"}
    assert "needs --tokenizer" in out[1]["error"] and "--tokenizer" in out[2]["error"]


def test_batch_takes_quantize_as_generate_does(tmp_path, capsys):
    """`tessera batch --quantize w8a8` compiles the model as `tessera generate --quantize w8a8` does:
    the same greedy tokens row by row."""
    src = _rows_file(tmp_path / "in.jsonl", [{"prompt": [8, 9]}, {"prompt": [5, 6, 7, 30, 31]}])
    rc, _, err = cli(capsys, "batch", "gpt2", *SET_ARGS, "--input", src, "--output", tmp_path / "o.jsonl",
                     "--max-tokens", 7, "--threads", 1, "--quantize", "w8a8", "--quantize-head")
    assert rc == 0, err
    got = [row["tokens"] for row in _results(tmp_path / "o.jsonl")]
    rc, out, err = cli(capsys, "generate", "gpt2", *SET_ARGS, "--input", "tokens=[[8, 9], [5, 6, 7, 30, 31]]",
                       "--max-new-tokens", 7, "--quantize", "w8a8", "--quantize-head", "--format", "json")
    assert rc == 0, err
    assert got == [row["tokens"] for row in json.loads(out)["outputs"]]


def test_output_is_written_atomically(tmp_path, capsys, monkeypatch):
    from tessera.runtime.serving import batch

    target = tmp_path / "results.jsonl"
    target.write_text("old\n")
    # a failure part-way through writing leaves the old file and no temporary file
    with pytest.raises(TypeError):
        batch.write_atomically(str(target), [{"tokens": [1]}, {"tokens": object()}])
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["results.jsonl"]
    # a bad input file is refused before anything is written
    bad = _rows_file(tmp_path / "bad.jsonl", [{"prompt": [1]}])
    with open(bad, "a") as f:
        f.write("[1, 2]\n")
    err = cli_error(capsys, "batch", "gpt2", *SET_ARGS, "--input", bad, "--output", target)
    assert "bad.jsonl:2" in err
    assert target.read_text() == "old\n"
    # a good run replaces it whole, through a temporary file beside it
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real(a, b))[1])
    good = _rows_file(tmp_path / "good.jsonl", [{"prompt": [1], "max_tokens": 2}])
    rc, _, err = cli(capsys, "batch", "gpt2", *SET_ARGS, "--input", good, "--output", target, "--threads", 1)
    assert rc == 0, err
    assert len(_results(target)) == 1 and "tokens" in _results(target)[0]
    assert [os.path.dirname(a) for a, b in renames] == [str(tmp_path)] and renames[0][1] == target
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl", "results.jsonl"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ('{"prompt": [1]}\n{"prompt": [2]\n', "in.jsonl:2: not a JSON line"),
    ('{"prompt": [1]}\n\n"w1"\n', "in.jsonl:3: a line must be a JSON object"),
    ("\n\n", "no rows"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_bad_input_files(tmp_path, capsys, content, message):
    src = tmp_path / "in.jsonl"
    if isinstance(content, bytes):
        src.write_bytes(content)
    elif content is not None:
        src.write_text(content)
    err = cli_error(capsys, "batch", "gpt2", "--input", src, "--output", tmp_path / "out.jsonl")
    assert message in err
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_batch_options(tmp_path, capsys):
    src = _rows_file(tmp_path / "in.jsonl", [{"prompt": [1]}])
    assert "--concurrency and --address apply with --ray" in cli_error(
        capsys, "batch", "gpt2", "--input", src, "--output", tmp_path / "o.jsonl", "--concurrency", 3)
    assert "--max-tokens must be an integer >= 1" in cli_error(
        capsys, "batch", "gpt2", "--input", src, "--output", tmp_path / "o.jsonl", "--max-tokens", 0)
    assert "is the --input file" in cli_error(capsys, "batch", "gpt2", "--input", src, "--output", src)


def test_ray_flags_without_ray_name_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] == "ray"
                        else real(name, *a))
    src = _rows_file(tmp_path / "in.jsonl", [{"prompt": [1]}])
    err = cli_error(capsys, "batch", "gpt2", *SET_ARGS, "--input", src, "--output", tmp_path / "o.jsonl", "--ray")
    assert "pip install 'tessera[serve]'" in err and "Ray" in err
    err = cli_error(capsys, "serve", "gpt2", "--ray", "--replicas", 2)
    assert "pip install 'tessera[serve]'" in err and "Ray" in err


# ------------------------------------------------------------------------------------ serve --ray options


@pytest.mark.parametrize("args, message", [
    (["--replicas", 2, "--min-replicas", 1, "--max-replicas", 3], "not both"),
    (["--min-replicas", 1], "needs both"),
    (["--min-replicas", 3, "--max-replicas", 2], "more than --max-replicas"),
    (["--replicas", 0], "--replicas must be an integer >= 1"),
])
def test_serve_ray_option_errors(capsys, args, message):
    assert message in cli_error(capsys, "serve", "gpt2", "--ray", *args)


def test_serve_ray_explain_shows_the_deployment(capsys):
    """--explain prints the deployment without starting Ray: max_ongoing_requests is --max-batch (not
    Serve's default 5), each replica reserves --threads CPUs."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tessera[serve]')")
    rc, _, err = cli(capsys, "serve", "gpt2", "--ray", "--min-replicas", 1, "--max-replicas", 4, "--max-batch", 12,
                     "--max-queue", 40, "--threads", 2, "--explain")
    assert rc == 0, err
    assert "'max_ongoing_requests': 12" in err and "'max_queued_requests': 40" in err
    assert "'ray_actor_options': {'num_cpus': 2}" in err
    assert "'autoscaling_config': {'min_replicas': 1, 'max_replicas': 4" in err


def test_serve_run_arguments():
    from tessera.runtime.serving import ray_serve
    from tessera.runtime.serving.model import UsageError

    opts, ray_opts = ray_serve.options_from_args({"model": "gpt2", "set": "layers=2,d=64", "replicas": "3",
                                                  "max_batch": "6", "threads": "2"})
    assert (opts.spec, opts.sets, opts.max_batch, opts.threads) == ("gpt2", ["layers=2", "d=64"], 6, 2)
    assert ray_opts.replicas == 3
    with pytest.raises(UsageError, match="needs model="):
        ray_serve.options_from_args({"replicas": "2"})
    with pytest.raises(UsageError, match="unknown argument 'port'"):
        ray_serve.options_from_args({"model": "gpt2", "port": "80"})
    with pytest.raises(UsageError, match="max_batch must be an integer"):
        ray_serve.options_from_args({"model": "gpt2", "max_batch": "many"})


def test_an_address_where_nothing_listens_is_refused_at_once():
    """Ray itself retries for minutes; the command checks a HOST:PORT address first."""
    from tessera.runtime.serving.model import UsageError
    from tessera.runtime.serving.ray_support import check_reachable

    port = _free_port()  # bound then closed: nothing listens there
    with pytest.raises(UsageError, match=f"cannot reach Ray at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(UsageError, match="cannot reach Ray"):
        check_reachable(f"ray://127.0.0.1:{port}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}")  # something listens: left to Ray
    check_reachable("auto")
