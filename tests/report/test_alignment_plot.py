"""``tessera run --plot-attention``: the matrix drawn is the attention computed independently in numpy.

The matrix is captured where the command hands it to the drawing (alignment_plot.draw), so these
tests check exactly what is plotted. References are written here from the weights alone: a tiny
GPT-2 in numpy (layer norm, projections, causal softmax(QKᵀ/√d), MLP) for transformer attention,
and softmax(E_tgt Eₛᵣ꜀ᵀ) for tests/specs/alignment.tsr's [B, T, S] alignment output.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import MODELS, ROOT, cli, cli_error

pytest.importorskip("matplotlib")

from tessera.runtime.report import alignment
from tessera.runtime.report import alignment_plot
from tessera.runtime import pipeline  # noqa: E402
from tessera.runtime.io.weights import SeededWeights  # noqa: E402

SETS = ["--set", "layers=2", "--set", "d=32", "--set", "heads=4", "--set", "vocab=64", "--set", "ctx=16"]
GPT2 = [MODELS / "gpt2.tsr", *SETS]
HEADS, D = 4, 32
TOKENS = [[3, 1, 4, 1, 5, 9, 2], [2, 6, 5, 3, 5, 8, 9]]
ALIGN = ROOT / "tests" / "specs" / "alignment.tsr"
PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- numpy references
def _weights(seed: int = 0, sharpen: float = 1.0) -> dict[str, np.ndarray]:
    """The tiny GPT-2's seeded weights (as `tessera run --seed` draws them); ``sharpen`` scales the
    query and key projections so the attention is far from uniform."""
    built = pipeline.build(MODELS / "gpt2.tsr", None, [s for s in SETS if s != "--set"])
    w = {k: np.asarray(v, np.float64) for k, v in SeededWeights(built.graph, seed).items()}
    for k in w:
        if k.endswith(("attn.q.weight", "attn.k.weight")):
            w[k] = w[k] * sharpen
    return w


def _ln(x, w, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def _lin(w, x, p):
    return x @ w[p + ".weight"].T + w[p + ".bias"]


def _split(x):
    b, t, d = x.shape
    return x.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3)


def _gpt2_probs(w, tokens) -> list[np.ndarray]:
    """Every layer's attention probabilities [B, H, T, T] of GPT-2, computed in float64."""
    tokens = np.asarray(tokens)
    t = tokens.shape[1]
    h = w["wte.weight"][tokens] + w["wpe.weight"][np.arange(t)]
    out = []
    for i in range(2):
        p = f"layers.{i}."
        x = _ln(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        q, k, v = (_split(_lin(w, x, p + f"attn.{n}")) for n in "qkv")
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // HEADS)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
        out.append(probs)
        o = (probs @ v).transpose(0, 2, 1, 3).reshape(h.shape)
        h = h + _lin(w, o, p + "attn.o")
        x = _ln(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        f = _lin(w, x, p + "mlp.fc")
        f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f ** 3)))
        h = h + _lin(w, f, p + "mlp.proj")
    return out


def _checkpoint(tmp_path: Path, w: dict[str, np.ndarray], name: str = "sharp") -> Path:
    from safetensors.numpy import save_file

    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.astype(np.float32) for k, v in w.items()}, str(path))
    return path


# ---------------------------------------------------------------- capturing what is drawn
@pytest.fixture
def drawn(monkeypatch):
    """The Alignments the command hands to the drawing, in order (the PNG is still written)."""
    seen = []
    real = alignment_plot.draw

    def capture(al, path, *a, **k):
        seen.append(al)
        return real(al, path, *a, **k)

    monkeypatch.setattr(alignment_plot, "draw", capture)
    return seen


def _tokens_arg(tokens) -> str:
    return "tokens=" + json.dumps(tokens)


