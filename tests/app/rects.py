"""The synthetic scene of the localiser tests (tests/app/test_detect.py, test_oversized.py and the
``rect_scene`` fixture of tests/conftest.py): bright rectangles (buildings) on dark ground, as
georeferenced GeoTIFFs and as PNGs, with their true footprints, and a tiny localiser ONNX graph
that finds bright pixels, so the buildings it should find are known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import REPO

DAMAGE_MODEL = REPO / "models" / "default.onnx"
SIZE = 256
RES = 0.5
X0, Y0 = 362000.0, 4102000.0
#: (col0, row0, col1, row1) pixel rectangles; the last two share 16 px of wall.
RECTS = [
    (20, 20, 50, 44),
    (80, 24, 116, 52),
    (150, 20, 176, 60),
    (24, 100, 60, 124),
    (100, 96, 124, 136),
    (180, 110, 220, 140),
    (30, 180, 66, 216),
    (66, 196, 100, 232),
]


def make_localizer(
    path: Path,
    *,
    level: float = 150.0,
    tile_size: int = 64,
    scale: float = 1.0,
    threshold: float = 0.5,
    min_area_px: int = 20,
    task: str = "localize",
    largest_building_px: int | None = None,
) -> Path:
    """A tiny localiser ONNX file: sigmoid(0.2 * (mean over channels - level)); with
    ``largest_building_px``, that metadata prop too."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["image"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[3], keepdims=0),
        helper.make_node("Sub", ["m", "level"], ["d"]),
        helper.make_node("Mul", ["d", "gain"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["building"]),
    ]
    graph = helper.make_graph(
        nodes,
        "brightness-localizer",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", "H", "W", 3])],
        [helper.make_tensor_value_info("building", TensorProto.FLOAT, ["N", "H", "W"])],
        initializer=[
            helper.make_tensor("level", TensorProto.FLOAT, [], [level]),
            helper.make_tensor("gain", TensorProto.FLOAT, [], [0.2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    props = {
        "format_version": 1,
        "task": task,
        "tile_size": tile_size,
        "scale": scale,
        "threshold": threshold,
        "min_area_px": min_area_px,
        "trained_on": "nothing: a brightness rule for tests",
        "license": None,
        "training": {},
        "metrics": {},
    }
    if largest_building_px is not None:
        props["largest_building_px"] = largest_building_px
    helper.set_model_props(model, {k: json.dumps(v) for k, v in props.items()})
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def draw(destroyed: tuple[int, ...] = ()) -> np.ndarray:
    """uint8 [SIZE, SIZE, 3]: dark textured ground, bright rectangles; ``destroyed`` rectangles
    (indices into RECTS) drawn as dark rubble."""
    rng = np.random.default_rng(0)
    image = rng.integers(40, 80, (SIZE, SIZE, 3)).astype(np.uint8)
    for i, (c0, r0, c1, r1) in enumerate(RECTS):
        if i in destroyed:
            image[r0:r1, c0:c1] = rng.integers(20, 110, (r1 - r0, c1 - c0, 3))
        else:
            image[r0:r1, c0:c1] = (215, 205, 190)
            image[r0 + 2 : r1 - 2, c0 + 2 : (c0 + c1) // 2] = (200, 190, 178)  # two roof faces
    return image


def _write_geotiff(path: Path, rgb: np.ndarray) -> Path:
    from affine import Affine

    from data_prep.synthetic_scene import write_tile

    return write_tile(path, rgb, "EPSG:32615", Affine(RES, 0, X0, 0, -RES, Y0))


def _write_png(path: Path, rgb: np.ndarray) -> Path:
    import cv2

    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.ascontiguousarray(rgb[:, :, ::-1]))
    return path


def make_rect_scene(root: Path) -> dict:
    """Georeferenced pre/post GeoTIFFs, the same pair as PNGs, and the true footprints."""
    import shapely
    from affine import Affine

    from data_prep.synthetic_scene import write_footprints

    pre, post = draw(), draw(destroyed=(1, 5))
    t = Affine(RES, 0, X0, 0, -RES, Y0)
    boxes = [shapely.box(*(t @ (c0, r1)), *(t @ (c1, r0))) for c0, r0, c1, r1 in RECTS]
    footprints = write_footprints(
        root / "footprints.geojson",
        boxes,
        "EPSG:32615",
        {"uid": np.array([f"b{i}" for i in range(len(RECTS))], dtype=object)},
        "GeoJSON",
    )
    return {
        "pre": _write_geotiff(root / "pre" / "scene_pre.tif", pre),
        "post": _write_geotiff(root / "post" / "scene_post.tif", post),
        "pre_png": _write_png(root / "images" / "rects_00000001_pre_disaster.png", pre),
        "post_png": _write_png(root / "images" / "rects_00000001_post_disaster.png", post),
        "footprints": footprints,
        "boxes": boxes,
    }
