"""Log-probabilities while streaming: the API's ``generate(stream=True, logprobs=N)``, ``tessera
generate --format jsonl --logprobs N`` and the server's SSE chunks (completions' ``logprobs`` and
chat's ``choices[].logprobs.content``, read with the official ``openai`` client from a real
``tessera serve`` process on 127.0.0.1).

The reference is independent of Tessera: ``log_softmax`` (torch) of the logits transformers' GPT-2
gives on the same weights (a tiny checkpoint saved by ``save_pretrained``), and transformers' own
greedy tokens. Streamed values must also equal the non-streamed ones (tests/generation/test_decoding_options.py
checks those against transformers too).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tessera  # noqa: E402

from conftest import cli  # noqa: E402
from test_decoding_options import NEW, PROMPT, PROMPT_IDS, TEMPLATE, _hf, _model, _word_tokenizer  # noqa: E402

TOP = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A GPT-2 checkpoint folder with a word-level tokenizer (token 'wI' is id I) and a chat template,
    and the transformers model it was saved from."""
    folder = tmp_path_factory.mktemp("gpt2stream")
    model = _model()
    model.save_pretrained(folder, safe_serialization=True)
    _word_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": TEMPLATE}))
    return folder, model


def _reference(model, prompt, new=NEW):
    """transformers' greedy tokens and, per step, log_softmax of its logits (float64)."""
    want, logits = _hf(model, prompt, new, eos_token_id=None)
    return want, [torch.log_softmax(lg, -1) for lg in logits]


def _check_entries(entries, want, ref, top=TOP):
    """Tessera's entries ({token, logprob, top}) against transformers' tokens and log_softmax."""
    assert [e["token"] for e in entries] == want
    for e, r in zip(entries, ref):
        assert abs(e["logprob"] - r[e["token"]].item()) < 1e-4
        best = torch.topk(r, top)
        assert [a["token"] for a in e["top"]] == best.indices.tolist()
        np.testing.assert_allclose([a["logprob"] for a in e["top"]], best.values.numpy(), atol=1e-4)


# ------------------------------------------------------------------ the API
def test_the_api_streams_each_token_with_its_logprobs(ckpt):
    folder, model = ckpt
    want, ref = _reference(model, PROMPT_IDS)
    m = tessera.load(folder)
    streamed = list(m.generate(PROMPT_IDS, max_new_tokens=NEW, ignore_eos=True, logprobs=TOP, stream=True))
    assert len(streamed) == NEW  # one dict per token, as it is decoded
    _check_entries(streamed, want, ref)
    whole = m.generate(PROMPT_IDS, max_new_tokens=NEW, ignore_eos=True, logprobs=TOP)
    assert [{k: e[k] for k in ("token", "logprob", "top")} for e in streamed] == whole["logprobs"]


def test_a_streamed_text_prompt_gives_each_tokens_text(ckpt):
    folder, model = ckpt
    want, ref = _reference(model, PROMPT_IDS, 6)
    m = tessera.load(folder)
    streamed = list(m.generate(PROMPT, max_new_tokens=6, ignore_eos=True, logprobs=1, stream=True))
    _check_entries(streamed, want, ref, top=1)
    assert "".join(e["text"] for e in streamed) == " ".join(f"w{t}" for t in want)  # the decoder's spacing


def test_a_streamed_batch_gives_a_list_per_step_with_none_once_a_prompt_stops(ckpt):
    folder, model = ckpt
    short = PROMPT_IDS[:3]
    want_a, ref_a = _reference(model, PROMPT_IDS, 4)
    want_b, ref_b = _reference(model, short, 4)
    stop = want_b[1]  # the second prompt stops at its second token (a stop token the first may not hit early)
    if stop in want_a[:3] or stop == want_b[0]:
        pytest.skip("the stop token also ends the first prompt early with these weights")
    m = tessera.load(folder)
    steps = list(m.generate([PROMPT_IDS, short], max_new_tokens=4, ignore_eos=True, logprobs=TOP, stream=True,
                            stop_tokens=[stop]))
    assert all(isinstance(s, list) and len(s) == 2 for s in steps)
    first = [s[0] for s in steps if s[0] is not None]
    second = [s[1] for s in steps if s[1] is not None]
    _check_entries(first, want_a[:len(first)], ref_a)
    _check_entries(second, want_b[:2], ref_b)
    assert len(second) == 2 and steps[-1][1] is None


