"""A KV cache in onnxruntime OrtValues on the model's device: the serving engine's (serving/engine.py), and
`generate`'s when its decoder steps with the plain branch on CUDA (fp32: generation/cached.py ``CachedDecoder``).
Here, not in serving/, so generation can use it (serving imports generation; runtime/serving/device_cache.py
re-exports it).

Why: on CUDA a numpy cache is host memory, so every decoding step bound the rows' live view as
GroupQueryAttention's past and buffer output and onnxruntime copied the whole view to the device and
back -- ``2 x n x W x C`` bytes a step, bounded by the host link, not the GPU. Here the cache is
allocated once on the session's device and bound in place (IOBinding by pointer and shape): a
decoding step moves the token ids, positions, masks and cache lengths in and the logits out, and
GroupQueryAttention writes each row's new column into the shared buffer itself, as ``tessera
generate``'s ``BoundStep`` does (generation/cached.py).

The layout is the numpy cache's (engine.py's module docstring): per layer and key/value one flat
buffer of ``max_batch * kv_heads * capacity * hd`` elements, whose live view is the prefix
``[max_batch, kv_heads, W, hd]``; a row ``[1, kv_heads, W, hd]`` is a contiguous block, so every view
the engine binds is a pointer and a shape. What the engine did with numpy on that buffer is done here
on the device by tiny onnxruntime graphs (onnx.helper, run on the model's provider through IOBinding):

- ``put``: columns of a call's cache outputs (or of host arrays: the prefix cache) into a row;
- ``move_row``: the last row into a freed slot;
- ``relayout``: the live view re-laid for another width, row by row (zeros by ConstantOfShape and Concat,
  not Pad: onnxruntime's CUDA Pad has no bfloat16 kernel);
- ``read``: a row's columns back to the host (the prefix cache storing blocks: per request, not per step).

None of these graphs binds one buffer as both an input and an output (onnxruntime does not promise
what an aliased Slice or Concat writes): a row edited in place is composed into a scratch row first
and copied back. Only GroupQueryAttention's past and present share a buffer, which the kernel
supports. Every graph runs as well on the CPU provider over CPU OrtValues: the engine's
``device_cache=True`` on a CPU session runs this whole path there, which is how its numerics are
checked on a machine without a GPU (tests/serving/test_serve_device_cache.py).
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.bfloat16 import element_type, is_bf16, ortvalue

from tessera.runtime.errors import UsageError

_BIG = np.iinfo(np.int64).max


def session_device(session) -> tuple[str, int]:
    """(onnxruntime device name, device id) of the session's first provider: ("cuda", id) or ("cpu", 0)."""
    if session.get_providers()[0] == "CUDAExecutionProvider":
        opts = session.get_provider_options().get("CUDAExecutionProvider", {})
        return "cuda", int(opts.get("device_id", 0) or 0)
    return "cpu", 0


