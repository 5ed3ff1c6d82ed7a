"""Reference semantics in plain numpy, below the op registry: the numerics the ops' reference facets
share (numerics.py), the score epilogue of fused attention (score_epilogue.py), the tiled attention
reference (flash.py) and the quantisers' numpy (quant.py). The interpreter that runs a whole graph
through the ops is ops/interpret.py, above them."""
