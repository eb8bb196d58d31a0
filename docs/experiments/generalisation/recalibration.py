"""Calibration on a new event from its own labels: `adapt`'s recalibration on Hurricane Michael.

    python docs/experiments/generalisation/recalibration.py MODEL CHIPS [--finetune] [--k 20,50,...]
        [--draws 3]

MODEL: a base that never saw Michael (the Michael-free base of fewshot.md,
work/fs9/hurricane-michael/base.onnx, or the bundled models/default.onnx); CHIPS:
work/all5/chips64. For each k and draw (seed 1000 k + draw), k of Michael's labelled buildings
are drawn at random and the model is adapted to them as `adapt` does it (`app.adapt.model.
adapt_model`, the heads; with --finetune, `cli.adapt.finetune_model`, the network), into a real
model file read back by ONNX Runtime; the other Michael buildings are graded by the base and by
the adapted model. Printed per k (mean and range over the draws): the temperature kept, and on
the graded buildings the ECE of the base, of the adapted model as written (recalibrated), and of
the same adapted model with the recalibration taken out (its probabilities at T = 1), with
accuracy and macro-F1 (the grades do not depend on the temperature). ECE: top-label, 15 equal-
width bins (runtime.metrics.calibration).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from app.adapt.labelled import from_chip_store
from app.adapt.model import adapt_model
from runtime.head import log_softmax
from runtime.metrics import classification_metrics
from runtime.metrics.calibration import expected_calibration_error
from runtime.predictor import Predictor


def _without_temperature(p: np.ndarray, t: float) -> np.ndarray:
    """``softmax(h)`` from ``p = softmax(h / t)``."""
    return np.exp(log_softmax(np.log(np.clip(p.astype(np.float64), 1e-30, 1.0)) * t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("chips")
    ap.add_argument("--finetune", action="store_true")
    ap.add_argument("--k", default="20,50,100,200,500")
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    base = Predictor(args.model)
    names = list(base.class_names)
    b = from_chip_store(args.chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    p0 = base.predict(b.pre, b.post).probabilities
    print(
        f"{args.model}: {len(b)} Michael buildings; the base on all: ECE "
        f"{expected_calibration_error(p0, b.labels):.3f}, "
        f"accuracy {np.mean(p0.argmax(1) == b.labels):.3f}"
    )
    arm = "finetune" if args.finetune else "heads"
    print(
        f"arm: {arm}; k, draw: T kept | graded: ECE base / adapted / adapted at T = 1 | "
        "accuracy base / adapted | macro-F1 base / adapted | seconds"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for k in [int(v) for v in args.k.split(",")]:
            rows = []
            for draw in range(args.draws):
                rng = np.random.default_rng(1000 * k + draw)
                pick = np.zeros(len(b), dtype=bool)
                pick[rng.permutation(len(b))[:k]] = True
                out = Path(tmp) / f"k{k}-{draw}.onnx"
                start = time.perf_counter()
                if args.finetune:
                    from cli.adapt import finetune_model

                    result = finetune_model(base, b.subset(pick), out)
                else:
                    result = adapt_model(base, b.subset(pick), out)
                seconds = time.perf_counter() - start
                r = result.block["recalibration"]
                t = r["temperature"] if r["kept"] else 1.0
                y = b.labels[~pick]
                p = Predictor(out).predict(b.pre[~pick], b.post[~pick]).probabilities
                pb = p0[~pick]
                m0 = classification_metrics(y, pb.argmax(1), names)
                m1 = classification_metrics(y, p.argmax(1), names)
                row = (
                    t,
                    expected_calibration_error(pb, y),
                    expected_calibration_error(p, y),
                    expected_calibration_error(_without_temperature(p, t), y),
                    m0["accuracy"],
                    m1["accuracy"],
                    m0["macro_f1"],
                    m1["macro_f1"],
                    seconds,
                )
                rows.append(row)
                print(
                    f"k = {k}, draw {draw} ({result.block['method']}): T {t:.2f} | ECE "
                    f"{row[1]:.3f} / {row[2]:.3f} / {row[3]:.3f} | accuracy {row[4]:.3f} / "
                    f"{row[5]:.3f} | macro-F1 {row[6]:.3f} / {row[7]:.3f} | {seconds:.1f} s",
                    flush=True,
                )
            a = np.asarray(rows)
            mean, lo, hi = a.mean(0), a.min(0), a.max(0)
            print(
                f"k = {k}, {args.draws} draws: T {mean[0]:.2f} ({lo[0]:.2f}-{hi[0]:.2f}) | ECE "
                f"{mean[1]:.3f} / {mean[2]:.3f} ({lo[2]:.3f}-{hi[2]:.3f}) / {mean[3]:.3f} | "
                f"accuracy {mean[4]:.3f} / {mean[5]:.3f} | macro-F1 {mean[6]:.3f} / "
                f"{mean[7]:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
