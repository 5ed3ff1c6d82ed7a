"""The alignment matrix ``tessera run --plot-attention`` draws: which output, which row and head,
and which tokens label its axes.

Kept apart from the drawing (runtime/report/alignment_plot.py, which needs matplotlib) so that the matrix
can be computed and tested on its own: the plot is made from exactly the ``Alignment`` returned here.

The weights come from a model output: one the user names (``--attention-output``), the
probabilities of a transformer attention site exposed as ``attention_probs.<L>``
(compiler/passes/expose_attention.py, ``--layer L``), or by default the only output whose name
says it holds attention weights (``ATTENTION_WORDS``). Shapes accepted: [Tq, Tk], [B, Tq, Tk]
(an encoder–decoder's alignment, target × source) and [B, H, Tq, Tk] (per head: one head, or
their mean). The axes are labelled with the token ids (or, with a tokenizer, the text pieces) of
the integer input whose sequence dimension is the axis's: the source tokens on x, the target on y,
as in Bahdanau et al. (2015), figure 3; positions where no input matches. Positions a padding mask
input marks as padding are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tessera.compiler.ir.signature import InputLimits, InputSpec
from tessera.compiler.passes.expose_attention import PREFIX, output_name

from tessera.runtime.pipeline import UsageError

# An output whose name holds one of these words (as a word part: ``align``, ``cross_attn``,
# ``attention_probs.0``, ``weights``) is taken to hold attention weights.
ATTENTION_WORDS = ("align", "attn", "attention", "probs", "weights")
_WORDS = re.compile("|".join(ATTENTION_WORDS), re.I)


@dataclass
class Alignment:
    """The matrix to draw and its axis labels: ``matrix[i, j]`` is how much target (query) token
    ``rows[i]`` attends to source (key) token ``cols[j]``."""

    matrix: np.ndarray   # [Tq, Tk], float64
    rows: list[str]      # target / query tokens (y axis)
    cols: list[str]      # source / key tokens (x axis)
    output: str          # the model output it was read from
    what: str            # which batch row and head, for the title


def _shape(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def attention_outputs(shapes: dict[str, list]) -> list[str]:
    """The outputs whose name marks them as attention weights and whose rank (2 to 4) fits."""
    return [name for name, dims in shapes.items() if _WORDS.search(name) and 2 <= len(dims) <= 4]


def choose_output(shapes: dict[str, list], name: str | None = None, layer: int | None = None,
                  model: str = "the model") -> str:
    """The output to plot: ``name`` (--attention-output), attention site ``layer``'s exposed
    probabilities, or the only output that attention_outputs finds."""
    listing = ", ".join(f"{k} {_shape(v)}" for k, v in shapes.items())
    if name is not None:
        if name not in shapes:
            raise UsageError(f"--attention-output {name}: {model} has no output of that name (its outputs: {listing})")
        if not 2 <= len(shapes[name]) <= 4:
            raise UsageError(f"--attention-output {name} is {_shape(shapes[name])}; attention weights are "
                             f"[Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk]")
        return name
    if layer is not None:
        want = output_name(layer)
        if want in shapes:
            return want
        have = [k for k in shapes if k.startswith(PREFIX)]
        raise UsageError(f"{model} has no output {want}: the probabilities of attention site {layer} are not "
                         f"exposed (a fused attention kernel never forms them"
                         f"{'; it exposes ' + ', '.join(have) if have else ''}). Run from the spec instead "
                         f"(tessera run SPEC --plot-attention FILE.png --layer {layer}) or compile them in: "
                         f"tessera compile SPEC --attention-probs {layer} -o MODEL.onnx")
    found = attention_outputs(shapes)
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(f"{model} has no output of attention weights (none of its outputs, {listing}, is named "
                         f"with {', '.join(ATTENTION_WORDS)}); name one with --attention-output NAME, or for "
                         f"transformer attention choose a site with --layer L")
    raise UsageError(f"{model} has {len(found)} outputs of attention weights ({', '.join(found)}); choose one "
                     f"with --attention-output NAME")


def select(weights: np.ndarray, batch_index: int = 0, head: int | str | None = None) -> tuple[np.ndarray, str]:
    """The [Tq, Tk] matrix of one batch row (and one head, or the mean over heads for ``"mean"``,
    the default for [B, H, Tq, Tk]), in float64; and a few words saying which."""
    w = np.asarray(weights)
    if w.ndim not in (2, 3, 4):
        raise UsageError(f"attention weights are [Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk]; this output is "
                         f"{list(w.shape)}")
    if w.ndim < 4 and head is not None:
        raise UsageError(f"--head applies to attention over heads [B, H, Tq, Tk]; this output is {list(w.shape)}")
    if w.ndim == 2:
        if batch_index != 0:
            raise UsageError(f"--batch-index {batch_index}: this output [Tq, Tk] has no batch axis")
        return w.astype(np.float64), "one sequence"
    if not 0 <= batch_index < w.shape[0]:
        raise UsageError(f"--batch-index {batch_index} is out of range: the batch has {w.shape[0]} "
                         f"row{'s' if w.shape[0] != 1 else ''} (0 to {w.shape[0] - 1})")
    row = w[batch_index].astype(np.float64)
    what = f"batch row {batch_index}"
    if w.ndim == 3:
        return row, what
    heads = w.shape[1]
    if head is None or head == "mean":
        return row.mean(axis=0), f"{what}, mean over {heads} heads"
    if not 0 <= int(head) < heads:
        raise UsageError(f"--head {head} is out of range: the attention has {heads} heads (0 to {heads - 1}, "
                         f"or mean)")
    return row[int(head)], f"{what}, head {int(head)} of {heads}"


def token_input(dim, specs: list[InputSpec], limits: InputLimits | None) -> InputSpec | None:
    """The integer input whose sequence axis (its last) is ``dim``: token ids (an input indexing an
    embedding table) first, then any other integer input but a mask or type ids."""
    if not isinstance(dim, str):
        return None
    fits = [s for s in specs if s.dtype in ("i64", "i32") and 1 <= len(s.dims) <= 2 and s.dims[-1] == dim]
    ids = set(limits.ids) if limits is not None else set()
    fits.sort(key=lambda s: (s.name not in ids, bool(re.search("mask|type", s.name, re.I))))
    return fits[0] if fits else None


def _labels(n: int, spec: InputSpec | None, feeds: dict[str, np.ndarray], batch_index: int, tokenizer) -> list[str]:
    if spec is None or spec.name not in feeds:
        return [str(i) for i in range(n)]
    ids = np.asarray(feeds[spec.name])
    row = ids[batch_index] if ids.ndim == 2 else ids
    if row.shape[0] != n:
        return [str(i) for i in range(n)]
    if tokenizer is None:
        return [str(int(i)) for i in row]
    return [tokenizer.id_to_token(int(i)) or str(int(i)) for i in row]


def real_positions(dim, n: int, specs: list[InputSpec], feeds: dict[str, np.ndarray], batch_index: int) -> np.ndarray:
    """The positions of an axis that are not padding: where the one mask input over that dimension
    ([B, dim], named with ``mask``, as the models' padding masks are) is nonzero; all n otherwise.
    Why: a right-padded batch row would show its padding as rows and columns of the plot."""
    every = np.arange(n)
    masks = [s for s in specs if isinstance(dim, str) and re.search("mask", s.name, re.I) and len(s.dims) == 2
             and s.dims[-1] == dim and s.name in feeds]
    if len(masks) != 1:
        return every
    row = np.asarray(feeds[masks[0].name])
    row = row[batch_index] if row.ndim == 2 and batch_index < row.shape[0] else None
    if row is None or row.shape[0] != n or not row.any():
        return every
    return np.flatnonzero(row)


def alignment(outputs: dict[str, np.ndarray], output_dims: dict[str, list], specs: list[InputSpec],
              feeds: dict[str, np.ndarray], output: str, batch_index: int = 0, head: int | str | None = None,
              limits: InputLimits | None = None, tokenizer=None) -> Alignment:
    """The Alignment of ``output`` (chosen by choose_output) from a run's outputs: the matrix of
    one batch row and head (select), its axes' tokens from the inputs of the same dimension, and
    the positions a padding mask marks left out (real_positions)."""
    matrix, what = select(outputs[output], batch_index, head)
    dims = output_dims.get(output) or [None] * outputs[output].ndim
    b = batch_index if outputs[output].ndim > 2 else 0
    rows = _labels(matrix.shape[0], token_input(dims[-2], specs, limits), feeds, b, tokenizer)
    cols = _labels(matrix.shape[1], token_input(dims[-1], specs, limits), feeds, b, tokenizer)
    keep_r = real_positions(dims[-2], matrix.shape[0], specs, feeds, b)
    keep_c = real_positions(dims[-1], matrix.shape[1], specs, feeds, b)
    if len(keep_r) < matrix.shape[0] or len(keep_c) < matrix.shape[1]:
        what += ", padding left out"
        matrix = matrix[np.ix_(keep_r, keep_c)]
        rows, cols = [rows[i] for i in keep_r], [cols[i] for i in keep_c]
    return Alignment(matrix, rows, cols, output, what)


def from_run(sess, outputs: dict[str, np.ndarray], specs: list[InputSpec], feeds: dict[str, np.ndarray],
             limits: InputLimits | None = None, output: str | None = None, layer: int | None = None,
             batch_index: int = 0, head: int | str | None = None, tokenizer=None,
             model: str = "the model") -> Alignment:
    """The Alignment a run's outputs give (what `tessera run --plot-attention` and Model.alignment
    draw): the output chosen by choose_output, its symbolic dimensions read from the session."""
    dims = {o.name: list(o.shape) for o in sess.get_outputs()}
    shapes = {n: list(outputs[n].shape) if n in outputs else dims[n] for n in dims}
    name = choose_output(shapes, output, layer, model)
    return alignment(outputs, dims, specs, feeds, name, batch_index, head, limits, tokenizer)


__all__ = ["ATTENTION_WORDS", "Alignment", "attention_outputs", "choose_output", "select", "token_input",
           "real_positions", "alignment", "from_run"]
