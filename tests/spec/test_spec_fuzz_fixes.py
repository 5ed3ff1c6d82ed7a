"""issue 25, item 4: the spec fuzzer's tracebacks, each with its reproducer in tests/hostile/.

generate/mixed_head_sizes.tsr: GroupQueryAttention decodes only head sizes that are multiples of 8,
so one layer of this model writes the cache buffer itself and the other does not; the decode step
bound an output with an empty name (onnxruntime: "Failed to find NodeArg with name:"). The tokens
are checked against a greedy loop over full recomputations (``run`` on the whole sequence, no cache).

report/softcap_zero_scale.tsr (scores divided by 0 under a soft-cap: ZeroDivisionError in the
attention recogniser) is run by tests/spec/test_fuzz.py with the other report reproducers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tessera
from conftest import cli

HOSTILE = Path(__file__).resolve().parents[1] / "hostile"


def test_mixed_head_sizes_decode_like_a_full_recomputation():
    m = tessera.load(HOSTILE / "generate" / "mixed_head_sizes.tsr", seed=3)
    prompt = [5, 9, 2, 17]
    new = m.generate(prompt, max_new_tokens=6)
    seq = list(prompt)
    for _ in range(6):
        logits = m.run(tokens=np.array([seq], dtype=np.int64))["logits"]
        seq.append(int(np.argmax(logits[0, -1])))
    assert new == seq[len(prompt):]


def test_mixed_head_sizes_generate_command(capsys):
    rc, out, err = cli(capsys, "generate", HOSTILE / "generate" / "mixed_head_sizes.tsr",
                       "--input", "tokens=[[1, 2, 3]]", "--max-new-tokens", "4")
    assert rc == 0, err
    assert len(out.split()) == 4


def test_zero_scale_is_left_unfused(capsys):
    rc, out, err = cli(capsys, "report", HOSTILE / "report" / "softcap_zero_scale.tsr", "--format", "json")
    assert rc == 0, err
