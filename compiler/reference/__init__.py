"""Reference semantics in plain numpy: the interpreter the ONNX export is tested against
(interpret.py) and the tiled attention reference (flash.py)."""