@pytest.mark.parametrize("layer, head, row", [(0, "0", 0), (1, "3", 1), (1, "mean", 0), (0, None, 1)])
def test_gpt2_matrix_is_numpy_softmax_qk(capsys, tmp_path, drawn, layer, head, row):
    w = _weights(sharpen=25.0)
    ckpt = _checkpoint(tmp_path, w)
    png = tmp_path / "a.png"
    args = ["run", *GPT2, "--weights", ckpt, "-i", _tokens_arg(TOKENS), "--plot-attention", png,
            "--layer", layer, "--batch-index", row] + (["--head", head] if head else [])
    rc, _, err = cli(capsys, *args)
    assert rc == 0, err
    (al,) = drawn
    probs = _gpt2_probs(w, TOKENS)[layer][row]
    want = probs.mean(0) if head in (None, "mean") else probs[int(head)]
    np.testing.assert_allclose(al.matrix, want, atol=1e-5)
    np.testing.assert_allclose(al.matrix.sum(-1), 1.0, atol=1e-5)   # every query's weights sum to 1
    assert al.matrix.max() > 0.5 and (probs.max(-1) > 0.9).any()  # sharp enough that a wrong site shows
    assert al.rows == al.cols == [str(t) for t in TOKENS[row]]     # token ids on both axes
    assert png.read_bytes().startswith(PNG)
    assert f"alignment of attention_probs.{layer}" in err


def test_gpt2_seeded_weights_layer0(capsys, tmp_path, drawn):
    """Without --weights: the seeded initialiser's weights, as other tests draw them."""
    rc, _, err = cli(capsys, "run", *GPT2, "--seed", 3, "-i", _tokens_arg(TOKENS[:1]), "--plot-attention",
                     tmp_path / "a.png", "--layer", 0, "--head", 2)
    assert rc == 0, err
    np.testing.assert_allclose(drawn[0].matrix, _gpt2_probs(_weights(seed=3), TOKENS[:1])[0][0, 2], atol=1e-6)


def test_python_api_gives_the_same_matrix(tmp_path):
    import tessera

    m = tessera.load(MODELS / "gpt2.tsr", weights=_checkpoint(tmp_path, _weights(sharpen=25.0)), layers=2, d=32,
                     heads=4, vocab=64, ctx=16)
    al = m.alignment(layer=1, head=0, batch_index=1, plot=tmp_path / "api.png", tokens=TOKENS)
    np.testing.assert_allclose(al.matrix, _gpt2_probs(_weights(sharpen=25.0), TOKENS)[1][1, 0], atol=1e-5)
    assert al.rows == [str(t) for t in TOKENS[1]]
    assert (tmp_path / "api.png").read_bytes().startswith(PNG)


def test_the_pass_exposes_the_softmax_in_the_numpy_interpreter():
    """The compiler side alone: the pass's extra output, run by the numpy reference interpreter."""
    from tessera.compiler.passes.pipeline import build_pipeline, attention_sites
    from tessera.compiler.ops import interpret

    built = pipeline.build(MODELS / "gpt2.tsr", None, [s for s in SETS if s != "--set"])
    w = SeededWeights(built.graph, 0)
    result = build_pipeline(attention_probs=[0])(built.graph)
    assert built.graph.outputs == ["logits", "attention_probs.0"]
    assert [s.fused for s in attention_sites(result)] == [False, True]
    out = interpret.run(built.graph, w, {"tokens": np.array(TOKENS)})
    np.testing.assert_allclose(out["attention_probs.0"], _gpt2_probs(_weights(), TOKENS)[0], atol=1e-6)


def test_exposing_the_probabilities_leaves_the_outputs_and_other_sites_fused(capsys, tmp_path):
    tokens = ["-i", _tokens_arg(TOKENS)]
    rc, plain, err = cli(capsys, "run", *GPT2, *tokens, "--format", "json", "--explain")
    assert rc == 0, err
    assert "attention sites: 2 (2 fused, 0 not fused)" in err
    rc, exposed, err = cli(capsys, "run", *GPT2, *tokens, "--format", "json", "--explain",
                           "--plot-attention", tmp_path / "a.png", "--layer", 1)
    assert rc == 0, err
    assert "attention sites: 2 (1 fused, 1 not fused)" in err
    assert "layers.0.attn.sdpa (" in err and "gpt2.tsr:12:10): fused -> portable" in err
    assert "gpt2.tsr:12:10): not fused: the attention weights: also a model output " \
           "(attention_probs.1)" in err
    a, b = json.loads(plain)["outputs"], json.loads(exposed)["outputs"]
    assert list(a) == list(b) == ["logits"]  # the exposed probabilities are drawn, not printed
    np.testing.assert_allclose(np.array(b["logits"]["values"]), np.array(a["logits"]["values"]), atol=1e-5)


