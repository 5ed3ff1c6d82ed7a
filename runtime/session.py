"""onnxruntime sessions: provider choice and input signatures of ONNX files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from tessera.compiler.backends.onnx.export import ONNX_DTYPES
from tessera.compiler.ir.signature import InputLimits, InputSpec

from tessera.runtime import metadata
from tessera.runtime.errors import ModelFileError
from tessera.runtime.files import stat_or_raise
from tessera.runtime.onnx_skeleton import skeleton_bytes
from tessera.runtime.machine import gpu_present  # open_session reads it by this module's name (tests replace it)

_FROM_ONNX = {v: k for k, v in ONNX_DTYPES.items()}


class ProviderError(Exception):
    pass


def _ort():
    import onnxruntime as ort  # heavy (~0.3 s): loaded when a session is first opened

    ort.set_default_logger_severity(3)  # onnxruntime-gpu warns loudly on machines without CUDA
    return ort


def _refused(src, e: Exception) -> ModelFileError:
    what = "the model" if isinstance(src, bytes) else src
    msg = str(e).split("] : ", 1)[-1].strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ModelFileError(f"onnxruntime cannot load {what}: {msg}")


def open_session(model: str | Path | bytes, provider: str = "auto"):
    """An InferenceSession on the chosen provider. 'auto' takes CUDA when it really starts, else CPU.
    A model onnxruntime refuses (corrupt, unsupported, external data outside its folder) is a
    ModelFileError with onnxruntime's reason."""
    try:
        return _open_session(model, provider)
    except (ProviderError, ModelFileError):
        raise
    except Exception as e:  # onnxruntime raises its own types (Fail, InvalidGraph, NotImplemented, ...)
        raise _refused(model if isinstance(model, bytes) else str(model), e) from None


def _open_session(model: str | Path | bytes, provider: str):
    ort = _ort()
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # run-time failures are reported by run_session, not by onnxruntime's log
    src = model if isinstance(model, bytes) else str(model)
    if provider == "cpu":
        return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    if provider not in ("auto", "cuda"):
        raise ProviderError(f"unknown provider '{provider}' (use auto, cpu or cuda)")
    # auto tries CUDA only where a GPU is present: onnxruntime-gpu lists the provider on any machine, and
    # a CUDA session that fails for want of a device costs seconds before the CPU fallback
    if "CUDAExecutionProvider" in ort.get_available_providers() and (provider == "cuda" or gpu_present()):
        ort.set_default_logger_severity(4)  # a failed CUDA load is expected on CPU machines; we fall back
        try:
            sess = ort.InferenceSession(src, opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
            if sess.get_providers()[0] == "CUDAExecutionProvider":
                return sess
        except Exception:  # CUDA libraries missing or no device: fall through
            pass
        finally:
            ort.set_default_logger_severity(3)
    if provider == "cuda":
        raise ProviderError("the CUDA provider is not usable on this machine (no GPU or CUDA libraries); "
                            "use --provider cpu or auto")
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def onnx_signature(path: str | Path, model: onnx.ModelProto | None = None) -> tuple[list[InputSpec],
                                                                                   InputLimits | None]:
    """The inputs of an ONNX file, and the id ranges and position limits Tessera stored in its
    metadata (None for files Tessera did not write). Reads the file once, without external data
    (or takes ``model``, the file already read by load_model_proto); a file that is not a readable
    ONNX model is a ModelFileError saying why."""
    model = model if model is not None else load_model_proto(Path(path))
    init = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in init:
            continue
        t = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
        specs.append(InputSpec(vi.name, _FROM_ONNX.get(t.elem_type, "f32"), dims))
    check_loop_trips(model, path)
    limits = None
    for e in model.metadata_props:
        if e.key == InputLimits.METADATA_KEY:
            limits = metadata.input_limits(e.value, path, {s.name for s in specs})
    return specs, limits


MAX_LOOP_TRIPS = 10 ** 7
"""Iterations a Loop with a constant trip count may declare: Tessera's own Loops (tiled attention,
scans) count heads x tiles or time steps at run time; a constant of 10**12 is a file that would run
for days with no way to stop it but killing the process."""


def check_loop_trips(model: onnx.ModelProto, path) -> None:
    """Refuse a Loop (at any depth) whose trip count is a constant past MAX_LOOP_TRIPS, before running."""
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        consts = {i.name: i for i in g.initializer}
        consts.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant" and n.output
                       for a in n.attribute if a.name == "value"})
        for n in g.node:
            graphs.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
            graphs.extend(sub for a in n.attribute if a.type == onnx.AttributeProto.GRAPHS for sub in a.graphs)
            if n.op_type != "Loop" or not n.input or n.input[0] not in consts:
                continue
            try:
                trips = numpy_helper.to_array(consts[n.input[0]]).reshape(-1)
            except Exception:  # a malformed tensor: onnxruntime refuses the file with its own reason
                continue
            if trips.size == 1 and trips.dtype.kind in "iu" and int(trips[0]) > MAX_LOOP_TRIPS:
                raise ModelFileError(f"{path}: Loop {n.name or n.output[0] if n.output else '?'} runs "
                                     f"{int(trips[0]):,} times, more than the {MAX_LOOP_TRIPS:,} that run allows "
                                     f"(it would not finish)")


def load_model_proto(path: Path) -> onnx.ModelProto:
    """The file's graph, inputs, outputs and metadata, without the data of its large weights."""
    st = stat_or_raise(path, "model file", ModelFileError)
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"{path} is {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}, "
                             f"not an ONNX model")
    if st.st_size == 0:
        raise ModelFileError(f"{path} is empty, not an ONNX model")
    try:  # the structure only: the weights are onnxruntime's to read (runtime/onnx_skeleton.py)
        model = onnx.ModelProto.FromString(skeleton_bytes(path))
    except Exception as e:  # the skim's ValueError, protobuf's DecodeError and friends
        raise ModelFileError(f"{path} is not an ONNX model (corrupt or truncated: {type(e).__name__})") from None
    if not model.HasField("graph") or not model.opset_import:
        raise ModelFileError(f"{path} is not an ONNX model (no graph or opset)")
    return model


class RunError(Exception):
    """onnxruntime rejected the inputs at run time (e.g. a token id past the vocabulary)."""


def ort_message(e: Exception) -> str:
    """onnxruntime's message without its '[ONNXRuntimeError] : N : CODE :' prefix."""
    return str(e).split("] : ", 1)[-1].strip()


def run_session(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    try:
        return dict(zip(names, sess.run(names, feeds)))
    except Exception as e:  # onnxruntime raises its own exception types (InvalidArgument, Fail, ...)
        msg = ort_message(e)
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in feeds.items())
        raise RunError(f"onnxruntime could not run the model on the inputs given ({shapes}): {msg}."
                       f"{_hint(msg)}") from None


def _hint(msg: str) -> str:
    """The hint for an index past a table (a Gather's bounds check: token ids past the vocabulary,
    positions past the context); other failures (a kernel's own checks on CUDA, say) get none."""
    if "out of data bounds" in msg or "indices element" in msg or "index out of range" in msg.lower():
        return " Check that token ids are below the vocabulary size and the sequence fits the model's context."
    return ""
