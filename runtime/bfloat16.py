"""bfloat16 on the host: raw 16-bit words that onnxruntime's Python API can bind, for ``--dtype bf16`` on CUDA.

Why: onnxruntime's Python API has no numpy type for bfloat16 -- ``session.run`` refuses such a feed and
``OrtValue.numpy()`` such an output ("No corresponding Numpy type for Tensor Type. bfloat16"). Its IOBinding
and OrtValue factories take the ONNX element type as an integer, though, and a bfloat16 tensor is 16-bit
words. So host arrays of a bf16 model are numpy arrays of ml_dtypes' ``bfloat16`` (onnx's own dependency;
2 bytes an element, sliced and assigned like any numpy array) and cross into onnxruntime by pointer or as
their ``uint16`` view, tagged BFLOAT16. Only what the host stores goes through here (generation's prompt
columns, the prefix cache's blocks, a device cache's reads); nothing is converted to or from floats, and the
logits a bf16 graph gives are float32 (cast inside the graph), so choosing a token never reads bfloat16.
"""

from __future__ import annotations

import numpy as np

BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16


def np_float(dtype: str):
    """The host numpy type of an IR float dtype: f32, f16, or ml_dtypes' bfloat16 for bf16."""
    if dtype == "bf16":
        from ml_dtypes import bfloat16

        return bfloat16
    return np.float16 if dtype == "f16" else np.float32


def is_bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def element_type(dtype):
    """What IOBinding and the OrtValue factories take for ``dtype``: its numpy type, or BFLOAT16 (an int)."""
    return BFLOAT16 if is_bf16(dtype) else np.dtype(dtype).type


def ortvalue(arr: np.ndarray):
    """A CPU OrtValue over ``arr`` (bf16: its uint16 view tagged BFLOAT16; the array must outlive it)."""
    from tessera.runtime.session import _ort

    ort = _ort()
    arr = np.ascontiguousarray(arr)
    if is_bf16(arr.dtype):
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16), BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def host_array(value) -> np.ndarray:
    """A host OrtValue's contents as a numpy array (a copy for bf16: its words read by pointer)."""
    if value.element_type() != BFLOAT16:
        return value.numpy()
    import ctypes

    from ml_dtypes import bfloat16

    shape = value.shape()
    count = int(np.prod(shape)) if shape else 1
    words = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr())) if count else \
        np.zeros(0, np.uint16)
    return words.copy().view(bfloat16).reshape(shape)


def run_bound(session, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """``session.run`` for a graph with bfloat16 inputs or outputs: through IOBinding, every input from host
    memory (bf16 arrays as tagged words), every output to host memory, read back by ``host_array``."""
    io = session.io_binding()
    keep = []
    for name, value in feeds.items():
        value = np.ascontiguousarray(value)
        if is_bf16(value.dtype):
            keep.append(ortvalue(value))
            io.bind_ortvalue_input(name, keep[-1])
        else:
            io.bind_cpu_input(name, value)
    for name in names:
        io.bind_output(name, "cpu")
    session.run_with_iobinding(io)
    return {name: host_array(v) for name, v in zip(names, io.get_outputs())}
