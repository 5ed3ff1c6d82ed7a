"""Decoding options against transformers on the same weights: logprobs, min_p, no_repeat_ngram_size,
min_new_tokens (runtime/generation/sampling.py), and --chat's prompt ids (runtime/io/chat_template.py).

The references are transformers' own: ``generate`` on a tiny GPT-2 saved by ``save_pretrained``
(greedy, where the two libraries' random generators differ), its logits for log_softmax, its
logits processors (MinP, Temperature, TopK, TopP) on the same scores, and ``apply_chat_template``
on the same tokenizer folder. Logprobs are of the model's raw distribution (log_softmax of the
logits before any processor), as vLLM's default ``logprobs`` and transformers' ``output_logits`` are.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tessera  # noqa: E402
from tessera.runtime.errors import UsageError  # noqa: E402
from tessera.runtime.generation.sampling import Sampling, banned_ngram_tokens, process_logits  # noqa: E402

from conftest import cli, cli_error  # noqa: E402

VOCAB = 64
PROMPT_IDS = [5, 17, 42, 17, 42, 30]
PROMPT = " ".join(f"w{i}" for i in PROMPT_IDS)
NEW = 12


def _word_tokenizer(folder, bos: bool = False):
    """A word-level tokenizer.json whose token 'wI' is id I (I >= 4), so prompts' ids are known by hand;
    <s>, </s>, <|user|>, <|assistant|> are ids 0-3. ``bos``: encoding adds <s> first (as Llama's does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(4, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w4"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[:4]])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A GPT-2 checkpoint folder with its tokenizer, and the transformers model it was saved from."""
    folder = tmp_path_factory.mktemp("gpt2opts")
    model = _model()
    model.save_pretrained(folder, safe_serialization=True)
    _word_tokenizer(folder)
    return folder, model


def _hf(model, prompt, new=NEW, **kw):
    """transformers' greedy generate (output_logits: the raw logits of each step)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), [lg[0].double() for lg in out.logits]


def _tessera(capsys, folder, *extra, prompt=PROMPT_IDS):
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([prompt])}", "--format", "json",
                       "-q", *map(str, extra))
    assert rc == 0, err
    return json.loads(out)["outputs"][0]


def _model_logprobs(model, sequence):
    """log_softmax of transformers' logits for every position of ``sequence`` (teacher-forced), float64."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()
    return torch.log_softmax(logits, -1)


# ------------------------------------------------------------------ logprobs
def test_logprobs_equal_log_softmax_of_transformers_logits(ckpt, capsys):
    folder, model = ckpt
    want, logits = _hf(model, PROMPT_IDS, eos_token_id=None)
    row = _tessera(capsys, folder, "--max-new-tokens", NEW, "--ignore-eos", "--logprobs", 3)
    assert row["tokens"] == want and len(row["logprobs"]) == NEW
    for step, (entry, lg) in enumerate(zip(row["logprobs"], logits)):
        ref = torch.log_softmax(lg, -1)
        assert entry["token"] == want[step]
        assert abs(entry["logprob"] - ref[want[step]].item()) < 1e-4
        top = torch.topk(ref, 3)
        assert [a["token"] for a in entry["top"]] == top.indices.tolist()
        np.testing.assert_allclose([a["logprob"] for a in entry["top"]], top.values.numpy(), atol=1e-4)
        assert entry["top"][0]["token"] == entry["token"]  # greedy: the chosen token is the most likely
    # the API gives the same, as a dict per prompt
    m = tessera.load(folder)
    got = m.generate(PROMPT_IDS, max_new_tokens=NEW, ignore_eos=True, logprobs=3)
    assert got["tokens"] == want
    np.testing.assert_allclose([e["logprob"] for e in got["logprobs"]], [e["logprob"] for e in row["logprobs"]],
                               atol=1e-6)


def test_logprobs_are_of_the_raw_distribution_when_sampling(ckpt, capsys):
    """Sampled at temperature 1.7 with top-k 5: each logprob is still log_softmax of the model's logits
    (transformers' forward on the sampled sequence), not of the tempered, filtered scores."""
    folder, model = ckpt
    row = _tessera(capsys, folder, "--max-new-tokens", 8, "--ignore-eos", "--temperature", 1.7, "--top-k", 5,
                   "--seed", 3, "--logprobs", 0)
    seq = PROMPT_IDS + row["tokens"]
    ref = _model_logprobs(model, seq)
    for i, entry in enumerate(row["logprobs"]):
        pos = len(PROMPT_IDS) - 1 + i  # the logits that chose new token i
        assert entry["top"] == []
        assert abs(entry["logprob"] - ref[pos, entry["token"]].item()) < 1e-4
    # tempered and filtered, the chosen tokens' log-probabilities would differ: the check above can fail
    tempered = torch.log_softmax(torch.log_softmax(ref, -1) / 1.7, -1)
    assert max(abs(e["logprob"] - tempered[len(PROMPT_IDS) - 1 + i, e["token"]].item())
               for i, e in enumerate(row["logprobs"])) > 1e-2


# ------------------------------------------------------------------ no_repeat_ngram_size, min_new_tokens
@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_size_gives_transformers_tokens(ckpt, capsys, n):
    folder, model = ckpt
    free, _ = _hf(model, PROMPT_IDS, 20, eos_token_id=None)
    want, _ = _hf(model, PROMPT_IDS, 20, eos_token_id=None, no_repeat_ngram_size=n)
    assert want != free  # the ban changes greedy's tokens here: the comparison below can fail
    row = _tessera(capsys, folder, "--max-new-tokens", 20, "--ignore-eos", "--no-repeat-ngram-size", n)
    assert row["tokens"] == want
    m = tessera.load(folder)
    assert m.generate(PROMPT_IDS, max_new_tokens=20, ignore_eos=True, no_repeat_ngram_size=n) == want


def test_banned_ngram_tokens_by_hand():
    #           0  1  2  3  4  5  6
    tokens = [7, 8, 9, 7, 8, 5, 7]
    assert sorted(banned_ngram_tokens(tokens, 2)) == [8, 8]  # 7 was followed by 8 twice
    assert banned_ngram_tokens(tokens + [8], 3) == [9, 5]   # (7, 8) was followed by 9 and by 5
    assert sorted(set(banned_ngram_tokens(tokens, 1))) == [5, 7, 8, 9]
    assert banned_ngram_tokens([7], 3) == []  # too short to hold a 3-gram's prefix


def _eos_folder(tmp_path, model, prompt):
    """``model`` saved with eos_token_id = greedy decoding's 2nd new token (so it stops early)."""
    free, _ = _hf(model, prompt, NEW, eos_token_id=None)
    eos = free[1]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path, safe_serialization=True)
    return eos, free


