"""Evaluation of trained models on labelled chips: scorers, metrics files and calibration."""
