"""The building localiser: a U-Net on the pre-disaster image that outputs building probability.

``config`` (the dataclass config), ``model`` (the U-Net and its uint8 ONNX wrapper), ``data``
(random crops of tiles and their building masks), ``metrics`` (pixel precision / recall / F1,
blob filtering, choosing the threshold), ``train`` (the loop), ``export`` (the ONNX model) and
``cli`` (``local-damage localize train|export|evaluate``). Imagery and label polygons are read by
:mod:`data_prep.masks`.
"""
