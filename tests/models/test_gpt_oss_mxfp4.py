"""gpt-oss with MXFP4 experts (the released checkpoints' format): a seeded, perturbed GptOssForCausalLM
saved as a folder, its expert matrices then quantised by an MXFP4 encoder written here (numpy: per 32
values the E8M0 exponent floor(log2(max |v|)) - 2, each value rounded to the nearest E2M1 value, two
nibbles a byte, value 2k in the low nibble, in transformers' [E, out, in / 32, 16] layout) into
``*_blocks`` / ``*_scales`` with ``quantization_config.quant_method = "mxfp4"``. The reference is
transformers' own ``convert_moe_packed_tensors`` (torch on CPU) of the same blocks and scales, loaded
into a GptOssForCausalLM: Tessera's loaded parameters equal it exactly, its logits within 1e-4 and
``tessera generate FOLDER``'s greedy tokens equal transformers'. A blocks tensor without its scales,
mis-shaped pairs, a NaN scale and other quant_methods are errors naming the tensors or the key."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import MODELS, cli, hf_greedy, ort_run
from tessera.compiler.ops import interpret
from tessera.runtime import pipeline
from tessera.runtime.io.weights import WeightsError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
mxfp4_hf = pytest.importorskip("transformers.integrations.mxfp4")

TOL = 1e-4
SPEC = MODELS / "gpt_oss.tsr"
VOCAB = 100
LAYERS = 2
EXPERTS = 4
PACKED = ("gate_up_proj", "down_proj")

# E2M1's magnitudes by code 0..7 (OCP MX v1.0): the encoder's own table, code + 8 is the negative value
MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., R, C]`` (C a multiple of 32) as MXFP4 blocks ``[..., R, C / 32, 16]`` and scales
    ``[..., R, C / 32]``: per 32 values the shared exponent floor(log2(amax)) - 2 (E2M1's largest
    exponent; amax then scales into [4, 8), rounded into 6 at most), biased by 127."""
    g = w.reshape(w.shape[:-1] + (w.shape[-1] // 32, 32)).astype(np.float64)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).clip(-127, 127)
    scaled = g / np.exp2(exp)[..., None]
    code = np.abs(np.abs(scaled)[..., None] - MAGNITUDES).argmin(-1) + 8 * (scaled < 0)
    code = code.astype(np.uint8)
    # contiguous: safetensors' numpy writer stores a strided array's memory as it lies, not in C order
    return (np.ascontiguousarray(code[..., 0::2] | (code[..., 1::2] << 4), dtype=np.uint8),
            np.ascontiguousarray(exp + 127, dtype=np.uint8))


def tiny_config(**kw):
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 8, "rope_theta": 150000.0}, **kw)


def write_mxfp4_folder(float_folder, folder, edit=None) -> dict:
    """A copy of ``float_folder`` with each expert matrix as MXFP4 blocks and scales; returns its tensors.
    ``edit(tensors)`` changes them before they are written (the error cases)."""
    shutil.copytree(float_folder, folder)
    tensors = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.rsplit(".", 1)[-1] in PACKED]:
        w = tensors.pop(name)  # [E, in, out]; transformers packs [E, out, in] along in
        tensors[name + "_blocks"], tensors[name + "_scales"] = encode_mxfp4(np.swapaxes(w, 1, 2))
    if edit is not None:
        edit(tensors)
    safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(transformers' model with the dequantised experts, the MXFP4 folder, its tensors, the float folder)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:  # experts large enough that the SwiGLU's clamps (limit 7) bite
            layer.mlp.experts.gate_up_proj.mul_(20.0)
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model.save_pretrained(root / "float")
    tensors = write_mxfp4_folder(root / "float", root / "mxfp4")
    state = model.state_dict()
    for name in [n for n in state if n.rsplit(".", 1)[-1] in PACKED]:
        state[name] = mxfp4_hf.convert_moe_packed_tensors(torch.from_numpy(tensors[name + "_blocks"]),
                                                          torch.from_numpy(tensors[name + "_scales"]),
                                                          dtype=torch.float32)
    reference = transformers.GptOssForCausalLM(tiny_config()).eval()
    reference.load_state_dict(state)
    return reference, root / "mxfp4", tensors, root / "float", model


def test_the_encoded_blocks_exercise_every_code_and_many_scales(case):
    """Both nibbles take all 16 codes and the scales several exponents, so a swapped nibble order, a
    wrong table entry or bias is seen; the dequantised experts differ from the float ones (quantised)."""
    reference, _, tensors, _, model = case
    blocks = np.concatenate([tensors[n].ravel() for n in tensors if n.endswith("_blocks")])
    scales = np.concatenate([tensors[n].ravel() for n in tensors if n.endswith("_scales")])
    assert set(np.unique(blocks & 0x0F)) == set(range(16)) and set(np.unique(blocks >> 4)) == set(range(16))
    assert len(np.unique(scales)) >= 4
    got = reference.model.layers[0].mlp.experts.gate_up_proj
    assert (got - model.model.layers[0].mlp.experts.gate_up_proj).abs().max() > 1e-3


def test_loaded_parameters_equal_transformers_dequantisation(case):
    """Each expert's gate, up and down weight equals convert_moe_packed_tensors' tensor cut as transformers'
    GptOssExperts reads it (gate the even columns of gate_up [d, 2f], up the odd; x @ W, so W^T is
    linear's [out, in]) -- exactly; every other parameter equals the float checkpoint's."""
    reference, folder, _, _, _ = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    for i, layer in enumerate(reference.model.layers):
        gate_up = layer.mlp.experts.gate_up_proj.detach().numpy()
        down = layer.mlp.experts.down_proj.detach().numpy()
        for e in range(EXPERTS):
            ffn = f"layers.{i}.moe.experts.{e}.ffn"
            np.testing.assert_array_equal(weights[f"{ffn}.gate.weight"], gate_up[e][:, 0::2].T)
            np.testing.assert_array_equal(weights[f"{ffn}.up.weight"], gate_up[e][:, 1::2].T)
            np.testing.assert_array_equal(weights[f"{ffn}.down.weight"], down[e].T)
    np.testing.assert_array_equal(weights["layers.1.attn.q.weight"],
                                  reference.model.layers[1].self_attn.q_proj.weight.detach().numpy())


def test_logits_equal_transformers_with_the_dequantised_experts(case):
    reference, folder, _, _, _ = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in reference.parameters())
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, 19)).astype(np.int64)
    with torch.no_grad():
        ref = reference(input_ids=torch.from_numpy(tokens)).logits.numpy()
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


