"""Export of a trained run to a self-describing ONNX model."""
