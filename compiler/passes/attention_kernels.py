"""Choose how each fused_attention node is lowered, per target, and its tile sizes.

Lowerings (``--attention NAME`` forces one):

- ``gqa``: onnxruntime's com.microsoft.GroupQueryAttention. On CUDA it has
  flash kernels for fp16/bf16 with head size a multiple of 8, at most 256. On
  CPU, onnxruntime 1.31 allocates the N×N attention probabilities (measured:
  3.3 GB extra at N=8192 with 12 heads, docs/benchmarks/log.md) and is slower than
  the portable kernel, so auto does not pick it there; --attention gqa still can.
  It is causal only (optionally with a local window), without padding mask or
  bias, and needs queries and keys of the same length.
- ``mha``: com.microsoft.MultiHeadAttention. Tiled on CPU only without mask,
  bias or past (non-causal self- or cross-attention); flash on CUDA fp16/bf16.
- ``portable``: Tessera's own tiled kernel in standard ONNX ops (a Loop over
  query tiles; causal tiles skip the keys they cannot see). Exact, runs on any
  ONNX runtime, memory O(N·tile) instead of O(N²). Handles every case.
- ``block``: no Loop: the whole [B, H, Tq, Tk] score block as plain MatMul/Softmax
  (memory O(N²), as unfused). Handles every case. On CPU, auto uses it while the
  scores fit BLOCK_BYTES: where the sequence length is known at compile time by
  choosing it, otherwise by an If on the run-time length in front of the kernel
  chosen for long sequences (the node's ``block_bytes``).

Tile sizes follow the FlashAttention paper's rule: with M bytes of on-chip
memory and head size d, key tiles hold Bc = ceil(M / (4·d·bytes)) columns and
query tiles Br = min(Bc, d) rows. On CPU, M is the per-core L2 cache; on CUDA,
the shared memory of one streaming multiprocessor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.compiler.backends.onnx.attention import kernel_assumes, kernel_clash, kernel_features
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import PRECISION_BYTES, Graph, Node
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.patterns.attention import recognise
from tessera.compiler.reference import score_epilogue

KERNELS = ("gqa", "mha", "attn23", "block", "portable")

# The whole score block of a site (B·H·Tq·Tk scores) up to this many bytes is computed as one
# block with no Loop on CPU. bench/attention.py, B = 1, 12 heads of 64, causal, fp32, 2 threads
# (docs/benchmarks/log.md, "Short sequences: the block kernel"): the block is faster than the
# portable Loop up to N = 256 (3 MiB of scores) and slower from 384 (6.75 MiB) on, by 3x at 512 (12 MiB).
BLOCK_BYTES = 4 * 1024 * 1024
BLOCK_MEASURED = "N = 128: 1.0 against 1.4 ms for the Loop and 1.1 ms unfused"

# On-chip memory per target, bytes (CPU: a typical per-core L2; CUDA: H100/H200 SM shared memory).
ON_CHIP_BYTES = {"cpu": 2 * 1024 * 1024, "cuda": 228 * 1024}


@dataclass(frozen=True)
class Target:
    device: str = "cpu"  # cpu | cuda
    dtype: str = "fp32"  # fp32 | fp16 | bf16


def tile_sizes(target: Target, head_size: int) -> tuple[int, int]:
    """(query tile Br, key tile Bc) from the FlashAttention rule, rounded down to powers of two."""
    m = ON_CHIP_BYTES[target.device]
    bc = math.ceil(m / (4 * head_size * PRECISION_BYTES[target.dtype]))
    br = min(bc, head_size)
    pow2 = lambda n: 1 << max(4, int(math.floor(math.log2(max(n, 16)))))  # noqa: E731
    return pow2(br), pow2(bc)


_NAMES = {"gqa": "GroupQueryAttention", "mha": "MultiHeadAttention", "attn23": "onnx's Attention (opset 23)",
          "block": "the block kernel",
          "portable": "the portable kernel", "cached": "the cached kernel", "phased": "the phased kernel"}


def unsupported(kernel: str, attrs: dict) -> str | None:
    """Why ``kernel`` cannot compute the score epilogue these attributes ask for: the features the node
    uses that the kernel's allow-list (backends/onnx/attention.py KERNEL_FEATURES) lacks, or a shortcut
    the kernel takes (KERNEL_ASSUMES; with ``prefix_keys``, the mask-less gqa decoding step's too) that one of
    them breaks; None if neither."""
    have = kernel_features(kernel, attrs.get("decode"), attrs.get("prefill"))
    missing = [f for f in score_epilogue.used(attrs) if f not in have]
    if missing:
        return (f"{_NAMES.get(kernel, kernel)} computes no {score_epilogue.words(missing)} "
                f"(of the score epilogue it computes {score_epilogue.words(sorted(have)) or 'nothing'})")
    clash = kernel_clash(kernel, score_epilogue.used(attrs))
    if clash:
        return f"{_NAMES.get(kernel, kernel)} cannot be exact here: {clash}"
    broken = score_epilogue.broken(kernel_assumes(kernel, attrs), attrs)
    if broken:
        return f"{_NAMES.get(kernel, kernel)} cannot be exact here: {'; '.join(broken)}"
    return None


def no_kernel(attrs: dict) -> str | None:
    """Why no kernel can lower a fused attention with these attributes (None: one can). Fusion
    (passes/fuse_attention.py) leaves such a site unfused with this reason."""
    reasons = [unsupported(k, attrs) for k in KERNELS]
    if all(reasons):
        missing = [f for f in score_epilogue.used(attrs) if all(f not in kernel_features(k) for k in KERNELS)]
        return f"no attention kernel computes the {score_epilogue.words(missing) or 'score epilogue'} of these " \
               f"scores ({'; '.join(reasons)})"
    return None


def why_not(kernel: str, node: Node, graph: Graph, target: Target) -> str | None:
    """Why ``kernel`` cannot lower this fused attention (None: it can): first what it computes
    (its allow-list of score-epilogue features), then its limits on shapes and targets."""
    a = node.attrs
    if kernel not in KERNELS:
        return f"unknown kernel '{kernel}'"
    missing = unsupported(kernel, a)
    if missing:
        return missing
    q_t, k_t = graph.type_of(node.inputs[0]), graph.type_of(node.inputs[1])
    hd = q_t.shape[-1]
    same_len = dims.equal(q_t.shape[-2], k_t.shape[-2])
    if kernel in ("portable", "block"):
        return None
    if not dims.is_static(hd):
        return "the head size is not fixed"
    if value_size_differs(node, graph):
        return "values have a different head size from queries and keys"
    if target.device == "cuda" and (int(hd) % 8 or int(hd) > 256):
        return f"CUDA flash kernels need a head size that is a multiple of 8 and at most 256 (got {int(hd)})"
    if int(hd) % 8:
        return f"onnxruntime's contrib attention kernels need a head size that is a multiple of 8 (got {int(hd)})"
    if kernel == "gqa":
        if target.device == "cuda" and target.dtype == "fp32":
            return ("onnxruntime 1.31 has no fp32 CUDA kernel for GroupQueryAttention (it would run on the CPU, "
                    "copied to and from the device)")
        if not a["causal"]:
            return "GroupQueryAttention is used here for causal attention only"
        if not same_len:
            return "queries and keys have different lengths (GroupQueryAttention without a cache needs equal ones)"
        return None
    if kernel == "attn23":
        return None
    if kernel == "mha":
        if target.device == "cuda" and target.dtype != "fp16":
            return (f"onnxruntime 1.31's MultiHeadAttention runs its unfused MATH path on CUDA in {target.dtype} "
                    f"(tests/cuda_stub); onnx's Attention (opset 23) runs the memory-efficient kernel")
        if a["causal"]:
            return "MultiHeadAttention materialises the N×N scores when causal (unidirectional)"
        if a["kv_heads"] != a["heads"]:
            return "MultiHeadAttention has no grouped key/value heads"
    return None


def score_bytes(node: Node, graph: Graph, target: Target):
    """Bytes of the whole [B, H, Tq, Tk] score block (a sympy expression where lengths are symbolic)."""
    q_t, k_t = graph.type_of(node.inputs[0]), graph.type_of(node.inputs[1])
    return (dims.dim(q_t.shape[0]) * node.attrs["heads"] * dims.dim(q_t.shape[-2]) * dims.dim(k_t.shape[-2])
            * PRECISION_BYTES[target.dtype])


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def choose(node: Node, graph: Graph, target: Target) -> tuple[str, str]:
    """The kernel for one fused attention on a target, and the reason. On CPU, a site whose whole
    score block fits BLOCK_BYTES gets the block kernel; one whose length is only known at run time
    keeps the long-sequence kernel named here, with the block in front of it (``block_for``)."""
    impl, reason = _choose_long(node, graph, target)
    refused = why_not(impl, node, graph, target)
    if refused:  # a feature breaks the long kernel's shortcut: the block kernel computes every score
        return "block", (f"the block kernel, which takes no shortcut, computes every score of the whole block "
                         f"(memory O(N²)): {refused}")
    if target.device != "cpu":
        return impl, reason
    n = score_bytes(node, graph, target)
    if dims.is_static(n):
        if int(n) <= BLOCK_BYTES:
            return "block", (f"the whole score block ({_mib(int(n))}) fits {_mib(BLOCK_BYTES)}: one block of plain "
                             f"MatMul/Softmax with no Loop is faster there ({BLOCK_MEASURED}; docs/benchmarks/log.md)")
        return impl, reason
    return impl, (f"the block kernel (no Loop) while the B·H·Tq·Tk scores fit {_mib(BLOCK_BYTES)} at run time "
                  f"({BLOCK_MEASURED}); longer: {reason}")


def block_for(node: Node, graph: Graph, target: Target, impl: str) -> int:
    """BLOCK_BYTES where auto puts the block kernel in front of ``impl`` at run time, else 0."""
    if target.device != "cpu" or impl not in ("portable", "mha"):
        return 0
    return 0 if dims.is_static(score_bytes(node, graph, target)) else BLOCK_BYTES


def _choose_long(node: Node, graph: Graph, target: Target) -> tuple[str, str]:
    """The kernel for one fused attention on a target when its scores are too big for one block."""
    if target.device == "cuda":
        return _choose_cuda(node, graph, target)
    candidates = [("mha", "onnxruntime's MultiHeadAttention is tiled without mask, bias or past")]
    if target.device == "cuda":
        candidates.insert(0, ("gqa", "onnxruntime's GroupQueryAttention has a flash kernel for causal prefill"))
    for kernel, good in candidates:
        if why_not(kernel, node, graph, target) is None:
            return kernel, good + (" (flash kernel on CUDA)" if target.device == "cuda" else " on CPU")
    if node.attrs["causal"] and target.device == "cpu" and why_not("gqa", node, graph, target) is None:
        return "portable", ("Tessera's tiled kernel: onnxruntime 1.31's GroupQueryAttention on CPU holds the "
                            "N×N probabilities and is slower (3.3 GB extra, 1.6–1.8× the time at N=8192, 12 heads; "
                            "docs/benchmarks/log.md)")
    reason = why_not("gqa", node, graph, target) if node.attrs["causal"] else why_not("mha", node, graph, target)
    return "portable", f"Tessera's tiled kernel: onnxruntime's contrib kernels would not be tiled here ({reason})"


# What onnxruntime-gpu 1.31.1's CUDA provider chose for each lowering (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1,
# sm_90, under the stub CUDA libraries of tests/cuda_stub; a choice made by the kernels' host code, not timed):
# GroupQueryAttention fp16/bf16 FLASH_ATTENTION; Attention-23 with a boolean or float attn_mask
# EFFICIENT_ATTENTION in fp32, fp16 and bf16 (with is_causal and no mask in fp32: MATH, hence no is_causal);
# MultiHeadAttention MATH in fp32 and bf16, causal or with a bias.
CUDA_SEEN = "onnxruntime-gpu 1.31.1, sm_90, tests/cuda_stub"


def _choose_cuda(node: Node, graph: Graph, target: Target) -> tuple[str, str]:
    """The fused CUDA kernel for one site: GroupQueryAttention (flash) for causal self-attention with no
    other mask in fp16/bf16; else onnx's Attention (opset 23) with its masks and bias as one attn_mask
    (memory-efficient kernel); the portable Loop only where neither applies."""
    gqa = why_not("gqa", node, graph, target)
    if gqa is None:
        return "gqa", f"onnxruntime's GroupQueryAttention: FLASH_ATTENTION for causal {target.dtype} ({CUDA_SEEN})"
    attn = why_not("attn23", node, graph, target)
    if attn is None:
        masks = [w for w, on in (("causal", node.attrs["causal"]), ("padding", node.attrs["padding"]),
                                 ("bias", node.attrs["bias"])) if on]
        as_mask = f", its {' and '.join(masks)} as one attn_mask" if masks else ""
        return "attn23", (f"onnx's Attention (opset 23){as_mask}: EFFICIENT_ATTENTION in {target.dtype} ({CUDA_SEEN}); "
                          f"not GroupQueryAttention: {gqa}")
    return "portable", (f"no fused CUDA kernel applies (onnx's Attention: {attn}; GroupQueryAttention: {gqa}): "
                        f"Tessera's tiled kernel, a Loop whose slice bounds the host reads at each iteration")


# bench/decode_attention.py, one decoding step (T = 1), 12 heads of 64, fp32, 2 threads, ms (min of 300, two
# runs on 2026-12-02): Tessera's cached lowering / GroupQueryAttention sharing the cache buffer (bound by
# IOBinding) / MultiHeadAttention with past. Alone, GroupQueryAttention is as fast or faster.
DECODE_MEASURED = "0.041 / 0.029 / 0.045 ms at P = 128, 0.119-0.195 / 0.129-0.173 / 0.152-0.168 ms at P = 1024"


def cached_prefill(node: Node, graph: Graph, target: Target, gqa_decode: bool = False) -> str | None:
    """The prompt's kernel of a phased site when not the portable Loop: on CUDA, onnx's Attention (opset
    23), where it computes the site's features (KERNEL_FEATURES, KERNEL_CLASHES) and the values have the
    keys' head size (as the uncached attn23 asks, ``why_not``: with narrower values, DeepSeek's, onnxruntime
    1.31's CUDA Attention was seen taking its MATH path, and that case was never run on a GPU here)."""
    if target.device != "cuda" or unsupported("attn23", node.attrs) or value_size_differs(node, graph):
        return None
    return "attn23"


def value_size_differs(node: Node, graph: Graph) -> bool:
    """Whether the site's value heads have a size of their own (sdpa's v [B, H, Tk, hv], hv != hd)."""
    return not dims.equal(graph.type_of(node.inputs[2]).shape[-1], graph.type_of(node.inputs[0]).shape[-1])


def choose_cached(node: Node, graph: Graph, target: Target, gqa_decode: bool = False) -> tuple[str, str]:
    """The lowering of a KV-cached attention site (compiler/passes/kv_cache.py), both phases, and why.

    ``phased`` is an If on T: the prompt (T > 1) goes through the portable tiled kernel, which never
    forms the T x (P+T) scores, and each decoding step (T = 1) through plain MatMul/Softmax over the
    cache buffer (backends/onnx/cached_attention.py), read in place from the numpy arrays the loop
    feeds -- or, in buffer mode on CPU, through onnxruntime's GroupQueryAttention writing the buffer
    in place (passes/kv_cache.py ``decode``, which rewrites this reason to say so); MultiHeadAttention
    with past copies the past every step and has no grouped key/value heads. On CUDA the plain
    branch stands, unmeasured (no GPU was lent)."""
    missing = unsupported("phased", {**node.attrs, "decode": "gqa" if gqa_decode else None})
    if missing:  # fused for the block kernel alone (a feature breaking the cache's shortcuts): no cache
        raise PassError(f"the attention at {node.scope} cannot be cached: {missing}")
    if node.attrs.get("chunk"):  # the chunks follow each row's positions, which the cache's mask holds
        return "cached", ("chunked attention: prompt and decoding steps through the plain cached kernel, whose "
                          "mask counts the chunks from each row's first real token (the tiled prefill would "
                          "count them from the left padding)")
    prefill = "prefill (T > 1): portable tiled kernel, the T x (P+T) scores never formed"
    if target.device == "cuda" and value_size_differs(node, graph):
        prefill += " (not onnx's Attention: values have a different head size from queries and keys)"
    if cached_prefill(node, graph, target, gqa_decode):
        prefill = (f"prefill (T > 1): onnx's Attention (opset 23) over past and new keys, its masks as one attn_mask "
                   f"(EFFICIENT_ATTENTION in {target.dtype}; {CUDA_SEEN})")
    if gqa_decode:  # passes/kv_cache.py found the site fit for it (buffer cache, float32, head size)
        return "phased", (f"{prefill}; decode (T = 1): GroupQueryAttention over the cache buffer, bound as its "
                          f"past and present, the new column written in place")
    where = "CPU" if target.device == "cpu" else "CPU (not measured on CUDA)"
    return "phased", (f"{prefill}; decode (T = 1): "
                      f"cached, plain MatMul/Softmax over the cache buffer, read in place with no binding; "
                      f"GroupQueryAttention with a shared buffer, as fast alone on {where}, needs the buffer bound as "
                      f"its output, and MultiHeadAttention with past copies the past and has no grouped key/value "
                      f"heads ({DECODE_MEASURED}; bench/decode_attention.py)")


@dataclass(frozen=True)
class KernelChoice:
    """The kernel-selection pass's note for one fused_attention node."""

    node: str
    impl: str
    reason: str


class ChooseAttentionKernels(Pass):
    """Set impl, q_tile and k_tile on every fused attention the recogniser finds; notes: a KernelChoice each."""

    name = "choose-attention-kernels"

    def __init__(self, target: Target = Target(), force: str | None = None):
        if force is not None and force not in KERNELS:
            raise PassError(f"unknown attention kernel '{force}' (choose from {', '.join(KERNELS)}, or unfused)")
        self.target, self.force = target, force

    def run(self, graph: Graph) -> PassResult:
        choices, changed = [], False
        for cand in recognise(graph):
            if cand.match is None or not cand.match.fused:
                continue
            node = cand.node
            if self.force:
                problem = why_not(self.force, node, graph, self.target)
                if problem:
                    raise PassError(f"--attention {self.force} cannot lower the attention at {node.scope} "
                                    f"({node.origin}): {problem}")
                impl, reason, block = self.force, "forced by --attention", 0
            else:
                impl, reason = choose(node, graph, self.target)
                block = block_for(node, graph, self.target, impl)
                problem = why_not(impl, node, graph, self.target) or (block and why_not("block", node, graph,
                                                                                       self.target))
                if problem:  # fusion leaves a site no kernel computes unfused (no_kernel): a bug if reached
                    raise PassError(f"the attention at {node.scope} ({node.origin}) was fused, but {problem}")
            hd = graph.type_of(cand.match.q).shape[-1]
            br, bc = tile_sizes(self.target, int(hd) if dims.is_static(hd) else 64)
            chosen = {"impl": impl, "q_tile": br, "k_tile": bc}
            if block or node.attrs.get("block_bytes"):
                chosen["block_bytes"] = block
            changed = changed or any(node.attrs.get(k) != v for k, v in chosen.items())
            node.attrs.update(chosen)
            choices.append(KernelChoice(node.name, impl, reason))
        return PassResult(graph, changed, choices)
