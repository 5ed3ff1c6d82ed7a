"""Writing compiled models in other runtimes' layouts: onnxruntime-genai model folders (genai)."""
