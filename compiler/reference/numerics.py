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


def rope_inv_freq(hd: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """RoPE's hd/2 inverse frequencies theta^(-2i/hd), in fp32 as Hugging Face computes them.

    ``scaling`` = (factor, low_freq, high_freq, original_ctx) applies Llama 3.1's frequency
    scaling ("llama3" rope_type): wavelengths longer than original_ctx / low_freq are divided by
    factor, those shorter than original_ctx / high_freq are kept, and those between are
    interpolated smoothly."""
    inv_freq = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))).astype(np.float32)
    if scaling is None:
        return inv_freq
    factor, low, high, ctx = (np.float32(v) for v in scaling)
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    smooth = (ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < ctx / high) & ~(wavelen > ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


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
