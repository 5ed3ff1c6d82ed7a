"""MXFP4 tensors of a checkpoint folder (gpt-oss's released experts), dequantised when read.

Why: the released gpt-oss checkpoints store each layer's stacked expert matrices as two tensors,
``NAME_blocks`` (uint8, two FP4 E2M1 values a byte) and ``NAME_scales`` (uint8, one E8M0 exponent per
32 values), with ``quantization_config.quant_method = "mxfp4"`` in config.json. A folder saying so
presents each such pair as the one float tensor ``NAME`` that transformers dequantises it to
(``convert_moe_packed_tensors`` in transformers/integrations/mxfp4.py), with its shape and layout,
so the mapping file's rules for the float checkpoint (unstacking, splitting, transposing) read it
unchanged. Only this layout is read: blocks ``[E, R, G, 16]`` and scales ``[E, R, G]``, decoded to
``[E, G * 32, R]``; anything else is refused with the tensors named.

The decoding, as transformers': byte ``b`` holds value ``2k`` in its low nibble and ``2k + 1`` in its
high one, each nibble an index into the E2M1 table below (sign bit 3); each group of 32 values is
multiplied by ``2 ** (scale - 127)``; the ``[E, R, G * 32]`` result is transposed to ``[E, G * 32, R]``.
A scale byte of 255 is NaN in the OCP MX format (transformers would read 2 ** 128): refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QUANT_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
BYTES_PER_BLOCK = 16  # 32 FP4 values share one scale
E8M0_BIAS = 127
E8M0_NAN = 255

# the FP4 E2M1 values by nibble (transformers' FP4_VALUES; OCP MX v1.0, table 5)
E2M1 = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


class Mxfp4Error(Exception):
    """A folder's MXFP4 tensors that cannot be read; the message names them (weights.py re-raises it)."""


def quant_method(folder: Path) -> str | None:
    """The ``quantization_config.quant_method`` of the folder's config.json, or None (a file, not a
    folder; no config.json; no such key; a config that does not parse, which the config reader reports)."""
    path = Path(folder) / "config.json"
    try:
        if not Path(folder).is_dir() or not path.is_file() or path.stat().st_size > 16 * 1024 * 1024:
            return None
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return method if isinstance(method, str) else None


def pairs(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> dict[str, tuple[str, str, tuple]]:
    """The packed tensors of a checkpoint's headers: float tensor name -> (its blocks, its scales, the
    dequantised shape). Every blocks tensor without its scales (or the reverse), a pair whose dtypes
    are not uint8 or whose shapes do not fit, is one line of the Mxfp4Error."""
    problems, out = [], {}
    for name in sorted(shapes):
        if name.endswith(SCALES) and name[:-len(SCALES)] + BLOCKS not in shapes:
            problems.append(f"{name} has no {name[:-len(SCALES)] + BLOCKS}")
        if not name.endswith(BLOCKS):
            continue
        base = name[:-len(BLOCKS)]
        scales = base + SCALES
        if scales not in shapes:
            problems.append(f"{name} has no {scales}")
            continue
        b, s = tuple(shapes[name]), tuple(shapes[scales])
        if dtypes[name] != "U8" or dtypes[scales] != "U8":
            problems.append(f"{name} is {dtypes[name]} and {scales} is {dtypes[scales]}; both must be U8")
        elif len(b) != 4 or b[-1] != BYTES_PER_BLOCK or s != b[:-1]:
            problems.append(f"{name} is {list(b)} and {scales} is {list(s)}; expected [E, R, G, "
                            f"{BYTES_PER_BLOCK}] and [E, R, G] (32 values a scale)")
        elif base in shapes:
            problems.append(f"{name} and {scales} pack {base}, which the checkpoint also holds as a tensor")
        else:
            out[base] = (name, scales, (b[0], b[2] * 2 * BYTES_PER_BLOCK, b[1]))
    if problems:
        raise Mxfp4Error("MXFP4 tensors that cannot be read (quantization_config.quant_method = \"mxfp4\"): "
                         + "; ".join(problems))
    return out


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of ``blocks [..., R, G, 16]`` with ``scales [..., R, G]``: ``[..., G * 32, R]``
    (the last two axes swapped, as transformers' [E, R, G * 32] -> [E, G * 32, R]). Exact: every
    product of an E2M1 value and a power of two in [2^-127, 2^127] is a float32."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if (scales == E8M0_NAN).any():
        raise Mxfp4Error(f"a scale byte is {E8M0_NAN}, NaN in the OCP MX format")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), dtype=np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - E8M0_BIAS
    values = np.ldexp(values, exponents).astype(np.float32, copy=False)
    flat = values.reshape(values.shape[:-2] + (values.shape[-2] * values.shape[-1],))  # [..., R, G * 32]
    return np.ascontiguousarray(np.swapaxes(flat, -1, -2))


def explain(folder: Path, packed: list[str]) -> str | None:
    """--explain's line for a folder whose tensors ``packed`` were dequantised from MXFP4 (None if none)."""
    from tessera.compiler.passes.site_groups import compact_names

    if not packed:
        return None
    kinds: dict[str, list[str]] = {}
    for name in packed:  # one group per name with its numbers taken out (each projection of every layer)
        kinds.setdefault("".join(c for c in name if not c.isdigit()), []).append(name)
    names = "; ".join(compact_names(group) for group in kinds.values())
    return (f"MXFP4 weights: {len(packed)} tensor(s) of {folder} dequantised from MXFP4 (FP4 E2M1 values, "
            f"one E8M0 scale per 32) to float32 as they load, as transformers' convert_moe_packed_tensors: {names}")
