"""`local-damage demo`: score an example scene end to end, for people who do not want a browser.

The example is the project's synthetic georeferenced scene (two pre tiles in UTM, two post tiles
in EPSG:4326, 40 footprints; see :mod:`data_prep.synthetic_scene`), scored by the same
:func:`app.scoring.scene.score_scene` as ``local-damage score``: GeoJSON, Cloud-Optimised GeoTIFF and PNG
overlay. The imagery is synthetic, so the grades show the pipeline working, not the model's
accuracy on real disasters (the model card has that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.scoring.common import ScoreOptions, ScoreReport
from app.scoring.detect import score_scene_detected
from app.scoring.scene import score_scene
from app.scoring.writer import OutputPaths
from data_prep.synthetic_scene import make_scene
from runtime.predictor import Predictor

#: Said wherever the demo's results are shown.
SYNTHETIC_NOTE = (
    "The example imagery is synthetic (drawn by data_prep.synthetic_scene, not a real disaster): "
    "the grades show the pipeline working end to end, not the model's accuracy on real imagery."
)


@dataclass(frozen=True)
class DemoResult:
    """What the demo wrote.

    Attributes:
        scene: the synthetic scene's folder (GeoTIFF tiles and footprints).
        report: the scoring report (per-class counts, outputs, time).
        command: the equivalent ``local-damage score`` command line.
    """

    scene: Path
    report: ScoreReport
    command: str


def run_demo(
    predictor: Predictor, out: str | os.PathLike, progress: bool = True, localizer=None
) -> DemoResult:
    """Write the example scene under ``out/scene`` and score it into ``out``.

    Writes ``out/buildings.geojson`` (one feature per footprint: damage, probabilities,
    confidence, status, source), ``out/damage.tif`` (COG of class ids) and ``out/overlay.png``.
    With a ``localizer`` (:class:`runtime.localizer.Localizer`) the footprints are left aside and
    the buildings the localiser finds on the pre tiles are graded instead (``source``
    ``detected``).
    """
    out = Path(out)
    scene = make_scene(out / "scene")
    vector, raster, overlay = out / "buildings.geojson", out / "damage.tif", out / "overlay.png"
    pre, post = [str(p) for p in scene.pre], [str(p) for p in scene.post]
    options = ScoreOptions(progress=progress)
    if localizer is not None:
        report = score_scene_detected(
            predictor,
            pre,
            post,
            OutputPaths(vector, raster, overlay),
            localizer=localizer,
            name="example",
            options=options,
        )
    else:
        report = score_scene(
            predictor,
            pre,
            post,
            scene.buildings,
            OutputPaths(vector, raster, overlay),
            name="example",
            options=options,
        )
    command = (
        "local-damage score --model "
        + str(predictor.path)
        + " --pre "
        + " ".join(str(p) for p in scene.pre)
        + " --post "
        + " ".join(str(p) for p in scene.post)
        + (
            f" --localizer {localizer.path}"
            if localizer is not None
            else f" --buildings {scene.buildings}"
        )
        + f" --out {vector} --raster {raster} --overlay {overlay}"
    )
    return DemoResult(scene.root, report, command)
