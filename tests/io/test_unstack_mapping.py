"""Mapping rules that unstack a 3-D ``[experts, ...]`` checkpoint tensor (gpt-oss's, Llama 4's) into one
parameter per expert (``unstack = "e"``: item e of the first axis, then split, groups and transpose as
for any tensor), against numpy slicing written here; each item read alone; the rule's mistakes refused
with the rule named."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import build
from tessera.runtime.io.weights import Checkpoint, NameMap, WeightsError, load_weights

SPEC = """
model M(d = 6, e = 3, f = 4) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = experts(x, e, 2, f, bias=true, name="moe")
}
"""

MAP = """
[names]
"router.weight" = "moe.router.weight"
"gate_up" = { unstack = "e", split = ["moe.experts.{e}.ffn.gate.weight", "moe.experts.{e}.ffn.up.weight"], axis = 1, groups = "f", transpose = true }
"gate_up_bias" = { unstack = "e", split = ["moe.experts.{e}.ffn.gate.bias", "moe.experts.{e}.ffn.up.bias"], axis = 0, groups = "f" }
"down" = { unstack = "e", to = "moe.experts.{e}.ffn.down.weight", transpose = true }
"down_bias" = { unstack = "e", to = "moe.experts.{e}.ffn.down.bias" }
"""


def _checkpoint(tmp_path, rng, e=3, d=6, f=4):
    t = {"router.weight": rng.standard_normal((e, d)), "gate_up": rng.standard_normal((e, d, 2 * f)),
         "gate_up_bias": rng.standard_normal((e, 2 * f)), "down": rng.standard_normal((e, f, d)),
         "down_bias": rng.standard_normal((e, d))}
    t = {k: v.astype(np.float32) for k, v in t.items()}
    save_file(t, str(tmp_path / "w.safetensors"))
    return t


def test_unstacked_interleaved_experts_equal_numpy_slices(tmp_path, rng):
    (tmp_path / "m.tsr").write_text(SPEC)
    (tmp_path / "m.hf.toml").write_text(MAP)
    graph = build(str(tmp_path / "m.tsr"))
    t = _checkpoint(tmp_path, rng)
    w = load_weights(graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "m.hf.toml"), hyper={"f": 4})
    for i in range(3):
        p = f"moe.experts.{i}.ffn."
        np.testing.assert_array_equal(w[p + "gate.weight"], t["gate_up"][i][:, 0::2].T)  # even columns
        np.testing.assert_array_equal(w[p + "up.weight"], t["gate_up"][i][:, 1::2].T)    # odd columns
        np.testing.assert_array_equal(w[p + "gate.bias"], t["gate_up_bias"][i][0::2])
        np.testing.assert_array_equal(w[p + "up.bias"], t["gate_up_bias"][i][1::2])
        np.testing.assert_array_equal(w[p + "down.weight"], t["down"][i].T)
        np.testing.assert_array_equal(w[p + "down.bias"], t["down_bias"][i])


def test_each_expert_is_read_alone(tmp_path, rng, monkeypatch):
    (tmp_path / "m.tsr").write_text(SPEC)
    (tmp_path / "m.hf.toml").write_text(MAP)
    graph = build(str(tmp_path / "m.tsr"))
    _checkpoint(tmp_path, rng)
    w = load_weights(graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "m.hf.toml"), hyper={"f": 4})
    whole = []
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: whole.append(name))
    w["moe.experts.2.ffn.down.bias"]
    assert whole == []


def test_more_experts_in_the_checkpoint_are_unexpected(tmp_path, rng):
    (tmp_path / "m.tsr").write_text(SPEC)
    (tmp_path / "m.hf.toml").write_text(MAP)
    graph = build(str(tmp_path / "m.tsr"))
    t = _checkpoint(tmp_path, rng, e=4)
    t["router.weight"] = t["router.weight"][:3]
    save_file(t, str(tmp_path / "w.safetensors"))
    with pytest.raises(WeightsError, match=r"unexpected \(4\): down, down_bias, gate_up, gate_up_bias"):
        load_weights(graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "m.hf.toml"), hyper={"f": 4})


@pytest.mark.parametrize("rule,msg", [
    ('"{i}.w" = { unstack = "i", to = "x.{i}.weight" }', r"names a placeholder of the source"),
    ('"w" = { unstack = "e", to = "x.weight" }', r"unstacks into \{e\}, which target 'x.weight' does not use"),
    ('"w" = { unstack = "E", to = "x.{E}.weight" }', r"'unstack' must be a placeholder name"),
    ('"w" = { unstack = 1, to = "x.{e}.weight" }', r"'unstack' must be a placeholder name"),
])
def test_bad_unstack_rules_are_refused(tmp_path, rule, msg):
    (tmp_path / "bad.hf.toml").write_text("[names]\n" + rule + "\n")
    with pytest.raises(WeightsError, match=msg):
        NameMap.load(tmp_path / "bad.hf.toml")


def test_unstacking_a_vector_is_refused(tmp_path):
    m = NameMap.load(_write(tmp_path, '"w" = { unstack = "e", to = "x.{e}.bias" }'))
    with pytest.raises(WeightsError, match=r"w has shape \[3\]; .* needs a rank of 2 or more"):
        m.plan({"w": (3,)})


def _write(tmp_path, rule):
    (tmp_path / "m.hf.toml").write_text("[names]\n" + rule + "\n")
    return tmp_path / "m.hf.toml"
