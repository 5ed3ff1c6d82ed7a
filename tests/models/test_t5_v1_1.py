"""T5 v1.1 / Flan-T5 (models/t5.tsr with ff="gated-gelu", tied=false), loaded from a checkpoint folder's
config.json alone (issue 39): a seeded, perturbed transformers T5ForConditionalGeneration with
feed_forward_proj "gated-gelu" and its own lm_head (DenseReluDense.wi_0 / wi_1, gelu_new, the head's input
not scaled). Against transformers with the same weights: the parameter count (sum(p.numel())), the logits
(numpy interpreter and onnxruntime, 1e-4) for two sources of uneven length, and `tessera generate`'s and the
API's greedy tokens against transformers' generate; both config layouts (transformers 5's
scale_decoder_outputs, and the published checkpoints' tie_word_embeddings false alone) give the untied
head. The variants' counts equal transformers' model built on the meta device from the published
config.json values. Note: transformers 5 ties lm_head to shared when it builds any T5 (it unties them
when a checkpoint holds both with different values, as the published v1.1 ones do): the reference models
here are given their own lm_head, as loading such a checkpoint does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import MODELS, build, cli, cli_error, ort_run, perturbed
from tessera.compiler.ops import interpret
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "t5.tsr"
VOCAB, NEW, START, EOS = 64, 16, 0, 1
SRC = [[5, 17, 42, 9, 3, 30, 2, 8, 11], [7, 11, 21, 2, 0, 0, 0, 0, 0]]  # the second right-padded
SRC_MASK = [[1] * 9, [1, 1, 1, 1, 0, 0, 0, 0, 0]]


def _untie(model):
    """Give the model its own lm_head (a v1.1 checkpoint's), of the shared table's shape and device."""
    assert model.lm_head.weight is model.shared.weight  # transformers 5 ties every T5 it builds
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    return model


@pytest.fixture(scope="module")
def v11(tmp_path_factory):
    """A 2-layer T5 v1.1: gated GELU, an untied head; 8 buckets of max_distance 6 (the decoder's saturate
    within the steps), the decoder's relative table moved most so that each row's tokens differ."""
    torch.manual_seed(2)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                decoder_start_token_id=START, pad_token_id=0, eos_token_id=EOS)
    model = _untie(transformers.T5ForConditionalGeneration(cfg))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)
    model = perturbed(model, 0.25, seed=2)
    with torch.no_grad():
        model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 2.0)
    assert model.lm_head.weight is not model.shared.weight
    assert model.config.dense_act_fn == "gelu_new" and not model.config.scale_decoder_outputs
    folder = tmp_path_factory.mktemp("t5v11")
    model.save_pretrained(folder, safe_serialization=True)
    # the folder is that model to transformers too: its own head survives the save and the load
    again = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    assert again.lm_head.weight is not again.shared.weight
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    return model, folder


def _feeds(tgt):
    return {"src": np.array(SRC, np.int64), "src_mask": np.array(SRC_MASK, np.int64), "tgt": np.array(tgt, np.int64)}


def _reference(model, feeds) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(feeds["src"]), attention_mask=torch.from_numpy(feeds["src_mask"]),
                     decoder_input_ids=torch.from_numpy(feeds["tgt"])).logits.numpy()


def _check_logits(model, folder):
    built = pipeline.build(SPEC, weights=str(folder))
    assert built.info.hyperparams["ff"] == "gated-gelu" and built.info.hyperparams["tied"] is False
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    weights = pipeline.weights_for(built, str(folder), 0)
    feeds = _feeds(np.random.default_rng(0).integers(2, VOCAB, (2, 12)))
    ref = _reference(model, feeds)
    for got in (interpret.run(built.graph, weights, feeds)["logits"], ort_run(built.graph, weights, feeds)["logits"]):
        assert np.abs(got - ref).max() <= TOL


def test_logits_and_count_equal_transformers(v11):
    _check_logits(*v11)


def test_the_published_config_layout_gives_the_untied_head(v11, tmp_path):
    """google/t5-v1_1-* and google/flan-t5-* config.json say tie_word_embeddings false and nothing of
    scale_decoder_outputs (written by transformers 4): the same model."""
    model, folder = v11
    copy = tmp_path / "published"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg.pop("scale_decoder_outputs") is False
    cfg["tie_word_embeddings"] = False
    (copy / "config.json").write_text(json.dumps(cfg))
    _check_logits(model, copy)


def test_transformers_logits_move_with_each_v1_1_choice(v11):
    """The gate's activation (gelu_new: not ReLU, not erf GELU) and the unscaled head each move transformers'
    logits here, so the comparison above tells them apart."""
    import copy

    model, _ = v11
    feeds = {k: v[:1] for k, v in _feeds([[START, 12, 40, 3]]).items()}
    ref = _reference(model, feeds)
    for act, moved in ((torch.nn.ReLU(), 1e-2), (torch.nn.GELU(), 1e-3)):
        other = copy.deepcopy(model)
        for block in (*other.encoder.block, *other.decoder.block):
            block.layer[-1].DenseReluDense.act = act
        assert np.abs(_reference(other, feeds) - ref).max() > moved, act
    scaled = copy.deepcopy(model)
    scaled.config.scale_decoder_outputs = True
    assert np.abs(_reference(scaled, feeds) - ref).max() > 1e-2


def _greedy(model) -> list[list[int]]:
    """transformers' greedy generate, each row's new tokens up to and with its first end-of-sequence token."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(SRC), attention_mask=torch.tensor(SRC_MASK), max_new_tokens=NEW,
                             do_sample=False, num_beams=1)
    return [row[:row.index(EOS) + 1] if EOS in row else row for row in out[:, 1:].tolist()]


