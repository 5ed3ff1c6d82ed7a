"""Numpy building blocks shared by the ops' reference semantics, the ONNX lowerings (which bake
the same tables) and the tests: erf, softmax, the fill of masked scores, RoPE frequencies and
the sinusoidal position table. Pure numpy; nothing here knows about graphs or ops."""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def min_value(dtype) -> float:
    return float(np.finfo(dtype).min)


def erf(x: np.ndarray) -> np.ndarray:
    return _erf(x.astype(np.float64)).astype(np.float64).astype(x.dtype)


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")


def longrope_parts(scaling: tuple) -> tuple[int, float, tuple, tuple]:
    """A longrope rope's attribute (original_ctx, attention_factor, short factors..., long factors...)
    as (original_ctx, attention_factor, short, long): one flat tuple of numbers in the graph, like
    every other kind's, so attribute hashing and printing need nothing new."""
    half = (len(scaling) - 2) // 2
    return int(scaling[0]), float(scaling[1]), tuple(scaling[2:2 + half]), tuple(scaling[2 + half:])


def rope_inv_freq(hd: int, theta: float, scaling: tuple | None = None, kind: str = "llama3",
                  seq_len: int | None = None) -> np.ndarray:
    """RoPE's hd/2 inverse frequencies theta^(-2i/hd), in fp32 as Hugging Face computes them
    (transformers.modeling_rope_utils), with the scaling ``kind`` (rope_type) given ``scaling``:

    - "llama3": (factor, low_freq, high_freq, original_ctx), Llama 3.1's: wavelengths longer than
      original_ctx / low_freq are divided by factor, those shorter than original_ctx / high_freq
      are kept, and those between are interpolated smoothly (low_freq = high_freq: none between);
    - "linear": (factor,): every frequency divided by factor (positions interpolated);
    - "dynamic": (factor, original_ctx), dynamic NTK: the base grows with the sequence length
      ``seq_len`` once it passes original_ctx (plain RoPE up to there);
    - "yarn": (factor, beta_fast, beta_slow, original_ctx, attention_factor, truncate): YaRN's
      blend of interpolated and extrapolated frequencies (its cos/sin factor: rope_attention_factor);
    - "longrope": (original_ctx, attention_factor, short..., long...) (longrope_parts), Phi-3's: each
      frequency divided by its own factor, the short ones while the sequence length ``seq_len`` (the
      largest position + 1) is at most original_ctx, the long ones past it (transformers'
      _compute_longrope_parameters and longrope_frequency_update)."""
    if kind == "longrope":
        ctx, _, short, long = longrope_parts(scaling)
        ext = np.asarray(long if seq_len is not None and seq_len > ctx else short, dtype=np.float32)
        shape = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
        return (np.float32(1.0) / (ext * np.float32(theta) ** shape)).astype(np.float32)
    if kind == "dynamic" and scaling is not None:
        factor, ctx = scaling
        length = np.float32(max(int(seq_len if seq_len is not None else ctx), int(ctx)))
        grow = np.float32(factor) * length / np.float32(ctx) - np.float32(factor - 1)
        theta = np.float32(theta) * grow ** np.float32(hd / (hd - 2))
    inv_freq = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))).astype(np.float32)
    if scaling is None or kind == "dynamic":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling[0])).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(hd, theta, *scaling[:4], bool(scaling[5]))
    factor, low, high, ctx = (np.float32(v) for v in scaling)
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    if high == low:  # no band between the bounds (Llama 4 Scout's 1.0 and 1.0): divided or kept, nothing smoothed
        return scaled.astype(np.float32)  # (transformers' 0/0 there is nan, at a wavelength exactly ctx / low only)
    smooth = (ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < ctx / high) & ~(wavelen > ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(hd, theta, factor, beta_fast, beta_slow, ctx, truncate) -> np.ndarray:
    """transformers' _compute_yarn_parameters: the frequencies of dimensions that turn fewer than
    beta_slow times over original_ctx are interpolated (divided by factor), those turning more
    than beta_fast times are kept, with a linear ramp between."""
    import math

    def correction_dim(rotations):
        return (hd * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(theta) ** (np.arange(0, hd, 2).astype(np.float32) / np.float32(hd))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(scaling: tuple | None, kind: str) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1·ln(factor) + 1 as
    transformers derives it), longrope's (settled by the builtin); 1 for every other kind."""
    if kind == "longrope":
        return longrope_parts(scaling)[1]
    if kind != "yarn" or scaling is None:
        return 1.0
    import math

    factor, given = float(scaling[0]), float(scaling[4])
    if given:
        return given
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def sinusoidal_div(d: int) -> np.ndarray:
    """10000^(2i/d) for i < d/2, in fp32: the divisors of the sinusoidal table's angles."""
    return np.power(np.float32(10000.0), np.arange(0, d, 2, dtype=np.float32) / np.float32(d))


def sinusoidal_table(n: int, d: int) -> np.ndarray:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    pos = np.arange(n, dtype=np.float32)[:, None]
    div = sinusoidal_div(d)
    ang = pos / div[None, :]
    pe = np.zeros((n, d), dtype=np.float32)
    pe[:, 0::2] = np.sin(ang)
    pe[:, 1::2] = np.cos(ang)
    return pe