def test_min_new_tokens_holds_the_eos_off_as_transformers_does(tmp_path, capsys):
    model = _model()
    eos, free = _eos_folder(tmp_path, model, PROMPT_IDS)
    stopped, _ = _hf(model, PROMPT_IDS, NEW, eos_token_id=eos)
    want, _ = _hf(model, PROMPT_IDS, NEW, eos_token_id=eos, min_new_tokens=6)
    assert stopped == free[:2] and len(want) > 6 and want != stopped
    assert _tessera(capsys, tmp_path, "--max-new-tokens", NEW)["tokens"] == stopped
    assert _tessera(capsys, tmp_path, "--max-new-tokens", NEW, "--min-new-tokens", 6)["tokens"] == want
    m = tessera.load(tmp_path)
    assert m.generate(PROMPT_IDS, max_new_tokens=NEW, min_new_tokens=6) == want


def test_generation_config_gives_the_new_defaults_and_explain_names_them(tmp_path, capsys):
    model = _model()
    eos, _ = _eos_folder(tmp_path, model, PROMPT_IDS)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config.update(no_repeat_ngram_size=2, min_new_tokens=5, min_p=0.2)  # min_p: do_sample is not true
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    want, _ = _hf(transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval(), PROMPT_IDS, NEW)
    rc, out, err = cli(capsys, "generate", tmp_path, "--input", f"tokens={json.dumps([PROMPT_IDS])}",
                       "--max-new-tokens", NEW, "--format", "json", "--explain", "-q")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["tokens"] == want
    where = str(tmp_path / "generation_config.json")
    assert f"no_repeat_ngram_size = 2: {where}" in err and f"min_new_tokens = 5: {where}" in err
    assert "min_p = 0.0: Tessera's default" in err and "min_p 0.2 but not do_sample" in err


# ------------------------------------------------------------------ min_p
def _hf_warped(scores, temperature, top_k=0, top_p=1.0, min_p=0.0):
    from transformers.generation import logits_process as lp

    procs = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(lp.TopPLogitsWarper(top_p))
    if min_p:
        procs.append(lp.MinPLogitsWarper(min_p))
    return lp.LogitsProcessorList(procs)(None, torch.tensor(scores)).numpy()


