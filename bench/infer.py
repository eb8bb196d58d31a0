"""`local-damage bench infer`: chip pairs per second, PyTorch eager against ONNX Runtime.

For each encoder the same run measures, on the same uint8 chip pairs and batch size:

- **PyTorch eager fp32**, the baseline: the model with the exported graph's uint8 preprocessing,
  under ``torch.inference_mode``;
- **ONNX Runtime fp32**: the model as ``local-damage export`` writes it;
- **ONNX Runtime int8**: the same, quantized (static QDQ calibrated on other chips by default);
- **ONNX Runtime fp16**: only when onnxruntime has the CUDA provider (fp16 is slow on CPUs).

Each row gives pairs per second (best of ``repeat`` passes after one warm-up batch), the ratio to
eager, and the share of pairs where the runtime picks the same class as eager. Without ``--run``
the models are randomly initialised LocalNets exported on the fly and the chips come from
:mod:`data_prep.synthetic`; argmax agreement of a random model is a weak test (its logits are
nearly tied), so use ``--run`` with a trained run to measure agreement properly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.store import read_manifest
from data_prep.synthetic import make_xbd
from data_prep.text_table import Column, text_table
from data_prep.xbd import prepare_xbd
from local_damage.train.errors import RunFileNotFoundError
from runtime.contract import CPU_ONLY, open_session

DEFAULT_ENCODERS = ("resnet18", "resnet50")


def _best_time(fn: Callable[[], np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    """Fastest of ``repeat`` calls of ``fn`` in seconds, and its (last) output."""
    best, out = math.inf, None
    for _ in range(max(int(repeat), 1)):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def synthetic_chips(
    n: int, input_size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At least ``n`` chip pairs from a freshly generated synthetic xBD set, at ``input_size``.

    Returns:
        uint8 ``[M, S, S, 3]`` pre and post chips (``M >= n``) and their int labels ``[M]``.
    """
    from local_damage.export.parity import load_chips

    tiles = math.ceil(n / 9) + 1  # a 256 px tile holds 10-11 buildings
    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        root = make_xbd(Path(tmp) / "xbd", seed=seed, n_tiles=tiles, size=256)
        chips = Path(tmp) / "chips"
        prepare_xbd([root], chips, progress=False)
        ids = read_manifest(chips)["chip_id"].tolist()
        if len(ids) < n:  # preparation lists what failed; a short set would time the wrong thing
            raise RuntimeError(
                f"synthetic xBD set: {len(ids)} chip pairs prepared, {n} needed "
                "(see the preparation errors above)"
            )
        return load_chips(chips, ids, input_size)


def _eager(model, device: str) -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    import torch

    from local_damage.export.graph import uint8_model

    wrapper = uint8_model(model.to(device).eval()).to(device)

    def run(pre: np.ndarray, post: np.ndarray, batch_size: int) -> np.ndarray:
        out = []
        with torch.inference_mode():
            for i in range(0, len(pre), batch_size):
                a = torch.from_numpy(pre[i : i + batch_size]).to(device)
                b = torch.from_numpy(post[i : i + batch_size]).to(device)
                out.append(wrapper(a, b)[0].float().cpu().numpy())
        return np.concatenate(out)

    return run


def _onnx(path: Path, threads: int | None, providers: list[str]):
    """``(run, where)``: a function grading chip pairs with an ONNX Runtime session over
    ``path``, and ``CUDA`` or ``CPU``: the provider the session really took (ONNX Runtime falls
    back to the CPU when the CUDA provider cannot start, e.g. without its CUDA libraries)."""
    from local_damage.export.parity import ort_outputs

    session = open_session(path, providers or CPU_ONLY, threads)[0]

    def run(pre: np.ndarray, post: np.ndarray, batch_size: int) -> np.ndarray:
        return ort_outputs(session, pre, post, batch_size)[0]

    return run, "CUDA" if session.get_providers()[0] == "CUDAExecutionProvider" else "CPU"


@dataclass(frozen=True)
class InferBenchOptions:
    """How `bench infer` measures (the flags of the same names); the models measured are
    :func:`bench_infer`'s arguments.

    Attributes:
        input_size: model input side in pixels (with a trained run: the run's own).
        batch_size: pairs per call, the same for every runtime.
        pairs: chip pairs per timed pass.
        threads: ONNX Runtime intra-op thread counts to measure (``None``: its default).
        int8_methods: int8 quantizations to measure (``static`` and/or ``dynamic``).
        calibration: chips for static int8 calibration (not among the timed ones).
        repeat: timed passes per row; the fastest counts.
        seed: seed of the random weights and of the synthetic data.
    """

    input_size: int = 128
    batch_size: int = 32
    pairs: int = 128
    threads: Sequence[int | None] = (None,)
    int8_methods: Sequence[str] = ("static",)
    calibration: int = 64
    repeat: int = 2
    seed: int = 0


