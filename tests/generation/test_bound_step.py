"""The bound decoding step under one If (compiler/backends/onnx/bound_step.py).

References: the same decoder compiled without the rewrite (bound_step=False: the per-layer Ifs,
checked against transformers by tests/generation/test_packed_gqa_decode.py and tests/generation/test_generate.py), run on
the same feeds: the bound branch's logits and buffers must equal the unsplit graph's bit for bit, the
general branch's every output too; hand-built graphs for the refusals."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import MODELS

from tessera.compiler.backends.onnx.bound_step import INPUT, general_graph, split_bound_step
from tessera.compiler.backends.onnx.walk import all_nodes
from tessera.runtime import pipeline
from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

SETS = ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=100", "d_ff=96"]


def _compile(monkeypatch, on: bool, **kw):
    built = pipeline.build(MODELS / "llama.tsr", None, SETS)
    return compile_cached(built, pipeline.weights_for(built, None, 0), bound_step=on, **kw)


def _session(model):
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_one_if_whose_bound_branch_has_no_per_layer_if_and_no_column_gather(monkeypatch):
    model, info = _compile(monkeypatch, True)
    top = [n for n in model.graph.node if n.op_type == "If"]
    assert len(top) == 1 and top[0].name == "bound_step/If"
    bound = next(a.g for a in top[0].attribute if a.name == "else_branch")
    ops = [n.op_type for n in bound.node]
    assert "If" not in ops and "GatherElements" not in ops and ops.count("GroupQueryAttention") == 2
    assert [n.op_type for n in general_graph(model).node].count("If") == 2  # the general branch: as before
    assert f"a branch of its own ({len(bound.node)} nodes" in info.explain()
    inits = {i.name for i in model.graph.initializer}
    assert INPUT in inits and INPUT in {i.name for i in model.graph.input}
    # the weights are the main graph's, read from the outer scope: neither branch holds one
    assert not any(b.g.initializer and any(i.name.endswith("weight") for i in b.g.initializer)
                   for n in all_nodes(model.graph.node) for b in n.attribute if b.type == b.GRAPH)


def _step_feeds(info, rng, rows=2, past=6, capacity=10):
    feeds = {info.tokens: rng.integers(1, 100, (rows, 1)), "position_ids": np.full((rows, 1), past),
             "attention_mask": np.concatenate([np.ones((rows, past)), np.zeros((rows, capacity - past)),
                                               np.ones((rows, 1))], axis=1).astype(np.int64),
             info.length_input: np.array([past], dtype=np.int64)}
    for layer in info.layers:
        for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size)):
            feeds[name] = rng.standard_normal((rows, layer.kv_heads, capacity, size)).astype(np.float32)
    return feeds


def test_both_branches_give_the_unsplit_graphs_outputs_bit_for_bit(monkeypatch):
    split, info = _compile(monkeypatch, True)
    plain, _ = _compile(monkeypatch, False)
    s, p = _session(split), _session(plain)
    names = [o.name for o in plain.graph.output]
    feeds = _step_feeds(info, np.random.default_rng(0))
    want = dict(zip(names, p.run(names, feeds)))
    general = dict(zip(names, s.run(names, feeds)))  # cache_columns left at its default: True
    bound = dict(zip(names, s.run(names, {**feeds, INPUT: np.array(False)})))
    columns = {n for layer in info.layers for n in (layer.present_key, layer.present_value)}
    for name in names:
        np.testing.assert_array_equal(general[name], want[name], err_msg=name)
        if name in columns:
            assert bound[name].size == 0  # not computed on a bound step
        else:
            np.testing.assert_array_equal(bound[name], want[name], err_msg=name)
    # a prompt (T > 1) runs the general branch whatever cache_columns says
    prompt = {**feeds, info.tokens: feeds[info.tokens].repeat(3, axis=1), "position_ids": np.array([[6, 7, 8]] * 2),
              "attention_mask": np.concatenate([feeds["attention_mask"], np.ones((2, 2), np.int64)], axis=1)}
    want = p.run(names, prompt)
    got = s.run(names, {**prompt, INPUT: np.array(False)})
    for name, a, b in zip(names, got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_generate_through_the_bound_step_equals_the_unsplit_graph(monkeypatch):
    """generate's BoundStep binds cache_columns = False: the same tokens and logits at every step as the
    unsplit graph's (itself checked against transformers by test_packed_gqa_decode.py)."""
    split, info = _compile(monkeypatch, True)
    plain, info0 = _compile(monkeypatch, False)
    prompts = [[5, 9, 13, 2, 7, 1, 3], [3, 1]]
    runs = []
    for model, i in ((split, info), (plain, info0)):
        steps = []
        cached = CachedModel(model.SerializeToString(), i)
        tokens = generate(cached, prompts, 10, on_logits=lambda k, x: steps.append(np.array(x))).tokens
        runs.append((tokens, steps))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(a, b)


def _if(cond: str, out: str):
    branch = lambda v: helper.make_graph([helper.make_node("Identity", ["x"], [f"{out}_{v}"])], f"{out}{v}", [],  # noqa: E731
                                         [helper.make_tensor_value_info(f"{out}_{v}", TensorProto.FLOAT, None)])
    return helper.make_node("If", [cond], [out], then_branch=branch("t"), else_branch=branch("e"))


@pytest.mark.parametrize("conds, reason", [
    ((), "no top-level If"),
    (("c1", "c1"), "no decoding branch runs GroupQueryAttention"),
])
def test_a_graph_it_does_not_fit_is_left_as_it_is_with_the_reason(conds, reason):
    nodes = [helper.make_node("Identity", ["c"], ["c1"])] + [_if(c, f"y{i}") for i, c in enumerate(conds)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                       helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(conds))])
    model = helper.make_model(g)
    before = model.SerializeToString()
    assert reason in split_bound_step(model, set())
    assert model.SerializeToString() == before


def test_explain_says_why_a_decoder_keeps_its_per_layer_ifs(monkeypatch):
    _, info = _compile(monkeypatch, True, decode="plain")  # no GroupQueryAttention: nothing bound in place
    assert "as above (no decoding branch runs GroupQueryAttention" in info.explain()


def test_ifs_on_different_conditions_are_not_gathered(monkeypatch):
    plain, info = _compile(monkeypatch, False)
    ifs = [n for n in plain.graph.node if n.op_type == "If"]
    ifs[1].input[0] = "cache_columns_other"  # the second site tests something else
    plain.graph.input.append(helper.make_tensor_value_info("cache_columns_other", TensorProto.BOOL, []))
    assert split_bound_step(plain, set()) == "the Ifs test different conditions"