def test_generate_equals_transformers_greedy_for_two_uneven_sources(v11, capsys):
    model, folder = v11
    want = _greedy(model)
    assert want[0] != want[1] and all(len(set(row)) > 2 for row in want)  # rows and steps told apart
    rc, printed, err = cli(capsys, "generate", folder, "--input", f"src={SRC}", "--input", f"src_mask={SRC_MASK}",
                           "--max-new-tokens", NEW, "--format", "json", "-q")
    assert rc == 0, err
    assert [o["tokens"] for o in json.loads(printed)["outputs"]] == want
    import tessera

    assert tessera.load(folder).generate(inputs={"src": SRC, "src_mask": SRC_MASK}, max_new_tokens=NEW) == want


def test_another_feed_forward_is_refused_with_the_reason(v11, tmp_path, capsys):
    _, folder = v11
    copy = tmp_path / "silu"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["feed_forward_proj"] = "gated-silu"
    (copy / "config.json").write_text(json.dumps(cfg))
    err = cli_error(capsys, "report", copy)
    assert "feed_forward_proj gated-silu is not implemented for T5" in err


# config.json of google/t5-v1_1-{small,base,large,xl,xxl} (the same shapes as google/flan-t5-*): d_kv 64,
# vocab_size 32128, 32 buckets, feed_forward_proj "gated-gelu", tie_word_embeddings false
VARIANTS = {"v1_1_small": dict(d_model=512, d_ff=1024, num_heads=6, num_layers=8),
            "v1_1_base": dict(d_model=768, d_ff=2048, num_heads=12, num_layers=12),
            "v1_1_large": dict(d_model=1024, d_ff=2816, num_heads=16, num_layers=24),
            "v1_1_xl": dict(d_model=2048, d_ff=5120, num_heads=32, num_layers=24),
            "v1_1_xxl": dict(d_model=4096, d_ff=10240, num_heads=64, num_layers=24)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    cfg = transformers.T5Config(vocab_size=32128, d_kv=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                **VARIANTS[variant])
    with torch.device("meta"):
        model = _untie(transformers.T5ForConditionalGeneration(cfg))
    want = sum(p.numel() for p in model.parameters())
    assert build("t5", variant).param_count() == want
    if variant == "v1_1_base":  # google/t5-v1_1-base: 247,577,856 (248M on its model page)
        assert want == 247_577_856
    if variant == "v1_1_xxl":  # "About 11B params" (t5.1.1.xxl.gin, google-research/text-to-text-transfer-transformer)
        assert round(want / 1e9) == 11


def test_report_counts_the_base_variant(capsys):
    rc, out, err = cli(capsys, "report", "t5", "--variant", "v1_1_base", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["params"]["total"] == 247_577_856
