"""Serving: the ONNX Runtime predictor, the scoring CLI and the Gradio app. Never imports torch."""
