"""`local-damage bench flags`: how often each abstain flag fires on real chips and on corrupted
copies of them (no torch).

On the chips of one fold of a chip store (chips as cut for the model, before resizing) it
measures:

- **false alarms**: the share of the real chip pairs that get each flag (the goal is at most 2%
  per flag on real held-out imagery);
- **detection** on corrupted copies of the same pairs, each case with the flag it should raise:

  ==================  =============================================================  ============
  case                corruption                                                      flag
  ==================  =============================================================  ============
  ``black pre``       pre chip all zero                                               blank
  ``black post``      post chip all zero                                              blank
  ``cloud``           a white, soft-edged, smooth overlay over 70-95% of the post     cloud
  ``haze``            a uniform white veil (opacity 0.7-0.85) over the whole post     haze/cloud
  ``shifted post``    post shifted by ``--shift`` chip pixels in a random direction   misaligned
  ``other event``     post chip from a tile of another event                          ood
  ==================  =============================================================  ============

``shifted post`` is measured only when the flags can measure a residual shift
(:data:`runtime.flags.MEASURE_SHIFT`), and ``ood`` only for a model with class prototypes (see
``local-damage calibrate``). Every corruption is seeded, so a rerun prints the same figures.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.split import fold_indices
from data_prep.store import ChipReader, StoreError, read_manifest
from runtime.contract import ModelError
from runtime.flags import BLANK, CLOUD, FLAGS, HAZE, MISALIGNED, OOD, OVERSIZED, Flagger
from runtime.predictor import Predictor
from runtime.registry import default_model

#: The flags of chip pairs (``oversized`` is raised on detected footprints, not on chips).
CHIP_FLAGS = tuple(f for f in FLAGS if f != OVERSIZED)
#: Default shift of the ``shifted post`` case, in chip pixels.
SHIFT_PX = 8.0


# --------------------------------------------------------------------------------------------
# corruptions: uint8 [S, S, 3] chips in, uint8 chips out


def smooth_field(size: int, rng: np.random.Generator, cells: int = 4) -> np.ndarray:
    """float32 ``[size, size]`` smooth random field in about [0, 1]: a ``cells`` x ``cells`` grid
    of uniform values upsampled bicubically (cloud-like, low frequency)."""
    import cv2

    grid = rng.random((cells + 1, cells + 1)).astype(np.float32)
    return cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC)


def cloud_overlay(chip: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The chip under a cloud: a white (235-250), slightly uneven, nearly opaque (peak opacity
    0.85-1) layer over a random 70-95% of it, with edges softened over about 1/16 of the chip."""
    import cv2

    size = chip.shape[0]
    field = smooth_field(size, rng)
    coverage = rng.uniform(0.7, 0.95)
    cut = float(np.quantile(field, 1 - coverage))
    alpha = np.clip((field - cut) / 0.1 + 0.5, 0, 1) * rng.uniform(0.85, 1.0)
    sigma = max(size / 16, 1.0)
    alpha = cv2.GaussianBlur(alpha.astype(np.float32), (0, 0), sigma)[..., None]
    white = rng.uniform(235, 250) + 6 * (smooth_field(size, rng) - 0.5)
    cloud = white[..., None] + rng.normal(0, 1.0, chip.shape)
    out = chip.astype(np.float32) * (1 - alpha) + cloud * alpha
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def haze_veil(chip: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The chip behind a uniform grey-white veil (200-230) of opacity 0.7-0.85."""
    a = rng.uniform(0.7, 0.85)
    veil = rng.uniform(200, 230)
    out = chip.astype(np.float32) * (1 - a) + veil * a
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def shift_chip(chip: np.ndarray, shift_px: float, rng: np.random.Generator) -> np.ndarray:
    """The chip moved by ``shift_px`` pixels in a random direction (edges reflected)."""
    import cv2

    angle = rng.uniform(0, 2 * np.pi)
    dx, dy = shift_px * np.cos(angle), shift_px * np.sin(angle)
    m = np.array([[1, 0, dx], [0, 1, dy]], dtype=np.float32)
    size = chip.shape[1], chip.shape[0]
    return cv2.warpAffine(chip, m, size, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)


# --------------------------------------------------------------------------------------------
# the bench


def fold_records(chips: Path, fold: int | None) -> tuple[list[dict], list[dict]]:
    """Manifest rows of the fold (every row when None), and every row of the store."""
    frame = read_manifest(chips)
    everything = frame.to_dict("records")
    if fold is None:
        return everything, everything
    wanted = set(fold_indices(chips, fold)[1])
    return [r for r in everything if r["chip_id"] in wanted], everything


def _rates(flags: list[list[str]]) -> dict[str, float]:
    n = max(len(flags), 1)
    out = {f: sum(f in fl for fl in flags) / n for f in CHIP_FLAGS}
    out["any"] = sum(bool(fl) for fl in flags) / n
    return out


def bench_flags(
    model: str | Path,
    chips: str | Path,
    fold: int | None = None,
    shift_px: float = SHIFT_PX,
    seed: int = 0,
    limit: int | None = None,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Per-flag rates on the real chip pairs of a fold and on corrupted copies of them.

    Args:
        model: an ONNX model (its prototypes, if any, decide ``ood``).
        chips: a chip store cut with the model's chip spec.
        fold: the fold of ``chips/splits.csv`` to use (None: every chip).
        shift_px: shift of the ``shifted post`` case, in chip pixels.
        seed: seed of the corruptions and of the other-event pairing.
        limit: use at most this many pairs (spread evenly over the fold).
        batch_size: pairs per ONNX Runtime call.

    Returns:
        ``{"model", "chips", "fold", "n", "checks", "real": {flag: rate, "any": rate},
        "cases": [{"case", "expects", "n", "detected", "rates"}], "skipped": [why]}``.
    """
    chips = Path(chips)
    predictor = Predictor(model)
    try:
        flagger = Flagger(predictor.metadata)
    except ValueError as exc:  # the model's flag metadata cannot be used
        raise ModelError(str(exc)) from exc
    records, everything = fold_records(chips, fold)
    if not records:
        raise StoreError(f"{chips}: fold {fold} holds no chips")
    if limit is not None and len(records) > limit:
        step = len(records) / limit
        records = [records[int(i * step)] for i in range(limit)]
    reader = ChipReader(chips)
    pairs = [reader.pair(r) for r in records]
    pre = np.stack([p[0] for p in pairs])
    post = np.stack([p[1] for p in pairs])
    rng = np.random.default_rng(seed)

    def flag(a: np.ndarray, b: np.ndarray) -> list[list[str]]:
        emb = predictor.predict(a, b, batch_size=batch_size).embedding
        return flagger.batch(a, b, emb)

    result: dict[str, Any] = {
        "model": str(model),
        "chips": str(chips),
        "fold": fold,
        "n": len(records),
        "checks": flagger.checks,
        "seed": seed,
        "shift_px": shift_px,
        "real": _rates(flag(pre, post)),
        "cases": [],
        "skipped": [],
    }

    def each(fn: Callable[[np.ndarray, np.random.Generator], np.ndarray], chips_: np.ndarray):
        return np.stack([fn(c, rng) for c in chips_])

    cases: list[tuple[str, tuple[str, ...], np.ndarray, np.ndarray]] = [
        ("black pre", (BLANK,), np.zeros_like(pre), post),
        ("black post", (BLANK,), pre, np.zeros_like(post)),
        ("cloud", (CLOUD,), pre, each(cloud_overlay, post)),
        ("haze", (HAZE, CLOUD), pre, each(haze_veil, post)),
    ]
    if flagger.measure_shift is not None:
        cases.append(
            (
                "shifted post",
                (MISALIGNED,),
                pre,
                each(lambda c, r: shift_chip(c, shift_px, r), post),
            )
        )
    else:
        result["skipped"].append("shifted post: no residual-shift measurement (misaligned off)")
    events = np.array([r["event"] for r in everything])
    if len(set(events)) < 2:
        result["skipped"].append("other event: the store holds one event")
    elif flagger.ood is None:
        result["skipped"].append(
            "other event: the model has no class prototypes (run `local-damage calibrate`)"
        )
    else:
        other = []
        for r in records:
            candidates = np.flatnonzero(events != r["event"])
            other.append(reader.pair(everything[int(rng.choice(candidates))])[1])
        cases.append(("other event", (OOD,), pre, np.stack(other)))
    for name, expects, a, b in cases:
        flags = flag(a, b)
        detected = sum(any(e in fl for e in expects) for fl in flags) / len(flags)
        result["cases"].append(
            {
                "case": name,
                "expects": list(expects),
                "n": len(flags),
                "detected": detected,
                "rates": _rates(flags),
            }
        )
    return result


def format_result(result: dict[str, Any]) -> str:
    """The figures as two plain-text tables."""
    cols = [*CHIP_FLAGS, "any"]
    head = f"{'':<14} {'n':>5}  " + "  ".join(f"{c:>10}" for c in cols)
    where = f"fold {result['fold']}" if result["fold"] is not None else "every chip"
    lines = [
        f"flags of {result['model']} on {result['chips']} ({where}, {result['n']} pairs); "
        f"checks: {', '.join(result['checks'])}",
        "",
        "false alarms on the real pairs (share flagged):",
        head,
        f"{'real':<14} {result['n']:>5}  " + "  ".join(f"{result['real'][c]:>10.2%}" for c in cols),
        "",
        "corrupted copies (share flagged; detected = the expected flag):",
        head + f"  {'detected':>10}  expects",
    ]
    for case in result["cases"]:
        lines.append(
            f"{case['case']:<14} {case['n']:>5}  "
            + "  ".join(f"{case['rates'][c]:>10.2%}" for c in cols)
            + f"  {case['detected']:>10.2%}  {'/'.join(case['expects'])}"
        )
    lines += [f"not measured: {why}" for why in result["skipped"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model = args.model if args.model is not None else default_model()
    result = bench_flags(model, args.chips, args.fold, args.shift, args.seed, args.limit)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
