"""Scoring: scenes, xBD tiles, detected buildings and batches of scenes to per-building grades
and the files GIS tools open (no torch)."""
