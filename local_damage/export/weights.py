"""A run's weights as fp16 safetensors, small enough to ship beside its model (``export
--weights``) for fine-tuning with ``local-damage train --init``."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from data_prep.store import atomic_path
from local_damage.train.checkpoint import resolve_weights


def export_weights(run: str | Path, out: str | Path) -> Path:
    """Write the run's best weights as fp16 safetensors (for ``train --init``), atomically.

    Floating-point tensors are stored in fp16 (half the size; fine-tuning loads them into an fp32
    model); integer buffers (BatchNorm counters) are kept. The run's config travels in the
    file's metadata.
    """
    run = Path(run)
    state = load_file(str(resolve_weights(run)))
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    config = run / "config.yaml"
    metadata = {"config": config.read_text()} if config.is_file() else {}
    metadata["source"] = "local-damage export --weights"
    with atomic_path(out, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in half.items()}, str(tmp), metadata=metadata)
    return Path(out)
