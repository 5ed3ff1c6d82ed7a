"""A deployment plan (how a model is split over devices, trained or served) and the shape facts it needs.

The parallel, training and capacity figures (parallel.py, training.py, capacity.py)
all start from the same two things: what the user asked for (``Plan``: tensor,
pipeline, data and expert parallel degrees, ZeRO stage, recomputation, serving
context) and what the graph is (``ModelShape``: layers, heads, key/value heads,
widths, experts, context), read from the graph's structure, not from
hyperparameter names. ``check`` turns the combinations that cannot be deployed
into one clear ``PlanError`` before anything is computed; ``check_options``, its
part that needs no model, is what the report's options run before a spec is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.analysis.structure import Structure, layer_key, node_layer
from tessera.compiler.ir.graph import Graph

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
HEADROOM = 0.10  # share of device memory a server keeps free (allocator slack, CUDA context, fragmentation)


class PlanError(ValueError):
    """A plan that cannot be deployed on this model (the command reports it as a usage error)."""


@dataclass(frozen=True)
class Plan:
    tp: int = 1                 # tensor parallel: heads and MLP columns split T ways (Megatron)
    pp: int = 1                 # pipeline parallel: consecutive layers on P stages
    dp: int = 1                 # data parallel replicas
    ep: int = 1                 # expert parallel: the experts of each MoE block spread E ways
    train: bool = False
    zero: int = 0               # ZeRO stage (0: none; 1 optimizer, 2 + gradients, 3 + weights sharded over dp)
    recompute: str = "none"     # activation recomputation: none, selective (attention core), full (whole layer)
    serve: bool = False
    context: int | None = None  # --serve: tokens per sequence (prompt + generated)
    headroom: float = HEADROOM

    @property
    def parallel(self) -> bool:
        return (self.tp, self.pp, self.dp, self.ep) != (1, 1, 1, 1)

    @property
    def devices(self) -> int:
        """T x P x D; expert-parallel ranks are data-parallel ranks (as in Megatron), so E above D
        means E replicas."""
        return self.tp * self.pp * max(self.dp, self.ep)


@dataclass(frozen=True)
class ModelShape:
    layers: list[str]           # repeated layer keys in graph order (layers.0, layers.1, ...)
    heads: int                  # query heads (the score matrix's head axis)
    kv_heads: int               # key/value heads as cached (before any grouped-query repeat)
    head_dim: int
    hidden: int                 # the residual stream's width h
    ffn: int                    # the MLP's (or one expert's) inner width
    gated: bool                 # SwiGLU-style MLP: two input projections of width ffn
    experts: int                # experts per MoE block (0 without)
    top: int                    # experts each token runs
    context: int | None         # longest sequence the model's positions support, if it says
    decodes: bool = False       # has causal self-attention or cross-attention: keeps a KV cache


def _int(d) -> int | None:
    try:
        return int(d)
    except TypeError:
        return None


def model_shape(graph: Graph, st: Structure) -> ModelShape:
    layers = list(dict.fromkeys(k for k in (layer_key(p) for p in graph.params) if k))
    heads = kv = hd = 0
    if st.attention:
        a = st.attention[0]
        q, k = graph.type_of(a.q).shape, graph.type_of(a.k).shape
        heads = _int(q[-3]) if len(q) >= 4 else 1
        kv = _int(k[-3]) if len(k) >= 4 else 1
        hd = _int(q[-1]) or 0
    hidden = 0
    for n in graph.nodes.values():  # the token embedding's width is the residual stream's
        if n.op == "embedding" and n.inputs[1] in graph.params:
            hidden = int(graph.params[n.inputs[1]].shape[-1])
            break
    hidden = hidden or heads * hd
    # the MLP's inner width: the widest linear output of the first layer (q,k,v and the output are
    # at most 3h wide when fused; an MLP is 2.7h to 4h); gated when two of its linears are that wide
    first = layers[0] if layers else None
    widths = [int(graph.params[n.inputs[1]].shape[0]) for n in graph.nodes.values()
              if n.op == "linear" and len(n.inputs) > 1 and n.inputs[1] in graph.params
              and node_layer(n) == first and len(graph.params[n.inputs[1]].shape) == 2]
    experts = top = 0
    if st.experts:
        e = st.experts[0]
        experts, top = e.count, e.top
        w = [graph.params[p].shape for p in e.params[0]]
        ffn = max(min(s) for s in w)
        gated = len(w) >= 3
    else:
        ffn = max(widths, default=0)
        gated = widths.count(ffn) >= 2
    return ModelShape(layers, heads or 0, kv or 0, hd, hidden, ffn, gated, experts, top, model_context(graph),
                      any(a.causal or a.cross for a in st.attention))


def model_context(graph: Graph) -> int | None:
    """The positions a model supports: rows of a learned position table (an embedding of an
    ``arange``), or the ``max_ctx`` a rotary embedding was built for; None if it says neither."""
    for n in graph.nodes.values():
        if n.op == "embedding":
            ids = graph.values[n.inputs[0]].producer
            if ids and graph.nodes[ids].op == "arange":
                return int(graph.type_of(n.inputs[1]).shape[0])
        if n.op == "rope" and n.attrs.get("max_ctx"):
            return int(n.attrs["max_ctx"])
    return None


def cli_flag(name: str) -> str:
    """A plan field as the command line spells it (--tp); the Python API passes its own naming."""
    return "--" + name


def option_errors(plan: Plan, flag=cli_flag) -> list[str]:
    """The reasons the options contradict each other, whatever the model (``flag`` names a field
    as the caller spells it: --zero on the command line, zero in the Python API)."""
    errors = []
    for name in ("tp", "pp", "dp", "ep"):
        if getattr(plan, name) < 1:
            errors.append(f"{flag(name)} must be at least 1, got {getattr(plan, name)}")
    if plan.zero not in ZERO_STAGES:
        errors.append(f"{flag('zero')} must be one of 0, 1, 2, 3, got {plan.zero}")
    elif plan.zero and plan.dp < 2:
        errors.append(f"{flag('zero')} {plan.zero} shards over data-parallel replicas: it needs {flag('dp')} 2 "
                      f"or more")
    if plan.recompute not in RECOMPUTE:
        errors.append(f"{flag('recompute')} must be one of {', '.join(RECOMPUTE)}, got {plan.recompute}")
    if (plan.zero or plan.recompute != "none") and not plan.train:
        errors.append(f"{flag('zero')} and {flag('recompute')} describe training: add {flag('train')}")
    if plan.train and plan.serve:
        errors.append(f"{flag('train')} and {flag('serve')} plan different things: choose one")
    if plan.serve:
        if plan.context is None or plan.context < 1:
            errors.append(f"{flag('serve')} needs {flag('context')} N (tokens per sequence, at least 1)")
    elif plan.context is not None:
        errors.append(f"{flag('context')} is the serving context: add {flag('serve')}")
    return errors


def check_options(plan: Plan, flag=cli_flag) -> None:
    """The rules between the options alone, as one PlanError (runtime/options.ReportOptions.check
    runs them before any spec is built)."""
    errors = option_errors(plan, flag)
    if errors:
        raise PlanError("; ".join(errors))


def check(plan: Plan, shape: ModelShape) -> None:
    """Every reason the plan cannot run on this model, as one PlanError: the option rules, then
    those of the model's shape (heads, layers, experts, positions)."""
    check_options(plan)
    errors = []
    if plan.tp > 1:
        if not shape.heads:
            errors.append(f"--tp {plan.tp}: the model has no attention heads to split")
        else:
            if shape.heads % plan.tp:
                errors.append(f"--tp {plan.tp} does not divide the {shape.heads} attention heads")
            if shape.kv_heads % plan.tp:
                errors.append(f"--tp {plan.tp} does not divide the {shape.kv_heads} key/value heads "
                              f"(each device must hold whole key/value heads)")
    if plan.pp > max(len(shape.layers), 1):
        errors.append(f"--pp {plan.pp} is more pipeline stages than the model's {len(shape.layers)} layers")
    if plan.ep > 1:
        if not shape.experts:
            errors.append(f"--ep {plan.ep}: the model has no mixture of experts")
        elif shape.experts % plan.ep:
            errors.append(f"--ep {plan.ep} does not divide the {shape.experts} experts")
    if plan.serve:
        if plan.context is not None and shape.context is not None and plan.context > shape.context:
            errors.append(f"--context {plan.context} is longer than the {shape.context} positions the model supports")
        if not shape.decodes:
            errors.append("--serve: the model has no causal attention: it does not decode token by token "
                          "(no KV cache to size)")
    if errors:
        raise PlanError("; ".join(errors))