@pytest.mark.parametrize("settings", [dict(temperature=1.0, min_p=0.1), dict(temperature=0.7, min_p=0.3),
                                      dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.2),
                                      dict(temperature=2.0, top_p=0.95, min_p=0.5)])
def test_the_warpers_equal_transformers_processors(ckpt, settings):
    """Temperature, top-k, top-p and min-p in transformers' order, on GPT-2's logits of every prefix."""
    _, model = ckpt
    with torch.no_grad():
        scores = model(torch.tensor([PROMPT_IDS + [9, 10, 11, 12]])).logits[0].float().numpy()
    ours = process_logits(scores, None, Sampling(**settings))
    ref = _hf_warped(scores, **settings)
    assert np.array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], rtol=1e-6, atol=1e-6)
    if settings.get("min_p"):  # min_p removes tokens the other warpers keep
        without = process_logits(scores, None, Sampling(**{**settings, "min_p": 0.0}))
        assert np.isfinite(without).sum() > np.isfinite(ours).sum()


def test_min_p_sampling_keeps_to_transformers_min_p_set_and_changes_the_result(ckpt, capsys):
    """Sampled at temperature 3 (seeded), every token chosen with --min-p 0.3 lies in the set transformers'
    MinP warper keeps for its prefix (the model's logits, tempered); without --min-p some does not."""
    folder, model = ckpt

    def sampled(*extra):
        row = _tessera(capsys, folder, "--max-new-tokens", 10, "--ignore-eos", "--temperature", 3, "--seed", 1,
                       *extra)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT_IDS + row["tokens"]])).logits[0].float().numpy()
        kept = np.isfinite(_hf_warped(logits, 3.0, min_p=0.3))
        return row["tokens"], [bool(kept[len(PROMPT_IDS) - 1 + i, t]) for i, t in enumerate(row["tokens"])]

    with_min_p, inside = sampled("--min-p", 0.3)
    without, inside_without = sampled()
    assert all(inside)
    assert not all(inside_without) and with_min_p != without
    # the API samples the same tokens
    m = tessera.load(folder)
    assert m.generate(PROMPT_IDS, max_new_tokens=10, ignore_eos=True, temperature=3, seed=1, min_p=0.3) == with_min_p


# ------------------------------------------------------------------ the serving engine: the same choice
def test_the_serving_engine_chooses_and_scores_as_generate(ckpt, capsys):
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request

    folder, model = ckpt
    want, logits = _hf(model, PROMPT_IDS, NEW, eos_token_id=None, no_repeat_ngram_size=2)
    engine = Engine(serving_model.load(str(folder)), max_batch=2)
    handle = engine.submit(Request(list(PROMPT_IDS), NEW, Sampling(no_repeat_ngram_size=2, logprobs=2),
                                   ignore_eos=True))
    other = engine.submit(Request([9, 10, 11], NEW, Sampling()))  # shares the steps, greedy without options
    while not (handle.finished and other.finished):
        engine.step()
    assert handle.tokens == want
    ref = [torch.log_softmax(lg, -1) for lg in logits]
    np.testing.assert_allclose([e["logprob"] for e in handle.logprobs], [r[t].item() for r, t in zip(ref, want)],
                               atol=1e-4)
    assert [[a["token"] for a in e["top"]] for e in handle.logprobs] == [torch.topk(r, 2).indices.tolist()
                                                                         for r in ref]
    assert other.tokens == _hf(model, [9, 10, 11], NEW, eos_token_id=None)[0]


def test_a_batch_row_takes_the_options(ckpt):
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.batch import RowError, row_request
    from tessera.runtime.serving.engine import Engine

    folder, model = ckpt
    engine = Engine(serving_model.load(str(folder)), max_batch=1)
    req = row_request({"prompt": PROMPT_IDS, "max_tokens": 20, "no_repeat_ngram_size": 2, "min_p": 0.1,
                       "min_tokens": 3}, engine, 16)
    assert (req.sampling.no_repeat_ngram_size, req.sampling.min_p, req.sampling.min_new_tokens) == (2, 0.1, 3)
    req.ignore_eos = True
    handle = engine.submit(req)
    while not handle.finished:
        engine.step()
    assert handle.tokens == _hf(model, PROMPT_IDS, 20, eos_token_id=None, no_repeat_ngram_size=2)[0]
    with pytest.raises(RowError, match="min_tokens must be an integer"):
        row_request({"prompt": PROMPT_IDS, "min_tokens": 1.5}, engine, 16)


