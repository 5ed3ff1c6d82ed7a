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

from tessera.compiler.reference import score_epilogue


def _attrs(scale, causal, window, key_mask, bias, softcap, sinks=None) -> dict:
    """The fused node's attributes for these arguments (reference/score_epilogue.py reads them)."""
    a = {"scale": float(scale), "causal": bool(causal), "window": int(window or 0),
         "padding": key_mask is not None, "bias": bias is not None}
    if sinks is not None:
        a["sinks"] = True
    if softcap:
        a["softcap"] = float(softcap)
    return a


def _sink_rows(sinks, q):
    """Sinks [H] as [1, H, 1, 1] for q [B, H, T, d] (None: none)."""
    return None if sinks is None else np.asarray(sinks, np.float32).reshape(1, q.shape[1], 1, 1)


def attention_reference(q, k, v, scale, causal=False, window=0, key_mask=None, bias=None, softcap=0.0,
                        sinks=None):
    """Plain attention, [.., Tq, hd] x [.., Tk, hd]: softmax over keys of the score epilogue
    (reference/score_epilogue.py: scale, soft-cap, bias, masks filled with the dtype's minimum); with
    ``sinks`` [H] (q [B, H, T, d]) one more logit per head in the normaliser (gpt-oss)."""
    a = _attrs(scale, causal, window, key_mask, bias, softcap, sinks)
    where = score_epilogue.Where(q.shape[-2], k.shape[-2], key_mask=key_mask, bias=bias, sinks=_sink_rows(sinks, q))
    s = score_epilogue.apply(q @ np.swapaxes(k, -1, -2), a, where)
    return score_epilogue.softmax(s, a, where) @ v


def tiled_attention(q, k, v, scale, causal=False, window=0, key_mask=None, q_tile=64, k_tile=64, sinks=None):
    """Online-softmax attention over tiles; memory O(q_tile * k_tile) per head for the scores. With
    ``sinks`` [H] (q [B, H, T, d]) the running maximum starts at the sink and the sum at 1 (exp(sink -
    sink)), so the sink is in the normaliser however the key tiles raise the maximum; a row whose keys
    are all hidden then weighs only the sink (output 0), as the plain formula gives."""
    *lead, tq, _ = q.shape
    tk = k.shape[-2]
    a = _attrs(scale, causal, window, key_mask, None, 0.0, sinks)
    sink = _sink_rows(sinks, q)
    out = np.zeros((*lead, tq, v.shape[-1]), dtype=np.float32)
    for r0 in range(0, tq, q_tile):
        r1 = min(r0 + q_tile, tq)
        qt = q[..., r0:r1, :].astype(np.float32)
        m = np.full((*lead, r1 - r0, 1), -np.inf, dtype=np.float32)
        l = np.zeros((*lead, r1 - r0, 1), dtype=np.float32)
        if sink is not None:  # the sink as a first key tile of one column that weighs no value
            m = np.broadcast_to(sink, m.shape).astype(np.float32)
            l = np.ones_like(l)
        acc = np.zeros((*lead, r1 - r0, v.shape[-1]), dtype=np.float32)
        last_key = tk if not causal else min(tk, r1 + (tk - tq))  # keys after the tile's last row are hidden
        first_key = 0
        if causal and window:
            first_key = max(0, r0 + (tk - tq) - window + 1)
        for c0 in range((first_key // k_tile) * k_tile, last_key, k_tile):
            c1 = min(c0 + k_tile, tk)
            where = score_epilogue.Where(tq, tk, r0, c0, None if key_mask is None else key_mask[:, c0:c1])
            s = score_epilogue.apply(qt @ np.swapaxes(k[..., c0:c1, :], -1, -2).astype(np.float32), a, where)
            m_new = np.maximum(m, s.max(-1, keepdims=True))
            correction = np.exp(m - m_new)
            p = np.exp(s - m_new)
            l = l * correction + p.sum(-1, keepdims=True)
            acc = acc * correction + p @ v[..., c0:c1, :].astype(np.float32)
            m = m_new
        out[..., r0:r1, :] = acc / l
    return out.astype(q.dtype)
