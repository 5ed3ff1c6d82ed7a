"""Jamba (models/jamba.tsr): attention and Mamba layers in one decoder, against transformers'
JambaForCausalLM with the same weights; and prompts of different lengths batched left-padded, the
padding kept out of the recurrent state (compiler/passes/state_padding.py). A second tiny model has
the released models' mixture of experts in every other layer (JambaSparseMoeBlock: softmax over all
experts, the top k kept without renormalising), dense SwiGLUs in the others.

The references are transformers' own model (its PyTorch path on CPU; use_mamba_kernels=False) with a
checkpoint folder written by save_pretrained: logits, parameter count, greedy generate of each prompt
alone (no padding anywhere) and of transformers' own left-padded batch (its Mamba layers zero the
padded positions' inputs). The folder is the model (runtime/io/checkpoint.py's model_type table).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import build, cli, cli_error, hf_greedy, perturbed

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW = 10
PROMPTS = [[5, 17, 42, 99, 3, 7, 8], [9, 8], [61, 2, 33, 4]]  # three lengths in one batch


@pytest.fixture(scope="module")
def hf():
    """A tiny Jamba: layers mamba, attention, mamba, attention (attn period 2, offset 1), dense SwiGLU."""
    torch.manual_seed(0)
    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                   attn_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_d_conv=4,
                                   mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, bos_token_id=1,
                                   eos_token_id=None, pad_token_id=0)  # no stop: every row makes NEW tokens
    return perturbed(transformers.JambaForCausalLM(cfg), 0.3)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("jamba") / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _alone(hf, prompt: list[int], new: int = NEW, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_logits_and_parameter_count_equal_transformers(hf, folder):
    import tessera

    m = tessera.load(str(folder))
    ids = [[5, 17, 42, 99, 3, 7, 8], [1, 2, 3, 4, 5, 6, 7]]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(m.run(tokens=ids)["logits"], want, atol=1e-4, rtol=0)
    assert sum(int(np.prod(w.shape)) for w in m.weights.values()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_uneven_prompts_in_one_batch_give_each_prompt_its_own_tokens(hf, folder, capsys, penalty):
    """`tessera generate FOLDER` with three prompts of different lengths: every row's tokens are the
    ones transformers gives that prompt alone, and the ones transformers' left-padded batch gives;
    with and without a repetition penalty."""
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps(PROMPTS)}",
                       "--max-new-tokens", NEW, "--repetition-penalty", penalty, "--format", "json", "-q")
    assert rc == 0, err
    got = [o["tokens"] for o in json.loads(out)["outputs"]]
    assert got == [_alone(hf, p, repetition_penalty=penalty) for p in PROMPTS]
    assert got == hf_greedy(hf, PROMPTS, NEW, repetition_penalty=penalty)
    if penalty != 1.0:  # the penalty changed the tokens: its path was taken
        assert got != hf_greedy(hf, PROMPTS, NEW)
    assert len({tuple(g) for g in got}) == 3 and len({t for g in got for t in g}) > 4, got


def test_the_api_batch_equals_each_prompt_alone(folder):
    import tessera

    m = tessera.load(str(folder))
    batch = m.generate(PROMPTS, max_new_tokens=NEW)
    assert batch == [m.generate(p, max_new_tokens=NEW) for p in PROMPTS]


def test_a_compiled_cached_jamba_batches_uneven_prompts_too(hf, folder, tmp_path, capsys):
    """The file keeps what its decoder does with padding (tessera.kv_cache's padded_state)."""
    rc, _, err = cli(capsys, "compile", folder, "--kv-cache", "--explain", "-o", tmp_path / "j.onnx")
    assert rc == 0, err
    assert "left padding kept out of them" in err
    rc, out, err = cli(capsys, "generate", tmp_path / "j.onnx", "--input", f"tokens={json.dumps(PROMPTS)}",
                       "--max-new-tokens", NEW, "--format", "json", "-q")
    assert rc == 0, err
    assert [o["tokens"] for o in json.loads(out)["outputs"]] == [_alone(hf, p) for p in PROMPTS]


def test_a_decoder_that_lets_padding_into_its_state_is_refused_for_uneven_prompts(folder, tmp_path, capsys):
    """A hybrid's file whose metadata says the state does not keep padding out (one compiled before
    state_padding.py) generates prompts of one length, and refuses uneven ones with the reason."""
    import onnx

    from test_metadata_hostile import _with_meta

    rc, _, err = cli(capsys, "compile", folder, "--kv-cache", "-o", tmp_path / "j.onnx")
    assert rc == 0, err
    model = onnx.load(str(tmp_path / "j.onnx"), load_external_data=False)
    meta = json.loads(next(e.value for e in model.metadata_props if e.key == "tessera.kv_cache"))
    assert meta["padded_state"] is True
    meta["padded_state"] = False
    old = _with_meta(tmp_path, "j.onnx", "tessera.kv_cache", json.dumps(meta), "old")
    err = cli_error(capsys, "generate", old, "--input", f"tokens={json.dumps(PROMPTS)}", "--max-new-tokens", 2)
    assert "does not keep left padding out of that state" in err
    rc, _, err = cli(capsys, "generate", old, "--input", "tokens=[[1, 2, 3], [4, 5, 6]]", "--max-new-tokens", 2)
    assert rc == 0, err


def test_fp16_left_padded_batch_gives_fp32_tokens_and_each_prompt_its_own(hf, folder, capsys):
    """--dtype fp16: the padding gates (a where on each conv1d input and each scan's carried state,
    compiler/passes/state_padding.py) run at fp16 too; the batch's tokens are fp32's and transformers'
    for each prompt alone."""
    got = {}
    for dtype in ("fp32", "fp16"):
        rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps(PROMPTS)}", "--max-new-tokens",
                           NEW, "--dtype", dtype, "--format", "json", "-q")
        assert rc == 0, err
        got[dtype] = [o["tokens"] for o in json.loads(out)["outputs"]]
    assert got["fp16"] == got["fp32"] == [_alone(hf, p) for p in PROMPTS]


