"""The measurements of one held-out event: per repeat and number of labels k, the base model
adapted to k labels (random or suggested), and the network fine-tuned on the random ones as
``adapt --finetune`` does it, alone and with the event's other buildings as unlabelled imagery
(``adapt --semi``), each scored on the rest of the event."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.adapt.fit import METHODS, AdaptError, adapt_head
from app.adapt.labelled import from_chip_store
from app.adapt.model import base_model
from app.adapt.suggest import suggestion_order
from data_prep.split import spatial_blocks
from data_prep.store import read_manifest
from local_damage.adapt.finetune import FinetuneOptions
from local_damage.adapt.network import FinetuneError
from local_damage.export.weights import export_weights
from runtime.grading import grade_ids
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor
from runtime.selection import INTACT
from studies.fewshot_settings import FewShotError, Settings, pool_size
from studies.finetune_arm import finetune_labels, finetuned_classes


def _scores(y: np.ndarray, pred: np.ndarray, names: Sequence[str]) -> dict[str, float | None]:
    """Accuracy, macro-F1 and ``intact_damaged``: the share of the intact buildings (class
    :data:`runtime.selection.INTACT`) graded as damaged (None when none is intact)."""
    m = classification_metrics(y, pred, names)
    intact = y == INTACT
    return {
        "accuracy": round(float(m["accuracy"]), 6),
        "macro_f1": round(float(m["macro_f1"]), 6),
        "intact_damaged": round(float(np.mean(pred[intact] != INTACT)), 6)
        if intact.any()
        else None,
    }


def tuned(weights: Path, b, given, ev, unlabelled, max_epochs: int, seed: int):
    """``(predictions of ev or None, model, note, seconds)``: the network fine-tuned on the
    labels ``given`` (:func:`finetune_labels`) and the seconds fine-tuning took (choice
    included); None when the base network was kept or fine-tuning refused the labels (the base
    model's grades stand)."""
    try:
        r = finetune_labels(
            weights, b, given, unlabelled, FinetuneOptions(max_epochs=max_epochs, seed=seed)
        )
    except FinetuneError as exc:
        return None, "base", f"fine-tuning refused: {exc}", None
    if not r.epochs:
        return None, "base", f"base network kept ({r.seconds:.0f} s)", r.seconds
    note = f"{r.epochs} epoch(s) ({r.seconds:.0f} s)"
    return finetuned_classes(r, b, ev), "finetuned", note, r.seconds


def area_blocks(chips, ids) -> np.ndarray:
    """The spatial block (:func:`data_prep.split.spatial_blocks`) of each building of ``ids``."""
    manifest = read_manifest(chips)
    block = spatial_blocks(manifest)
    tile = dict(zip(manifest["chip_id"], manifest["tile"], strict=True))
    return np.asarray([block[tile[i]] for i in ids])


def area_split(
    blocks: np.ndarray, perm: np.ndarray, n_pool: int, rng
) -> tuple[np.ndarray, np.ndarray]:
    """``(pool, graded)`` by area: whole blocks in a random order go to the pool until it holds
    at least ``n_pool`` buildings (within a block in the order of ``perm``); the other blocks are
    graded. No block is on both sides.

    Raises:
        FewShotError: the event's first blocks leave no other block to grade.
    """
    names = np.unique(blocks)
    order = rng.permutation(len(names))
    pool: list[int] = []
    taken = set()
    for j in order:
        if len(pool) >= n_pool:
            break
        pool += perm[blocks[perm] == names[j]].tolist()
        taken.add(names[j])
    graded = np.flatnonzero(~np.isin(blocks, list(taken)))
    if not len(graded):
        raise FewShotError(
            f"{len(names)} spatial block(s): the pool of {n_pool} buildings takes them all; "
            "lower --pool-share or use --draw random"
        )
    return np.asarray(pool, dtype=np.int64), graded


def measure_event(
    event: str, chips, cfg, base_run: Path, base_onnx: Path, settings: Settings, bar=None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every measurement of one held-out event (see :mod:`studies.fewshot`).

    Returns:
        ``(rows, splits)``: one row per repeat, k and arm (``labelled``: the chip ids given,
        ``accuracy`` and ``macro_f1`` of the evaluation set, ``model``: the head kept, ``note``),
        and per repeat the chip ids of the pool (in random order) and of the evaluation set.
    """
    predictor = Predictor(base_onnx)
    names = list(predictor.class_names)
    b = from_chip_store(chips, names, event=event)
    b = b.subset(b.labelled)
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    base_net = base_model(predictor)  # the base and the heads graded under the model's own rule
    y, ids = b.labels, np.asarray(b.ids)
    base_pred = grade_ids(p.probabilities, INTACT, base_net.false_alarm_cost)
    tiles = b.tiles()
    n_pool = pool_size(len(b), settings)
    weights = base_onnx.with_suffix(".safetensors")
    if settings.finetune_epochs and not weights.is_file():
        export_weights(base_run, weights)
    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    blocks = area_blocks(chips, b.ids) if settings.draw == "area" else None
    for r in range(settings.repeats):
        rng = np.random.default_rng([settings.seed, r, zlib.crc32(event.encode())])
        perm = rng.permutation(len(b))
        if blocks is None:
            pool, ev = perm[:n_pool], np.sort(perm[n_pool:])
        else:
            pool, ev = area_split(blocks, perm, n_pool, rng)
        # the suggested labels come in rounds, as an analyst gets them: the first round ranked
        # with the base model, each later one with the head adapted to the labels so far
        suggested: list[int] = []
        head = None
        splits.append({"repeat": r, "pool": ids[pool].tolist(), "eval": ids[ev].tolist()})
        common = {"event": event, "repeat": r, "pool": int(len(pool)), "n_eval": int(len(ev))}
        base = _scores(y[ev], base_pred[ev], names)
        for k in sorted(settings.k):
            if len(suggested) < k:
                taken = set(suggested)
                rest = np.asarray([i for i in pool if i not in taken], dtype=np.int64)
                prob = p.probabilities[rest]
                if head is not None:
                    prob = np.exp(head.log_probabilities(raw[rest], p.embedding[rest]))
                # the random share is drawn in the pool's own random order: the first round is
                # the random arm's draw, and a later round's random picks are the next of it
                ranked, _ = suggestion_order(
                    prob,
                    p.embedding[rest],
                    k - len(suggested),
                    p.embedding[suggested] if suggested else None,
                    adapted=head is not None,
                    order=np.arange(len(rest)),
                )
                suggested += rest[ranked].tolist()
            for arm in ("adapt-random", "adapt-suggested", "finetune", "semi"):
                if arm in ("finetune", "semi") and (
                    not settings.finetune_epochs or (settings.tune_k and k not in settings.tune_k)
                ):
                    continue
                given = pool[:k] if arm != "adapt-suggested" else np.asarray(suggested[:k], int)
                row: dict[str, Any] = {**common, "k": int(k), "arm": arm}
                row["labelled"] = ids[given].tolist()
                row["labels_per_class"] = {
                    n: int(np.sum(y[given] == i)) for i, n in enumerate(names)
                }
                if k == 0:
                    row.update(base, model="base")
                elif arm in ("finetune", "semi"):
                    # semi: every building of the event not given is unlabelled imagery
                    unl = np.setdiff1d(np.arange(len(b)), given) if arm == "semi" else None
                    pred, model, note, seconds = tuned(
                        weights, b, given, ev, unl, settings.finetune_epochs, settings.seed + r
                    )
                    row.update(base if pred is None else _scores(y[ev], pred, names))
                    row.update(model=model if pred is None else arm, note=note)
                    row["seconds"] = None if seconds is None else round(float(seconds), 2)
                else:
                    try:
                        a = adapt_head(
                            raw[given],
                            p.embedding[given],
                            y[given],
                            base_net,
                            METHODS,
                            settings.seed,
                            settings.unlabelled,
                            [tiles[i] for i in given],
                        )
                        lp = a.head.log_probabilities(raw[ev], p.embedding[ev])
                        graded = grade_ids(np.exp(lp), INTACT, base_net.false_alarm_cost)
                        row.update(_scores(y[ev], graded, names), model=a.head.method)
                        if arm == "adapt-suggested":
                            head = a.head
                    except AdaptError as exc:  # adapt refuses; the analyst keeps the base model
                        row.update(base, model="base", note=f"adapt refused: {exc}")
                        if arm == "adapt-suggested":
                            head = None
                rows.append(row)
                if k and bar is not None:
                    bar.update()
    return rows, splits
