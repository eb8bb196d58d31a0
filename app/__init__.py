"""Serving, on runtime/ and data_prep/ (never torch): scoring scenes, xBD tiles and batches to
files GIS tools open (``app.scoring``), adapting a model to a new event from a few labels
(``app.adapt``), and the Gradio web app for analysts (``app.web``)."""
