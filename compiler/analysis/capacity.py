"""Serving capacity: how many sequences of a given context fit on a device, and how fast they decode.

A server holds the weights once and, for each sequence in flight, its KV cache at the
full context plus the working activations of one decoding step. With a device of M
bytes, a stated headroom kept free (plan.HEADROOM: allocator slack, runtime context,
fragmentation) and the per-device figures of the split (parallel.py):

    max_batch = floor((M·(1 − headroom) − weights) / (KV cache of one sequence at N
                                                       + activations of one decoding step))

Decoding at that batch is timed with the roofline's decoding step (roofline.py: every
weight and the whole KV cache read once per step) at B = max_batch and context N, split
T ways (each rank reads 1/T of the weights and cache; the all-reduces are not timed);
pipeline stages run one after another for a token, so P does not shorten a step.
Time to first token is the fused prefill of one prompt of N tokens, split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Capacity:
    device_memory: float
    headroom: float
    usable_bytes: int           # memory left for sequences after the headroom and the weights
    per_sequence_bytes: int     # KV cache at N + one decoding step's activations, one device
    max_batch: int


def capacity(device_memory: float, headroom: float, weights: int, kv_per_sequence: int,
             act_per_sequence: int) -> Capacity:
    usable = int(device_memory * (1 - headroom)) - weights
    per_seq = kv_per_sequence + act_per_sequence
    batch = max(usable, 0) // per_seq if per_seq else 0
    return Capacity(device_memory, headroom, usable, per_seq, batch)
