"""Experiments of the method: cross-validation, class geometry and the loss probe."""
