"""Checkpoints: weights as safetensors, training state (optimiser, scheduler, RNG) as a
weights-only torch file, so that nothing is ever unpickled from a checkpoint.

Layout of ``RUN/``::

    config.yaml                 the resolved config
    best.safetensors            weights of the best epoch by validation macro-F1 (or the last)
    checkpoints/last/model.safetensors
    checkpoints/last/state.pt   optimiser, scheduler, RNG states, epoch, best score
    metrics.csv, summary.json, curves.png
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.store import atomic_path
from local_damage.train.errors import RunFileNotFoundError, TrainingError

BEST = "best.safetensors"
LAST_DIR = Path("checkpoints") / "last"


def save_weights(
    model: torch.nn.Module, path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a model's state dict as safetensors, atomically."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file(state, str(tmp), metadata=metadata)


def load_weights(
    model: torch.nn.Module, path: str | Path, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load safetensors weights into ``model``; returns (missing, unexpected) keys."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise RunFileNotFoundError(f"{path}: weights file not found")
    state = load_file(str(path))
    result = model.load_state_dict(state, strict=strict)
    return list(result.missing_keys), list(result.unexpected_keys)


def resolve_weights(init: str | Path) -> Path:
    """Weights file from a run folder (its best, else last, weights) or a .safetensors file."""
    init = Path(init)
    if init.is_dir():
        for candidate in (init / BEST, init / LAST_DIR / "model.safetensors"):
            if candidate.is_file():
                return candidate
        raise RunFileNotFoundError(
            f"{init}: no {BEST} or {LAST_DIR}/model.safetensors in this run folder"
        )
    if init.suffix != ".safetensors":
        raise TrainingError(f"{init}: expected a run folder or a .safetensors weights file")
    if not init.is_file():
        raise RunFileNotFoundError(f"{init}: weights file not found")
    return init


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states in a form `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()  # noqa: NPY002 - the global state is what we save
    state: dict[str, Any] = {
        "python": repr(random.getstate()),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_to_tuple(ast.literal_eval(state["python"])))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np_state = ("MT19937", keys, n["pos"], n["has_gauss"], n["cached"])
    np.random.set_state(np_state)  # noqa: NPY002 - restores the global state we saved
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list | tuple) else x


def save_training_state(run: str | Path, model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Save the last checkpoint: weights plus optimiser/scheduler/RNG/epoch state."""
    last = Path(run) / LAST_DIR
    save_weights(model, last / "model.safetensors")
    with atomic_path(last / "state.pt", suffix=".pt") as tmp:
        torch.save(state, tmp)


def load_training_state(run: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load the last checkpoint of ``run`` into ``model``; return the saved state dict."""
    last = Path(run) / LAST_DIR
    if not (last / "state.pt").is_file():
        raise RunFileNotFoundError(f"{last}: no checkpoint to resume from")
    load_weights(model, last / "model.safetensors")
    return torch.load(last / "state.pt", map_location="cpu", weights_only=True)


@dataclass
class Standing:
    """Where a run stands: its best epoch by validation macro-F1 (by epoch number without
    validation) and the epochs since it improved, for early stopping."""

    best_score: float = -1.0
    best_epoch: int = -1
    stale: int = 0


def save_checkpoint(
    run: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    standing: Standing,
) -> None:
    """The last checkpoint after ``epoch``: weights, optimiser, schedule, RNG states, standing."""
    save_training_state(
        run,
        model,
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "epoch": epoch,
            "best_score": standing.best_score,
            "best_epoch": standing.best_epoch,
            "stale": standing.stale,
        },
    )


def resume_checkpoint(
    run: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, Standing]:
    """Restore the last checkpoint of ``run`` (weights, optimiser, schedule and RNG states);
    returns the epoch to continue from and the standing."""
    state = load_training_state(run, model)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["epoch"] + 1, Standing(state["best_score"], state["best_epoch"], state["stale"])
