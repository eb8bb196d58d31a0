"""`local-damage probe`: how hard each term of the objective pulls on the encoder, and where.

The LOCAL objective adds three terms, ``alpha * C(z)``, ``alpha * beta * C(l)`` and
``(1 - alpha) * WCE`` (Eq. 5-6), with ``C`` the contrastive loss of the method (OCL or SCL). All
three reach the shared encoder, but only the cross-entropy trains the classifier that grades. The
probe takes a model (freshly initialised from a config, or the weights of a run) and a few
batches of training chips, and for each batch computes the gradient of each weighted term with
respect to the encoder's weights separately. It reports, averaged over the batches:

- the norm of each term's encoder gradient and its ratio to the cross-entropy's: how much of
  each step is spent on that term;
- the cosine between each contrastive term's gradient and the cross-entropy's: whether the term
  helps (> 0), is indifferent (about 0) or fights (< 0) the grading;
- over pairs of different classes, the share whose ``<l_i, l_n>`` is below 0 and the mean of
  ``|<l_i, l_n>|``: with no negative inner product, the absolute value OCL puts on negatives
  changes nothing and OCL on ``l`` is SCL on ``l``;
- per class, the norm of the raw latent map ``mean_c(f_pre - f_post)`` before it is normalised
  into ``l``, and the mean cosine between ``l`` (and ``z``) of two pairs of that class: a class
  whose pre/post features barely differ (no damage) has a small raw map whose direction is
  noise, and a mean within-class cosine near 0 says the contrastive term is asked to cluster
  that noise.

Nothing is trained or written except the optional JSON; the figures print as a table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from data_prep.errors import LocalDamageError
from data_prep.spec import CLASS_NAMES
from data_prep.split import fold_indices
from data_prep.store import read_manifest
from local_damage.data import ChipPairDataset, class_counts, normalize
from local_damage.losses import class_weights
from local_damage.losses.objective import METHODS
from local_damage.models import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.loop import model_config_for, seed_everything


class ProbeError(LocalDamageError, ValueError):
    """A probe that cannot run on its input; the message names the file or setting."""


def probe(
    cfg,
    chips: str | Path,
    *,
    init: str | Path | None = None,
    holdout: int | None = None,
    batches: int = 20,
    epoch: int = 0,
) -> dict[str, Any]:
    """Gradient and embedding statistics of ``cfg``'s objective on training chips.

    Args:
        cfg: a training :class:`~local_damage.train.config.Config`.
        chips: chip store folder.
        init: weights to load (a run folder or .safetensors); None keeps the initialisation.
        holdout: a fold of splits.csv left out (the test tiles).
        batches: number of training batches to average over.
        epoch: the epoch whose alpha weights the terms (0 = the start of training).

    Returns:
        ``{"alpha", "beta", "terms": {name: {"grad_norm", "ratio_to_wce", "cos_with_wce"}},
        "latent_negatives": {"share_below_zero", "mean_abs_inner"}, "per_class": {class: {"n",
        "latent_raw_norm", "l_within_cos", "z_within_cos"}}}``. ``latent_negatives`` describes the
        inner products ``<l_i, l_n>`` of pairs of different classes: the share below 0 (0 means
        every one is >= 0, where OCL on ``l`` is SCL on ``l``) and their mean absolute value
        (what OCL drives to 0); None without a latent term.

    Raises:
        ProbeError: ``batches`` < 1, no manifest, no splits.csv or no such holdout fold, or
            ``init`` is not a run folder or weights file.
    """
    if batches < 1:
        raise ProbeError(f"batches must be >= 1, got {batches}")
    seed_everything(cfg.train.seed, False)
    try:
        if holdout is not None:
            ids, _ = fold_indices(chips, None, holdout)
        else:
            ids = read_manifest(chips)["chip_id"].tolist()
    except (FileNotFoundError, ValueError) as exc:  # the store's manifest or splits
        raise ProbeError(str(exc)) from exc
    ds = ChipPairDataset(chips, ids, cfg.data.input_size, augment=False)
    keep = list(ds.chip_ids[ds.labels >= 0])
    ds = ChipPairDataset(chips, keep, cfg.data.input_size, augment=False)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    loader = DataLoader(
        ds, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True, generator=generator
    )
    model = build_model(model_config_for(cfg))
    if init is not None:
        try:
            weights = ckpt.resolve_weights(init)
        except (FileNotFoundError, ValueError) as exc:
            raise ProbeError(str(exc)) from exc
        ckpt.load_weights(model, weights, strict=False)
    model.train()
    k = cfg.model.num_classes
    weights = torch.as_tensor(
        class_weights(class_counts(ds.labels, k), k, counts=True), dtype=torch.float32
    )
    objective = cfg.loss.build(weights)
    alpha = cfg.loss.alpha(epoch, cfg.train.epochs)
    spec = METHODS[cfg.loss.method]
    params = [p for p in model.encoder.parameters() if p.requires_grad]

    def flat_grad(loss) -> torch.Tensor:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, params, strict=True)
            ]
        )

    sums: dict[str, list[float]] = {}
    per_class: dict[int, dict[str, list[float]]] = {c: {} for c in range(k)}

    def add(store: dict, key: str, value: float) -> None:
        store.setdefault(key, []).append(float(value))

    for step, (pre, post, y) in enumerate(loader):
        if step >= batches:
            break
        feats_pre, feats_post = model.encode_pair(normalize(pre), normalize(post))
        logits, z_raw, _, _ = model._heads_raw(feats_pre[-1], feats_post[-1])
        z = z_raw if not cfg.loss.normalize_z else torch.nn.functional.normalize(z_raw, dim=1)
        g_wce = flat_grad((1 - alpha) * objective.wce(logits, y))
        n_wce = float(g_wce.norm())
        add(sums, "wce.grad_norm", n_wce)
        terms = {}
        if objective.contrastive is not None:
            terms["contrastive_z"] = alpha * objective.contrastive_z(z, y)
        raw_map = l_emb = None
        if spec.latent and model.latent is not None:
            l_emb, latent_map = model.latent(feats_pre, feats_post)  # centred when configured
            raw_map = latent_map.flatten(1)
            terms["contrastive_l"] = alpha * objective.beta * objective.contrastive(l_emb, y)
        for name, loss in terms.items():
            g = flat_grad(loss)
            n = float(g.norm())
            add(sums, f"{name}.grad_norm", n)
            add(sums, f"{name}.ratio_to_wce", n / max(n_wce, 1e-12))
            cos = float(torch.dot(g, g_wce) / max(n * n_wce, 1e-12)) if n > 0 else float("nan")
            add(sums, f"{name}.cos_with_wce", cos)
        with torch.no_grad():
            zn = torch.nn.functional.normalize(z, dim=1)
            ln = l_emb
            negative = y[:, None] != y[None, :]
            if ln is not None and bool(negative.any()):
                inner = (ln @ ln.T)[negative]
                add(sums, "l.negatives_below_zero", (inner < 0).float().mean())
                add(sums, "l.negatives_abs_inner", inner.abs().mean())
            for c in range(k):
                idx = torch.nonzero(y == c).flatten()
                if len(idx) == 0:
                    continue
                add(per_class[c], "n", len(idx))
                if raw_map is not None:
                    for v in raw_map[idx].norm(dim=1):
                        add(per_class[c], "latent_raw_norm", v)
                if len(idx) < 2:
                    continue
                off = ~torch.eye(len(idx), dtype=torch.bool)
                add(per_class[c], "z_within_cos", (zn[idx] @ zn[idx].T)[off].mean())
                if ln is not None:
                    add(per_class[c], "l_within_cos", (ln[idx] @ ln[idx].T)[off].mean())

    def mean(values: list[float] | None) -> float | None:
        if not values:
            return None
        arr = np.asarray(values, dtype=np.float64)
        arr = arr[np.isfinite(arr)]
        return float(arr.mean()) if arr.size else None

    term_names = [
        "wce",
        *(n for n in ("contrastive_z", "contrastive_l") if f"{n}.grad_norm" in sums),
    ]
    result_terms = {
        name: {
            stat: mean(sums.get(f"{name}.{stat}"))
            for stat in ("grad_norm", "ratio_to_wce", "cos_with_wce")
        }
        for name in term_names
    }
    latent_negatives = {
        "share_below_zero": mean(sums.get("l.negatives_below_zero")),
        "mean_abs_inner": mean(sums.get("l.negatives_abs_inner")),
    }
    result_terms["wce"]["ratio_to_wce"] = 1.0
    result_terms["wce"]["cos_with_wce"] = 1.0
    return {
        "method": cfg.loss.method,
        "alpha": alpha,
        "beta": float(cfg.loss.beta),
        "epoch": epoch,
        "init": None if init is None else str(init),
        "batches": min(batches, len(loader)),
        "terms": result_terms,
        "latent_negatives": latent_negatives,
        "per_class": {
            CLASS_NAMES[c]: {
                "n": int(sum(stats.get("n", []))),
                "latent_raw_norm": mean(stats.get("latent_raw_norm")),
                "l_within_cos": mean(stats.get("l_within_cos")),
                "z_within_cos": mean(stats.get("z_within_cos")),
            }
            for c, stats in per_class.items()
        },
    }


def format_probe(result: dict[str, Any]) -> str:
    """The probe's figures as two small markdown tables."""

    def f(x: float | None, digits: int = 3) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    lines = [
        f"method {result['method']}, alpha {result['alpha']:.3f}, beta {result['beta']:g}, "
        f"{result['batches']} batches, weights: {result['init'] or 'initialisation'}",
        "",
        "| term | encoder gradient norm | ratio to WCE | cos with WCE |",
        "|---|---|---|---|",
    ]
    for name, t in result["terms"].items():
        lines.append(
            f"| {name} | {f(t['grad_norm'], 4)} | {f(t['ratio_to_wce'])} | {f(t['cos_with_wce'])} |"
        )
    lines += [
        "",
        "| class | pairs | raw latent map norm | within-class cos of l | within-class cos of z |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["per_class"].items():
        lines.append(
            f"| {name} | {c['n']} | {f(c['latent_raw_norm'], 4)} | {f(c['l_within_cos'])} | "
            f"{f(c['z_within_cos'])} |"
        )
    neg = result.get("latent_negatives") or {}
    if neg.get("share_below_zero") is not None:
        lines += [
            "",
            f"pairs of different classes: share with <l_i, l_n> < 0 {f(neg['share_below_zero'])}, "
            f"mean |<l_i, l_n>| {f(neg['mean_abs_inner'])}"
            + (
                " (no negative inner product: OCL on l is SCL on l)"
                if neg["share_below_zero"] == 0
                else ""
            ),
        ]
    return "\n".join(lines)
