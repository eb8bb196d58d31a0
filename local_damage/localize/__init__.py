"""The building localiser: a U-Net on the pre-disaster image that outputs building probability.

``config`` (the dataclass config), ``model`` (the U-Net, its uint8 ONNX wrapper and the PyTorch
model function), ``data`` (random crops of tiles and their building masks), ``train`` (the
loop) and ``export`` (the ONNX model); the torch-free scoring of a localiser on tiles (pixel
precision / recall / F1, blob filtering, choosing the threshold) is
:mod:`runtime.evaluation.localizer`, the localiser's errors :mod:`runtime.localize_errors`; the
commands are in :mod:`cli.localize` (``local-damage localize train|export|evaluate``). Imagery
and label polygons are read by :mod:`data_prep.masks`.
"""