def test_speculative_decoding_of_uneven_prompts_gives_each_prompt_its_own_tokens(hf, folder, capsys):
    """The state after rejected drafts is replayed (generation/rollback.py; drafts accepted and
    rejected are counted in tests/generation/test_speculative_state.py)."""
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps(PROMPTS)}", "--max-new-tokens",
                       NEW, "--speculative", "ngram", "--format", "json", "-q")
    assert rc == 0, err
    assert [o["tokens"] for o in json.loads(out)["outputs"]] == [_alone(hf, p) for p in PROMPTS]


# ---- the mixture of experts (num_experts > 1) ------------------------------------------------------


@pytest.fixture(scope="module")
def hf_moe():
    """Six layers, every kind of pair once at least (attention period 3 offset 1, experts period 2
    offset 1): 0 mamba+dense, 1 attention+experts, 2 mamba+dense, 3 mamba+experts, 4 attention+dense,
    5 mamba+experts; 4 experts, top 2."""
    torch.manual_seed(1)
    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, attn_layer_period=3,
                                   attn_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                   expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                                   mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, bos_token_id=1,
                                   eos_token_id=None, pad_token_id=0)
    assert cfg.layers_num_experts == [1, 4, 1, 4, 1, 4]
    assert cfg.layers_block_type == ["mamba", "attention", "mamba", "mamba", "attention", "mamba"]
    return perturbed(transformers.JambaForCausalLM(cfg), 0.3)


@pytest.fixture(scope="module")
def moe_folder(hf_moe, tmp_path_factory):
    """save_pretrained writes each expert's own tensors (experts.{e}.gate_proj.weight ...), as the
    released checkpoints have them."""
    path = tmp_path_factory.mktemp("jamba_moe") / "ckpt"
    hf_moe.save_pretrained(path, safe_serialization=True)
    return path


def _routes(hf, ids) -> set[int]:
    """The experts transformers' routers choose for these tokens, over every expert layer."""
    chosen = set()
    hooks = [layer.feed_forward.router.register_forward_hook(lambda _m, _i, out: chosen.update(out[2].flatten().tolist()))
             for layer in hf.model.layers if hasattr(layer.feed_forward, "router")]
    with torch.no_grad():
        hf(input_ids=torch.tensor(ids))
    for h in hooks:
        h.remove()
    return chosen