def test_compiled_onnx_with_and_without_the_probabilities(capsys, tmp_path, drawn):
    import onnx

    w = _weights(sharpen=25.0)
    ckpt = _checkpoint(tmp_path, w)
    plain, with_probs = tmp_path / "plain.onnx", tmp_path / "probs.onnx"
    assert cli(capsys, "compile", *GPT2, "--weights", ckpt, "-o", plain)[0] == 0
    rc, _, err = cli(capsys, "compile", *GPT2, "--weights", ckpt, "--attention-probs", 1, "-o", with_probs)
    assert rc == 0, err
    assert [o.name for o in onnx.load(str(with_probs)).graph.output] == ["logits", "attention_probs.1"]
    rc, _, err = cli(capsys, "run", with_probs, "-i", _tokens_arg(TOKENS), "--plot-attention", tmp_path / "a.png",
                     "--layer", 1, "--head", 1)
    assert rc == 0, err
    np.testing.assert_allclose(drawn[0].matrix, _gpt2_probs(w, TOKENS)[1][0, 1], atol=1e-5)
    assert drawn[0].rows == drawn[0].cols == [str(t) for t in TOKENS[0]]  # dims read from the ONNX file
    # the only attention output is the default
    assert cli(capsys, "run", with_probs, "-i", _tokens_arg(TOKENS), "--plot-attention", tmp_path / "b.png")[0] == 0
    assert drawn[1].output == "attention_probs.1" and "mean over 4 heads" in drawn[1].what
    err = cli_error(capsys, "run", plain, "-i", _tokens_arg(TOKENS), "--plot-attention", tmp_path / "c.png",
                    "--layer", 1)
    assert "has no output attention_probs.1" in err and "--attention-probs 1" in err and "Run from the spec" in err
    err = cli_error(capsys, "run", with_probs, "-i", _tokens_arg(TOKENS), "--plot-attention", tmp_path / "c.png",
                    "--layer", 0)
    assert "it exposes attention_probs.1" in err


def test_compile_all_probs(capsys, tmp_path):
    import onnx

    out = tmp_path / "all.onnx"
    rc, _, err = cli(capsys, "compile", *GPT2, "--attention-probs", "all", "--explain", "-o", out)
    assert rc == 0, err
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["logits", "attention_probs.0", "attention_probs.1"]
    assert "0 fused, 2 not fused" in err


def test_cross_attention_has_the_source_on_x_and_the_target_on_y(capsys, tmp_path, drawn):
    sets = ["--set", "layers=1", "--set", "d=32", "--set", "heads=4", "--set", "vocab=50", "--set", "d_ff=64"]
    rc, _, err = cli(capsys, "run", MODELS / "transformer.tsr", *sets, "-i", "src=[[5, 6, 7, 8]]",
                     "-i", "src_mask=[[1, 1, 1, 0]]", "-i", "tgt=[[1, 2]]", "--plot-attention", tmp_path / "x.png",
                     "--layer", 2, "--head", 3)  # sites: encoder self, decoder self, decoder cross
    assert rc == 0, err
    (al,) = drawn
    assert al.cols == ["5", "6", "7"] and al.rows == ["1", "2"]  # the padded source position is left out
    assert al.matrix.shape == (2, 3) and "padding left out" in al.what
    np.testing.assert_allclose(al.matrix.sum(-1), 1.0, atol=1e-6)  # the masked key had weight 0


