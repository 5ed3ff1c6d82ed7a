"""Training memory of one device: states under each ZeRO stage, activations after Korthikanti et al. 2022.

States (Rajbhandari et al., ZeRO, 2020), for the Φ parameters one device holds after
the tensor, pipeline and expert split (parallel.py), with Adam:

    weights  Φ·e   (÷ D with ZeRO-3)          e: bytes of --dtype
    gradients Φ·e  (÷ D with ZeRO-2 and 3)
    optimizer Φ·8  (Adam's two fp32 moments; ÷ D with ZeRO-1, 2, 3)
    master    Φ·4  (fp32 copy for fp16/bf16 training, 0 for fp32; ÷ D with ZeRO-1, 2, 3)

Activations per layer follow "Reducing Activation Recomputation in Large Transformer
Models" (Korthikanti et al. 2022, Table 2), in the **tensor + sequence parallel**
variant: every term is divided by T. Why that variant: sequence parallelism is what
Megatron runs with tensor parallelism since that paper (it costs no extra
communication: the all-reduces become reduce-scatter + all-gather), and without it the
10·sbh of norms and dropouts would stay replicated, which no current recipe does.
For a GPT layer at 2-byte activations the paper's counts are

    none       sbh(34 + 5as/h) / T
    selective  34·sbh / T            (the attention core is recomputed: no scores kept)
    full       2·sbh / T             (only the layer's input is kept)

This module writes the 34 out term by term so that it follows the model's shape
(e: element bytes, kv: key/value heads, f: MLP width; dropout masks 1 byte, as in the
paper): attention e·(3 + 2·kv/a)·sbh + sbh (input of QKV, Q, K, V, input of the output
projection; dropout mask), MLP e·sbh + e·c·sbf + sbh (its input, c = 2 for GeLU and 3 for
SwiGLU intermediate tensors; dropout mask), two norms 2·e·sbh, scores (2e + 1)·as²b (softmax
output, dropout mask and output). GPT (kv = a, f = 4h, GeLU, e = 2) gives 11 + 19 + 4 = 34
and 5as²b exactly. A mixture of experts keeps its MLP tensors for each of the top-k copies of
a token. With fused attention (FlashAttention) the scores are never stored: the kernel keeps
one fp32 log-sum-exp per query row and head, 4·asb, instead of (2e + 1)·as²b.

Pipeline: under 1F1B the first stage holds P micro-batches in flight, each through its L/P
layers, so it holds L layers' worth (the paper's point); the figure is for that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.analysis.plan import ModelShape, Plan
from tessera.compiler.analysis.poly import Poly


@dataclass
class TrainingStates:
    weights: int
    gradients: int
    optimizer: int
    master_weights: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.master_weights


def _shard(x: int, by: int) -> int:
    return -(-x // by)


def states(params: int, plan: Plan, act_bytes: int) -> TrainingStates:
    """ZeRO stage 1 shards the optimizer (moments and master weights), 2 also the gradients,
    3 also the weights, each over the D data-parallel replicas."""
    d = plan.dp
    return TrainingStates(
        weights=_shard(params * act_bytes, d if plan.zero >= 3 else 1),
        gradients=_shard(params * act_bytes, d if plan.zero >= 2 else 1),
        optimizer=_shard(params * 8, d if plan.zero >= 1 else 1),
        master_weights=_shard(params * 4, d if plan.zero >= 1 else 1) if act_bytes < 4 else 0)


def layer_activations(shape: ModelShape, plan: Plan, b: Poly, s: Poly, e: int, fused: bool,
                      moe: bool) -> Poly:
    """Bytes one transformer layer keeps for its backward pass on one device (see the module doc)."""
    h, a, kv, f = shape.hidden, shape.heads, shape.kv_heads, shape.ffn
    sbh = s * b * h
    if plan.recompute == "full":
        return sbh * e / plan.tp
    attn = sbh * (e * 3 + 1) + s * b * (2 * e * kv * shape.head_dim)
    copies = shape.top if moe and shape.top else 1
    mlp = sbh * (e * copies + 1) + s * b * (e * (3 if shape.gated else 2) * f * copies)
    norms = sbh * (2 * e)
    total = attn + mlp + norms
    if plan.recompute == "none":
        total = total + (b * s * a * 4 if fused else b * s * s * (a * (2 * e + 1)))
    return total / plan.tp


def activations(shape: ModelShape, plan: Plan, stage_layers: list[int], stage_moe: list[int], b: Poly,
                s: Poly, e: int, fused: bool, bindings: dict[str, int]) -> Poly:
    """The largest stage's kept activations: stage i has min(P − i, micro-batches) in flight under
    1F1B; with as many micro-batches as stages the first stage holds P of them. The largest is
    chosen at ``bindings``."""
    best, best_v = Poly(), -1
    for i, (n, m) in enumerate(zip(stage_layers, stage_moe)):
        in_flight = plan.pp - i
        p = (layer_activations(shape, plan, b, s, e, fused, False) * (n - m)
             + layer_activations(shape, plan, b, s, e, fused, True) * m) * in_flight
        v = p.evaluate(bindings)
        if v > best_v:
            best, best_v = p, v
    return best