def test_moe_logits_and_parameter_count_equal_transformers(hf_moe, moe_folder):
    import tessera

    m = tessera.load(str(moe_folder))
    ids = [[5, 17, 42, 99, 3, 7, 8], [1, 2, 3, 4, 5, 6, 7]]
    assert _routes(hf_moe, ids) == {0, 1, 2, 3}  # the tokens exercise every expert
    with torch.no_grad():
        want = hf_moe(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(m.run(tokens=ids)["logits"], want, atol=1e-4, rtol=0)
    assert sum(int(np.prod(w.shape)) for w in m.weights.values()) == sum(p.numel() for p in hf_moe.parameters())
    moe_layers = [i for i, e in enumerate(hf_moe.config.layers_num_experts) if e > 1]
    assert sorted({int(p.split(".")[1]) for p in m.weights if ".moe." in p}) == moe_layers


def test_moe_greedy_generation_equals_transformers_alone_and_left_padded(hf_moe, moe_folder, capsys):
    rc, out, err = cli(capsys, "generate", moe_folder, "--input", f"tokens={json.dumps(PROMPTS)}",
                       "--max-new-tokens", NEW, "--format", "json", "-q")
    assert rc == 0, err
    got = [o["tokens"] for o in json.loads(out)["outputs"]]
    assert got == [_alone(hf_moe, p) for p in PROMPTS]
    assert got == hf_greedy(hf_moe, PROMPTS, NEW)
    assert len({tuple(g) for g in got}) == 3 and len({t for g in got for t in g}) > 4, got


def test_moe_compiled_with_a_cache_generates_transformers_tokens(hf_moe, moe_folder, tmp_path, capsys):
    rc, _, err = cli(capsys, "compile", moe_folder, "--kv-cache", "-o", tmp_path / "j.onnx")
    assert rc == 0, err
    rc, out, err = cli(capsys, "generate", tmp_path / "j.onnx", "--input", f"tokens={json.dumps(PROMPTS)}",
                       "--max-new-tokens", NEW, "--format", "json", "-q")
    assert rc == 0, err
    assert [o["tokens"] for o in json.loads(out)["outputs"]] == hf_greedy(hf_moe, PROMPTS, NEW)


def test_moe_experts_stacked_as_transformers_holds_them_load_too(hf_moe, moe_folder, tmp_path):
    """transformers 5's own state dict stacks the experts (experts.gate_up_proj [E, 2 d_ff, d], gate
    then up; experts.down_proj [E, d, d_ff]); the mapping unstacks and splits them."""
    import shutil

    import tessera
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_moe.state_dict().items()}
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in state
    (tmp_path / "ckpt").mkdir()
    shutil.copy(moe_folder / "config.json", tmp_path / "ckpt" / "config.json")
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    ids = [[5, 17, 42, 99, 3, 7, 8]]
    with torch.no_grad():
        want = hf_moe(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(tessera.load(str(tmp_path / "ckpt")).run(tokens=ids)["logits"], want, atol=1e-4,
                               rtol=0)


def test_v0_1_counts_equal_transformers_and_the_published_figures():
    """Jamba v0.1's config (JambaConfig's defaults are that model's): transformers' count on the meta
    device, and the model card's 52 B total, 12 B active parameters."""
    from tessera.compiler.analysis.params import parameter_report

    cfg = transformers.JambaConfig(use_mamba_kernels=False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.mamba_dt_rank) == (16, 2, 14336, 256)
    with torch.device("meta"):
        model = transformers.JambaForCausalLM(cfg)
    rep = parameter_report(build("jamba", "v0_1"))
    assert rep["total"] == sum(p.numel() for p in model.parameters())
    # active per token: all but the (16 - 2) experts a token does not run, 3 x d x d_ff each, in the
    # 16 expert layers (the odd ones)
    assert rep["active_per_token"] == rep["total"] - 16 * (16 - 2) * 3 * 4096 * 14336
    assert round(rep["total"] / 1e9) == 52
    assert round(rep["active_per_token"] / 1e9) == 12


def test_moe_hyperparameters_out_of_range_are_refused(capsys):
    err = cli_error(capsys, "report", "jamba", "--variant", "tiny_moe", "--set", "expert_offset=2")
    assert "expert_offset=2 must be below expert_period=2" in err
    err = cli_error(capsys, "report", "jamba", "--variant", "tiny_moe", "--set", "top=5")
    assert "top=5 must be between 1 and n_experts=4" in err