# ---------------------------------------------------------------- a model output of alignment weights
def test_alignment_output_is_numpy_softmax(capsys, tmp_path, drawn):
    rng = np.random.default_rng(1)  # embeddings of std 1: peaked weights, unlike the seeded std 0.02
    w = {"src_emb.weight": rng.normal(size=(20, 8)), "tgt_emb.weight": rng.normal(size=(20, 8))}
    src, tgt = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[11, 12, 13], [14, 15, 16]]
    png = tmp_path / "align.png"
    rc, out, err = cli(capsys, "run", ALIGN, "--weights", _checkpoint(tmp_path, w), "-i", "src=" + json.dumps(src),
                       "-i", "tgt=" + json.dumps(tgt), "--plot-attention", png, "--batch-index", 1)
    assert rc == 0, err
    w = {k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}
    s = w["tgt_emb.weight"][tgt[1]] @ w["src_emb.weight"][src[1]].T
    want = np.exp(s - s.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    (al,) = drawn
    assert al.output == "align" and al.matrix.shape == (3, 5)  # target x source
    np.testing.assert_allclose(al.matrix, want, atol=1e-6)
    np.testing.assert_allclose(al.matrix.sum(-1), 1.0, atol=1e-6)
    assert al.matrix.max() > 0.5
    assert al.cols == [str(i) for i in src[1]] and al.rows == [str(i) for i in tgt[1]]  # source on x
    assert png.read_bytes().startswith(PNG)
    assert "align" in out and "context" in out  # the model's outputs are printed as usual


def test_an_output_that_is_not_weights_gets_a_note(capsys, tmp_path, drawn):
    rc, _, err = cli(capsys, "run", ALIGN, "-i", "src=[[1, 2]]", "-i", "tgt=[[3]]", "--plot-attention",
                     tmp_path / "c.png", "--attention-output", "context")
    assert rc == 0, err
    assert "note: context holds values from" in err and "not attention weights in [0, 1]" in err
    assert drawn[0].matrix.shape == (1, 8)  # drawn all the same: [B, T, d] read as [B, Tq, Tk]


def test_tokenizer_labels_the_axes(capsys, tmp_path, drawn):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>"] + [f"w{i}" for i in range(2, 20)]
    tok = Tokenizer(models.WordLevel({x: i for i, x in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rc, _, err = cli(capsys, "run", ALIGN, "-i", "src=[[2, 3, 4]]", "-i", "tgt=[[5, 6]]", "--tokenizer",
                     tmp_path / "tokenizer.json", "--plot-attention", tmp_path / "a.png")
    assert rc == 0, err
    assert drawn[0].cols == ["w2", "w3", "w4"] and drawn[0].rows == ["w5", "w6"]


def test_text_batch_row_is_labelled_with_its_pieces_and_its_padding_left_out(capsys, tmp_path, drawn):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "man", "is", "eating", "food", "the", "cat", "sleeps"]
    tok = Tokenizer(models.WordLevel({x: i for i, x in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    bert = ["--set", "layers=2", "--set", "d=32", "--set", "heads=4", "--set", "d_ff=64", "--set", "vocab=50",
            "--set", "ctx=64"]
    rc, _, err = cli(capsys, "run", MODELS / "bert.tsr", *bert, "--tokenizer", tmp_path / "tokenizer.json",
                     "--text", "a man is eating food", "--text", "the cat sleeps", "--plot-attention",
                     tmp_path / "b.png", "--layer", 1, "--batch-index", 1)
    assert rc == 0, err
    (al,) = drawn
    assert al.rows == al.cols == ["[CLS]", "the", "cat", "sleeps", "[SEP]"]
    np.testing.assert_allclose(al.matrix.sum(-1), 1.0, atol=1e-6)  # the padded keys had weight 0


def test_select_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 4, 5))
    assert np.array_equal(alignment.select(x, 1, 2)[0], x[1, 2])
    np.testing.assert_allclose(alignment.select(x, 0, "mean")[0], x[0].mean(0))
    np.testing.assert_allclose(alignment.select(x, 0)[0], x[0].mean(0))
    assert np.array_equal(alignment.select(x[:, 0], 1)[0], x[1, 0])
    assert np.array_equal(alignment.select(x[0, 0])[0], x[0, 0])


# ---------------------------------------------------------------- the PNG file
def test_a_failed_write_leaves_the_previous_file(capsys, tmp_path, monkeypatch):
    import matplotlib.figure

    png = tmp_path / "a.png"
    png.write_bytes(b"previous plot, must survive")

    def full(self, fname, *a, **k):
        Path(fname).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    err = cli_error(capsys, "run", ALIGN, "-i", "src=[[1, 2]]", "-i", "tgt=[[3]]", "--plot-attention", png)
    assert "No space left on device" in err
    assert png.read_bytes() == b"previous plot, must survive"
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


@pytest.mark.parametrize("make, expected", [
    (lambda d: d, "is a folder"),
    (lambda d: d / "plot", "--plot-attention"),
    (lambda d: d / "plot.xyz", "'.xyz' names no image format"),
], ids=["folder", "no-suffix", "unknown-suffix"])
def test_bad_paths_are_refused_before_the_run(capsys, tmp_path, monkeypatch, make, expected):
    from tessera.runtime import session

    def never(*a, **k):
        raise AssertionError("the model ran before the plot path was checked")

    monkeypatch.setattr(session, "open_session", never)
    assert expected in cli_error(capsys, "run", ALIGN, "-i", "src=[[1]]", "-i", "tgt=[[1]]",
                                 "--plot-attention", make(tmp_path))


def test_missing_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    err = cli_error(capsys, "run", ALIGN, "-i", "src=[[1]]", "-i", "tgt=[[1]]", "--plot-attention",
                    tmp_path / "a.png")
    assert "--plot-attention needs matplotlib: pip install 'tessera[plot]'" in err


# ---------------------------------------------------------------- bad choices are clear errors
RUN_GPT2 = ["run", *GPT2, "-i", "tokens=[[1, 2, 3]]"]
RUN_ALIGN = ["run", ALIGN, "-i", "src=[[1, 2]]", "-i", "tgt=[[3, 4, 5]]"]


@pytest.mark.parametrize("args, expected", [
    (RUN_GPT2 + ["--layer", "2"], "no attention site 2: its attention sites are 0: layers.0.attn.sdpa ("),
    (RUN_GPT2 + ["--layer", "0", "--head", "4"], "--head 4 is out of range: the attention has 4 heads (0 to 3, or mean)"),
    (RUN_GPT2 + ["--layer", "0", "--batch-index", "1"], "--batch-index 1 is out of range: the batch has 1 row (0 to 0)"),
    (RUN_GPT2, "has no output of attention weights"),
    (RUN_GPT2 + ["--attention-output", "logitz"], "--attention-output logitz: "),
    (RUN_ALIGN + ["--head", "0"], "--head applies to attention over heads [B, H, Tq, Tk]; this output is [1, 3, 2]"),
    (RUN_ALIGN + ["--layer", "0"], "no attention site 0: the model has no attention over heads"),
    (RUN_ALIGN + ["--layer", "0", "--attention-output", "align"], "--layer and --attention-output both choose"),
    (["run", MODELS / "worked_example.tsr", "-i", "x=[[1, 0], [0, 1]]", "--batch-index", "1"],
     "--batch-index 1: this output [Tq, Tk] has no batch axis"),
], ids=["layer", "head", "batch-index", "no-output", "unknown-output", "head-on-rank-3", "no-heads", "both",
        "no-batch-axis"])
def test_bad_choices_are_clear_errors(capsys, tmp_path, args, expected):
    err = cli_error(capsys, *args, "--plot-attention", tmp_path / "a.png")
    assert expected in err
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("flag, value", [("--layer", "0"), ("--head", "mean"), ("--batch-index", "0"),
                                         ("--attention-output", "align")])
def test_plot_options_need_plot_attention(capsys, flag, value):
    assert f"{flag} applies with --plot-attention FILE.png" in cli_error(capsys, *RUN_ALIGN, flag, value)


@pytest.mark.parametrize("args", [["--head", "first"], ["--layer", "-1"], ["--batch-index", "x"],
                                  ["--plot-atention", "a.png"]])
def test_unknown_or_malformed_arguments_are_usage_errors(capsys, args):
    from tessera.runtime.cli import main

    with pytest.raises(SystemExit) as info:
        main([str(a) for a in RUN_ALIGN] + ["--plot-attention", "a.png"] + args)
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_choose_output_names_the_candidates():
    shapes = {"logits": ["B", "T", 64], "cross_attn": ["B", "T", "S"], "self_attn": ["B", "T", "T"]}
    with pytest.raises(pipeline.UsageError, match="2 outputs of attention weights .cross_attn, self_attn."):
        alignment.choose_output(shapes)
    assert alignment.choose_output({"logits": ["B", "T", 64], "align": ["B", "T", "S"]}) == "align"