def test_generate_on_the_folder_equals_transformers_greedy(case, capsys):
    reference, folder, _, _, _ = case
    prompt = np.random.default_rng(3).integers(1, VOCAB, 9).tolist()
    new = 10  # past the window of 5
    rc, out, err = cli(capsys, "generate", folder, "--input", f"tokens={json.dumps([prompt])}", "--format", "json",
                       "-q", "--max-new-tokens", str(new), "--ignore-eos", "--explain")
    assert rc == 0, err
    tokens = json.loads(out)["outputs"][0]["tokens"]
    assert tokens == hf_greedy(reference, [prompt], new)[0]
    assert len(set(tokens)) > 3, "degenerate: the model repeats one token"
    assert ("MXFP4 weights: 4 tensor(s) of" in err and "dequantised from MXFP4" in err
            and "model.layers.{0-1}.mlp.experts.down_proj; model.layers.{0-1}.mlp.experts.gate_up_proj" in err), err


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _cut_scales(tensors):
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :, :1])


def _nan_scale(tensors):
    tensors["model.layers.1.mlp.experts.down_proj_scales"][0, 0, 0] = 255


@pytest.mark.parametrize("edit, message", [
    (_drop("model.layers.1.mlp.experts.down_proj_scales"),
     r"MXFP4 tensors that cannot be read .*model\.layers\.1\.mlp\.experts\.down_proj_blocks has no "
     r"model\.layers\.1\.mlp\.experts\.down_proj_scales"),
    (_drop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
     r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scales has no model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks"),
    (_cut_scales,
     r"model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks is \[4, 64, 2, 16\] and "
     r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scales is \[4, 64, 1\]; expected \[E, R, G, 16\] and \[E, R, G\]"),
    (_nan_scale, r"tensors holding NaN or infinity: layers\.1\.moe\.experts\.0\.ffn\.down\.weight"),
], ids=["blocks-without-scales", "scales-without-blocks", "mis-shaped", "nan-scale"])
def test_bad_mxfp4_tensors_are_errors_naming_them(case, tmp_path, capsys, edit, message):
    _, _, _, float_folder, _ = case
    folder = tmp_path / "bad"
    write_mxfp4_folder(float_folder, folder, edit)
    built = pipeline.build(SPEC, weights=str(folder))
    with pytest.raises(WeightsError, match=message):
        pipeline.weights_for(built, str(folder), 0)
    rc, _, err = cli(capsys, "run", folder, "--input", "tokens=[[1, 2, 3]]")
    assert rc == 2 and "Traceback" not in err, err


def test_other_quant_methods_are_refused_by_the_config(case, tmp_path):
    _, folder, _, _, _ = case
    copy = tmp_path / "gptq"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r'quantization_config.quant_method = "gptq" is not supported .*allows "mxfp4"'):
        pipeline.build(SPEC, weights=str(copy))


def test_blocks_in_a_folder_not_marked_mxfp4_are_unexpected(case, tmp_path):
    """Without quant_method "mxfp4" the pairs are not decoded: they are tensors the model does not have."""
    _, folder, _, _, _ = case
    copy = tmp_path / "unmarked"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    built = pipeline.build(SPEC, weights=str(copy))
    with pytest.raises(WeightsError, match=r"unexpected \(8\): .*gate_up_proj_blocks"):
        pipeline.weights_for(built, str(copy), 0)
