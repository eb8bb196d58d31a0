"""The Gradio web app for analysts (no torch)."""
