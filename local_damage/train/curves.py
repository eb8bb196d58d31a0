"""Training curves of a run folder as ``curves.png``, drawn from its metrics.csv."""

from __future__ import annotations

from pathlib import Path

from data_prep.spec import CLASS_NAMES
from data_prep.store import atomic_path
from local_damage.train.records import METRICS_CSV


def plot_curves(run: Path) -> None:
    """Training curves as RUN/curves.png: loss, validation metrics and class-mean geometry."""
    import pandas as pd
    from matplotlib.figure import Figure

    df = pd.read_csv(run / METRICS_CSV)
    fig = Figure(figsize=(13, 3.5))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for col in ("train_loss", "wce", "contrastive_z", "contrastive_l"):
        if col in df and df[col].notna().any():
            ax1.plot(df["epoch"] + 1, df[col], marker="o", label=col)
    ax1.set_xlabel("epoch")
    ax1.set_title("training loss")
    ax1.legend(fontsize=8)
    for col in ("val_accuracy", "val_macro_f1"):
        if col in df and df[col].notna().any():
            ax2.plot(df["epoch"] + 1, df[col], marker="o", label=col)
    ax2.set_xlabel("epoch")
    ax2.set_ylim(0, 1)
    ax2.set_title("validation")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    else:  # trained without validation (every chip, or --holdout alone)
        ax2.text(0.5, 0.5, "no validation fold", ha="center", va="center", transform=ax2.transAxes)
    for col, style in (
        ("train_max_abs_cos", "-"),
        ("train_mean_offdiag_cos", "--"),
        ("val_max_abs_cos", "-"),
        ("val_mean_offdiag_cos", "--"),
    ):
        if col in df and df[col].notna().any():
            ax3.plot(df["epoch"] + 1, df[col], style, marker=".", label=col)
    simplex = -1.0 / (len(CLASS_NAMES) - 1)  # SupCon's regular simplex over the grades
    if ax3.get_legend_handles_labels()[0]:
        ax3.axhline(0.0, color="grey", lw=0.8, label="OCL's orthogonal classes")
        ax3.axhline(simplex, color="grey", lw=0.8, ls=":", label=f"SCL's simplex ({simplex:.2f})")
    ax3.set_ylim(-1, 1)
    ax3.set_xlabel("epoch")
    ax3.set_title("class-mean cosines of z")
    if ax3.get_legend_handles_labels()[0]:
        ax3.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(run / "curves.png", suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
