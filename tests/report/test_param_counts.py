"""Every bundled spec elaborates, shape-checks, and has its published parameter count."""

from pathlib import Path

import pytest

from conftest import build
from tessera.compiler import ops
from tessera.compiler.analysis.params import parameter_report

SPECS = Path(__file__).resolve().parents[1] / "specs"

PUBLISHED = [
    ("gpt2", "small", 124_439_808),
    ("gpt2", "medium", 354_823_168),
    ("gpt2", "large", 774_030_080),
    ("gpt2", "xl", 1_557_611_200),
    ("bert", "base", 109_482_240),
    ("bert", "minilm_l6", 22_713_216),
    ("vit", "b16", 86_389_248),
    ("llama", "llama2_7b", 6_738_415_616),
    ("llama", "llama3_8b", 8_030_261_248),
    ("llama", "llama3_1_8b", 8_030_261_248),  # Meta-Llama-3.1-8B: the same tensors, rope scaling only
    ("mixtral", "8x7b", 46_702_792_704),
]


@pytest.mark.parametrize("spec,variant,count", PUBLISHED, ids=[f"{s}-{v}" for s, v, _ in PUBLISHED])
def test_published_parameter_counts(spec, variant, count):
    g = build(spec, variant)
    ops.check_graph(g)
    assert g.param_count() == count


def test_gpt3_is_about_175_billion():
    g = build("gpt2", "gpt3")
    assert abs(g.param_count() - 175e9) / 175e9 < 0.01


@pytest.mark.parametrize("variant,paper", [("base", 65e6), ("big", 213e6)])
def test_original_transformer_close_to_the_paper(variant, paper):
    """Vaswani et al. report 65M (base) and 213M (big) with a 37k shared vocabulary."""
    g = build("transformer", variant)
    assert abs(g.param_count() - paper) / paper < 0.04


def test_gpt2_small_table_matches_the_seed():
    """The seed's table: attention, MLP, norms, layer, embeddings, final norm, total."""
    rep = parameter_report(build("gpt2", "small"))
    layer = rep["per_layer"]["layers.0"]
    assert layer["attn"] == 2_362_368          # 4D^2 + 4D
    assert layer["mlp"] == 4_722_432           # 8D^2 + 5D
    assert layer["ln_1"] + layer["ln_2"] == 3_072
    assert layer["total"] == 7_087_872
    assert rep["by_component"] == {"wte": 38_597_376, "wpe": 786_432, "layers": 85_054_464, "ln_f": 1_536}
    assert rep["total"] == 124_439_808
    assert rep["tied"] == {"wte.weight": ["wte", "head"]}


def test_parameter_paths_follow_the_spec():
    g = build("gpt2", "small")
    assert "layers.3.attn.q.weight" in g.params
    assert g.params["layers.3.attn.q.weight"].shape == (768, 768)
    assert g.params["wte.weight"].shape == (50257, 768)
    assert "head.weight" not in g.params  # tied to wte


def test_problem_12_2_single_head_attention():
    """Single head, D=512, D_q=64, with biases: 328,320 parameters, independent of N."""
    assert build(str(SPECS / "problem_12_2_single_head.tsr")).param_count() == 328_320


def test_problem_12_6_24_layers_of_width_1024():
    assert build(str(SPECS / "problem_12_6_stack.tsr")).param_count() == 302_309_376
