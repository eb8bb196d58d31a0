"""Whether a whole scene looks like the imagery the model learnt from.

A model that never saw a disaster grades it badly and confidently: on Hurricane Michael, which
the bundled model never saw, it calls about one intact building in five damaged, and no single
building's flag says so. What does show it is the scene as a whole: the buildings of an unseen
event sit far from the model's class prototypes. Each building's *familiarity* is the largest
cosine similarity of its embedding to a class prototype (the score the ``ood`` flag thresholds,
:func:`runtime.flags.ood_scores`). The model's ``ood`` metadata block keeps a reference
familiarity, ``scene``: the :data:`QUANTILE` quantile of the familiarity of its calibration
buildings (tiles it did not train on, of the events it learnt from). A scene is **unfamiliar**
when the median familiarity of its scored buildings is below that reference, i.e. most of its
buildings look less like the training data than nine in ten buildings of the known events do,
and it has at least :data:`MIN_BUILDINGS` scored buildings (fewer say too little either way).

Measured in docs/flags.md ("A scene unlike the training data"): with the four-event model bundled
before, every held-out tile of at least 10 buildings of its own events passed and 48 of the 53
Michael tiles were called unfamiliar. The recipe of today's bundled model (strong augmentation,
the pair matched in colour) makes embeddings of unlike imagery alike: its fold models call no
tile unfamiliar, those of the events they never saw included, so with it the check seldom fires.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: The reference familiarity is this quantile of the calibration buildings' familiarity.
QUANTILE = 0.10
#: Fewer scored buildings than this: the scene is not judged.
MIN_BUILDINGS = 10
#: Key of the reference in the ``ood`` metadata block, and of the result in reports and outputs.
SCENE_KEY = "scene"
#: The warning's first words, which the app shows as its heading.
HEADLINE = "grades uncertain on this imagery"
#: What the analyst is told to do about an unfamiliar scene.
ADVICE = (
    "label a few buildings and adapt (`local-damage adapt`, or Correct and Adapt in the app) "
    "before relying on the grades"
)


def scene_reference(familiarity: np.ndarray) -> dict[str, Any]:
    """The ``scene`` entry of a model's ``ood`` block, from the familiarity of its calibration
    buildings (held-out tiles of the training events).

    Raises:
        ValueError: no familiarity to take the quantile of.
    """
    f = np.asarray(familiarity, dtype=np.float64)
    f = f[np.isfinite(f)]
    if f.size == 0:
        raise ValueError("no familiarity scores to set the scene reference from")
    return {
        "familiarity": float(np.quantile(f, QUANTILE)),
        "quantile": QUANTILE,
        "min_buildings": MIN_BUILDINGS,
        "rule": (
            f"a scene of at least {MIN_BUILDINGS} scored buildings is unfamiliar when their "
            f"median familiarity (largest cosine to a class prototype) is below the "
            f"{QUANTILE:g} quantile of the calibration buildings'"
        ),
    }


def reference_of(ood_block: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``scene`` reference of a model's ``ood`` block; None when the model has none (it was
    calibrated before scenes were judged, or carries no prototypes) or it is malformed."""
    ref = (ood_block or {}).get(SCENE_KEY)
    if not isinstance(ref, Mapping):
        return None
    try:
        value = float(ref["familiarity"])
        minimum = int(ref.get("min_buildings", MIN_BUILDINGS))
    except (KeyError, TypeError, ValueError):
        return None
    if not np.isfinite(value) or minimum < 1:
        return None
    return {**dict(ref), "familiarity": value, "min_buildings": minimum}


def judge_scene(familiarity: np.ndarray, reference: Mapping[str, Any]) -> dict[str, Any]:
    """How familiar a scene's scored buildings are against the model's reference.

    Args:
        familiarity: ``[N]`` familiarity of the scene's scored buildings (NaN entries ignored).
        reference: the model's reference (:func:`reference_of`).

    Returns:
        ``{"buildings", "quantile", "median_familiarity", "reference_familiarity",
        "share_below", "min_buildings", "unfamiliar"}``; ``unfamiliar`` is None when the scene has fewer than
        ``min_buildings`` scored buildings (not judged), ``median_familiarity`` and
        ``share_below`` None when it has none.
    """
    f = np.asarray(familiarity, dtype=np.float64)
    f = f[np.isfinite(f)]
    ref = float(reference["familiarity"])
    minimum = int(reference.get("min_buildings", MIN_BUILDINGS))
    median = float(np.median(f)) if f.size else None
    return {
        "buildings": int(f.size),
        "quantile": float(reference.get("quantile", QUANTILE)),
        "median_familiarity": None if median is None else round(median, 6),
        "reference_familiarity": round(ref, 6),
        "share_below": None if not f.size else round(float(np.mean(f < ref)), 6),
        "min_buildings": minimum,
        "unfamiliar": None if f.size < minimum else bool(median < ref),
    }


def scene_warning(result: Mapping[str, Any] | None) -> str:
    """The line a report shows for an unfamiliar scene; empty otherwise."""
    if not result or not result.get("unfamiliar"):
        return ""
    share, q = result["share_below"], float(result.get("quantile", QUANTILE))
    return (
        f"{HEADLINE}: {share:.0%} of its {result['buildings']} scored "
        f"buildings look less like the imagery the model learnt from than {1 - q:.0%} of the "
        "buildings of the events it was trained on do (median familiarity "
        f"{result['median_familiarity']:.3f}"
        f" < {result['reference_familiarity']:.3f}); on a disaster it never saw the model calls "
        f"many intact buildings damaged: {ADVICE}"
    )
