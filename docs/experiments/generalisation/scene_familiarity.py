"""The scene familiarity check (runtime.familiarity) of a model, measured on whole tiles:

    python docs/experiments/generalisation/scene_familiarity.py MODEL KNOWN FOLD NEW [NEW ...]

MODEL: a model whose ``ood`` block carries the scene reference (`local-damage calibrate
--scene-only`); KNOWN: the chip store it was calibrated on, FOLD its calibration fold (tiles of
the events it learnt from that it did not train on); NEW: chip stores of events it never saw
(e.g. Hurricane Michael cut with the model's chip spec). For every tile of at least
``min_buildings`` labelled buildings it prints whether the tile is called unfamiliar, with the
tile's accuracy and the share of its intact buildings called damaged. The KNOWN tiles are judged
against a reference taken from the other calibration tiles only (leave one tile out), so that no
tile is judged against a reference it helped set; NEW tiles against the model's own reference.
"""

import sys

import numpy as np
import pandas as pd

from app.adapt.labelled import from_chip_store
from runtime.familiarity import judge_scene, reference_of, scene_reference
from runtime.flags import OodCheck
from runtime.predictor import Predictor


def tiles(predictor, check, chips, fold=None):
    """Per building: tile, familiarity, label, grade (of the fold's chips when given)."""
    b = from_chip_store(chips, list(predictor.class_names))
    manifest = pd.read_csv(f"{chips}/manifest.csv", dtype={"chip_id": str}).set_index("chip_id")
    tile = manifest.loc[b.ids, "tile"].to_numpy()
    keep = np.ones(len(b), bool)
    if fold is not None:
        splits = pd.read_csv(f"{chips}/splits.csv", dtype={"chip_id": str}).set_index("chip_id")
        keep = splits.loc[b.ids, "fold"].to_numpy() == fold
    b = b.subset(keep)
    p = predictor.predict(b.pre, b.post)
    return tile[keep], check.scores(p.embedding), b.labels, p.probabilities.argmax(1)


def row(name, tile, f, y, pred, reference):
    verdict = judge_scene(f, reference)
    intact = y == 0
    return {
        "set": name,
        "tile": tile,
        "buildings": len(y),
        "median_familiarity": verdict["median_familiarity"],
        "reference": round(reference["familiarity"], 4),
        "unfamiliar": verdict["unfamiliar"],
        "accuracy": round(float(np.mean(y == pred)), 3),
        "intact_called_damaged": round(float(np.mean(pred[intact] != 0)), 3)
        if intact.any()
        else None,
    }


def main(model, known, fold, new):
    predictor = Predictor(model)
    check = OodCheck.from_metadata(predictor.metadata)
    reference = reference_of(check.block)
    minimum = reference["min_buildings"]
    rows = []
    t, f, y, pred = tiles(predictor, check, known, int(fold))
    for name in np.unique(t):
        m = t == name
        if m.sum() >= minimum:
            own = {**reference, **scene_reference(f[~m])}  # the other calibration tiles only
            rows.append(row("known event, held-out tile", name, f[m], y[m], pred[m], own))
    for chips in new:
        t, f, y, pred = tiles(predictor, check, chips)
        for name in np.unique(t):
            m = t == name
            if m.sum() >= minimum:
                rows.append(row(f"new event ({chips})", name, f[m], y[m], pred[m], reference))
    df = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    print(df.to_string(index=False))
    print()
    summary = df.groupby(["set", "unfamiliar"]).agg(
        tiles=("tile", "size"),
        buildings=("buildings", "sum"),
        accuracy=("accuracy", "mean"),
        intact_called_damaged=("intact_called_damaged", "mean"),
    )
    print(summary.round(3).to_string())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
