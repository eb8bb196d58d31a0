"""Relative radiometric normalisation as adaptation without labels, on Michael's buildings:

    python docs/experiments/generalisation/radiometric.py MODEL CHIPS [EVENT]

MODEL: an exported model that never saw the event (the Michael-free base of fewshot.md, or the
bundled ``models/default.onnx``); CHIPS: a store of the event's chips at the model's chip size
(``work/all5/events64``); EVENT: default ``hurricane-michael``. The post image of a pair is
rescaled, channel by channel, to the mean and standard deviation of its pre image, as change
detection normalises two acquisitions before comparing them (relative radiometric
normalisation, Schott et al. 1988; Canty and Nielsen 2008), so that a change of sensor, light or
season between the dates is not read as damage:

- ``tile``: the statistics of every chip of the tile together (a scene-wide shift is removed,
  the change at one building kept);
- ``chip``: each chip's own statistics (what ``model.pair_norm`` does inside networks trained
  with it; here applied to a network trained without it).

Prints accuracy, macro-F1, the share of intact buildings called damaged and the F1 per class,
for the raw pairs and each normalisation.
"""

from __future__ import annotations

import sys

import numpy as np
from sklearn.metrics import f1_score

from app.adapt.labelled import from_chip_store
from runtime.predictor import Predictor


def match(post: np.ndarray, pre: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """``post`` shifted and scaled per channel to ``pre``'s mean and standard deviation."""
    mu_pre, sd_pre = pre.mean(axes, keepdims=True), pre.std(axes, keepdims=True)
    mu_post, sd_post = post.mean(axes, keepdims=True), post.std(axes, keepdims=True)
    return (post - mu_post) / np.maximum(sd_post, 1e-3) * sd_pre + mu_pre


def main(model: str, chips: str, event: str = "hurricane-michael") -> None:
    predictor = Predictor(model)
    b = from_chip_store(chips, list(predictor.class_names), event=event)
    tile = np.asarray(b.tiles())
    pre, post, y = b.pre.astype(np.float32), b.post.astype(np.float32), b.labels
    by_tile = post.copy()
    for t in np.unique(tile):
        s = tile == t
        by_tile[s] = match(post[s], pre[s], (0, 1, 2))
    print(
        f"{event}: {len(y)} buildings, {int((y == 0).sum())} intact, {len(np.unique(tile))} tiles"
    )
    for name, p in (
        ("raw", post),
        ("tile", by_tile),
        ("chip", match(post, pre, (1, 2))),
    ):
        u8 = np.clip(np.rint(p), 0, 255).astype(np.uint8)
        pred = predictor.predict(b.pre, u8).probabilities.argmax(1)
        f1 = f1_score(y, pred, average=None, labels=range(len(predictor.class_names)))
        print(
            f"{name}: accuracy {(pred == y).mean():.3f}, macro-F1 "
            f"{f1_score(y, pred, average='macro'):.3f}, intact called damaged "
            f"{(pred[y == 0] != 0).mean():.1%}, F1 per class {np.round(f1, 3).tolist()}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:4])