def bench_infer(
    encoders: Sequence[str] = DEFAULT_ENCODERS,
    run: str | os.PathLike | None = None,
    options: InferBenchOptions | None = None,
    *,
    as_json: bool = False,
    print_result: bool = True,
) -> dict[str, Any]:
    """Measure inference throughput of PyTorch eager and ONNX Runtime fp32 / int8 (/ fp16 on GPU).

    Args:
        encoders: encoders of the randomly initialised models (ignored with ``run``).
        run: a trained run folder: its model and its validation chips (training chips for int8
            calibration) instead of random models and synthetic chips.
        options: sizes, thread counts, quantizations, passes and seed (default
            ``InferBenchOptions()``).
        as_json: print the rows as JSON records instead of a table.
        print_result: print at all.

    Returns:
        ``{"context": {...}, "rows": [...]}``; each row has ``encoder``, ``runtime``,
        ``precision``, ``threads``, ``pairs_per_s``, ``ratio_vs_eager``, ``agreement_vs_eager``
        (share of pairs with the same argmax), ``max_abs_logit_diff_vs_eager`` and the context
        fields ``input_size``, ``batch_size``, ``pairs`` and ``models``.
    """
    import onnxruntime as ort
    import torch

    from local_damage.export.graph import export_onnx
    from local_damage.export.parity import chip_selection, load_chips
    from local_damage.export.quantize import convert_fp16, quantize_int8
    from local_damage.export.run import load_run
    from local_damage.models import ModelConfig, build_model

    o = options or InferBenchOptions()
    input_size, pairs = o.input_size, o.pairs
    batch_size, repeat, seed = o.batch_size, o.repeat, o.seed
    cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else None
    device = "cuda" if cuda else "cpu"

    if run is not None:
        info = load_run(run)
        input_size = int(info.cfg.data.input_size)
        store = Path(str(info.summary.get("chips") or ""))
        if not (store / "manifest.csv").is_file():
            raise RunFileNotFoundError(f"{run}: the run's chip store {store} is not available")
        val_ids, _, calib_ids = chip_selection(
            store, info.summary.get("fold"), pairs, o.calibration
        )
        # validation chips first, then other chips of the store that calibration did not use
        taken = set(val_ids) | set(calib_ids)
        others = [c for c in read_manifest(store)["chip_id"] if c not in taken]
        timed_ids = (val_ids + others)[:pairs]
        pre, post, _ = load_chips(store, timed_ids, input_size)
        calib = load_chips(store, calib_ids, input_size)[:2]
        chips_what = (
            f"{len(pre)} chips of {store} ({min(len(val_ids), len(pre))} from the validation "
            f"fold, {len(calib[0])} other chips for int8 calibration)"
        )
        models = [(info.cfg.model.encoder, info.model, f"trained run {run}")]
    else:
        pre, post, _ = synthetic_chips(pairs + o.calibration, input_size, seed)
        calib = (pre[pairs : pairs + o.calibration], post[pairs : pairs + o.calibration])
        pre, post = pre[:pairs], post[:pairs]
        chips_what = f"{len(pre)} synthetic chips (data_prep.synthetic, seed {seed})"
        models = []
        for enc in encoders:
            torch.manual_seed(seed)
            models.append((enc, build_model(ModelConfig(encoder=enc, weights=None)), "random init"))
    unique = len(pre)
    if unique < pairs:  # a small validation fold: time the same chips again to reach `pairs`
        pre, post = (
            np.resize(pre, (pairs, *pre.shape[1:])),
            np.resize(post, (pairs, *post.shape[1:])),
        )

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        for enc, model, what in models:
            model.eval()
            fp32 = Path(tmp) / f"{enc}.onnx"
            export_onnx(model, fp32, input_size, {"input_size": input_size})
            variants: list[tuple[str, str, Path]] = [("fp32", "fp32", fp32)]
            for method in o.int8_methods:
                path = Path(tmp) / f"{enc}.int8-{method}.onnx"
                quantize_int8(fp32, path, calib, method=method)
                variants.append((f"int8 {method}", "int8", path))
            if cuda:
                path = Path(tmp) / f"{enc}.fp16.onnx"
                convert_fp16(fp32, path)
                variants.append(("fp16", "fp16", path))

            eager = _eager(model, device)
            eager(pre[:batch_size], post[:batch_size], batch_size)  # warm-up
            seconds, ref = _best_time(lambda e=eager: e(pre, post, batch_size), repeat)
            base = len(pre) / seconds
            eager_name = f"PyTorch eager ({device})"
            found = [
                _row(eager_name, "fp32", torch.get_num_threads(), base, base, ref, ref, unique)
            ]
            for label, precision, path in variants:
                for th in o.threads:
                    fn, where = _onnx(path, th, providers or ["CPUExecutionProvider"])
                    fn(pre[:batch_size], post[:batch_size], batch_size)  # warm-up
                    seconds, out = _best_time(lambda f=fn: f(pre, post, batch_size), repeat)
                    name = f"ORT {label} ({where})"
                    found.append(
                        _row(name, precision, th, len(pre) / seconds, base, out, ref, unique)
                    )
                    del fn
            model.cpu()
            for r in found:
                context = {"input_size": input_size, "batch_size": batch_size, "pairs": len(pre)}
                rows.append({"encoder": enc, **r, **context, "models": what})
    figures = {
        "context": {
            "chips": chips_what,
            "input_size": input_size,
            "batch_size": batch_size,
            "pairs": len(pre),
            "repeat": max(int(repeat), 1),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__.split("+")[0],
            "torch_threads": torch.get_num_threads(),
            "onnxruntime": ort.__version__,
            "device": device,
        },
        "rows": rows,
    }
    if print_result:
        print(json.dumps(rows, indent=2) if as_json else format_table(figures))
    return figures


