"""The building localiser: a U-Net on the pre-disaster image that outputs building probability.

``config`` (the dataclass config), ``model`` (the U-Net, its uint8 ONNX wrapper and the PyTorch
model function), ``data`` (random crops of tiles and their building masks), ``evaluate`` (pixel
precision / recall / F1, blob filtering, choosing the threshold; torch-free), ``train`` (the
loop), ``export`` (the ONNX model) and ``errors``; the commands are in :mod:`cli.localize`
(``local-damage localize train|export|evaluate``). Imagery and label polygons are read by
:mod:`data_prep.masks`.
"""
