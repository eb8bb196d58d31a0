"""Adapting a model to a new event from a few labelled buildings, and which to label next
(no torch)."""
