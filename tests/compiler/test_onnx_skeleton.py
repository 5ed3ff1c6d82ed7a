"""runtime/io/onnx_skeleton.py: an ONNX file read without the data of its large weights.

The reference is onnx's own parser: the skeleton must equal the full model with the data fields of
the large initializers cleared through the protobuf API, and nothing else changed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

from tessera.runtime.onnx_skeleton import KEEP_DATA_BYTES, skeleton_bytes
from tessera.runtime.errors import ModelFileError
from tessera.runtime.session import load_model_proto


def _model() -> onnx.ModelProto:
    big = numpy_helper.from_array(np.arange(40_000, dtype=np.float32).reshape(200, 200), "w")  # 160 KB raw
    packed = helper.make_tensor("b", TensorProto.FLOAT, [20_000], np.ones(20_000, np.float32).tolist())  # float_data
    small = numpy_helper.from_array(np.array([3], np.int64), "trips")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "y"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 200])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", 200])],
                              [big, packed, small])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, {"tessera.demo": '{"a": 1}'})
    return model


def test_skeleton_is_the_model_without_large_data(tmp_path):
    model = _model()
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())

    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    for init in expected.graph.initializer:
        if init.ByteSize() > KEEP_DATA_BYTES:
            for f in ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data",
                      "uint64_data"):
                init.ClearField(f)
    got = onnx.ModelProto.FromString(skeleton_bytes(path))
    assert got == expected
    assert [i.name for i in got.graph.initializer] == ["w", "b", "trips"]
    assert list(got.graph.initializer[0].dims) == [200, 200]
    assert numpy_helper.to_array(got.graph.initializer[2]).tolist() == [3]  # small tensors keep their data
    assert len(skeleton_bytes(path)) < 10_000 < path.stat().st_size


def test_truncated_file_is_a_model_file_error(tmp_path):
    data = _model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        load_model_proto(path)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_any_bytes_give_a_value_error_or_a_parse(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "x.onnx"
    path.write_bytes(data)
    try:
        skeleton_bytes(path)
    except ValueError:
        pass
