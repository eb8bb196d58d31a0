"""`local-damage adapt` never makes the base model worse on what the labels can tell: every
adjustment (the heads, and the discount of classes without a label) is a candidate judged by the
same cross-validation, the base model is always one and wins near-ties, and a class without a
label keeps its probability unless the labels give evidence against it."""

from __future__ import annotations

import numpy as np
import pytest

from app.adapt.fit import METHODS, AdaptError, BaseModel, adapt_head
from app.adapt.model import format_adaptation
from runtime.head import unit


def _logits(p: list[float], n: int) -> np.ndarray:
    return np.tile(np.log(np.asarray(p, np.float64)), (n, 1))


def _macro_f1(y: np.ndarray, pred: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    present = sorted(set(y.tolist()) | set(pred.tolist()))
    return float(f1_score(y, pred, labels=present, average="macro"))


def _scene(seed: int):
    """20 labels of no-damage (0), minor (1) and destroyed (3), none of major damage (2), on
    which the base model is right and gives major damage 0.2 each (an expected count of 4: the
    old rule multiplied major damage by 1 / (1 + 4) = 0.2); held-out buildings of all four
    classes, the major-damage ones graded right by the base model with p = 0.55."""
    rng = np.random.default_rng(seed)
    rows = {0: [0.6, 0.1, 0.2, 0.1], 1: [0.1, 0.6, 0.2, 0.1], 3: [0.1, 0.1, 0.2, 0.6]}
    y = np.repeat([0, 1, 3], [8, 6, 6])
    raw = np.vstack([_logits(rows[int(c)], 1) for c in y]) + rng.normal(0, 0.05, (20, 4))
    held_y = np.repeat([0, 1, 2, 3], [30, 20, 10, 20])
    rows[2] = [0.25, 0.12, 0.55, 0.08]
    held = np.vstack([_logits(rows[int(c)], 1) for c in held_y]) + rng.normal(0, 0.05, (80, 4))
    z = unit(rng.normal(size=(20, 16)))
    held_z = unit(rng.normal(size=(80, 16)))
    return raw, z, y, held, held_z, held_y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_class_missing_from_the_labels_is_not_discounted_without_evidence(seed):
    """The case that tripped the old rule: no major-damage building among the labels, and the
    base model grades the held-out major-damage buildings right. The adapted model is not worse
    than the base model on the held-out buildings (the old rule cost them every major-damage
    grade: macro-F1 1.0 -> about 0.78)."""
    raw, z, y, held, held_z, held_y = _scene(seed)
    base_pred = held.argmax(1)
    assert _macro_f1(held_y, base_pred) == 1.0
    ad = adapt_head(raw, z, y, BaseModel(4))
    pred = ad.head.log_probabilities(held, held_z).argmax(1)
    assert _macro_f1(held_y, pred) >= _macro_f1(held_y, base_pred) - 0.01, ad.cv["candidates"]
    assert (pred[held_y == 2] == 2).all()
    assert ad.head.discount[2] == 1.0
    assert not ad.head.method.endswith("+discount")


def test_a_class_the_labels_speak_against_is_discounted_when_it_helps():
    """The other side: the base model calls major damage on most labelled buildings, and every
    one of them is something else (a wildfire the base model grades too harshly). The discounted
    base model is the candidate kept, and it grades held-out buildings of the same kind better."""
    rng = np.random.default_rng(5)
    harsh = {0: [0.3, 0.1, 0.55, 0.05], 3: [0.05, 0.05, 0.5, 0.4]}
    y = np.repeat([0, 3], [12, 8])
    raw = np.vstack([_logits(harsh[int(c)], 1) for c in y]) + rng.normal(0, 0.05, (20, 4))
    held_y = np.repeat([0, 3], [60, 40])
    held = np.vstack([_logits(harsh[int(c)], 1) for c in held_y]) + rng.normal(0, 0.05, (100, 4))
    z, held_z = unit(rng.normal(size=(20, 16))), unit(rng.normal(size=(100, 16)))
    ad = adapt_head(raw, z, y, BaseModel(4))
    assert ad.head.method.endswith("+discount"), ad.cv["candidates"]
    assert ad.cv["candidates"][ad.head.method]["clear"]
    assert ad.head.discount[2] < 0.2 and ad.head.discount[1] == 1.0  # 1: never called
    before = _macro_f1(held_y, held.argmax(1))
    after = _macro_f1(held_y, ad.head.log_probabilities(held, held_z).argmax(1))
    assert after > before + 0.3


def test_the_base_model_is_always_a_candidate_and_wins_near_ties():
    """``--heads logistic`` still measures the base model; a head whose cross-validated NLL is
    lower than the base model's by less than the near-tie margin is not taken."""
    rng = np.random.default_rng(11)
    y = np.repeat([0, 3], [15, 15])
    raw = np.where(np.eye(4)[y] > 0, 1.0, 0.0) + rng.normal(0, 0.5, (30, 4))
    z = unit(rng.normal(size=(30, 8)))
    ad = adapt_head(raw, z, y, BaseModel(4), methods=("logistic",))
    assert "base" in ad.cv["candidates"] and "logistic" in ad.cv["candidates"]
    for name, m in ad.cv["candidates"].items():
        assert {"gain", "gain_se", "clear"} <= set(m), name
    assert ad.head.method == "base", ad.cv["candidates"]
    assert not any(m["clear"] for m in ad.cv["candidates"].values())


def test_the_candidates_are_every_head_kept_and_discounted():
    """With evidence against a class, each head of METHODS is tried both ways."""
    rng = np.random.default_rng(2)
    y = rng.choice([0, 3], 30)
    raw = rng.normal(0, 0.3, (30, 4))
    raw[:, 1] += 2.0  # the base model calls minor damage on all of them
    ad = adapt_head(raw, unit(rng.normal(size=(30, 8))), y, BaseModel(4))
    expected = {*METHODS, *(m + "+discount" for m in METHODS)}
    assert set(ad.cv["candidates"]) == expected


def _few_labels_of_one_grade():
    """5 labels, 3 of them minor damage (1) that the base model calls no-damage, on embeddings
    that hold nothing about the grade; 300 held-out buildings the base model grades right
    (no-damage, minor damage it calls no-damage, destroyed)."""
    rng = np.random.default_rng(0)
    y = np.array([1, 0, 1, 1, 3])
    raw = rng.normal(0, 0.3, (5, 4))
    raw[:, 0] += 2.0
    raw[4, 3] += 2.5
    z = unit(rng.normal(size=(5, 16)))
    ye = rng.choice([0, 1, 3], 300, p=[0.5, 0.2, 0.3])
    re = rng.normal(0, 0.3, (300, 4))
    re[np.arange(300), np.where(ye == 1, 0, ye)] += 2.0
    ze = unit(rng.normal(size=(300, 16)))
    return raw, z, y, re, ze, ye


def test_a_few_labels_of_one_grade_do_not_let_a_logistic_head_call_everything_that_grade(
    monkeypatch,
):
    """Below LOGISTIC_MIN_LABELS the logistic heads are not candidates: on this case, with them
    allowed, leave-one-out over the 5 labels picks one that calls most held-out buildings minor
    damage, far below the base model."""
    import app.adapt.fit as fit

    raw, z, y, re, ze, ye = _few_labels_of_one_grade()
    base_f1 = _macro_f1(ye, re.argmax(1))

    monkeypatch.setattr(fit, "LOGISTIC_MIN_LABELS", 0)
    tripped = adapt_head(raw, z, y, BaseModel(4))
    pred = tripped.head.log_probabilities(re, ze).argmax(1)
    assert tripped.head.method.startswith("logistic")
    assert np.mean(pred == 1) > 0.5 and _macro_f1(ye, pred) < base_f1 - 0.1

    monkeypatch.undo()
    assert len(y) < fit.LOGISTIC_MIN_LABELS
    ad = adapt_head(raw, z, y, BaseModel(4))
    assert not any(n.startswith("logistic") for n in ad.cv["candidates"])
    # the analyst is told which heads were left out, and why
    assert set(ad.cv["not_tried"]) == {"logistic", "logistic+prior"}
    block = {"method": ad.head.method, "labels": {"n": 5}, "cv": ad.cv}
    assert "logistic+prior  not tried: 5 labels, fewer than" in format_adaptation(block)
    assert _macro_f1(ye, ad.head.log_probabilities(re, ze).argmax(1)) >= base_f1 - 0.01


def test_the_rule_refuses_a_candidate_whose_accuracy_or_intact_recall_falls():
    """A head with a clearly lower NLL and a higher macro-F1 is still refused when its
    cross-validated accuracy or its recall of intact buildings is below the base model's (on a
    new event such a head calls many intact buildings damaged)."""
    from app.adapt.fit import choose

    rng = np.random.default_rng(0)
    base_losses = rng.uniform(0.8, 1.2, 200)
    losses = {"base": base_losses, "logistic": base_losses - 0.2}
    base = {"nll": 1.0, "accuracy": 0.60, "macro_f1": 0.30, "intact_recall": 0.90}

    def kept(**candidate):
        cands = {"base": dict(base), "logistic": {"nll": 0.8, "macro_f1": 0.35, **candidate}}
        return choose(cands, losses, ["base", "logistic"]), cands["logistic"]["clear"]

    assert kept(accuracy=0.62, intact_recall=0.90) == ("logistic", True)
    assert kept(accuracy=0.50, intact_recall=0.95) == ("base", False)
    assert kept(accuracy=0.62, intact_recall=0.70) == ("base", False)
    # no intact label among the given ones: accuracy and the rest decide
    assert kept(accuracy=0.62, intact_recall=None) == ("logistic", True)


def _clustered(seed: int, tiles: int, per_tile: int, dim: int = 32):
    """Damage clustered by tile: every building of a tile has the tile's grade (0 or 1) and the
    tile's look (its embedding is the tile's random direction plus noise), with nothing of the
    damage itself in the embedding; the base model is right on 70% of the buildings."""
    rng = np.random.default_rng(seed)
    grade = np.arange(tiles) % 2
    look = rng.normal(size=(tiles, dim))
    tile = np.repeat(np.arange(tiles), per_tile)
    y = grade[tile]
    z = unit(look[tile] + 0.1 * rng.normal(size=(len(y), dim)))
    right = rng.random(len(y)) < 0.7
    called = np.where(right, y, 1 - y)
    raw = np.log(np.where(np.eye(4)[called] > 0, 0.62, 0.01) + np.eye(4)[1 - called] * 0.35)
    return raw, z, y, np.asarray([f"tile_{t}" for t in tile])


def test_labels_of_several_tiles_are_cross_validated_by_tile():
    """A head that learns each tile's look wins a cross-validation that mixes a tile's labels
    into both sides of a fold, and grades new tiles worse than the base model; holding each
    tile's labels together refuses it."""
    raw, z, y, tiles = _clustered(0, tiles=8, per_tile=6)
    held_raw, held_z, held_y, _ = _clustered(1, tiles=8, per_tile=20)
    base = BaseModel(4)
    mixed = adapt_head(raw, z, y, base)
    assert mixed.cv["scheme"].startswith("stratified")
    assert mixed.head.method != "base", mixed.cv["candidates"]
    base_acc = np.mean(held_raw.argmax(1) == held_y)
    assert np.mean(mixed.head.log_probabilities(held_raw, held_z).argmax(1) == held_y) < base_acc
    by_tile = adapt_head(raw, z, y, base, tiles=tiles)
    assert by_tile.cv["scheme"] == "5-fold by tile"
    assert by_tile.head.method == "base", by_tile.cv["candidates"]
    # fewer than three tiles: nothing to hold out, the labels' own folds
    two = adapt_head(raw, z, y, base, tiles=np.where(tiles < "tile_4", "a", "b"))
    assert two.cv["scheme"] == mixed.cv["scheme"]
    four = adapt_head(raw[:24], z[:24], y[:24], base, tiles=tiles[:24])
    assert four.cv["scheme"] == "leave-one-tile-out"
    with pytest.raises(AdaptError, match="3 tiles for 48 labels"):
        adapt_head(raw, z, y, base, tiles=tiles[:3])


def test_a_head_kept_on_labels_of_one_or_two_tiles_is_flagged():
    """Labels of fewer than three tiles cannot be cross-validated by tile: when a head is kept
    on them, the summary (terminal, model card, app) says to check it on another tile."""
    from app.adapt.model import few_tiles_text

    head = {"method": "logistic", "labels": {"n": 30, "tiles": ["joplin_00000001"]}}
    text = few_tiles_text(head)
    assert text is not None and text.startswith("labels of 1 tile or scene only")
    assert text in format_adaptation(head)
    from app.web.model_card import _adaptation_text

    assert text in _adaptation_text(head)  # the model card says it too
    two = {**head, "labels": {"tiles": ["a", "b"]}}
    assert "labels of 2 tiles or scenes only" in (few_tiles_text(two) or "")
    assert few_tiles_text({**head, "labels": {"tiles": ["a", "b", "c"]}}) is None
    assert few_tiles_text({**head, "method": "base"}) is None
    # the groups of the cross-validation: two footprint files of one event are two groups
    from app.adapt.labelled import BuildingRef, Buildings

    chips = np.zeros((4, 8, 8, 3), np.uint8)
    ids = ["flood:a", "flood:b", "flood:c", "flood:d"]
    files = ["north.geojson", "north.geojson", "south.geojson", "south.geojson"]
    refs = [BuildingRef(f, i, r) for r, (f, i) in enumerate(zip(files, ids, strict=True))]
    read = Buildings(ids, ["flood"] * 4, np.array([0, 1, 0, -1]), chips, chips, [], refs)
    assert read.tiles() == ["flood"] * 4
    assert len(set(read.groups())) == 2
    counts = read.counts(["no-damage", "minor-damage", "major-damage", "destroyed"])
    assert counts["tiles"] == ["flood"] and counts["groups"] == 2
    store = Buildings(
        ["t1:a", "t2:b", "t3:c"], ["e"] * 3, np.array([0, 1, 2]), chips[:3], chips[:3]
    )
    assert store.groups() == store.tiles() == ["t1", "t2", "t3"]
