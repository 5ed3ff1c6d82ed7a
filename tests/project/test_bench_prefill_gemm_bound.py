"""bench/prefill_gemm_bound.py's layer shapes: the fused linears it times are a Llama layer's products.
Reference: transformers' LlamaForCausalLM built from the same config (grouped-query heads, its own
head_dim), whose q/k/v/o/gate/up/down weights must hold exactly the multiply-adds the bench counts."""

from __future__ import annotations

import pytest

from conftest import load_bench

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("head_dim", [None, 24])
def test_the_timed_products_are_the_layers_weights(head_dim):
    bench = load_bench("prefill_gemm_bound")
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 50}
    if head_dim:
        config["head_dim"] = head_dim
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    layer = hf.model.layers[0]
    weights = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    shapes = bench.linears(config)
    assert sum(k * n for k, n in shapes.values()) == sum(w.weight.numel() for w in weights)
    assert shapes["o"] == (layer.self_attn.o_proj.in_features, layer.self_attn.o_proj.out_features)
    assert shapes["down"] == (layer.mlp.down_proj.in_features, layer.mlp.down_proj.out_features)
