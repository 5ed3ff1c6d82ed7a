"""The numpy and ONNX element types of the IR's float dtypes (f32, f16, bf16): constants a lowering writes
at a tensor's precision. numpy only (onnx is imported when asked), so the kernel tables import it cheaply."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir.graph import numpy_dtype


def np_float(dtype: str):
    """The numpy type of constants for a tensor of this IR dtype (fp16, bf16: ml_dtypes' bfloat16, or fp32)."""
    return numpy_dtype(dtype) if dtype in ("f16", "bf16") else np.float32


def onnx_float(dtype: str) -> int:
    """The ONNX element type of a float tensor of this IR dtype (fp16, bf16 or fp32)."""
    from onnx import TensorProto

    return {"f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}.get(dtype, TensorProto.FLOAT)
