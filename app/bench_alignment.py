"""`local-damage bench alignment`: the ``misaligned`` flag on real chips and on shifted copies
(no torch, no model).

For the tiles of one fold of an xBD chip store, each tile's pre/post images are read from the
store's source folders, the tile's post-to-pre shift is measured and corrected as `score --labels`
does (:func:`data_prep.alignment.align_images`), and every building's chips are cut again from the
corrected pair by the chip-cutting function with the manifest's windows. It prints:

- the tile shifts (pixels, confidence, applied);
- **false alarms**: the share of real chip pairs flagged ``misaligned`` (residual shift above
  ``--limit`` chip pixels, :func:`data_prep.alignment.residual_shift`), on the store's chips as
  cut (no correction) and on the corrected chips;
- **detection**: the share of corrected pairs flagged once their post chip is moved by each of
  ``--shifts`` chip pixels in a random direction (:func:`app.bench_flags.shift_chip`).

Seeded: a rerun prints the same figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from app.flags import MISALIGNED_PX, misaligned_flag


def bench_alignment(
    chips: str | Path,
    fold: int | None = 1,
    shifts: tuple[float, ...] = (4.0, 8.0, 16.0),
    limit_px: float = MISALIGNED_PX,
    seed: int = 0,
) -> dict[str, Any]:
    """Figures of the ``misaligned`` flag on a fold of an xBD chip store (see the module doc)."""
    from app.bench_flags import _fold_records, shift_chip
    from data_prep.alignment import align_images, residual_shift
    from data_prep.store import ChipReader, read_meta
    from data_prep.windows import ChipWindow, crop_boundless, resize_chip
    from data_prep.xbd import read_tile_pair

    chips = Path(chips)
    meta = read_meta(chips)
    size = int(meta["spec"]["chip_size"])
    roots = [Path(r) for r in meta.get("roots", [])]
    records, _ = _fold_records(chips, fold)
    if not records:
        raise ValueError(f"{chips}: fold {fold} holds no chips")
    reader = ChipReader(chips)
    rng = np.random.default_rng(seed)
    by_tile: dict[str, list[dict]] = {}
    for r in records:
        by_tile.setdefault(r["tile"], []).append(r)

    tiles, raw, fixed_pre, fixed_post = [], [], [], []
    for tile, rows in sorted(by_tile.items()):
        found = [
            (
                root / "images" / f"{tile}_pre_disaster.png",
                root / "images" / f"{tile}_post_disaster.png",
            )
            for root in roots
        ]
        found = [p for p in found if p[0].is_file() and p[1].is_file()]
        if not found:
            raise FileNotFoundError(f"{tile}: pre/post images not found under {roots}")
        pre_img, post_img = read_tile_pair(*found[0])
        post_fixed, shift = align_images(pre_img, post_img)
        tiles.append({"tile": tile, "n": len(rows), **shift.to_dict()})
        for r in rows:
            a, b = reader.pair(r)
            raw.append(residual_shift(a, b))
            w = ChipWindow(int(r["win_col"]), int(r["win_row"]), int(r["win_size"]))
            fixed_pre.append(resize_chip(crop_boundless(pre_img, w), size))
            fixed_post.append(resize_chip(crop_boundless(post_fixed, w), size))

    def rate(values) -> float:
        return float(np.mean([misaligned_flag(v, limit_px) for v in values]))

    corrected = [residual_shift(a, b) for a, b in zip(fixed_pre, fixed_post, strict=True)]
    measured = [v for v in corrected if v is not None]
    cases = []
    for s in shifts:
        moved = [
            residual_shift(a, shift_chip(b, s, rng))
            for a, b in zip(fixed_pre, fixed_post, strict=True)
        ]
        cases.append({"shift_px": s, "detected": rate(moved)})
    return {
        "chips": str(chips),
        "fold": fold,
        "n": len(records),
        "limit_px": limit_px,
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
                )
            }
            for t in tiles
        ],
        "false_alarms": {"as_cut": rate(raw), "corrected": rate(corrected)},
        "measurable": len(measured) / max(len(corrected), 1),
        "residual_px_percentiles": {
            str(q): round(float(np.percentile(measured, q)), 2) for q in (50, 90, 98)
        }
        if measured
        else {},
        "cases": cases,
    }


def format_result(result: dict[str, Any]) -> str:
    """The figures as plain text."""
    lines = [
        f"misaligned (residual shift > {result['limit_px']:g} chip px) on {result['chips']} "
        f"fold {result['fold']} ({result['n']} pairs)",
        "",
        "tile shifts (post to pre, image pixels):",
    ]
    for t in result["tiles"]:
        s = t["shift_px"]
        shift = "-" if s["dx"] is None else f"({s['dx']:+.2f}, {s['dy']:+.2f})"
        lines.append(
            f"  {t['tile']:<36} {t['n']:>4}  {shift:<18} "
            f"{'corrected' if t['applied'] else 'not corrected: ' + t['reason']}"
        )
    fa = result["false_alarms"]
    lines += [
        "",
        f"false alarms, chips as cut:         {fa['as_cut']:.2%}",
        f"false alarms, tile shift corrected: {fa['corrected']:.2%}",
        f"residual measurable on {result['measurable']:.1%} of corrected pairs; percentiles "
        + ", ".join(f"{q}%: {v} px" for q, v in result["residual_px_percentiles"].items()),
        "",
        "detection on corrected pairs whose post chip is moved:",
    ]
    lines += [f"  {c['shift_px']:>5g} chip px: {c['detected']:.2%}" for c in result["cases"]]
    return "\n".join(lines)


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench alignment``."""
    p = bench_sub.add_parser(
        "alignment",
        help="misaligned flag: false alarms on real xBD chips, detection on shifted copies",
        description=(
            "For a fold of an xBD chip store: measure and correct each tile's post-to-pre shift "
            "as `score --labels` does, re-cut the chips, and print the share of real pairs "
            "flagged misaligned (before and after the correction) and the share flagged once the "
            "post chip is moved by each --shifts distance. Seeded; no torch, no model."
        ),
    )
    p.add_argument("--chips", required=True, metavar="CHIPS", help="xBD chip store")
    p.add_argument("--fold", type=int, default=1, metavar="K", help="fold (default 1)")
    p.add_argument(
        "--shifts",
        type=float,
        nargs="+",
        default=[4.0, 8.0, 16.0],
        metavar="PX",
        help="post chip shifts in chip pixels (default 4 8 16)",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=MISALIGNED_PX,
        metavar="PX",
        help=f"misaligned above this residual shift in chip pixels (default {MISALIGNED_PX:g})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the shift directions")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = bench_alignment(args.chips, args.fold, tuple(args.shifts), args.limit, args.seed)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
