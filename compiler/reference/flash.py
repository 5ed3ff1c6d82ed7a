"""Numpy reference of tiled attention with an online softmax (FlashAttention's algorithm).

Queries are processed in tiles of ``q_tile`` rows; each walks the key tiles of
``k_tile`` columns, keeping a running maximum ``m``, a running sum ``l`` and an
unnormalised output ``acc``. When a new tile raises the maximum, the old sum
and output are rescaled by exp(m_old - m_new). Key tiles that a causal mask
hides entirely are skipped. The result equals softmax(QKᵀ·scale + mask)·V
exactly (up to rounding) while holding only a q_tile × k_tile block of scores.

This is the algorithm's ground truth; the ONNX kernels are tested against the
plain formula, and this function is tested against it too.
"""

from __future__ import annotations

import numpy as np


def attention_reference(q, k, v, scale, causal=False, window=0, key_mask=None, bias=None, softcap=0.0):
    """Plain attention, [.., Tq, hd] x [.., Tk, hd]: softmax over keys, masked scores filled with min.
    With softcap = c > 0 the scaled scores are capped to (-c, c) as tanh(s)·c before the bias and
    masks (Gemma 2's logit soft-capping, its 1/c already folded into ``scale``)."""
    s = (q @ np.swapaxes(k, -1, -2)) * np.asarray(scale, q.dtype)
    if softcap:
        s = np.tanh(s) * np.asarray(softcap, q.dtype)
    if bias is not None:
        s = s + bias
    hide = _hidden(q.shape[-2], k.shape[-2], causal, window)
    fill = np.finfo(q.dtype).min
    if hide is not None:
        s = np.where(hide, fill, s)
    if key_mask is not None:
        s = np.where((key_mask != 0)[:, None, None, :], s, fill)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


def _hidden(tq, tk, causal, window, row0=0, col0=0, rows=None, cols=None):
    if not causal:
        return None
    rows = tq if rows is None else rows
    cols = tk if cols is None else cols
    i = np.arange(row0, row0 + rows)[:, None] + (tk - tq)
    j = np.arange(col0, col0 + cols)[None, :]
    hide = j > i
    if window:
        hide |= j <= i - window
    return hide


def tiled_attention(q, k, v, scale, causal=False, window=0, key_mask=None, q_tile=64, k_tile=64):
    """Online-softmax attention over tiles; memory O(q_tile * k_tile) per head for the scores."""
    *lead, tq, _ = q.shape
    tk = k.shape[-2]
    out = np.zeros((*lead, tq, v.shape[-1]), dtype=np.float32)
    fill = np.float32(np.finfo(np.float32).min)
    for r0 in range(0, tq, q_tile):
        r1 = min(r0 + q_tile, tq)
        qt = q[..., r0:r1, :].astype(np.float32)
        m = np.full((*lead, r1 - r0, 1), -np.inf, dtype=np.float32)
        l = np.zeros((*lead, r1 - r0, 1), dtype=np.float32)
        acc = np.zeros((*lead, r1 - r0, v.shape[-1]), dtype=np.float32)
        last_key = tk if not causal else min(tk, r1 + (tk - tq))  # keys after the tile's last row are hidden
        first_key = 0
        if causal and window:
            first_key = max(0, r0 + (tk - tq) - window + 1)
        for c0 in range((first_key // k_tile) * k_tile, last_key, k_tile):
            c1 = min(c0 + k_tile, tk)
            s = (qt @ np.swapaxes(k[..., c0:c1, :], -1, -2).astype(np.float32)) * np.float32(scale)
            hide = _hidden(tq, tk, causal, window, r0, c0, r1 - r0, c1 - c0)
            if hide is not None:
                s = np.where(hide, fill, s)
            if key_mask is not None:
                s = np.where((key_mask[:, c0:c1] != 0)[:, None, None, :], s, fill)
            m_new = np.maximum(m, s.max(-1, keepdims=True))
            correction = np.exp(m - m_new)
            p = np.exp(s - m_new)
            l = l * correction + p.sum(-1, keepdims=True)
            acc = acc * correction + p @ v[..., c0:c1, :].astype(np.float32)
            m = m_new
        out[..., r0:r1, :] = acc / l
    return out.astype(q.dtype)
