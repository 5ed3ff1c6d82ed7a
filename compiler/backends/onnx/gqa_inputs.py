"""GroupQueryAttention's input list, shared by the cached decoding steps (cached_attention.py) and the
serving engine's combined call (mixed_attention.py); kept apart because cached_attention.py imports
mixed_attention.py, so the other way round would be a cycle."""

from __future__ import annotations


def gqa_node_inputs(names: list[str]) -> list[str]:
    """GroupQueryAttention's inputs without trailing empty ones (an attention_bias left out: ``prefix_keys``)."""
    names = list(names)
    while names and not names[-1]:
        names.pop()
    return names
