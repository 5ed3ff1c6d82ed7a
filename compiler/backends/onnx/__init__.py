"""The ONNX backend: export.py lowers the IR to an ONNX model; attention.py emits the fused
attention kernels (onnxruntime contrib ops or the portable tiled Loop)."""
