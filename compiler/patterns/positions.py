"""Position tables read at an affine function of the position: ``embedding(a * arange(T) + c, ...)``.

Why: a learned position table is not always read at ``arange(T)``. BART and OPT keep two spare
rows at the front and read ``arange(T) + 2``; other checkpoints scale or shift the index. To
cache such a model, the KV cache pass must replace the whole index computation by the same
function of ``position_ids`` (which counts each row's real tokens, so it stays right past a left
padding and when P > 0). This module finds that function -- integer constants ``a`` and ``c``
from a chain of ``add``/``sub``/``mul`` by scalar constants between the ``arange`` and the
table's ``embedding`` -- or says why a use of the ``arange`` is something else (then the model
has no known cached form, and the pass refuses it with that reason).
"""

from tessera.compiler.ir.affine_index import (AFFINE_OPS, AffineRead, NotAffine, affine_reads,  # noqa: F401
                                              positions_reached)

# The walk itself lives in compiler/ir/affine_index.py: the input checks (ir/signature.py), below the
# patterns, follow the same affine reads to bound a position dimension by its table's rows.
