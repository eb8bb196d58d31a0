"""`local-damage bench alignment`: the ``misaligned`` flag on real xBD tiles and on shifted copies
(no torch, no model).

For the tiles of one fold (or several) of an xBD chip store, each tile's pre/post images are read
from the store's source folders and the tile's post-to-pre shift is measured and corrected as
`score --labels` does (:func:`data_prep.alignment.align_images`). Then, for every building, both
measurements ``runtime.flags`` uses:

- **context** (what `score`, `score-batch` and the app's tile mode use): the residual shift
  measured on the imagery around the building (:func:`data_prep.residual.image_context_residual`),
  flagged above ``--context-limit`` source pixels. False alarms: the real corrected pairs
  flagged. Detection: the share flagged once the corrected post image under the building is
  moved by each of ``--context-shifts`` source pixels in a random direction (a misregistered
  post image);
- **chips** (the app's chip mode, where only two chips are given): the residual shift of the chip
  pair alone (:func:`data_prep.residual.residual_shift`), flagged above ``--limit`` chip pixels,
  on the store's chips as cut and on chips re-cut from the corrected images; detection once the
  corrected post chip is moved by each of ``--shifts`` chip pixels
  (:func:`bench.flags.shift_chip`).

Seeded: a rerun prints the same figures.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.flags import fold_records, shift_chip
from data_prep.alignment import align_images
from data_prep.residual import (
    CONTEXT_SIDE,
    context_residual,
    context_window,
    image_context_residual,
    residual_shift,
)
from data_prep.store import STORE_META, ChipReader, StoreError, read_meta
from data_prep.windows import ChipWindow, crop_boundless, cut_pair
from data_prep.xbd_tiles import XbdRootError, read_tile_pair
from runtime.flags import MISALIGNED_CONTEXT_PX, MISALIGNED_PX, misaligned_flag


def moved_window(image: np.ndarray, window, dx: float, dy: float) -> np.ndarray:
    """``window`` of ``image`` after the image's content is moved by ``(dx, dy)`` pixels
    (bilinear; zero fill past the image)."""
    import cv2

    m = int(math.ceil(max(abs(dx), abs(dy)))) + 2
    big = crop_boundless(
        image, ChipWindow(window.col_off - m, window.row_off - m, window.size + 2 * m)
    )
    shift = np.array([[1, 0, dx], [0, 1, dy]], dtype=np.float32)
    moved = cv2.warpAffine(big, shift, big.shape[1::-1], flags=cv2.INTER_LINEAR)
    return moved[m : m + window.size, m : m + window.size]


def _tile_images(roots: list[Path], tile: str):
    found = [
        (
            root / "images" / f"{tile}_pre_disaster.png",
            root / "images" / f"{tile}_post_disaster.png",
        )
        for root in roots
    ]
    found = [p for p in found if p[0].is_file() and p[1].is_file()]
    if not found:
        raise XbdRootError(f"{tile}: pre/post images not found under {roots}")
    return read_tile_pair(*found[0])


def bench_alignment(
    chips: str | Path,
    fold: int | Sequence[int] | None = 1,
    shifts: tuple[float, ...] = (4.0, 8.0, 16.0),
    limit_px: float = MISALIGNED_PX,
    seed: int = 0,
    context_shifts: tuple[float, ...] = (4.0, 8.0, 12.0, 16.0),
    context_limit_px: float = MISALIGNED_CONTEXT_PX,
) -> dict[str, Any]:
    """Figures of the ``misaligned`` flag on a fold (or several folds together, or every chip
    with None) of an xBD chip store (see the module doc)."""
    chips = Path(chips)
    meta = read_meta(chips)
    if "spec" not in meta:
        raise StoreError(
            f"{chips}: no {STORE_META} with a chip spec; run `local-damage prepare` to create a "
            "chip store"
        )
    size = int(meta["spec"]["chip_size"])
    roots = [Path(r) for r in meta.get("roots", [])]
    folds = [fold] if fold is None or isinstance(fold, int) else list(fold)
    records = [r for f in folds for r in fold_records(chips, f)[0]]
    if not records:
        raise StoreError(f"{chips}: fold {fold} holds no chips")
    reader = ChipReader(chips)
    rng = np.random.default_rng(seed)
    by_tile: dict[str, list[dict]] = {}
    for r in records:
        by_tile.setdefault(r["tile"], []).append(r)

    tiles, raw, fixed_pre, fixed_post, tile_of = [], [], [], [], []
    context: dict[float, list[float]] = {0.0: [], **{float(s): [] for s in context_shifts}}
    for tile, rows in sorted(by_tile.items()):
        pre_img, post_img = _tile_images(roots, tile)
        post_fixed, shift = align_images(pre_img, post_img)
        tiles.append({"tile": tile, "n": len(rows), **shift.to_dict()})
        for r in rows:
            a, b = reader.pair(r)
            raw.append(residual_shift(a, b))
            tile_of.append(len(tiles) - 1)
            w = ChipWindow(int(r["win_col"]), int(r["win_row"]), int(r["win_size"]))
            a, b = cut_pair(pre_img, post_fixed, w, size)
            fixed_pre.append(a)
            fixed_post.append(b)
            centre = (w.col_off + w.size / 2, w.row_off + w.size / 2)
            cw = context_window(centre, max(CONTEXT_SIDE, w.size), pre_img.shape[:2])
            pre_window = crop_boundless(pre_img, cw)
            for s, values in context.items():
                angle = rng.uniform(0, 2 * np.pi)
                if s == 0:  # the real pair, measured as scoring measures it
                    values.append(image_context_residual(pre_img, post_fixed, centre, w.size))
                    continue
                moved = moved_window(post_fixed, cw, s * np.cos(angle), s * np.sin(angle))
                values.append(context_residual(pre_window, moved))

    def rate(values, limit) -> float:
        return float(np.mean([misaligned_flag(v, limit) for v in values]))

    corrected = [residual_shift(a, b) for a, b in zip(fixed_pre, fixed_post, strict=True)]
    measured = [v for v in corrected if v is not None]
    cases = []
    for s in shifts:
        moved = [
            residual_shift(a, shift_chip(b, s, rng))
            for a, b in zip(fixed_pre, fixed_post, strict=True)
        ]
        cases.append({"shift_px": s, "detected": rate(moved, limit_px)})
    real = np.asarray(context[0.0], dtype=float)
    finite = real[np.isfinite(real)]
    tile_of = np.asarray(tile_of)
    lined_up = np.zeros(len(real), dtype=bool)
    for i, t in enumerate(tiles):
        mine = real[tile_of == i]
        t["context_flagged"] = int(sum(misaligned_flag(v, context_limit_px) for v in mine))
        median = float(np.nanmedian(mine)) if np.isfinite(mine).any() else math.nan
        t["context_median_px"] = round(median, 2)
        # a tile whose buildings are mostly past the limit is misregistered as a whole
        t["lined_up"] = bool(np.isfinite(median) and median <= context_limit_px)
        lined_up[tile_of == i] = t["lined_up"]
    return {
        "chips": str(chips),
        "fold": fold if fold is None or isinstance(fold, int) else list(fold),
        "n": len(records),
        "seed": seed,
        "tiles": [
            {
                k: t[k]
                for k in (
                    "tile",
                    "n",
                    "applied",
                    "confident",
                    "reason",
                    "shift_px",
                    "agreeing_blocks",
                    "context_flagged",
                    "context_median_px",
                    "lined_up",
                )
            }
            for t in tiles
        ],
        "context": {
            "limit_px": context_limit_px,
            "false_alarms": rate(real, context_limit_px),
            "false_alarms_lined_up": rate(real[lined_up], context_limit_px)
            if lined_up.any()
            else None,
            "lined_up": int(lined_up.sum()),
            "measured": float(np.isfinite(real).mean()),
            "residual_px_percentiles": {
                str(q): round(float(np.percentile(finite, q)), 2) for q in (50, 90, 98)
            }
            if finite.size
            else {},
            # on a tile that does not line up the post is already off, so "moved by s" is not
            # an s px misalignment there: detection is also given on the lined-up tiles alone
            "cases": [
                {
                    "shift_px": s,
                    "detected": rate(v, context_limit_px),
                    "detected_lined_up": rate(
                        [x for x, ok in zip(v, lined_up, strict=True) if ok], context_limit_px
                    )
                    if lined_up.any()
                    else None,
                }
                for s, v in context.items()
                if s
            ],
        },
        "chip": {
            "limit_px": limit_px,
            "false_alarms": {
                "as_cut": rate(raw, limit_px),
                "corrected": rate(corrected, limit_px),
            },
            "measurable": len(measured) / max(len(corrected), 1),
            "residual_px_percentiles": {
                str(q): round(float(np.percentile(measured, q)), 2) for q in (50, 90, 98)
            }
            if measured
            else {},
            "cases": cases,
        },
    }


def format_result(result: dict[str, Any]) -> str:
    """The figures as plain text."""
    ctx, chip = result["context"], result["chip"]
    fold = result["fold"]
    folds = ", ".join(map(str, fold)) if isinstance(fold, list) else fold
    lines = [
        f"misaligned on {result['chips']} fold {folds} ({result['n']} buildings)",
        "",
        "tile shifts (post to pre, image pixels), then the buildings flagged misaligned around",
        "them and the median of their residual shifts:",
    ]
    for t in result["tiles"]:
        s = t["shift_px"]
        shift = "-" if s["dx"] is None else f"({s['dx']:+.2f}, {s['dy']:+.2f})"
        lines.append(
            f"  {t['tile']:<36} {t['n']:>4}  {shift:<18} "
            f"{'corrected' if t['applied'] else 'not corrected'}; flagged "
            f"{t['context_flagged']}, median {t['context_median_px']:.2f} px"
            + (
                ""
                if t["lined_up"]
                else " (misregistered: median past the limit)"
                if math.isfinite(t["context_median_px"])
                else " (no measurement: the windows match nowhere)"
            )
        )
    lined = ctx["false_alarms_lined_up"]
    lines += [
        "",
        f"around each building (scoring; residual shift > {ctx['limit_px']:g} source px):",
        f"  false alarms, tile shift corrected: {ctx['false_alarms']:.2%} of all buildings, "
        + ("-" if lined is None else f"{lined:.2%}")
        + f" of the {ctx['lined_up']} on tiles that line up (median measured, within the limit)",
        f"  measured on {ctx['measured']:.1%} of the pairs; percentiles "
        + ", ".join(f"{q}%: {v} px" for q, v in ctx["residual_px_percentiles"].items()),
        "  detection when the post image under the building is moved by",
    ]
    lines += [
        f"    {c['shift_px']:>5g} source px: {c['detected']:.2%}"
        + (
            ""
            if c.get("detected_lined_up") is None
            else f" ({c['detected_lined_up']:.2%} on the tiles that line up)"
        )
        for c in ctx["cases"]
    ]
    fa = chip["false_alarms"]
    lines += [
        "",
        f"chip pair alone (chip mode; residual shift > {chip['limit_px']:g} chip px):",
        f"  false alarms, chips as cut:         {fa['as_cut']:.2%}",
        f"  false alarms, tile shift corrected: {fa['corrected']:.2%}",
        f"  measurable on {chip['measurable']:.1%} of corrected pairs; percentiles "
        + ", ".join(f"{q}%: {v} px" for q, v in chip["residual_px_percentiles"].items()),
        "  detection when the corrected post chip is moved by",
    ]
    lines += [f"    {c['shift_px']:>5g} chip px: {c['detected']:.2%}" for c in chip["cases"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = bench_alignment(
        args.chips,
        args.fold[0] if len(args.fold) == 1 else tuple(args.fold),
        tuple(args.shifts),
        args.limit,
        args.seed,
        tuple(args.context_shifts),
        args.context_limit,
    )
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
