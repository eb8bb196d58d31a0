"""Evaluation of trained models on labelled chips: scorers, metrics files and calibration.

- :mod:`~local_damage.evaluation.scorers`: the scorer interface and the ONNX scorer (torch-free);
- :mod:`~local_damage.evaluation.torch_scorer`: the scorer of a run folder (PyTorch);
- :mod:`~local_damage.evaluation.chips`: which chips of a store are evaluated or calibrated on;
- :mod:`~local_damage.evaluation.evaluate`: metrics.json, predictions.csv and the figures;
- :mod:`~local_damage.evaluation.calibrate`: the temperature and the ``ood`` prototypes.
"""