def _row(
    runtime: str,
    precision: str,
    threads: int | None,
    rate: float,
    base: float,
    logits: np.ndarray,
    ref: np.ndarray,
    unique: int,
) -> dict[str, Any]:
    logits, ref = logits[:unique], ref[:unique]
    return {
        "runtime": runtime,
        "precision": precision,
        "threads": "default" if threads is None else int(threads),
        "pairs_per_s": round(rate, 2),
        "ratio_vs_eager": round(rate / base, 3),
        "agreement_vs_eager": round(float(np.mean(logits.argmax(1) == ref.argmax(1))), 4),
        "max_abs_logit_diff_vs_eager": float(np.abs(logits - ref).max(initial=0.0)),
    }


#: The table's columns, over the rows of :func:`bench_infer`.
_COLUMNS = [
    Column("encoder", "encoder", align="<", width=10),
    Column("runtime", "runtime", align="<", width=28),
    Column("threads", "threads", "!s", width=7),
    Column("pairs/s", "pairs_per_s", ".1f", width=9),
    Column("x eager", "ratio_vs_eager", ".2f", width=8),
    Column("agreement", "agreement_vs_eager", ".2%", width=9),
    Column("max |dlogit|", "max_abs_logit_diff_vs_eager", ".3g", width=12),
]


def format_table(figures: dict[str, Any]) -> str:
    """The figures of :func:`bench_infer` as a plain-text table."""
    c = figures["context"]
    lines = [
        f"inference: {c['chips']}, {c['pairs']} pairs per pass at {c['input_size']} px, batch "
        f"{c['batch_size']}; torch {c['torch']} ({c['torch_threads']} threads), onnxruntime "
        f"{c['onnxruntime']}; {c['cpu_count']} CPUs, device {c['device']}; best of "
        f"{c['repeat']} pass(es)",
        *text_table(_COLUMNS, figures["rows"], " "),
    ]
    note = (
        "x eager = pairs/s over PyTorch eager fp32 of the same encoder in this run; agreement = "
        "share of pairs with the same predicted class as eager"
    )
    if any(r.get("models") == "random init" for r in figures["rows"]):
        note += " (weak on random weights: their logits are nearly tied; use --run)"
    lines.append(note)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    options = InferBenchOptions(
        input_size=args.input_size,
        batch_size=args.batch_size,
        pairs=args.pairs,
        threads=args.threads,
        int8_methods=args.int8,
        calibration=args.calibration,
        repeat=args.repeat,
        seed=args.seed,
    )
    bench_infer(
        encoders=[e for text in args.encoders for e in text.split(",") if e],
        run=args.run,
        options=options,
        as_json=args.json,
    )
    return 0
