"""Evaluation of trained models on labelled data, without torch: scorers, metrics files,
calibration and the localiser's pixel scores.

- :mod:`~runtime.evaluation.scorers`: the scorer interface and the ONNX scorer;
- :mod:`~runtime.evaluation.chips`: which chips of a store are evaluated or calibrated on;
- :mod:`~runtime.evaluation.evaluate`: metrics.json, predictions.csv and the figures;
- :mod:`~runtime.evaluation.calibrate`: the temperature and the ``ood`` prototypes;
- :mod:`~runtime.evaluation.localizer`: a localiser run over whole tiles and scored.

The scorer of a run folder, and the augmented second view, need PyTorch:
:mod:`local_damage.evaluation.torch_scorer`.
"""
