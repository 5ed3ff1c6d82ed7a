"""The seed's worked example (section 2), compiled to ONNX and run in onnxruntime.

Expected numbers are the seed's: outputs (0.755, 0.910), (0.532, 0.937),
(0.735, 0.987); with the causal mask position 2 weighs (0.119, 0.881); with
1/sqrt(D_q) scaling query 2 weighs (0.108, 0.446, 0.446).
"""

import numpy as np

from conftest import build, ort_run

X = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)  # tokens as rows


def run(variant):
    g = build("worked_example", variant)
    assert g.params == {}, "the example's matrices are literals, not trainable parameters"
    return ort_run(g, {}, {"x": X})


def test_outputs_match_the_seed():
    out = run(None)
    np.testing.assert_allclose(np.round(out["y"], 3), [[0.755, 0.910], [0.532, 0.937], [0.735, 0.987]])
    np.testing.assert_allclose(np.round(out["weights"], 3),
                               [[0.090, 0.245, 0.665], [0.063, 0.468, 0.468], [0.013, 0.265, 0.721]])


def test_causal_mask():
    out = run("causal")
    np.testing.assert_allclose(np.round(out["weights"][1, :2], 3), [0.119, 0.881])
    assert out["weights"][1, 2] == 0.0
    np.testing.assert_allclose(out["weights"][0], [1.0, 0.0, 0.0])
    # Problem 12.5: the third query sees every position, so it is unchanged.
    np.testing.assert_allclose(np.round(out["weights"][2], 3), [0.013, 0.265, 0.721])


def test_scaled_scores():
    out = run("scaled")
    np.testing.assert_allclose(np.round(out["weights"][1], 3), [0.108, 0.446, 0.446])


def test_sequence_length_stays_symbolic():
    """The same graph accepts a fourth token (nothing in equation 12.1 depends on N)."""
    out = ort_run(build("worked_example"), {}, {"x": np.vstack([X, [[2, 1]]]).astype(np.float32)})
    assert out["y"].shape == (4, 2)
