"""Label-shift adaptation by EM (Saerens, Latinne & Decaestecker 2002) of the Michael-free base
model on Michael's unlabelled chips, against the base model unchanged:

    python docs/experiments/generalisation/label_shift.py MODEL CHIPS

MODEL: the base model of fewshot.md's Michael section (work/loeo54/hurricane-michael/base.onnx
as `bench fewshot` exported it); CHIPS: a 64 px store of the five events (`make all5-chips`:
work/all5/events64). The class prior of Michael is estimated by EM from the base model's
probabilities on every Michael chip, starting from three priors the model could be taken to
have learnt (the mean probability it gives the other events' chips, their class frequencies, a
uniform prior); the probabilities are then re-weighted by the new prior over the old. No label of
Michael is used. Prints the estimated prior, accuracy, macro-F1 and the share of intact buildings
called damaged on all 3,657 Michael buildings.
"""

import sys

import numpy as np
import pandas as pd

from app.adapt.labelled import from_chip_store
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor

EVENT = "hurricane-michael"


def em_prior(p: np.ndarray, source: np.ndarray, iterations: int = 200):
    """``(prior, adjusted probabilities)``: EM on the target's probabilities ``p`` [N, K]."""
    prior = source.copy()
    for _ in range(iterations):
        q = p * (prior / source)
        q /= q.sum(1, keepdims=True)
        prior = q.mean(0)
    return prior, q


def main(model: str, chips: str) -> None:
    predictor = Predictor(model)
    names = list(predictor.class_names)

    def graded(event):
        b = from_chip_store(chips, names, event=event)
        b = b.subset(b.labelled)
        return predictor.predict(b.pre, b.post).probabilities, b.labels

    p, y = graded(EVENT)
    events = sorted(set(pd.read_csv(f"{chips}/manifest.csv")["event"]) - {EVENT})
    other = [graded(e) for e in events]
    p_other = np.concatenate([o[0] for o in other])
    y_other = np.concatenate([o[1] for o in other])

    def report(name, pred):
        m = classification_metrics(y, pred, names)
        print(
            f"{name:<42} accuracy {m['accuracy']:.3f}, macro-F1 {m['macro_f1']:.3f}, intact "
            f"called damaged {np.mean(pred[y == 0] != 0):.3f}"
        )

    print("Michael's true prior:", np.round(np.bincount(y, minlength=len(names)) / len(y), 3))
    report("base", p.argmax(1))
    starts = {
        "mean probability on the other events": p_other.mean(0),
        "class frequencies of the other events": np.bincount(y_other, minlength=len(names))
        / len(y_other),
        "uniform": np.full(len(names), 1 / len(names)),
    }
    for name, source in starts.items():
        prior, q = em_prior(p, source)
        print(f"  EM from {name}: estimated prior {np.round(prior, 3)}")
        report(f"EM from {name}", q.argmax(1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
