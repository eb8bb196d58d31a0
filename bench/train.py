"""`local-damage bench train`: time per training step and activation memory per pair.

Two configurations of the same LOCAL training step (model forward, the ``local`` objective with
OCL on ``z`` and ``l`` plus weighted cross-entropy, backward, AdamW step) are measured on the
same weights and the same random batch:

- **naive**: float32, the pre and the post images as two separate encoder passes
  (:func:`separate_pass_forward`), every activation kept for backward, contiguous (NCHW) layout;
- **optimised**: the pair through the encoder as one batch of ``2B`` (:meth:`LocalNet.forward`),
  activation checkpointing of the encoder stages (``ModelConfig.gradient_checkpointing``), bf16
  autocast and channels-last layout.

Activation memory is the size of what autograd saves for backward during the forward pass and the
loss, recorded with :func:`torch.autograd.graph.saved_tensors_hooks`: every saved tensor's storage
is counted once (views and slices of one storage, e.g. the pre and post halves of a ``2B``
feature map, count once); the model's own parameters and buffers, and the bf16 copies of
them that autocast makes, are weights rather than activations and are left out. Checkpointed
regions save only their inputs, so the count is what stays in memory between forward and
backward. Memory per pair is that total over the batch size. On CUDA the peak of
``torch.cuda.max_memory_allocated`` over the configuration's steps is reported too.

With ``--chips`` it measures instead the loader against the training step on simulated chip
stores of xBD scale (:mod:`bench.train_scale`). This module is imported by the CLI parser: torch
is imported inside functions only.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from bench.train_scale import run_scale
from data_prep.errors import UsageError
from data_prep.text_table import Column, text_table

if TYPE_CHECKING:
    import torch

    from local_damage.models import LocalNet, LocalOutput

#: The configurations, baseline first.
CONFIGS = ("naive", "optimised")
#: Target: optimised activation memory at most this fraction of naive.
MEMORY_TARGET = 1.0 / 3.0
DEFAULT_ENCODERS = ("resnet18", "resnet50")
DEFAULT_SIZES = (128, 224, 512)
DEFAULT_BATCHES = (8, 16)
#: Input sides must be multiples of the encoder stride.
STRIDE = 32


# --------------------------------------------------------------------------- measurement


class SavedTensorBytes:
    """Context manager counting the bytes autograd saves for backward while it is active.

    Each saved tensor's storage is counted once, keyed by device and address, so views of one
    storage count once. Storages of the ``exclude`` tensors (the model's parameters and buffers)
    and of differentiable dtype/layout copies of them (the bf16 weight casts that autocast makes)
    are not activations: they are counted apart, in ``excluded_bytes``. Saved tensors are
    returned unchanged: the measured computation behaves as without the count.

    Args:
        exclude: Tensors whose storages, and copies of them, are left out of ``bytes``.

    Attributes:
        bytes: Total size in bytes of the unique activation storages saved so far.
        count: Number of those storages.
        excluded_bytes: Total size of the unique excluded storages saved so far (batch-independent).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t)[0] for t in exclude}
        self._storages: dict[tuple[str, int], int] = {}
        self._excluded: dict[tuple[str, int], int] = {}
        self._hooks: Any = None

    def __enter__(self) -> SavedTensorBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(tensor)
        if nbytes > 0:
            excluded = key in self._exclude or self._is_copy_of_excluded(tensor)
            (self._excluded if excluded else self._storages)[key] = nbytes
        return tensor

    def _is_copy_of_excluded(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a ``_to_copy`` of an excluded leaf tensor."""
        base = tensor._base if tensor._base is not None else tensor
        fn = base.grad_fn
        if fn is None or not fn.name().startswith("ToCopyBackward"):
            return False
        for parent, _ in fn.next_functions:
            leaf = getattr(parent, "variable", None)
            if leaf is not None and _storage_key(leaf)[0] in self._exclude:
                return True
        return False

    @property
    def bytes(self) -> int:
        return int(sum(self._storages.values()))

    @property
    def count(self) -> int:
        return len(self._storages)

    @property
    def excluded_bytes(self) -> int:
        return int(sum(self._excluded.values()))


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_key(tensor: torch.Tensor) -> tuple[tuple[str, int], int]:
    """``((device, storage address), storage bytes)`` of a tensor."""
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()), int(storage.nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without a storage: count their elements
        return (str(tensor.device), id(tensor)), tensor.numel() * tensor.element_size()


def _encode(model: LocalNet, x: torch.Tensor) -> list[torch.Tensor]:
    """One encoder pass over ``x`` ``[N, 3, H, W]`` with the model's layout and checkpointing."""
    import torch

    from local_damage.models import checkpointed_features

    if model.cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if model.cfg.gradient_checkpointing and model.training and torch.is_grad_enabled():
        return checkpointed_features(model.encoder, x)
    return list(model.encoder(x))


def separate_pass_forward(model: LocalNet, pre: torch.Tensor, post: torch.Tensor) -> LocalOutput:
    """:meth:`LocalNet.forward` with pre and post run through the encoder as two passes of ``B``.

    The same weights and heads as the paired forward; in eval mode the outputs are the same. In
    train mode batch normalisation takes its statistics over ``B`` images per pass instead of the
    ``2B`` of the paired forward, which is why the product runs the pair as one batch.

    Args:
        model: A :class:`LocalNet`.
        pre: ``[B, 3, H, W]`` normalised pre-event images.
        post: ``[B, 3, H, W]`` normalised post-event images.

    Returns:
        A :class:`LocalOutput` (logits ``[B, K]``, ``z`` ``[B, D_E]``, ``l`` ``[B, D_L]``, ...).
    """
    import torch.nn.functional as F

    from local_damage.models import LocalOutput

    if pre.shape != post.shape:
        raise ValueError(
            f"pre and post batches differ in shape: {tuple(pre.shape)} vs {tuple(post.shape)}"
        )
    feats_pre = _encode(model, pre)
    feats_post = _encode(model, post)
    logits, z_raw, e_pre, e_post = model._heads_raw(feats_pre[-1], feats_post[-1])
    z = F.normalize(z_raw, dim=1)
    l_emb = latent_map = None
    if model.latent is not None:
        l_emb, latent_map = model.latent(feats_pre, feats_post)
    return LocalOutput(logits, z, l_emb, e_pre, e_post, latent_map, z_raw)


def bench_labels(batch: int, num_classes: int = 4) -> torch.Tensor:
    """Labels ``[B]`` of a benchmark batch: each class twice in turn (0, 0, 1, 1, 2, 2, ...).

    Every anchor of a batch of 2 or more has a positive, and a batch of ``2K`` or more holds
    every class.
    """
    import torch

    return (torch.arange(batch) // 2) % num_classes


def measure_config(
    encoder: str,
    size: int,
    batch: int,
    config: str,
    *,
    steps: int = 2,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Measure one configuration of the LOCAL training step.

    Builds a randomly initialised model (default :class:`ModelConfig` heads) with ``seed``, a
    random normalised batch of ``batch`` pairs of ``size`` px, the ``local`` objective with
    inverse-frequency class weights and AdamW; runs one warm-up step with the saved-tensor count
    around forward and loss, then ``steps`` timed steps.

    Args:
        encoder: smp encoder name, e.g. ``"resnet18"``.
        size: Input side in pixels (a multiple of 32).
        batch: Pairs per step (>= 2).
        config: ``"naive"`` or ``"optimised"`` (see the module docstring).
        steps: Timed steps after the warm-up (>= 1).
        device: ``"cpu"`` or ``"cuda"``.
        seed: Seed of the weights, the batch and the labels.

    Returns:
        A record: ``encoder``, ``size``, ``batch``, ``config``, ``device``, ``threads``, ``steps``,
        ``step_s`` (mean seconds per timed step), ``pairs_per_s``, ``saved_bytes`` (unique
        activation storages saved for backward), ``saved_tensors`` (their count),
        ``weight_bytes`` (parameters and their autocast copies saved for backward, not
        counted as activations), ``bytes_per_pair`` and ``mib_per_pair`` (``saved_bytes`` over
        ``batch``), and ``peak_mib`` (CUDA max allocated over the steps; ``None`` on CPU).
    """
    import torch

    from local_damage.losses import LossConfig, class_weights
    from local_damage.models import ModelConfig, build_model
    from local_damage.train.config import OptimConfig

    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; valid: {', '.join(CONFIGS)}")
    _check_size_batch_steps(size, batch, steps)
    dev = torch.device(device)
    optimised = config == "optimised"

    torch.manual_seed(seed)
    model_cfg = ModelConfig(
        encoder=encoder, channels_last=optimised, gradient_checkpointing=optimised
    )
    model = build_model(model_cfg).to(dev).train()
    labels = bench_labels(batch, model_cfg.num_classes)
    weights = class_weights(labels.numpy(), model_cfg.num_classes)
    loss_cfg = LossConfig(method="local")
    objective = loss_cfg.build(torch.as_tensor(weights, dtype=torch.float32)).to(dev)
    alpha = loss_cfg.alpha(0)
    optim_cfg = OptimConfig()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay
    )
    pre = torch.randn(batch, 3, size, size, device=dev)
    post = torch.randn(batch, 3, size, size, device=dev)
    labels = labels.to(dev)
    exclude = list(model.parameters()) + list(model.buffers())

    def forward_and_loss() -> torch.Tensor:
        if optimised:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                output = model(pre, post)
        else:
            output = separate_pass_forward(model, pre, post)
        loss, _ = objective(
            output.logits.float(), labels, z=output.z.float(), l=output.l.float(), alpha=alpha
        )
        return loss

    def step(count: SavedTensorBytes | None = None) -> None:
        optimizer.zero_grad(set_to_none=True)
        if count is None:
            loss = forward_and_loss()
        else:
            with count:
                loss = forward_and_loss()
        loss.backward()
        optimizer.step()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    saved = SavedTensorBytes(exclude)
    step(saved)  # warm-up: allocator, kernels, optimiser state; and the memory count
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    step_s = sum(times) / len(times)
    record = {
        "encoder": encoder,
        "size": size,
        "batch": batch,
        "config": config,
        "device": dev.type,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "step_s": step_s,
        "pairs_per_s": batch / step_s,
        "saved_bytes": saved.bytes,
        "saved_tensors": saved.count,
        "weight_bytes": saved.excluded_bytes,
        "bytes_per_pair": saved.bytes / batch,
        "mib_per_pair": saved.bytes / batch / 2**20,
        "peak_mib": peak,
    }
    return record


def _check_size_batch_steps(size: int, batch: int, steps: int) -> None:
    if size < STRIDE or size % STRIDE:
        raise ValueError(f"input size {size} px: must be a positive multiple of {STRIDE}")
    if batch < 2:
        raise ValueError(f"batch {batch}: the contrastive loss needs at least 2 pairs")
    if steps < 1:
        raise ValueError(f"steps {steps}: at least one timed step is needed")


def _with_ratios(naive: dict[str, Any], optimised: dict[str, Any]) -> list[dict[str, Any]]:
    """The two records of one grid point with ``mem_ratio``/``time_ratio`` against naive."""
    out = []
    for rec in (naive, optimised):
        rec = dict(rec)
        rec["mem_ratio"] = rec["saved_bytes"] / naive["saved_bytes"]
        rec["time_ratio"] = rec["step_s"] / naive["step_s"]
        rec["meets_target"] = (
            None if rec["config"] == "naive" else bool(rec["mem_ratio"] <= MEMORY_TARGET)
        )
        out.append(rec)
    return out


def bench_train(
    encoders: Sequence[str] = DEFAULT_ENCODERS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    batches: Sequence[int] = DEFAULT_BATCHES,
    *,
    steps: int = 2,
    device: str = "cpu",
    seed: int = 0,
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Measure naive and optimised training steps over a grid of encoders, sizes and batches.

    A grid point that fails (e.g. out of memory) is reported and the grid goes on.

    Args:
        encoders: smp encoder names.
        sizes: Input sides in pixels (multiples of 32).
        batches: Pairs per step (>= 2).
        steps: Timed steps per configuration after one warm-up.
        device: ``"cpu"`` or ``"cuda"``.
        seed: Seed of weights and batches (the same for both configurations).
        on_rows: Called with the two records of each grid point as soon as they are measured.

    Returns:
        ``(rows, failures)``: the records of :func:`measure_config` with ``mem_ratio`` and
        ``time_ratio`` (over naive at the same encoder, size and batch) and ``meets_target``
        (optimised memory at most a third of naive; ``None`` on naive rows), and one line per
        failed grid point.
    """
    check_grid(encoders, sizes, batches, steps, device)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for encoder in encoders:
        for size in sizes:
            for batch in batches:
                try:
                    naive, optimised = (
                        measure_config(
                            encoder, size, batch, c, steps=steps, device=device, seed=seed
                        )
                        for c in CONFIGS
                    )
                except (RuntimeError, MemoryError) as err:
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    failures.append(
                        f"{encoder} {size} px batch {batch}: {type(err).__name__}: {first}"
                    )
                    continue
                finally:
                    _release(device)
                pair = _with_ratios(naive, optimised)
                rows.extend(pair)
                if on_rows is not None:
                    on_rows(pair)
    return rows, failures


def check_grid(
    encoders: Sequence[str], sizes: Sequence[int], batches: Sequence[int], steps: int, device: str
) -> None:
    """Raise a ``ValueError`` naming the first bad encoder, size, batch, step count or device."""
    for size in sizes:
        for batch in batches:
            _check_size_batch_steps(int(size), int(batch), steps)
    _check_device(device)
    _check_encoders(encoders)


def _release(device: str) -> None:
    """Free what the last measurement left (CUDA cache included) before the next one."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _check_encoders(encoders: Sequence[str]) -> None:
    from local_damage.models import encoder_names

    names = encoder_names()
    bad = [e for e in encoders if not e.startswith("tu-") and e not in names]
    if bad:
        raise ValueError(
            f"unknown encoder(s) {bad}; valid names are {names}, or 'tu-<model>' for a timm model"
        )


def _check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: must be 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available on this machine")


# --------------------------------------------------------------------------- output


def _target(r: dict[str, Any]) -> str:
    return "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "no")


def _columns(cuda: bool) -> list[Column]:
    cols = [
        Column("encoder", "encoder", align="<", width=9),
        Column("size", "size", "!s", width=5),
        Column("batch", "batch", "!s", width=5),
        Column("config", "config", width=10),
        Column("s/step", "step_s", ".3f", width=8),
        Column("pairs/s", "pairs_per_s", ".2f", width=8),
        Column("MiB/pair", "mib_per_pair", ".1f", width=9),
    ]
    if cuda:
        cols.append(Column("peak MiB", "peak_mib", ".0f", width=9))
    cols += [
        Column("mem ratio", "mem_ratio", ".3f", width=9),
        Column("time ratio", "time_ratio", ".2f", width=10),
        Column("<=1/3", _target, width=5),
    ]
    return cols


def format_header(device: str, threads: int, steps: int) -> str:
    """The title and column header of the table."""
    title = (
        f"LOCAL training step on {device} ({threads} threads), mean of {steps} timed step(s) "
        "after 1 warm-up; memory = bytes saved for backward (unique storages) per pair; "
        "ratios = optimised / naive"
    )
    return title + "\n" + text_table(_columns(device == "cuda"), [], "  ")[0]


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Table lines, one per record (columns as in :func:`format_header`)."""
    if not rows:
        return ""
    return "\n".join(text_table(_columns(rows[0]["device"] == "cuda"), rows, "  ")[1:])


def format_table(rows: Sequence[dict[str, Any]], steps: int) -> str:
    """The whole table of :func:`bench_train` records."""
    if not rows:
        return ""
    header = format_header(rows[0]["device"], rows[0]["threads"], steps)
    return header + "\n" + format_rows(rows)


# --------------------------------------------------------------------------- CLI


def run(args: argparse.Namespace) -> int:
    """Run `bench train`; 0 when every grid point was measured, 1 if some failed, 2 on bad input."""
    import torch

    if args.chips:
        return run_scale(args)
    try:
        check_grid(args.encoders, args.sizes, args.batches, args.steps, args.device)
    except ValueError as err:
        raise UsageError(str(err)) from err
    on_rows = None
    if not args.json:
        print(format_header(args.device, torch.get_num_threads(), args.steps), flush=True)

        def on_rows(pair: list[dict[str, Any]]) -> None:
            print(format_rows(pair), flush=True)

    try:
        rows, failures = bench_train(
            args.encoders,
            args.sizes,
            args.batches,
            steps=args.steps,
            device=args.device,
            seed=args.seed,
            on_rows=on_rows,
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.json:
        print(json.dumps(rows, indent=1))
    if failures:
        print(f"{len(failures)} grid point(s) failed:", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0
