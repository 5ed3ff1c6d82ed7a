"""``tessera perplexity`` and ``Model.perplexity`` (runtime/driver.perplexity).

The figure is checked against one computed here from transformers on the same small weights, in
both conventions: llama.cpp's llama-perplexity (non-overlapping windows of N tokens, the BOS the
vocabulary adds put first in each, the last N - N/2 - 1 tokens of each scored) and transformers'
sliding window (--stride; the tokens no earlier window scored).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import cli, cli_error  # noqa: E402

from tessera.runtime.driver import perplexity_windows  # noqa: E402

VOCAB = 96


def _folder(tmp_path, bos: bool):
    """A tiny Llama (tied head) saved by transformers, with a word tokenizer ('wI' is id I; id 0 is <s>,
    put before every text when ``bos``), and a text of 300 words drawn from a skewed distribution."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(tmp_path, safe_serialization=True)
    vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    words = (rng.zipf(1.5, 300) % (VOCAB - 2)) + 2
    (tmp_path / "text.txt").write_text(" ".join(f"w{w}" for w in words))
    return model, [int(w) for w in words]


def _nll(model, window: list[int]) -> np.ndarray:
    """-log p(token t | tokens before it) for t = 1 .. len - 1, from transformers in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([window])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1)
    return -logp[torch.arange(len(window) - 1), torch.tensor(window[1:])].numpy()


def _llama_cpp(model, ids: list[int], n: int, bos: int | None) -> float:
    """llama-perplexity: tokens = [BOS] + text; chunks of n; each chunk's first token set to BOS; the
    logits at first = n/2 ... n - 2 score the tokens after them."""
    tokens = ([bos] if bos is not None else []) + ids
    nll = []
    for k in range(len(tokens) // n):
        chunk = tokens[k * n:(k + 1) * n]
        if bos is not None:
            chunk[0] = bos
        nll.extend(_nll(model, chunk)[n // 2:])
    return float(np.exp(np.mean(nll)))


def _sliding(model, ids: list[int], n: int, stride: int) -> float:
    """transformers' docs ("Perplexity of fixed-length models"): labels -100 but for the last trg_len."""
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + n, len(ids))
        trg_len = end - prev_end
        inp = torch.tensor([ids[begin:end]])
        labels = inp.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(input_ids=inp).logits.double()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, VOCAB), shift_labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        valid = int((shift_labels != -100).sum())
        nll_sum += float(loss)
        count += valid
        prev_end = end
        if end == len(ids):
            break
    return float(np.exp(nll_sum / count))


@pytest.mark.parametrize("bos", [False, True])
def test_llama_cpp_convention_equals_transformers(bos, tmp_path, capsys):
    model, words = _folder(tmp_path, bos)
    want = _llama_cpp(model, words, 64, 0 if bos else None)
    rc, out, err = cli(capsys, "perplexity", tmp_path, "--text", tmp_path / "text.txt", "--context", 64,
                       "--format", "json", "-q")
    assert rc == 0, err
    got = json.loads(out)
    assert got["perplexity"] == pytest.approx(want, rel=1e-4)
    tokens = len(words) + bos
    assert got["windows"] == tokens // 64 and got["scored"] == (tokens // 64) * (64 - 32 - 1)
    assert got["convention"] == "llama.cpp" and got["text_tokens"] == tokens


def test_sliding_window_equals_transformers_and_the_api(tmp_path, capsys):
    import tessera

    model, words = _folder(tmp_path, True)
    want = _sliding(model, [0] + words, 64, 24)
    rc, out, err = cli(capsys, "perplexity", tmp_path, "--text", tmp_path / "text.txt", "--context", 64,
                       "--stride", 24, "-q")
    assert rc == 0, err
    assert out.startswith("perplexity ") and "sliding window" in out
    assert float(out.split()[1]) == pytest.approx(want, rel=1e-4)
    got = tessera.load(tmp_path).perplexity(tmp_path / "text.txt", context=64, stride=24)
    assert got["perplexity"] == pytest.approx(want, rel=1e-4) and got["scored"] == len(words)


def test_the_windows_of_each_convention():
    assert perplexity_windows(10, 4, None) == [(0, 4, 3), (4, 8, 7)]  # scores 4 - 2 - 1 = 1 token a window
    assert perplexity_windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    scored = [t for s, e, f in perplexity_windows(1000, 64, 24) for t in range(f, e)]
    assert scored == list(range(1, 1000))  # every token but the first, once


def test_perplexity_errors(tmp_path, capsys):
    _folder(tmp_path, False)
    capsys.readouterr()  # transformers' progress bar
    text = tmp_path / "text.txt"
    err = cli_error(capsys, "perplexity", tmp_path, "--text", text, "--context", 64, "--stride", 65)
    assert "--stride 65 is longer than --context 64" in err
    err = cli_error(capsys, "perplexity", tmp_path, "--text", text, "--context", 512)
    assert "300 tokens" in err and "--context 512" in err
    err = cli_error(capsys, "perplexity", tmp_path, "--text", tmp_path / "missing.txt")
    assert "missing.txt" in err
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe w3")
    err = cli_error(capsys, "perplexity", tmp_path, "--text", tmp_path / "bad.txt")
    assert "not UTF-8" in err
    err = cli_error(capsys, "perplexity", "gpt2", "--set", "layers=1", "--text", text)
    assert "needs a tokenizer" in err
    err = cli_error(capsys, "perplexity", "bert", "--set", "layers=1", "--set", "d=32", "--set", "heads=2",
                    "--text", text, "--tokenizer", tmp_path / "tokenizer.json", "--context", 8)
    assert "one token input" in err
