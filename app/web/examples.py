"""The web app's synthetic examples: one xBD-format tile and two chip pairs, generated (not real
imagery)."""

from __future__ import annotations

import os
from pathlib import Path

from data_prep.report import PrepareReport
from data_prep.spec import ChipSpec
from data_prep.synthetic import make_xbd, tile_name
from data_prep.windows import cut_building
from data_prep.xbd_tiles import parse_buildings, read_tile_image


def make_examples(folder: str | os.PathLike, seed: int = 0) -> dict[str, list[list[str]]]:
    """Write synthetic examples (one xBD-format tile and two chip pairs) into ``folder``.

    Returns:
        ``{"tile": [[pre, post, label_json]], "chip": [[pre, post], ...]}`` file paths.
    """
    import cv2

    folder = Path(folder)
    make_xbd(folder, seed=seed, n_tiles=1)
    name = tile_name(0)
    pre = next((folder / "images").glob(f"{name}_pre_disaster.*"))
    post = next((folder / "images").glob(f"{name}_post_disaster.*"))
    label = folder / "labels" / f"{name}_post_disaster.json"
    _, buildings = parse_buildings(label, PrepareReport())
    spec = ChipSpec()
    pre_img, post_img = read_tile_image(pre), read_tile_image(post)
    chips = []
    for wanted in (0, 3):  # an intact and a destroyed building
        b = next((b for b in buildings if b.label == wanted), None)
        if b is None:
            continue
        cut = cut_building(pre_img, post_img, b, spec)
        if cut is None:  # not on the tile (synthetic buildings always are)
            continue
        pair = []
        for phase, chip in zip(("pre", "post"), (cut.pre, cut.post), strict=True):
            path = folder / "chips" / f"{b.uid[:8]}_{phase}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(path), cv2.cvtColor(chip, cv2.COLOR_RGB2BGR))
            pair.append(str(path))
        chips.append(pair)
    return {"tile": [[str(pre), str(post), str(label)]], "chip": chips}