class _Graphs:
    """The cache's own graphs, one session each, built at first use over ``k`` buffers of ``dtype``.
    Every graph takes the k buffers' inputs ``x{i}`` (and ``y{i}``) and gives outputs ``out{i}``; the
    scalars (int64, 1-D) are shared and, being Slice/ConstantOfShape's shape inputs, stay on the host."""

    def __init__(self, device: str, device_id: int, dtype, k: int):
        self.device, self.device_id, self.k = device, device_id, k
        self.dtype = np.dtype(dtype)
        self.sessions = {}
        self.runs = 0  # graph runs (the tests count what a step costs)

    def _session(self, kind: str):
        sess = self.sessions.get(kind)
        if sess is None:
            sess = self.sessions[kind] = self._open(getattr(self, f"_{kind}")())
        return sess

    def _open(self, nodes_and_io):
        from onnx import TensorProto, helper, numpy_helper

        from tessera.runtime.session import _ort

        nodes, inputs, consts = nodes_and_io
        elem = TensorProto.BFLOAT16 if is_bf16(self.dtype) else TensorProto.FLOAT16 if self.dtype == np.float16 \
            else TensorProto.FLOAT
        value_infos = [helper.make_tensor_value_info(name, TensorProto.INT64 if is_int else elem, None)
                       for name, is_int in inputs]
        outputs = [helper.make_tensor_value_info(f"out{i}", elem, None) for i in range(self.k)]
        inits = [numpy_helper.from_array(np.array(v, dtype=np.int64), name) for name, v in consts.items()]
        graph = helper.make_graph(nodes, "tessera_device_cache", value_infos, outputs, inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 9
        ort = _ort()
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.intra_op_num_threads = 1  # copies: no thread pool of their own beside the model's
        opts.inter_op_num_threads = 1
        if self.device == "cuda":
            providers = [("CUDAExecutionProvider", {"device_id": str(self.device_id)}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        return ort.InferenceSession(model.SerializeToString(), opts, providers=providers)

    # ------------------------------------------------------------------ the graphs
    def _splice(self):
        """out = x with its columns [a, b) replaced by y[row, :, s0:s1] (b - a = s1 - s0): Concat of
        x[..., :a], the source columns and x[..., b:] along the columns (axis 2)."""
        from onnx import helper

        nodes, inputs = [], [("a", True), ("b", True), ("ms", True), ("me", True)]
        for i in range(self.k):
            inputs += [(f"x{i}", False), (f"y{i}", False)]
            nodes += [helper.make_node("Slice", [f"x{i}", "zero", "a", "axis2"], [f"l{i}"]),
                      helper.make_node("Slice", [f"y{i}", "ms", "me", "axes02"], [f"m{i}"]),
                      helper.make_node("Slice", [f"x{i}", "b", "big", "axis2"], [f"r{i}"]),
                      helper.make_node("Concat", [f"l{i}", f"m{i}", f"r{i}"], [f"out{i}"], axis=2)]
        return nodes, inputs, {"zero": [0], "big": [_BIG], "axis2": [2], "axes02": [0, 2]}

    def _resize(self):
        """out = x's first ``keep`` columns, then zeros to the new width (ConstantOfShape of ``z{i}``, the zero
        columns' shape, concatenated: onnxruntime's CUDA Pad has no bfloat16 kernel, Concat and ConstantOfShape do)."""
        from onnx import helper

        value = self._zero_value()
        nodes, inputs = [], [("keep", True)]
        for i in range(self.k):
            inputs += [(f"x{i}", False), (f"z{i}", True)]
            nodes += [helper.make_node("Slice", [f"x{i}", "zero", "keep", "axis2"], [f"s{i}"]),
                      helper.make_node("ConstantOfShape", [f"z{i}"], [f"p{i}"], value=value),
                      helper.make_node("Concat", [f"s{i}", f"p{i}"], [f"out{i}"], axis=2)]
        return nodes, inputs, {"zero": [0], "axis2": [2]}

    def _zero_value(self):
        """ConstantOfShape's value: one zero of the cache's type (bf16 spelled as its ONNX type)."""
        from onnx import TensorProto, helper, numpy_helper

        if is_bf16(self.dtype):
            return helper.make_tensor("value", TensorProto.BFLOAT16, [1], [0])
        return numpy_helper.from_array(np.zeros(1, dtype=self.dtype))

    def _copy(self):
        from onnx import helper

        return ([helper.make_node("Identity", [f"x{i}"], [f"out{i}"]) for i in range(self.k)],
                [(f"x{i}", False) for i in range(self.k)], {})

    def _read(self):
        """out = x's columns [c0, c1)."""
        from onnx import helper

        nodes, inputs = [], [("c0", True), ("c1", True)]
        for i in range(self.k):
            inputs.append((f"x{i}", False))
            nodes.append(helper.make_node("Slice", [f"x{i}", "c0", "c1", "axis2"], [f"out{i}"]))
        return nodes, inputs, {"axis2": [2]}

    def _zeros(self):
        from onnx import helper

        value = self._zero_value()
        return ([helper.make_node("ConstantOfShape", [f"x{i}"], [f"out{i}"], value=value) for i in range(self.k)],
                [(f"x{i}", True) for i in range(self.k)], {})

    def run(self, kind: str, io) -> None:
        from tessera.runtime.session import RunError, ort_message

        try:
            self._session(kind).run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run the device cache's {kind} graph: {ort_message(e)}") from None
        self.runs += 1

    def binding(self, kind: str):
        return self._session(kind).io_binding()


class DeviceCache:
    """The engine's cache buffers as OrtValues on ``session``'s device; see the module docstring.
    ``dims``: cache input name -> (kv_heads, head size), in the engine's order."""

    def __init__(self, session, dims: dict[str, tuple[int, int]], max_batch: int, capacity: int, dtype):
        from tessera.runtime.session import _ort

        self.device, self.device_id = session_device(session)
        self.dims, self.names = dict(dims), list(dims)
        self.max_batch, self.capacity = max_batch, capacity
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.elem = element_type(self.dtype)  # bf16: the ONNX type (an int; runtime/bfloat16.py)
        new = _ort().OrtValue.ortvalue_from_shape_and_type
        try:
            self.flat = {name: new([max_batch * kv * capacity * hd], self.elem, self.device, self.device_id)
                         for name, (kv, hd) in self.dims.items()}
            # one row per buffer: where a row is composed before it is copied into place
            self.scratch = {name: new([kv * capacity * hd], self.elem, self.device, self.device_id)
                            for name, (kv, hd) in self.dims.items()}
        except Exception as e:  # onnxruntime's allocation failure (out of device memory)
            from tessera.runtime.session import ort_message

            raise UsageError(f"the engine's KV cache ({self.nbytes / 2**20:,.1f} MiB) could not be allocated on "
                             f"{self.device}: {ort_message(e)}; serve fewer slots (--max-batch) or a shorter "
                             f"context (--max-context)") from None
        self.graphs = _Graphs(self.device, self.device_id, self.dtype, len(self.names))
        self.moved_rows = 0  # rows moved into a freed slot (the tests check leaves happen)
        self._zero()

    @property
    def nbytes(self) -> int:
        return sum(self.max_batch * kv * self.capacity * hd for kv, hd in self.dims.values()) * self.itemsize

    def pointer(self, name: str, row: int, width: int) -> int:
        """The address of row ``row`` of ``name``'s live view at ``width`` columns."""
        kv, hd = self.dims[name]
        return self.flat[name].data_ptr() + row * kv * width * hd * self.itemsize

    def shape(self, name: str, rows: int, width: int) -> list[int]:
        kv, hd = self.dims[name]
        return [rows, kv, width, hd]

    def bind(self, io, name: str, row: int, rows: int, width: int, output: str | None = None) -> None:
        """Bind rows [row, row + rows) of ``name``'s view at ``width`` as the input ``name`` (and, for a
        GroupQueryAttention graph, as its buffer output ``output``: one memory, written in place)."""
        ptr, shape = self.pointer(name, row, width), self.shape(name, rows, width)
        io.bind_input(name, self.device, self.device_id, self.elem, shape, ptr)
        if output:
            io.bind_output(output, self.device, self.device_id, self.elem, shape, ptr)

    def bind_empty(self, io, name: str) -> None:
        """An empty past [1, kv_heads, 0, hd] (a prompt's first chunk), on the device: nothing to copy."""
        io.bind_input(name, self.device, self.device_id, self.elem, self.shape(name, 1, 0),
                      self.flat[name].data_ptr())

    def _bind_rows(self, io, prefix: str, buffers, row: int, rows: int, width: int, output: bool = False) -> None:
        for i, name in enumerate(self.names):
            kv, hd = self.dims[name]
            ptr = buffers[name].data_ptr() + row * kv * width * hd * self.itemsize
            args = (self.device, self.device_id, self.elem, [rows, kv, width, hd], ptr)
            if output:
                io.bind_output(f"{prefix}{i}", *args)
            else:
                io.bind_input(f"{prefix}{i}", *args)

    # ------------------------------------------------------------------ operations
    def _zero(self) -> None:
        """Every buffer to zeros, once (device memory starts as whatever was there: a masked column
        holding a NaN would still poison a softmax over it)."""
        io = self.graphs.binding("zeros")
        for i, name in enumerate(self.names):
            size = self.flat[name].shape()
            io.bind_cpu_input(f"x{i}", np.array(size, dtype=np.int64))
            io.bind_output(f"out{i}", self.device, self.device_id, self.elem, size, self.flat[name].data_ptr())
        self.graphs.run("zeros", io)

    def _copy_rows(self, src, src_row: int, src_width: int, dst, dst_row: int, width: int) -> None:
        """Row ``src_row`` of ``src`` (buffers by name, a view ``src_width`` wide) to row ``dst_row`` of
        ``dst`` (``width`` wide; the same width), different memory."""
        io = self.graphs.binding("copy")
        self._bind_rows(io, "x", src, src_row, 1, src_width)
        self._bind_rows(io, "out", dst, dst_row, 1, width, output=True)
        self.graphs.run("copy", io)

    def put(self, row: int, width: int, at: int, sources: dict, src_row: int, s0: int, s1: int) -> None:
        """Columns [s0, s1) of row ``src_row`` of each source (by cache name: an OrtValue on the device, a
        call's cache output, or a host array) into row ``row``'s columns from ``at`` (view ``width`` wide)."""
        io, keep = self.graphs.binding("splice"), []
        io.bind_cpu_input("a", np.array([at], dtype=np.int64))
        io.bind_cpu_input("b", np.array([at + s1 - s0], dtype=np.int64))
        io.bind_cpu_input("ms", np.array([src_row, s0], dtype=np.int64))
        io.bind_cpu_input("me", np.array([src_row + 1, s1], dtype=np.int64))
        self._bind_rows(io, "x", self.flat, row, 1, width)
        for i, name in enumerate(self.names):
            src = sources[name]
            if isinstance(src, np.ndarray):  # the prefix cache's blocks: copied to the device here (bf16 as words)
                keep.append(ortvalue(np.ascontiguousarray(src, dtype=self.dtype)))
                io.bind_ortvalue_input(f"y{i}", keep[-1])
            else:
                io.bind_ortvalue_input(f"y{i}", src)
        self._bind_rows(io, "out", self.scratch, 0, 1, width, output=True)
        self.graphs.run("splice", io)
        self._copy_rows(self.scratch, 0, width, self.flat, row, width)

    def move_row(self, src_row: int, dst_row: int, width: int) -> None:
        """Row ``src_row`` into row ``dst_row`` (a leaving row's slot), every column of the view."""
        if src_row != dst_row:
            self._copy_rows(self.flat, src_row, width, self.flat, dst_row, width)
            self.moved_rows += 1

    def relayout(self, rows: int, old: int, new: int) -> None:
        """The first ``rows`` rows re-laid from a view ``old`` columns wide to one ``new`` wide, keeping
        their first min(old, new) columns (the rest zeros). Row by row, in the numpy cache's order (the
        last first when widening, the first first when narrowing), so no row's new place covers one not
        moved yet; a row whose new place overlaps its old one goes through the scratch row."""
        if old == new:
            return
        keep = min(old, new)
        order = range(rows - 1, -1, -1) if new > old else range(rows)
        for r in order:
            io = self.graphs.binding("resize")
            io.bind_cpu_input("keep", np.array([keep], dtype=np.int64))
            for i, name in enumerate(self.names):
                kv, hd = self.dims[name]
                io.bind_cpu_input(f"z{i}", np.array([1, kv, new - keep, hd], dtype=np.int64))
            self._bind_rows(io, "x", self.flat, r, 1, old)
            overlaps = r * new < (r + 1) * old and r * old < (r + 1) * new  # in units of kv_heads x hd
            self._bind_rows(io, "out", self.scratch if overlaps else self.flat, 0 if overlaps else r, 1, new,
                            output=True)
            self.graphs.run("resize", io)
            if overlaps:
                self._copy_rows(self.scratch, 0, new, self.flat, r, new)

    def read(self, row: int, width: int, c0: int, c1: int) -> dict[str, np.ndarray]:
        """Row ``row``'s columns [c0, c1) of every buffer, copied to the host: name -> [kv_heads, c1 - c0, hd]."""
        io = self.graphs.binding("read")
        io.bind_cpu_input("c0", np.array([c0], dtype=np.int64))
        io.bind_cpu_input("c1", np.array([c1], dtype=np.int64))
        self._bind_rows(io, "x", self.flat, row, 1, width)
        out = {}
        for i, name in enumerate(self.names):  # into host arrays of the cache's type (bf16: ml_dtypes' words)
            kv, hd = self.dims[name]
            arr = out[name] = np.empty((1, kv, c1 - c0, hd), dtype=self.dtype)
            io.bind_output(f"out{i}", "cpu", 0, self.elem, list(arr.shape), arr.ctypes.data)
        self.graphs.run("read", io)
        return {name: arr[0] for name, arr in out.items()}

    def host_view(self, rows: int, width: int) -> dict[str, np.ndarray]:
        """The first ``rows`` rows of every buffer's live view at ``width``, copied to the host:
        name -> [rows, kv_heads, width, hd] (the tests compare it with the numpy cache's)."""
        got = [self.read(r, width, 0, width) for r in range(rows)]
        return {name: np.stack([g[name] for g in got]) for name in self.names}