def test_the_completions_route_gives_openai_logprobs(ckpt):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    folder, model = ckpt
    want, logits = _hf(model, PROMPT_IDS, 5, eos_token_id=None)
    engine, server = build_server(ServeOptions(spec=str(folder), tokenizer=str(folder), max_batch=2))
    engine.start()
    try:
        with TestClient(create_app(server)) as client:
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                     "logprobs": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            assert lp["tokens"] == [f"w{t}" for t in want]
            ref = [torch.log_softmax(lg, -1) for lg in logits]
            np.testing.assert_allclose(lp["token_logprobs"], [r_[t].item() for r_, t in zip(ref, want)], atol=1e-4)
            assert [list(d) for d in lp["top_logprobs"]] == [[f"w{t}" for t in torch.topk(r_, 2).indices.tolist()]
                                                             for r_ in ref]
            assert lp["text_offset"] == [sum(len(f"w{t}") for t in want[:i]) for i in range(5)]
            bad = client.post("/v1/completions", json={"prompt": PROMPT, "min_p": 2})
            assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]
    finally:
        engine.close()


# ------------------------------------------------------------------ --chat
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_renders_transformers_apply_chat_template_ids(tmp_path, capsys):
    """A tokenizer that adds <s> itself and a template that writes it too: --chat's ids are
    apply_chat_template's (one <s>), and the tokens those of transformers' greedy generate from them."""
    model = _model()
    model.save_pretrained(tmp_path, safe_serialization=True)
    _word_tokenizer(tmp_path, bos=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": TEMPLATE}))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], add_generation_prompt=True,
                                     tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == [0, 2, 5, 6, 7, 1, 3]  # <s> <|user|> w5 w6 w7 </s> <|assistant|>, by hand
    want, _ = _hf(model, ids, 6, eos_token_id=None)
    rc, out, err = cli(capsys, "generate", tmp_path, "--chat", "--prompt", "w5 w6 w7", "--max-new-tokens", 6,
                       "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    assert row["prompt_tokens"] == ids and row["tokens"] == want
    # without --chat the tokenizer's own <s> and the bare words
    rc, out, _ = cli(capsys, "generate", tmp_path, "--prompt", "w5 w6 w7", "--max-new-tokens", 1, "--format", "json",
                     "-q")
    assert json.loads(out)["outputs"][0]["prompt_tokens"] == [0, 5, 6, 7]
    m = tessera.load(tmp_path)
    got = m.generate("w5 w6 w7", max_new_tokens=6, ignore_eos=True, chat=True, logprobs=0)
    assert got["prompt_tokens"] == ids and got["tokens"] == want


def test_chat_reads_chat_template_jinja_as_transformers_saves_it(tmp_path, capsys):
    """transformers >= 4.50 saves the template as chat_template.jinja beside tokenizer.json, not in
    tokenizer_config.json: --chat reads it, with the ids of apply_chat_template on the same folder."""
    model = _model()
    model.save_pretrained(tmp_path, safe_serialization=True)
    _word_tokenizer(tmp_path, bos=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "a stale template that the .jinja file overrides"}))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], add_generation_prompt=True,
                                     tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == [0, 2, 5, 6, 7, 1, 3]
    rc, out, err = cli(capsys, "generate", tmp_path, "--chat", "--prompt", "w5 w6 w7", "--max-new-tokens", 1,
                       "--ignore-eos", "--format", "json", "-q")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["prompt_tokens"] == ids


