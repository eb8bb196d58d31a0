"""Fine-tuning the last encoder blocks and the classifier of a model on an analyst's labels, with
the number of epochs chosen by cross-validation on those labels (``adapt --finetune``), and
optionally FixMatch on the event's unlabelled buildings (``adapt --semi``, :mod:`local_damage.adapt.semi`).

Torch is imported inside the functions, so that importing this module costs nothing and a
machine without PyTorch gets :class:`FinetuneError` naming what to install.

How (one pass of the frozen part, then cheap epochs):

1. The network is the base model's (weights: the fp16 ``.safetensors`` shipped beside it, with
   its config in the file's metadata). Everything but the last ``blocks`` residual blocks of the
   encoder (1: the last block of ResNet's fourth stage) and the classifier is frozen, BatchNorm statistics included (eval mode throughout: batches of a few
   labels would ruin them).
2. The frozen stages run once per labelled pair in each of its 8 turns and mirrors (the same one
   for pre and post); training reads those cached features, so an epoch is a pass of the last
   stage and the classifier only.
3. Linear probing, then fine-tuning (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
   Features"): the classifier alone is fitted for ``probe_epochs`` on the frozen features first,
   then the block and the classifier are trained together, the block at a tenth of the
   classifier's rate (discriminative rates, Howard & Ruder 2018), both decaying along a half
   cosine over ``max_epochs`` (so a few hundred labels do not swing the curve). Plain
   cross-entropy, AdamW: the labels' own class frequencies (the new event's prior, when they are
   a random draw) are kept rather than flattened by class weights. Cross-validation
   (:data:`FOLDS` folds) trains on each fold's labels for up to ``max_epochs`` epochs and records
   the held-out NLL, accuracy, macro-F1 and intact recall after every epoch; epoch 0 is the base
   network. The number of epochs kept is the one with the lowest mean held-out NLL, and it
   replaces epoch 0 only when it beats it clearly and loses neither accuracy nor intact recall
   (:mod:`runtime.selection`); then the network is trained on every label for that many epochs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from local_damage.adapt.network import (
    FinetuneError,
    load_network,
    logits_features,
    logits_of,
    prepare_chips,
    require_torch,
    split_network,
    trunk_features,
)
from local_damage.adapt.semi import Unlabelled
from runtime.grading import grade_ids
from runtime.predictor import softmax
from runtime.selection import INTACT, OutOfFold, clearly_better

log = logging.getLogger(__name__)

#: Folds of the cross-validation that chooses the number of epochs.
FOLDS = 3
#: Fewest optimiser steps in an epoch (with a few labels, a pass over them is one or two steps).
MIN_STEPS = 4


@dataclass
class FinetuneOptions:
    """How the network is fine-tuned (defaults: what ``adapt --finetune`` uses)."""

    blocks: int = 1
    max_epochs: int = 8
    #: the classifier's learning rate; the encoder block's is ``lr * encoder_lr`` (discriminative
    #: rates, Howard & Ruder 2018: the pretrained layer moves less than the new head)
    lr: float = 1e-3
    encoder_lr: float = 0.1
    #: epochs of the classifier alone before the block is trained (linear probing, then
    #: fine-tuning: Kumar et al. 2022, so the block is not pulled by a random-ish head)
    probe_epochs: int = 2
    #: the rates decay to 0 along a half cosine over ``max_epochs`` (the same in the
    #: cross-validation and the final training, so the chosen epoch means the same rate)
    cosine: bool = True
    #: weight the loss by inverse class frequency; off: the labels' own class frequencies (the
    #: event's prior, when the labels are a random draw) are kept
    class_weights: bool = False
    weight_decay: float = 1e-4
    batch_size: int = 32
    seed: int = 0
    #: torch threads while fine-tuning (None: torch's default, one per core). On an idle 2-core
    #: machine two threads take 0.6 of one thread's time; on one whose cores other work keeps
    #: busy, one thread is faster (two spin while they wait): ``adapt --threads 1``.
    threads: int | None = None
    #: FixMatch on unlabelled buildings (:mod:`local_damage.adapt.semi`): confidence threshold,
    #: weight of the pseudo-label loss, unlabelled pairs per labelled pair in a step.
    confidence: float = 0.95
    unlabelled_weight: float = 1.0
    unlabelled_ratio: int = 2
    #: the model's own grade rule (:mod:`runtime.grading`): the curve's accuracy, macro-F1 and
    #: intact recall are those of the grades the analyst will see
    false_alarm_cost: float = 1.0


@dataclass
class FinetuneResult:
    """The fine-tuned network and how it was chosen.

    Attributes:
        net: the LocalNet (eval mode, CPU); the base network when ``epochs`` is 0.
        config: the model's training config (a dict, as in the weights file).
        epochs: epochs kept (0: the base network was not beaten clearly).
        curve: per epoch 0..max, the cross-validated ``nll``, ``accuracy`` and ``macro_f1``
            (macro-F1: the mean over the folds; each fold's in ``macro_f1_folds``).
        scheme: the cross-validation, in words.
        seconds: wall time of the cross-validation and the final training.
        semi: FixMatch figures (share of unlabelled pairs above the confidence), when used.
        oof_logits: ``[N, K]`` raw logits of every label by the fold model that did not train on
            it, at the kept epoch (the base network's for 0): what ``adapt`` recalibrates the
            kept network's probabilities on (:mod:`app.adapt.recalibrate`).
    """

    net: Any
    config: dict[str, Any]
    epochs: int
    curve: list[dict[str, float]]
    seconds: float
    scheme: str = ""
    clear: dict[str, Any] = field(default_factory=dict)
    semi: dict[str, Any] = field(default_factory=dict)
    oof_logits: np.ndarray | None = None


def weights_beside(model: str | Path) -> Path:
    """The fine-tuning weights shipped beside a model file: ``NAME.safetensors`` for
    ``NAME.onnx`` (``export --weights`` writes them; the bundled model has them)."""
    return Path(model).with_suffix(".safetensors")


def _metrics(logits, y: np.ndarray, cost: float = 1.0) -> tuple[np.ndarray, float, np.ndarray]:
    """Per-label NLL ``[N]``, macro-F1 over the classes present in ``y``, and per-label
    correctness ``[N]``, of the grades under false-alarm cost ``cost``."""
    import torch
    from sklearn.metrics import f1_score

    lp = torch.log_softmax(logits.double(), dim=1).numpy()
    nll = -np.clip(lp[np.arange(len(y)), y], -50.0, 0.0)
    present = sorted({int(v) for v in y})
    pred = grade_ids(np.exp(lp), INTACT, cost)
    return nll, float(f1_score(y, pred, labels=present, average="macro")), pred == y


def _class_weights(y: np.ndarray, k: int):
    import torch

    counts = np.bincount(y, minlength=k).astype(np.float64)
    w = np.where(counts > 0, counts.sum() / np.maximum(counts, 1) / max((counts > 0).sum(), 1), 0)
    return torch.as_tensor(w, dtype=torch.float32)


def train_top(
    net,
    feats,
    y: np.ndarray,
    epochs: int,
    options: FinetuneOptions,
    seed: int,
    on_epoch=None,
    unlabelled=None,
) -> dict[str, Any]:
    """Train the top of ``net`` (its last ``options.blocks`` encoder blocks,
    :func:`~local_damage.adapt.network.split_network`) and the classifier for ``epochs`` epochs
    on cached trunk features ``feats`` (``[8, 2, N, C, h, w]``) of labels ``y``; ``on_epoch(e)``
    is called after each epoch (e from 1). With ``unlabelled`` (a
    :class:`local_damage.adapt.semi.Unlabelled`), each step adds FixMatch's pseudo-label loss.
    Returns the FixMatch figures (empty without it)."""
    import math

    import torch

    _, top, params = split_network(net, options.blocks)
    k = net.cfg.num_classes
    gen = torch.Generator().manual_seed(int(seed))
    head = list(net.classifier.parameters())
    block = [p for p in params if all(p is not h for h in head)]
    groups = [{"params": head, "lr": options.lr}]
    if block:
        groups.append({"params": block, "lr": options.lr * options.encoder_lr})
    opt = torch.optim.AdamW(groups, lr=options.lr, weight_decay=options.weight_decay)
    weight = _class_weights(y, k) if options.class_weights else None
    loss_fn = torch.nn.CrossEntropyLoss(weight=weight)
    yt = torch.as_tensor(np.array(y, dtype=np.int64))  # a copy: the labels may be read-only
    n = len(y)
    stats: dict[str, Any] = {"masked": [], "steps": 0}
    # an epoch is at least MIN_STEPS steps: with a few labels, one pass is one or two steps
    bs = min(options.batch_size, n)
    steps = max(MIN_STEPS, -(-n // bs))
    total = max(1, options.max_epochs * steps)

    def rate(step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total)) if options.cosine else 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    # linear probing first: the classifier alone on the frozen block's features
    with torch.no_grad():
        probe = [logits_features(net, top, feats[t, 0], feats[t, 1]) for t in range(feats.shape[0])]
    probe_opt = torch.optim.AdamW(head, lr=options.lr, weight_decay=options.weight_decay)
    for _ in range(options.probe_epochs * steps):
        idx = torch.randint(0, n, (bs,), generator=gen)
        turn = torch.randint(0, feats.shape[0], (bs,), generator=gen)
        r = torch.stack([probe[int(t)][int(i)] for t, i in zip(turn, idx, strict=True)])
        loss = loss_fn(net.classifier(r), yt[idx])
        probe_opt.zero_grad(set_to_none=True)
        loss.backward()
        probe_opt.step()
    for epoch in range(1, epochs + 1):
        order = torch.cat([torch.randperm(n, generator=gen) for _ in range(-(-steps * bs // n))])
        for step in range(steps):
            idx = order[step * bs : (step + 1) * bs]
            turn = torch.randint(0, feats.shape[0], (len(idx),), generator=gen)
            f_pre, f_post = feats[turn, 0, idx], feats[turn, 1, idx]
            loss = loss_fn(logits_of(net, top, f_pre, f_post), yt[idx])
            if unlabelled is not None:
                extra, share = unlabelled.loss(
                    net, top, bs * options.unlabelled_ratio, gen, options.confidence
                )
                loss = loss + options.unlabelled_weight * extra
                stats["masked"].append(share)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            stats["steps"] += 1
        if on_epoch is not None:
            on_epoch(epoch)
    if not stats["masked"]:
        return {}
    return {"steps": stats["steps"], "confident_share": float(np.mean(stats["masked"]))}


def _folds(y: np.ndarray, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    import warnings

    from sklearn.model_selection import KFold, StratifiedKFold

    n_folds = min(FOLDS, len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if np.bincount(y).max() >= n_folds and min(np.bincount(y)[np.bincount(y) > 0]) >= n_folds:
            return list(StratifiedKFold(n_folds, shuffle=True, random_state=seed).split(y, y))
        return list(KFold(n_folds, shuffle=True, random_state=seed).split(y))


def finetune(
    weights: str | Path,
    pre: np.ndarray,
    post: np.ndarray,
    labels: np.ndarray,
    options: FinetuneOptions | None = None,
    unlabelled_pre: np.ndarray | None = None,
    unlabelled_post: np.ndarray | None = None,
) -> FinetuneResult:
    """Fine-tune the network of ``weights`` on labelled chip pairs (module docstring).

    Args:
        weights: the base model's ``.safetensors`` (:func:`weights_beside`).
        pre, post: uint8 ``[N, S, S, 3]`` labelled chips.
        labels: ``[N]`` class ids.
        options: :class:`FinetuneOptions`.
        unlabelled_pre, unlabelled_post: uint8 chips of the event's unlabelled buildings: with
            them, FixMatch (:mod:`local_damage.adapt.semi`) joins every step.

    Raises:
        FinetuneError: PyTorch missing, weights unusable, fewer than 4 labels.
    """
    require_torch()
    import copy

    import torch

    options = options or FinetuneOptions()
    y = np.asarray(labels, dtype=np.int64)
    if len(y) < 4 or len(set(y.tolist())) < 2:
        raise FinetuneError(
            f"{len(y)} label(s) of {len(set(y.tolist()))} class(es): fine-tuning needs at least 4 "
            "labels of at least 2 classes (the head adapts to fewer: adapt without --finetune)"
        )
    start = time.perf_counter()
    threads = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    try:
        torch.manual_seed(options.seed)
        base, config = load_network(weights)
        size = input_size(config, pre.shape[1])
        net = copy.deepcopy(base)
        trunk, _, _ = split_network(net, options.blocks)
        x_pre, x_post = prepare_chips(pre, size), prepare_chips(post, size)
        feats = trunk_features(trunk, x_pre, x_post)
        extra = None
        if unlabelled_pre is not None and len(unlabelled_pre):
            extra = Unlabelled(trunk, unlabelled_pre, unlabelled_post, size)
        # cross-validation: held-out NLL and macro-F1 after each epoch, epoch 0 the base network
        n_ep = options.max_epochs
        nll = np.zeros((n_ep + 1, len(y)))
        f1 = np.zeros((n_ep + 1, FOLDS))
        right = np.zeros((n_ep + 1, len(y)))
        oof = np.zeros((n_ep + 1, len(y), base.cfg.num_classes))
        folds = _folds(y, options.seed)
        for j, (tr, te) in enumerate(folds):
            fold = copy.deepcopy(base)
            _, ftop, _ = split_network(fold, options.blocks)

            def record(e, fold=fold, ftop=ftop, te=te, j=j):
                with torch.no_grad():
                    logits = logits_of(fold, ftop, feats[0, 0, te], feats[0, 1, te])
                nll[e, te], f1[e, j], right[e, te] = _metrics(
                    logits, y[te], options.false_alarm_cost
                )
                oof[e, te] = logits.double().numpy()

            record(0)
            seed = options.seed + j
            train_top(fold, feats[:, :, tr], y[tr], n_ep, options, seed, record, extra)
        curve = [
            {
                "epoch": e,
                "nll": round(float(nll[e].mean()), 6),
                "accuracy": round(float(right[e].mean()), 6),
                "macro_f1": round(float(f1[e, : len(folds)].mean()), 6),
                "macro_f1_folds": [round(float(v), 6) for v in f1[e, : len(folds)]],
                "intact_recall": (
                    round(float(right[e][y == INTACT].mean()), 6) if (y == INTACT).any() else None
                ),
            }
            for e in range(n_ep + 1)
        ]
        best = min(range(n_ep + 1), key=lambda e: (curve[e]["nll"], e))

        def out_of_fold(e: int) -> OutOfFold:
            c = curve[e]
            pred = grade_ids(softmax(oof[e]), INTACT, options.false_alarm_cost)
            return OutOfFold(nll[e], c["macro_f1"], c["accuracy"], c["intact_recall"], pred)

        verdict = clearly_better(out_of_fold(0), out_of_fold(best), y)
        ok = verdict.clear
        epochs = best if ok and best > 0 else 0
        semi: dict[str, Any] = {}
        if epochs:
            semi = train_top(net, feats, y, epochs, options, options.seed, unlabelled=extra)
        else:
            net = base
        for p in net.parameters():
            p.requires_grad_(False)
        return FinetuneResult(
            net.eval(),
            config,
            epochs,
            curve,
            time.perf_counter() - start,
            f"{len(folds)}-fold (seed {options.seed})",
            {"best_epoch": best, **verdict.figures()},
            semi,
            oof[epochs],
        )
    finally:
        torch.set_num_threads(threads)


def input_size(config: dict[str, Any], default: int) -> int:
    """The network's input side from its training config."""
    return int((config.get("data") or {}).get("input_size") or default)


#: Metadata props of the base model a fine-tuned model does not inherit: its class prototypes
#: and temperature describe the base network's outputs, not the fine-tuned one's.
NOT_INHERITED = ("ood", "calibration", "adaptation", "outputs")


def export_finetuned(
    result: FinetuneResult,
    out: str | Path,
    base_metadata: dict[str, Any],
    props: dict[str, Any],
    change_map: bool,
) -> Path:
    """Write the fine-tuned network as a self-describing ONNX model (fp32, uint8 inputs), with
    the base model's metadata but :data:`NOT_INHERITED`, and ``props`` (the ``adaptation`` and
    ``calibration`` blocks) on top. Atomic."""
    from local_damage.export.graph import export_onnx

    if Path(out).suffix != ".onnx":
        raise FinetuneError(f"{out}: the model file name must end in .onnx")
    metadata = {k: v for k, v in base_metadata.items() if k not in NOT_INHERITED}
    metadata.update(props)
    size = input_size(result.config, 64)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return export_onnx(result.net, out, size, metadata, change_map=change_map)
