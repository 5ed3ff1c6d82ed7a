"""Run one ONNX file on onnxruntime's CUDA provider under the stub CUDA libraries and report, as one
JSON line on stdout: where each node was placed, which nodes onnxruntime moved to the CPU and why,
the Memcpy nodes it inserted (in the main graph and inside Loop/If bodies), the attention kernel each
contrib attention node chose (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1), whether one run completed its
host-side checks, and the host<->device copies counted by the stub.

Run by tests/cuda_stub_support.py in a subprocess whose LD_LIBRARY_PATH holds the stub (the provider
library resolves libcudart at load time). Usage: python check.py MODEL.onnx ... [--batch B] [--seq T] [--past P]

What the stub cannot tell: any value computed on the device (kernels do nothing), so this checks
placement and host code only (README.md beside this file).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile

import numpy as np


def _feeds(sess, batch: int, seq: int, past: int) -> dict:
    sizes = {"B": batch, "T": seq, "P": past, "S": seq + 3, "P + T": past + seq, "decode_width": past + seq,
             "length_rows": 1}
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(str(d), seq) for d in i.shape]
        if i.type == "tensor(int64)":
            if "mask" in i.name:
                arr = np.ones(shape, np.int64)
            elif i.name == "cache_length":  # the filled slots of a buffer cache
                arr = np.full(shape, past, np.int64)
            elif "position" in i.name:
                arr = np.broadcast_to(np.arange(past, past + shape[-1], dtype=np.int64), shape).copy()
            else:
                arr = np.ones(shape, np.int64)
        elif i.type == "tensor(int32)":  # GroupQueryAttention's seqlens_k (T - 1) and total length (T)
            arr = np.full(shape, past + seq - (1 if shape else 0), np.int32)
        elif i.type == "tensor(float16)":
            arr = np.zeros(shape, np.float16)
        elif i.type == "tensor(bfloat16)":
            import onnxruntime as ort
            from onnx import TensorProto

            feeds[i.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, np.uint16),
                                                                            TensorProto.BFLOAT16)
            continue
        elif i.type == "tensor(bool)":
            arr = np.ones(shape, bool)
        else:
            arr = np.zeros(shape, np.float32)
        feeds[i.name] = arr
    return feeds


def _memcpys(model) -> tuple[int, int]:
    """Memcpy nodes (MemcpyToHost/MemcpyFromHost) in the main graph, and inside subgraphs (Loop/If bodies)."""
    import onnx

    def walk(g, depth):
        top = sub = 0
        for n in g.node:
            if n.op_type.startswith("Memcpy"):
                if depth:
                    sub += 1
                else:
                    top += 1
            for a in n.attribute:
                graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
                for sg in graphs:
                    t, s = walk(sg, depth + 1)
                    sub += t + s
        return top, sub

    return walk(model.graph, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4)
    ap.add_argument("--past", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO", "1")
    for model in args.models:
        print(json.dumps(check(model, args)), flush=True)


def check(model: str, args) -> dict:
    import onnx
    import onnxruntime as ort

    work = tempfile.mkdtemp(prefix="cuda-check-")
    log_path = os.path.join(work, "ort.log")
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)  # the attention kernels' debug lines are printed on stdout,
    os.dup2(fd, 2)  # onnxruntime's log on stderr
    result: dict = {"providers": [], "ran": False, "error": None}
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 0
        so.log_verbosity_level = 0
        so.optimized_model_filepath = os.path.join(work, "optimized.onnx")
        sess = ort.InferenceSession(model, so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        result["providers"] = sess.get_providers()
        lib = ctypes.CDLL("libcudart.so.13")
        lib.stub_memcpy_reset()
        try:
            feeds = {k: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v)
                     for k, v in _feeds(sess, args.batch, args.seq, args.past).items()}
            sess.run_with_ort_values([o.name for o in sess.get_outputs()], feeds)  # bf16 outputs have no numpy type
            result["ran"] = True
        except Exception as e:  # a kernel's host-side check refused the node
            result["error"] = str(e).split("] : ", 1)[-1].strip()[:2000]
        counts = (ctypes.c_uint64 * 10)()
        lib.stub_memcpy_counts(counts)
        names = ("h2h", "h2d", "d2h", "d2d", "default")
        result["copies"] = {k: {"calls": counts[2 * i], "bytes": counts[2 * i + 1]} for i, k in enumerate(names)}
    except Exception as e:
        result["error"] = "session: " + str(e).split("] : ", 1)[-1].strip()[:2000]
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(fd)
    log = open(log_path, errors="replace").read()
    placed: dict[str, list] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Node\(s\) placed on \[(\w+)\]", line)
        if m:
            current = placed.setdefault(m.group(1), [])
            continue
        m = re.search(r"VerifyEachNodeIsAssignedToAnEp\]\s+(\S+) \((.*)\)$", line)
        if m and current is not None:
            current.append([m.group(1), m.group(2)])
        elif "VerifyEachNodeIsAssignedToAnEp" not in line:
            current = None
    forced = re.findall(r"Force fallback to CPU execution for node: (\S*)", log)
    not_found = sorted(set(re.findall(r"CUDA kernel not found in registries for Op type: (\S+) node name: (\S+)", log)))
    result["cpu_nodes"] = placed.get("CPUExecutionProvider", [])
    result["cpu_forced"] = sorted(forced)
    # onnxruntime moves a node to the CPU for one of two reasons, each logged: no CUDA kernel ("CUDA kernel
    # not found in registries"), or its CPU preference for small shape arithmetic ("Force fallback to CPU
    # execution": int64 values computed from shapes, read by the host). Unnamed nodes are matched by count.
    unforced, left = [], list(forced)
    for op, name in result["cpu_nodes"]:
        if name in left:
            left.remove(name)
        else:
            unforced.append([op, name])
    result["cpu_unforced"] = unforced
    result["not_found"] = [list(x) for x in not_found]
    result["cuda_nodes"] = len(placed.get("CUDAExecutionProvider", []))
    # GroupQueryAttention names its node, MultiHeadAttention and Attention do not: one entry per line
    kernels = re.findall(r"Operator=(\w+)(?: Node=(\S+))? DataType=(\w+) SdpaKernel=(\w+)", log)
    result["kernels"] = [[op, node, dtype, kind] for op, node, dtype, kind in kernels]
    result["kernel_details"] = re.findall(r"^flash=.*$", log, re.M)
    if os.path.exists(so.optimized_model_filepath if result["providers"] else ""):
        top, sub = _memcpys(onnx.load(so.optimized_model_filepath, load_external_data=False))
        result["memcpy_main"], result["memcpy_subgraph"] = top, sub
    return result


if __name__ == "__main__":
    main()