def test_the_chat_route_renders_as_generate_chat_and_gives_openai_logprobs(tmp_path, capsys):
    """The server's chat route and `generate --chat` share the template code: the same prompt ids,
    the same tokens, and the chat logprobs shape with generate's values."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from tessera.runtime.serving.app import create_app
    from tessera.runtime.serving.server import ServeOptions, build_server

    _model().save_pretrained(tmp_path, safe_serialization=True)
    _word_tokenizer(tmp_path, bos=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "chat_template": TEMPLATE}))
    rc, out, err = cli(capsys, "generate", tmp_path, "--chat", "--prompt", "w5 w6 w7", "--max-new-tokens", 4,
                       "--ignore-eos", "--logprobs", 1, "--format", "json", "-q")
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    engine, server = build_server(ServeOptions(spec=str(tmp_path), max_batch=2))
    engine.start()
    try:
        with TestClient(create_app(server)) as client:
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "logprobs": True, "top_logprobs": 1})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["prompt_tokens"] == len(row["prompt_tokens"])
            assert choice["token_ids"] == row["tokens"]
            content = choice["logprobs"]["content"]
            assert [c["token"] for c in content] == [f"w{t}" for t in row["tokens"]]
            assert [c["bytes"] for c in content] == [list(f"w{t}".encode()) for t in row["tokens"]]
            np.testing.assert_allclose([c["logprob"] for c in content], [e["logprob"] for e in row["logprobs"]],
                                       atol=1e-5)
            assert [[a["token"] for a in c["top_logprobs"]] for c in content] == \
                [[f"w{a['token']}" for a in e["top"]] for e in row["logprobs"]]
            bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                            "top_logprobs": 2})
            assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
    finally:
        engine.close()


def test_chat_errors(ckpt, tmp_path, capsys):
    folder, _ = ckpt  # its tokenizer folder has no tokenizer_config.json
    err = cli_error(capsys, "generate", folder, "--chat", "--prompt", "w5")
    assert "no chat template" in err and "tokenizer_config.json" in err
    err = cli_error(capsys, "generate", folder, "--chat", "--input", "tokens=[[5]]")
    assert "--chat" in err and "--prompt" in err
    m = tessera.load(folder)
    with pytest.raises(UsageError, match="chat=True"):
        m.generate("w5", chat=True)
    with pytest.raises(UsageError, match="text prompt"):
        m.generate([5, 6], chat=True)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize("args, words", [
    (["--min-p", "1.5"], "min_p must be in [0, 1]"),
    (["--min-p", "-0.1"], "min_p must be in [0, 1]"),
    (["--no-repeat-ngram-size", "-1"], "no_repeat_ngram_size must be an integer >= 0"),
    (["--min-new-tokens", "-2"], "min_new_tokens must be an integer >= 0"),
    (["--logprobs", "21", "--format", "json"], "logprobs must be an integer from 0"),
    (["--logprobs", "2"], "--format json or jsonl"),
])
def test_bad_decoding_options_are_clear_errors(ckpt, capsys, args, words):
    folder, _ = ckpt
    err = cli_error(capsys, "generate", folder, "--input", "tokens=[[5]]", *args)
    assert words in err


@pytest.mark.parametrize("kw, words", [
    (dict(min_p="0.1"), "min_p must be a finite number"), (dict(no_repeat_ngram_size=1.5), "must be an integer"),
    (dict(min_new_tokens=True), "must be an integer"), (dict(logprobs=-1), "logprobs must be an integer from 0"),
])
def test_bad_decoding_options_in_the_api(ckpt, kw, words):
    m = tessera.load(ckpt[0])
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace("=", "=")):
        m.generate([5, 6], max_new_tokens=2, **kw)


# ------------------------------------------------------------------ the documents' examples
def _doc_examples():
    """The fenced blocks of docs/generate.md and docs/python.md marked ``<!-- run in
    tests/generation/test_decoding_options.py -->``: (where, language, text)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for name in ("generate.md", "python.md"):
        lines = (root / "docs" / name).read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "<!-- run in tests/generation/test_decoding_options.py -->":
                assert lines[i + 1].startswith("```"), f"{name}:{i + 1}: the marker must precede a fence"
                end = next(k for k in range(i + 2, len(lines)) if lines[k].startswith("```"))
                found.append((f"{name}:{i + 2}", lines[i + 1][3:].strip(), lines[i + 2:end]))
    return found


DOC_EXAMPLES = _doc_examples()


def test_the_documents_show_the_examples():
    assert sorted(lang for _, lang, _ in DOC_EXAMPLES) == ["", "", "python"]


def _matches(expected: str, got: str) -> bool:
    """A line of a document's output: ``...`` stands for any text."""
    import re

    return re.fullmatch(".*".join(re.escape(part) for part in expected.split("...")), got) is not None


@pytest.mark.parametrize("where, lang, lines", DOC_EXAMPLES, ids=[w for w, _, _ in DOC_EXAMPLES])
def test_documented_example_runs(where, lang, lines, capsys, tmp_path, monkeypatch):
    import shlex

    monkeypatch.chdir(tmp_path)
    if lang == "python":
        exec(compile("\n".join(lines), where, "exec"), {})
        return
    assert lines[0].startswith("$ tessera ")
    rc, out, err = cli(capsys, *shlex.split(lines[0][len("$ tessera "):]))
    assert rc == 0, err
    got, want = out.splitlines(), lines[1:]
    assert len(got) == len(want) and all(_matches(w, g) for w, g in zip(want, got)), (where, out)