# ------------------------------------------------------------------ the command line
def test_generate_jsonl_streams_one_object_per_token(ckpt, capsys):
    folder, model = ckpt
    want, ref = _reference(model, PROMPT_IDS)
    rc, out, err = cli(capsys, "generate", folder, "--tokenizer", folder, "--prompt", PROMPT, "--format", "jsonl",
                       "--logprobs", TOP, "--max-new-tokens", NEW, "--ignore-eos", "-q")
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    tokens, stats = lines[:-1], lines[-1]
    assert len(tokens) == NEW and all(t["prompt"] == 0 for t in tokens)
    _check_entries(tokens, want, ref)
    assert "".join(t["text"] for t in tokens) == " ".join(f"w{t}" for t in want)
    assert stats["stats"]["new_tokens"] == NEW


def test_generate_jsonl_without_logprobs_gives_the_tokens(ckpt, capsys):
    folder, model = ckpt
    want, _ = _reference(model, PROMPT_IDS, 5)
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([PROMPT_IDS])}", "--format",
                       "jsonl", "--max-new-tokens", 5, "--ignore-eos", "-q")
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [t["token"] for t in lines[:-1]] == want and "logprob" not in lines[0]
    assert "text" not in lines[0]  # token ids in, no tokenizer: ids out


# ------------------------------------------------------------------ the server, with the openai client
@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from test_serve_http import ServerProcess

    s = ServerProcess([ckpt[0], "--max-batch", 2], tmp_path_factory.mktemp("log") / "server.log")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert s.stop() == 0, s.output()


def test_streamed_completion_chunks_carry_openai_logprobs(ckpt, served):
    _, model = ckpt
    want, ref = _reference(model, PROMPT_IDS, 5)
    chunks = list(served.completions.create(model=ckpt[0].name, prompt=PROMPT, max_tokens=5, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    tokens, lps, tops, offsets = [], [], [], []
    for ch in choices:
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            lps += ch.logprobs.token_logprobs
            tops += ch.logprobs.top_logprobs
            offsets += ch.logprobs.text_offset
    assert tokens == [f"w{t}" for t in want]
    np.testing.assert_allclose(lps, [r[t].item() for r, t in zip(ref, want)], atol=1e-4)
    assert [list(d) for d in tops] == [[f"w{t}" for t in torch.topk(r, 2).indices.tolist()] for r in ref]
    np.testing.assert_allclose([list(d.values()) for d in tops], [torch.topk(r, 2).values.tolist() for r in ref],
                               atol=1e-4)
    assert offsets == [sum(len(f"w{t}") for t in want[:i]) for i in range(5)]
    # each text chunk carries the tokens it shows (one word per token here), and the text is generate's
    texts = [ch for ch in choices if ch.text]
    assert all(ch.logprobs is not None and len(ch.logprobs.tokens) >= 1 for ch in texts)
    assert "".join(ch.text for ch in choices) == " ".join(f"w{t}" for t in want)
    # the same values as without streaming
    whole = served.completions.create(model=ckpt[0].name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert whole.tokens == tokens and whole.text_offset == offsets
    np.testing.assert_allclose(whole.token_logprobs, lps, atol=1e-6)


def test_streamed_chat_chunks_carry_openai_logprobs(ckpt, served):
    _, model = ckpt
    ids = [0, 2, 5, 6, 7, 1, 3]  # <s> <|user|> w5 w6 w7 </s> <|assistant|>: TEMPLATE's rendering, by hand
    want, ref = _reference(model, ids, 4)
    chunks = list(served.chat.completions.create(
        model=ckpt[0].name, messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.prompt_tokens == len(ids)
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs is not None
               for c in ch.choices[0].logprobs.content]
    assert [c.token for c in content] == [f"w{t}" for t in want]
    assert [c.bytes for c in content] == [list(f"w{t}".encode()) for t in want]
    np.testing.assert_allclose([c.logprob for c in content], [r[t].item() for r, t in zip(ref, want)], atol=1e-4)
    assert [[a.token for a in c.top_logprobs] for c in content] == \
        [[f"w{t}" for t in torch.topk(r, 2).indices.tolist()] for r in ref]
    np.testing.assert_allclose([[a.logprob for a in c.top_logprobs] for c in content],
                               [torch.topk(r, 2).values.tolist() for r in ref], atol=1e-4)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None


def test_a_stream_without_logprobs_has_none(ckpt, served):
    chunks = list(served.completions.create(model=ckpt[0].name, prompt=PROMPT, max_tokens=3, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
