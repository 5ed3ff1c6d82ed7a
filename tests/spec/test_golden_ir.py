"""Golden test: spec in, printed IR out (the seed's worked example, scaled variant).

The expected text was checked by hand against the seed's section 2: q_n =
Omega_q x_n is x @ Omega_q^T with the literal matrices, the scores are q k^T
divided by sqrt(D_q) = sqrt(2), softmax runs over the key axis, and the
outputs are the weights times v.
"""

from tessera.runtime.cli import main

EXPECTED = """\
graph WorkedExample
  in  x: f32[T, 2]
  const q/weight: f32[2, 2] = [[1., 0.], [1., 2.]]
  const k/weight: f32[2, 2] = [[1., 1.], [0., 1.]]
  const v/weight: f32[2, 2] = [[1., 0.], [0., 1.]]
  const const/const: f32[] = 1.4142135
  q: f32[T, 2] = linear(x, q/weight)
  k: f32[T, 2] = linear(x, k/weight)
  v: f32[T, 2] = linear(x, v/weight)
  transpose: f32[2, T] = transpose(k) {perm=[1, 0]}
  matmul: f32[T, T] = matmul(q, transpose)
  div: f32[T, T] = div(matmul, const/const)
  softmax: f32[T, T] = softmax(div) {axis=-1}
  matmul_1: f32[T, 2] = matmul(softmax, v)
  y: f32[T, 2] = identity(matmul_1)
  weights: f32[T, T] = identity(softmax)
  out y: f32[T, 2]
  out weights: f32[T, T]
"""


def test_worked_example_ir(capsys):
    from conftest import MODELS

    assert main(["ir", str(MODELS / "worked_example.tsr"), "--variant", "scaled"]) == 0
    assert capsys.readouterr().out == EXPECTED
