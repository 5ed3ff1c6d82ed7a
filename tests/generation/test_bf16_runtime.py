"""--dtype bf16 for generate, serve and batch (issue 37): accepted where the model runs on CUDA, refused with the
reason where it would run on the CPU provider, and the host's bfloat16 words (runtime/bfloat16.py) crossing into
onnxruntime and back unchanged. What runs on CUDA in bf16 (placement, FLASH_ATTENTION, copies per step) is checked
under the CUDA stub in tests/cuda/test_cuda_stub.py; the device cache's graphs in bf16 against numpy in
tests/serving/test_serve_device_cache.py."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.runtime.options import GenerateOptions, ModelRef
from tessera.runtime.pipeline import UsageError
from tessera.runtime.serving.batch import BatchOptions
from tessera.runtime.serving.server import ServeOptions


def test_bf16_is_accepted_on_cuda_and_refused_on_the_cpu_with_the_reason():
    for o in (GenerateOptions(provider="cuda", dtype="bf16"), ServeOptions(spec="gpt2", provider="cuda", dtype="bf16")):
        o.check()
        assert o.device == "cuda" and o.dtype == "bf16"
    target = ServeOptions(spec="gpt2", provider="cuda", dtype="bf16").engine_pipeline_options().target
    assert (target.device, target.dtype) == ("cuda", "bf16")
    for o in (GenerateOptions(provider="cpu", dtype="bf16"),
              ServeOptions(spec="gpt2", provider="cpu", dtype="bf16"),
              BatchOptions(spec="gpt2", input="a", output="b", provider="cpu", dtype="bf16")):
        with pytest.raises(UsageError, match="bf16 runs on CUDA only.*no bfloat16 kernel for GroupQueryAttention"):
            o.check()


def test_an_encoder_decoder_in_bf16_on_the_cpu_provider_is_refused_with_the_reason():
    """On CUDA an encoder-decoder generates in bf16 (tests/cuda/test_cuda_stub.py); on the CPU provider,
    which has no bfloat16 kernel for MatMul or attention, load_model refuses it before compiling (options'
    check refuses it first on the command line; this holds for a caller that skips it)."""
    from tessera.runtime.generation.loop import load_model

    ref = ModelRef(spec="bart", sets=["layers=1", "dec_layers=1", "d=32", "heads=2", "dec_heads=2", "vocab=64"])
    with pytest.raises(UsageError, match="encoder-decoder on onnxruntime's CPU provider.*no bfloat16 kernel"):
        load_model(ref, GenerateOptions(provider="cpu", dtype="bf16"))


def test_bfloat16_words_cross_into_onnxruntime_and_back_unchanged():
    """A bf16 Identity graph on the CPU provider (its Identity takes bfloat16): ml_dtypes' bfloat16 arrays in,
    the same words out, through CachedModel's path for such graphs (run_bound) and by pointer (host_array)."""
    from ml_dtypes import bfloat16
    from onnx import TensorProto, helper

    from tessera.runtime.bfloat16 import element_type, host_array, np_float, ortvalue, run_bound
    from tessera.runtime.session import _ort

    assert np_float("bf16") is bfloat16 and np_float("f16") is np.float16 and np_float("f32") is np.float32
    assert element_type(bfloat16) == TensorProto.BFLOAT16 and element_type(np.float16) is np.float16
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, None)],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    sess = _ort().InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = (np.arange(-6, 6, dtype=np.float32) / 3).reshape(3, 4).astype(bfloat16)
    y = run_bound(sess, {"x": x}, ["y"])["y"]
    assert y.dtype == bfloat16 and y.shape == (3, 4)
    np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(host_array(ortvalue(x)).view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(host_array(ortvalue(np.ones(3, np.float32))), np.ones(3, np.float32))
