"""A run's weights through the lent machine's return limit (16 MiB a file) and back:

    python docs/experiments/generalisation/half_weights.py pack RUN PREFIX
    python docs/experiments/generalisation/half_weights.py unpack PREFIX RUN

`pack` writes RUN/best.safetensors in float16 (48 -> 24 MB for the ResNet-18 recipes) as
PREFIX.part-aa, PREFIX.part-ab, ... of at most 15 MB each. `unpack` joins the parts and writes
them back in float32 as RUN/best.safetensors (atomically), beside the run's config.yaml and
summary.json that came back with them, so `cv` evaluates the run and `export` exports it. The
float16 rounding is below what the int8 export keeps anyway.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load, save, save_file

from data_prep.store import atomic_path

PART_BYTES = 15 * 2**20


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def pack(run: Path, prefix: Path) -> list[Path]:
    """Write ``run/best.safetensors`` in float16 as parts ``prefix.part-aa``, ... ."""
    source = run / "best.safetensors"
    if not source.is_file():
        raise SystemExit(f"{source}: no weights in this run folder")
    blob = save(_cast(load(source.read_bytes()), torch.float16))
    parts = []
    for i, start in enumerate(range(0, len(blob), PART_BYTES)):
        part = prefix.with_name(f"{prefix.name}.part-a{chr(ord('a') + i)}")
        part.write_bytes(blob[start : start + PART_BYTES])
        parts.append(part)
    return parts


def unpack(prefix: Path, run: Path) -> Path:
    """Join ``prefix.part-*`` into ``run/best.safetensors`` in float32."""
    parts = sorted(prefix.parent.glob(f"{prefix.name}.part-*"))
    if not parts:
        raise SystemExit(f"{prefix}.part-*: no parts")
    try:
        weights = load(b"".join(p.read_bytes() for p in parts))
    except Exception as exc:  # a missing or truncated part
        raise SystemExit(f"{prefix}.part-*: not whole safetensors weights ({exc})") from exc
    out = run / "best.safetensors"
    with atomic_path(out, suffix=".safetensors") as tmp:
        save_file(_cast(weights, torch.float32), tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("pack", "unpack"))
    p.add_argument("source", type=Path)
    p.add_argument("target", type=Path)
    args = p.parse_args(argv)
    if args.command == "pack":
        for part in pack(args.source, args.target):
            print(part)
    else:
        print(unpack(args.source, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
