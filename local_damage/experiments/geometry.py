"""The geometry experiment (`local-damage geometry`): where SCL and OCL put class embeddings.

No images and no network: each of N samples owns a free vector in R^D (normalised in the
forward pass) and the vectors alone are optimised, with Adam and shuffled mini-batches, under
SCL and under OCL. With an encoder of unlimited capacity this is exactly what the losses ask of
the embeddings, so the end state shows each loss's preferred geometry for the given class
proportions and batch size:

- OCL should send every class to one vector and the class vectors to an orthonormal set
  (Theorem 3.2), whatever the balance and the batch size.
- SCL should send the classes to a regular simplex (off-diagonal cosine ``-1/(K-1)``) when the
  classes are balanced (Theorem 3.1), and away from it when they are not, with minority classes
  drawn together (minority collapse).

Batches are drawn as a shuffled data loader draws them: a fresh permutation of the N samples
per pass, cut into batches of the given size, the incomplete remainder dropped. Every loss and
batch size starts from the same vectors. The full-batch loss (all N samples as one batch) is
recorded during training; a run counts as *converged* when that loss changed by less than
``tol`` (relative) over the last 10% of the steps. Two further measures cover that window:
the *Gram change*, the largest change of an entry of the class-mean Gram matrix (the relative
geometry), and the *drift*, the largest angle, over classes, between a class's mean direction at
90% of the steps and at the end (which also counts a rotation of the whole configuration, to
which both losses are blind).

Module top level imports nothing heavy: the CLI parser imports it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_prep.errors import LocalDamageError
from data_prep.store import atomic_path, write_json

XBD_PROPORTIONS = (0.70, 0.11, 0.13, 0.06)
LOSS_NAMES = ("scl", "ocl")
_LOSS_TITLES = {"scl": "SCL", "ocl": "OCL"}
TABLE_COLUMNS = (
    "loss",
    "batch",
    "draws/sample",
    "init max|cos|",
    "max|cos|",
    "max cos",
    "mean off-diag cos",
    "mean within cos",
    "min within cos",
    "full-batch loss",
    "theory",
    "gap",
    "rel. change last 10%",
    "converged",
    "Gram change last 10%",
    "drift (deg)",
)


class GeometryError(LocalDamageError, ValueError):
    """Settings of a geometry experiment that cannot run; the message says which."""


@dataclass
class GeometryConfig:
    """Settings of one geometry experiment.

    Attributes:
        proportions: class proportions (normalised to sum 1), one per class; K = their count.
        batch_sizes: mini-batch sizes to compare (each in [2, n]).
        losses: subset of ("scl", "ocl").
        n: number of samples N.
        dim: embedding dimension D (>= K so that K orthonormal vectors exist).
        steps: optimiser steps per run.
        lr: Adam learning rate.
        temperature: contrastive temperature t.
        seed: seed of the initial vectors and of the batch order.
        tol: convergence threshold on the relative change of the full-batch loss over the last
            10% of the steps.
        eval_points: how many times the full-batch loss is recorded during a run.

    Raises:
        GeometryError: a setting out of range (see :func:`class_counts_for` for the counts).
    """

    proportions: tuple[float, ...] = XBD_PROPORTIONS
    batch_sizes: tuple[int, ...] = (8, 64)
    losses: tuple[str, ...] = LOSS_NAMES
    n: int = 400
    dim: int = 16
    steps: int = 10_000
    lr: float = 0.01
    temperature: float = 0.5
    seed: int = 0
    tol: float = 1e-3
    eval_points: int = 50
    counts: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.proportions = tuple(float(p) for p in self.proportions)
        self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
        self.losses = tuple(self.losses)
        self.counts = class_counts_for(self.proportions, self.n)
        k = len(self.counts)
        if self.dim < k:
            raise GeometryError(f"dim must be >= the number of classes K={k}, got {self.dim}")
        for b in self.batch_sizes:
            if not 2 <= b <= self.n:
                raise GeometryError(f"batch size {b} must lie in [2, n={self.n}]")
        unknown = sorted(set(self.losses) - set(LOSS_NAMES))
        if unknown or not self.losses:
            raise GeometryError(f"unknown losses {unknown}; valid losses: {', '.join(LOSS_NAMES)}")
        if self.steps < 10:
            raise GeometryError(f"steps must be >= 10, got {self.steps}")
        if not self.lr > 0 or not self.temperature > 0 or not self.tol > 0:
            raise GeometryError("lr, temperature and tol must be > 0")
        if self.eval_points < 2:
            raise GeometryError(f"eval_points must be >= 2, got {self.eval_points}")


def class_counts_for(proportions: Sequence[float], n: int) -> tuple[int, ...]:
    """Split ``n`` samples over classes by ``proportions`` (largest-remainder rounding).

    Args:
        proportions: K non-negative weights, normalised here to sum 1.
        n: number of samples.

    Returns:
        K counts summing to ``n``.

    Raises:
        GeometryError: fewer than 2 classes, a negative or non-finite weight, or a class that would
            get fewer than 2 samples (it would never have a positive).
    """
    props = [float(p) for p in proportions]
    if len(props) < 2:
        raise GeometryError(f"need at least 2 class proportions, got {len(props)}")
    if any(not math.isfinite(p) or p <= 0 for p in props):
        raise GeometryError(f"class proportions must be finite and > 0, got {props}")
    total = sum(props)
    exact = [p / total * n for p in props]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(props)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    small = [i for i, c in enumerate(counts) if c < 2]
    if small:
        raise GeometryError(
            f"class(es) {small} get fewer than 2 of n={n} samples with proportions {props}; "
            "raise --n"
        )
    return tuple(counts)


def theory_value(loss: str, counts: Sequence[int], temperature: float) -> float:
    """Full-batch loss at the configuration each theorem names, for class counts ``counts``.

    ``mean_i log(n_i - 1 + (N - n_i) exp(-(1 - c) / t))`` over all N samples, with ``n_i`` the
    count of sample i's class and ``c`` the cosine between different classes: 0 for OCL
    (orthonormal classes; Theorem 3.2, the minimum of OCL for any counts) and ``-1/(K-1)`` for SCL
    (regular simplex; Theorem 3.1, the minimum of SCL only when the counts are equal).
    """
    k = len(counts)
    c = 0.0 if loss == "ocl" else -1.0 / (k - 1)
    big_n = sum(counts)
    total = sum(
        n_y * math.log(n_y - 1 + (big_n - n_y) * math.exp(-(1.0 - c) / temperature))
        for n_y in counts
    )
    return total / big_n


def _class_mean_directions(z, labels, k: int):
    import torch
    import torch.nn.functional as F

    sums = torch.zeros(k, z.shape[1], dtype=z.dtype).index_add_(0, labels, z)
    return F.normalize(sums, dim=1)


def geometry_metrics(z, labels, k: int) -> dict[str, Any]:
    """Class geometry of unit vectors.

    Args:
        z: [N, D] unit vectors (torch tensor).
        labels: [N] integer labels in [0, K).
        k: K.

    Returns:
        ``gram`` (K x K cosines between normalised class means), ``max_abs_cos`` and ``max_cos``
        (largest |cos| and cos off the diagonal), ``mean_offdiag_cos``, ``within_cos`` (per class,
        the mean cosine between two different samples of the class) and its mean and min.
    """
    import torch

    means = _class_mean_directions(z, labels, k)
    gram = means @ means.T
    off = gram[~torch.eye(k, dtype=torch.bool)]
    sums = torch.zeros(k, z.shape[1], dtype=z.dtype).index_add_(0, labels, z)
    n = torch.bincount(labels, minlength=k).to(z.dtype)
    within = (sums.pow(2).sum(dim=1) - n) / (n * (n - 1))
    return {
        "gram": gram.tolist(),
        "max_abs_cos": float(off.abs().max()),
        "max_cos": float(off.max()),
        "mean_offdiag_cos": float(off.mean()),
        "within_cos": within.tolist(),
        "mean_within_cos": float(within.mean()),
        "min_within_cos": float(within.min()),
    }


def run_one(cfg: GeometryConfig, loss_name: str, batch_size: int) -> dict[str, Any]:
    """Optimise the N free vectors under one loss and batch size; return its metrics.

    Returns:
        The `geometry_metrics` of the final vectors plus ``loss``, ``batch_size``,
        ``draws_per_sample`` (steps * batch / N), ``init_max_abs_cos``, ``final_loss`` (full
        batch), ``theory`` (`theory_value`), ``gap``, ``rel_change``, ``converged``,
        ``gram_change`` and ``drift_deg`` (see the module docstring), ``history`` ([step,
        full-batch loss] pairs) and ``seconds``.
    """
    import torch
    import torch.nn.functional as F

    # torch-bearing: imported here so that the command line reads its defaults without torch
    from local_damage.losses import OrthonormalContrastiveLoss, SupConLoss

    k = len(cfg.counts)
    labels = torch.repeat_interleave(torch.arange(k), torch.tensor(cfg.counts))
    gen = torch.Generator().manual_seed(cfg.seed)
    init = torch.randn(cfg.n, cfg.dim, generator=gen)
    vectors = init.clone().requires_grad_(True)
    loss_fn = (SupConLoss if loss_name == "scl" else OrthonormalContrastiveLoss)(cfg.temperature)
    opt = torch.optim.Adam([vectors], lr=cfg.lr)

    check_at = round(0.9 * cfg.steps)
    record = {round(cfg.steps * i / cfg.eval_points) for i in range(cfg.eval_points + 1)}
    record |= {check_at, cfg.steps}
    history: list[list[float]] = []
    means_at_check = None

    def evaluate(step: int) -> None:
        nonlocal means_at_check
        with torch.no_grad():
            z = F.normalize(vectors, dim=1)
            history.append([step, float(loss_fn(z, labels))])
            if step == check_at:
                means_at_check = _class_mean_directions(z, labels, k)

    per_pass = cfg.n // batch_size
    order = torch.empty(0, dtype=torch.long)
    start = time.perf_counter()
    evaluate(0)
    for step in range(1, cfg.steps + 1):
        j = (step - 1) % per_pass
        if j == 0:
            order = torch.randperm(cfg.n, generator=gen)
        idx = order[j * batch_size : (j + 1) * batch_size]
        loss = loss_fn(vectors[idx], labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in record:
            evaluate(step)
    seconds = time.perf_counter() - start

    with torch.no_grad():
        z = F.normalize(vectors, dim=1)
        metrics = geometry_metrics(z, labels, k)
        init_metrics = geometry_metrics(F.normalize(init, dim=1), labels, k)
        final_means = _class_mean_directions(z, labels, k)
        cos = (final_means * means_at_check).sum(dim=1).clamp(-1.0, 1.0)
        drift = float(torch.rad2deg(torch.acos(cos)).max())
        gram_change = float(
            (final_means @ final_means.T - means_at_check @ means_at_check.T).abs().max()
        )
    final = history[-1][1]
    at_check = next(v for s, v in history if s == check_at)
    rel_change = abs(final - at_check) / max(abs(final), 1e-12)
    theory = theory_value(loss_name, cfg.counts, cfg.temperature)
    return {
        "loss": loss_name,
        "batch_size": batch_size,
        "draws_per_sample": cfg.steps * batch_size / cfg.n,
        "init_max_abs_cos": init_metrics["max_abs_cos"],
        **metrics,
        "final_loss": final,
        "theory": theory,
        "gap": final - theory,
        "rel_change": rel_change,
        "converged": rel_change < cfg.tol,
        "gram_change": gram_change,
        "drift_deg": drift,
        "history": history,
        "seconds": seconds,
    }


def run_geometry(cfg: GeometryConfig, log=None) -> dict[str, Any]:
    """Run every loss x batch size of ``cfg``; return the config, class counts and runs.

    Args:
        cfg: the experiment.
        log: optional ``print``-like callable for one progress line per run.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and leaves the others free
    try:
        runs = []
        for loss_name in cfg.losses:
            for b in cfg.batch_sizes:
                res = run_one(cfg, loss_name, b)
                runs.append(res)
                if log:
                    log(
                        f"{_LOSS_TITLES[loss_name]} batch {b}: max|cos| {res['max_abs_cos']:.3f}, "
                        f"{res['seconds']:.1f} s"
                    )
    finally:
        torch.set_num_threads(threads)
    config = asdict(cfg)
    k = len(cfg.counts)
    return {
        "config": config,
        "counts": list(cfg.counts),
        "simplex_cos": -1.0 / (k - 1),
        "balanced": len(set(cfg.counts)) == 1,
        "runs": runs,
    }


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def markdown_table(results: dict[str, Any]) -> str:
    """The results as a markdown document: a settings line and one table row per run."""
    cfg = results["config"]
    counts = results["counts"]
    props = ", ".join(f"{c / sum(counts):.2f}" for c in counts)
    lines = [
        f"Geometry: N={cfg['n']} (class counts {counts}; proportions {props}), D={cfg['dim']}, "
        f"t={cfg['temperature']}, {cfg['steps']} Adam steps at lr {cfg['lr']}, seed {cfg['seed']}. "
        f"SCL simplex target cos = {results['simplex_cos']:.3f}; OCL target 0. "
        f"theory = Thm 3.2 minimum (OCL) / Thm 3.1 simplex value (SCL"
        f"{'' if results['balanced'] else ', not a bound: classes imbalanced'}); "
        f"converged = relative change of the full-batch loss over the last 10% < {cfg['tol']:g}.",
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|",
    ]
    for r in results["runs"]:
        cells = [
            _LOSS_TITLES[r["loss"]],
            str(r["batch_size"]),
            f"{r['draws_per_sample']:.0f}",
            _fmt(r["init_max_abs_cos"]),
            _fmt(r["max_abs_cos"]),
            _fmt(r["max_cos"]),
            _fmt(r["mean_offdiag_cos"]),
            _fmt(r["mean_within_cos"]),
            _fmt(r["min_within_cos"]),
            _fmt(r["final_loss"], 4),
            _fmt(r["theory"], 4),
            _fmt(r["gap"], 4),
            f"{r['rel_change']:.1e}",
            "yes" if r["converged"] else "no",
            _fmt(r["gram_change"]),
            _fmt(r["drift_deg"], 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_grams(results: dict[str, Any], path: str | Path) -> Path:
    """Heatmaps of the class-mean Gram matrices, one row per loss, one column per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    losses, batches = cfg["losses"], cfg["batch_sizes"]
    counts = results["counts"]
    k = len(counts)
    ticks = [f"c{i}\n{c / sum(counts):.0%}" for i, c in enumerate(counts)]
    fig, axes = plt.subplots(
        len(losses),
        len(batches),
        figsize=(max(2.7 * len(batches) + 0.9, 4.2), 2.75 * len(losses) + 0.3),
        squeeze=False,
        constrained_layout=True,
    )
    runs = {(r["loss"], r["batch_size"]): r for r in results["runs"]}
    image = None
    for i, loss_name in enumerate(losses):
        for j, b in enumerate(batches):
            ax, r = axes[i][j], runs[(loss_name, b)]
            image = ax.imshow(r["gram"], vmin=-1, vmax=1, cmap="RdBu_r")
            for a in range(k):
                for c in range(k):
                    v = r["gram"][a][c]
                    ax.text(
                        c,
                        a,
                        f"{v:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if abs(v) > 0.6 else "black",
                    )
            ax.set_xticks(range(k), ticks, fontsize=7)
            ax.set_yticks(range(k), ticks, fontsize=7)
            ax.set_title(
                f"{_LOSS_TITLES[loss_name]}, batch {b}\nmax|cos| {r['max_abs_cos']:.2f}, "
                f"within {r['mean_within_cos']:.2f}",
                fontsize=8,
            )
    fig.colorbar(image, ax=axes, shrink=0.8, label="cos between class means")
    balance = "balanced" if results["balanced"] else "imbalanced"
    fig.suptitle(
        f"Class-mean Gram, {balance}\nN={cfg['n']}, D={cfg['dim']}, t={cfg['temperature']}, "
        f"{cfg['steps']} steps",
        fontsize=9,
    )
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return path


def write_outputs(
    results: dict[str, Any], out: str | Path, name: str = "geometry"
) -> dict[str, Path]:
    """Write ``NAME.json`` (everything), ``NAME.md`` (the table) and ``NAME.png`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
    write_json(paths["json"], results)
    with atomic_path(paths["md"], suffix=".md") as tmp:
        tmp.write_text(markdown_table(results))
    plot_grams(results, paths["png"])
    return paths


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results JSON written by `write_outputs`."""
    return json.loads(Path(path).read_text())
