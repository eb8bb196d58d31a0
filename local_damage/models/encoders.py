"""Encoder construction and weight loading for the shared Siamese backbone.

Encoders come from segmentation-models-pytorch's registry (``get_encoder``), which returns the
feature map of every stage: for a depth-5 encoder and an input ``[N, C, H, W]`` the list holds
6 tensors, index 0 being the input itself and index ``k`` having stride ``2**k``. The four
ResNet blocks of the paper (``layer1`` .. ``layer4``) are feature indices 2..5 (strides 4..32).

Weights are random by default. A local file (``.pth``/``.pt``/``.bin``/``.ckpt`` read with
``torch.load(weights_only=True)``, or ``.safetensors``) may hold a plain encoder state dict, a dict
with a ``state_dict`` or ``model`` entry, or a whole-model state dict whose encoder keys carry an
``encoder.`` prefix. Hub weights (e.g. ``"imagenet"``) are taken from the Hugging Face cache when
present; otherwise they are downloaded, and a machine without network gets an error that says how
to fetch the file elsewhere and pass its path instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from data_prep.errors import LocalDamageError

#: Number of encoder stages requested from smp; the paper's 4 blocks are feature indices 2..5.
ENCODER_DEPTH = 5
#: File suffixes read with ``torch.load(weights_only=True)``.
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
#: File suffixes read with ``safetensors.torch.load_file``.
SAFETENSORS_SUFFIXES = (".safetensors",)
#: Prefixes stripped from state-dict keys (whole-model checkpoints, DataParallel wrappers).
_PREFIXES = ("module.", "encoder.")
#: Seconds to wait for a TCP connection to the hub before calling the machine offline.
_PROBE_TIMEOUT_S = 5.0


class WeightsUnavailableError(LocalDamageError, RuntimeError):
    """Hub weights were asked for but are neither cached nor downloadable from this machine."""


class EncoderError(LocalDamageError, ValueError):
    """An encoder name, hub weights name or weights file that cannot give the encoder asked for."""


class WeightsFileNotFoundError(LocalDamageError, FileNotFoundError):
    """An encoder weights file that is not there."""


@dataclass
class WeightsReport:
    """What happened when a state dict was loaded into an encoder.

    Attributes:
        path: The file the weights came from.
        loaded: Encoder keys that received a tensor from the file.
        missing: Encoder keys the file did not provide (they keep their initial values).
        unexpected: File keys the encoder has no use for (ignored).
    """

    path: Path
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def encoder_names() -> list[str]:
    """Names accepted by :func:`build_encoder` (plus any ``tu-<timm model>``)."""
    from segmentation_models_pytorch.encoders import get_encoder_names

    return list(get_encoder_names())


def check_name(name: str) -> None:
    """Refuse an encoder name that is neither an smp encoder nor ``tu-<timm model>``."""
    if name.startswith("tu-"):
        return
    names = encoder_names()
    if name not in names:
        raise EncoderError(
            f"unknown encoder {name!r}; valid names are {names}, or 'tu-<model>' for any timm model"
        )


def build_encoder(
    name: str,
    weights: str | os.PathLike | None = None,
    *,
    in_channels: int = 3,
    cache_dir: str | os.PathLike | None = None,
) -> nn.Module:
    """Build an smp encoder of depth 5, randomly initialised or with weights.

    Args:
        name: An smp encoder name (``"resnet18"``, ``"resnet34"``, ``"resnet50"``, ...) or
            ``"tu-<timm model>"``.
        weights: ``None`` for random initialisation; a path to a local weights file; or the name
            of smp hub weights for this encoder (e.g. ``"imagenet"``).
        in_channels: Channels of the input images.
        cache_dir: Hugging Face cache to look in for hub weights (default: the usual cache).

    Returns:
        The encoder; ``encoder(x)`` with ``x`` ``[N, in_channels, H, W]`` returns 6 feature maps
        and ``encoder.out_channels`` their channel counts.

    Raises:
        EncoderError: Unknown encoder name, unknown hub weights name, or a weights file that does
            not fit the encoder.
        WeightsFileNotFoundError: ``weights`` looks like a path but no such file exists.
        WeightsUnavailableError: Hub weights are not cached and cannot be downloaded.
    """
    from segmentation_models_pytorch.encoders import get_encoder

    check_name(name)
    if weights is not None and _looks_like_path(weights):
        encoder = _get_encoder(get_encoder, name, in_channels=in_channels)
        load_encoder_weights(encoder, weights)
        return encoder
    if weights is None:
        return _get_encoder(get_encoder, name, in_channels=in_channels)
    return _build_with_hub_weights(name, str(weights), in_channels=in_channels, cache_dir=cache_dir)


def _get_encoder(get_encoder: Callable, name: str, **kwargs) -> nn.Module:
    try:
        return get_encoder(name, depth=ENCODER_DEPTH, **kwargs)
    except RuntimeError as err:  # timm: "Unknown model (...)"
        raise EncoderError(f"cannot build encoder {name!r}: {err}") from err


def _looks_like_path(weights: str | os.PathLike) -> bool:
    if isinstance(weights, os.PathLike):
        return True
    path = Path(weights)
    return (
        path.exists()
        or path.suffix.lower() in TORCH_SUFFIXES + SAFETENSORS_SUFFIXES
        or os.sep in weights
        or "/" in weights
    )


def _build_with_hub_weights(
    name: str, weights: str, *, in_channels: int, cache_dir: str | os.PathLike | None
) -> nn.Module:
    from segmentation_models_pytorch.encoders import encoders, get_encoder

    if name.startswith("tu-"):
        # timm picks the pretrained tag from the name and looks in its caches before downloading;
        # without a reachable hub it is held to its caches so that it cannot hang on retries.
        what = f"pretrained timm weights for encoder {name!r}"
        try:
            _require_hub(what, hint=None)
            cache_only = contextlib.nullcontext()
        except WeightsUnavailableError:
            cache_only = _hub_offline()
        try:
            with cache_only:
                return get_encoder(name, in_channels=in_channels, depth=ENCODER_DEPTH, weights=True)
        except Exception as err:
            hint = (
                f"there, save build_encoder({name!r}, 'imagenet').state_dict() with torch.save "
                "and pass the saved file's path as the encoder weights"
            )
            raise WeightsUnavailableError(_offline_message(what, err, hint)) from err
    available = encoders[name]["pretrained_settings"]
    if weights not in available:
        raise EncoderError(
            f"no hub weights {weights!r} for encoder {name!r}; available: {sorted(available)}; "
            "or pass the path of a local weights file"
        )
    repo_id = available[weights]["repo_id"]
    revision = available[weights]["revision"]
    path = _hub_file(repo_id, revision, cache_dir=cache_dir)
    encoder = _get_encoder(get_encoder, name)
    report = load_encoder_weights(encoder, path)
    if report.missing:
        raise EncoderError(f"hub weights {path} lack encoder keys {report.missing[:5]}")
    encoder.set_in_channels(in_channels, pretrained=True)
    return encoder


def _hub_file(repo_id: str, revision: str, *, cache_dir: str | os.PathLike | None) -> Path:
    """Path of ``model.safetensors`` of a hub repo: from the cache, else downloaded."""
    from huggingface_hub import hf_hub_download

    what = f"hub weights {repo_id}@{revision[:8]}"
    hint = (
        "on a machine with network run\n"
        '  python -c "from huggingface_hub import hf_hub_download; print(hf_hub_download('
        f"'{repo_id}', 'model.safetensors', revision='{revision}'))\"\n"
        "copy the printed file here and pass its path as the encoder weights"
    )
    kwargs = {"revision": revision, "cache_dir": cache_dir}
    with contextlib.suppress(Exception):
        return Path(hf_hub_download(repo_id, "model.safetensors", local_files_only=True, **kwargs))
    _require_hub(what, hint=hint)
    try:
        return Path(hf_hub_download(repo_id, "model.safetensors", etag_timeout=10, **kwargs))
    except Exception as err:
        raise WeightsUnavailableError(_offline_message(what, err, hint)) from err


def _offline_message(
    what: str, err: BaseException | str | None = None, hint: str | None = None
) -> str:
    msg = f"cannot get {what}: not in the local cache and the hub cannot be reached"
    if isinstance(err, str):
        msg += f" ({err})"
    elif err is not None:
        msg += f" ({type(err).__name__}: {err})"
    return (
        msg
        + ".\nDownload the weights on a connected machine and pass a local path; "
        + (hint or "see the encoder's documentation for the file to fetch")
    )


@contextlib.contextmanager
def _hub_offline():
    """Hold huggingface_hub to its local cache for the duration of the block."""
    from huggingface_hub import constants

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous


def _require_hub(what: str, *, hint: str | None) -> None:
    """Fail fast, with the offline message, when the hub is disabled or unreachable."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"} or getattr(
        constants, "HF_HUB_OFFLINE", False
    ):
        raise WeightsUnavailableError(_offline_message(what, "HF_HUB_OFFLINE is set", hint))
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # connections go through a proxy: let the download itself decide
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as err:
        raise WeightsUnavailableError(_offline_message(what, err, hint)) from err


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from a ``.pth``-style or ``.safetensors`` file.

    Unwraps ``{"state_dict": ...}`` and ``{"model": ...}`` containers and keeps only tensors.

    Raises:
        WeightsFileNotFoundError: No file at ``path``.
        EncoderError: Unknown suffix, unreadable file, or no tensors in it.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsFileNotFoundError(f"weights file {path} not found")
    suffix = path.suffix.lower()
    try:
        if suffix in SAFETENSORS_SUFFIXES:
            from safetensors.torch import load_file

            obj = load_file(str(path), device="cpu")
        elif suffix in TORCH_SUFFIXES:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise EncoderError(
                f"weights file {path}: unknown suffix {suffix!r}; "
                f"expected one of {TORCH_SUFFIXES + SAFETENSORS_SUFFIXES}"
            )
    except ValueError:
        raise
    except Exception as err:
        raise EncoderError(
            f"weights file {path} cannot be read: {type(err).__name__}: {err}"
        ) from err
    for key in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping):
        raise EncoderError(f"weights file {path} holds a {type(obj).__name__}, not a state dict")
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise EncoderError(f"weights file {path} holds no tensors")
    return tensors


def _match_prefixes(state: dict[str, torch.Tensor], own: Mapping) -> dict[str, torch.Tensor]:
    """Strip ``module.``/``encoder.`` prefixes when that makes more keys match the encoder.

    A whole-model checkpoint keeps only its ``encoder.`` part; the other heads are not encoder
    keys and are dropped rather than reported as unexpected.
    """

    def strip(d: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}

    candidates = [state]
    for prefix in _PREFIXES:
        candidates += [strip(c, prefix) for c in candidates]
    # Most matching keys wins; ties go to the least stripped candidate (the earliest).
    best = max(candidates, key=lambda c: sum(k in own for k in c))
    return best


def load_encoder_weights(encoder: nn.Module, path: str | os.PathLike) -> WeightsReport:
    """Load encoder weights from a local file into ``encoder`` in place.

    Keys prefixed ``encoder.`` (and ``module.``) are matched with the prefix removed; a ResNet
    classifier head (``fc.*``) in the file is ignored. Keys missing from the file keep their
    current values and are reported with a warning.

    Args:
        encoder: The encoder from :func:`build_encoder`.
        path: A ``.pth``/``.pt``/``.bin``/``.ckpt`` or ``.safetensors`` file.

    Returns:
        Which keys were loaded, missing and unexpected.

    Raises:
        WeightsFileNotFoundError: No file at ``path``.
        EncoderError: Unreadable file, shapes that do not fit, or no key matching the encoder.
    """
    path = Path(path)
    own = encoder.state_dict()
    state = _match_prefixes(read_state_dict(path), own)
    report = WeightsReport(path=path)
    report.unexpected = sorted(k for k in state if k not in own and not k.startswith("fc."))
    report.missing = sorted(k for k in own if k not in state)
    matched = {k: v for k, v in state.items() if k in own}
    bad_shapes = [
        f"{k}: file {tuple(v.shape)} vs encoder {tuple(own[k].shape)}"
        for k, v in matched.items()
        if v.shape != own[k].shape
    ]
    if bad_shapes:
        raise EncoderError(
            f"weights file {path} does not fit encoder {type(encoder).__name__}: "
            f"{len(bad_shapes)} shape mismatches, e.g. {bad_shapes[:3]}"
        )
    if not matched:
        raise EncoderError(
            f"weights file {path} matched no encoder key: file keys look like "
            f"{sorted(state)[:3]}, encoder keys like {sorted(own)[:3]}"
        )
    nn.Module.load_state_dict(encoder, matched, strict=False)
    report.loaded = sorted(matched)
    if report.missing or report.unexpected:
        warnings.warn(
            f"weights file {path}: loaded {len(report.loaded)} encoder tensors; "
            f"{len(report.missing)} missing (kept as initialised, e.g. {report.missing[:3]}), "
            f"{len(report.unexpected)} unexpected (ignored, e.g. {report.unexpected[:3]})",
            stacklevel=2,
        )
    return report


# --------------------------------------------------------------------------- checkpointing


def resnet_stages(encoder: nn.Module) -> list[nn.Sequential] | None:
    """The stages of a torchvision-ResNet-based smp encoder, or None for other encoders.

    Running the stages in order reproduces ``encoder(x)[1:]``: stem (stride 2), maxpool+layer1
    (stride 4), layer2, layer3, layer4 (stride 32).
    """
    from torchvision.models import ResNet

    if not isinstance(encoder, ResNet) or getattr(encoder, "_depth", None) != ENCODER_DEPTH:
        return None
    return [
        nn.Sequential(encoder.conv1, encoder.bn1, encoder.relu),
        nn.Sequential(encoder.maxpool, encoder.layer1),
        nn.Sequential(encoder.layer2),
        nn.Sequential(encoder.layer3),
        nn.Sequential(encoder.layer4),
    ]


class _KeepBatchNormStats:
    """Context that undoes running-stat updates of batch norms (for the recompute pass)."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [
            m
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        ]
        self.saved: list[tuple[torch.Tensor, ...]] = []

    def __enter__(self) -> _KeepBatchNormStats:
        self.saved = [
            (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
            for m in self.norms
        ]
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for m, (mean, var, count) in zip(self.norms, self.saved, strict=True):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


def _checkpoint(module: nn.Module, fn: Callable, *args: torch.Tensor):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _KeepBatchNormStats(module)),
    )


def checkpointed_features(encoder: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``encoder(x)`` with activation checkpointing: stage inputs are kept, the rest recomputed.

    ResNet encoders are checkpointed stage by stage (only the 6 feature maps stay in memory);
    other encoders as one segment. Batch-norm running statistics are updated once, as without
    checkpointing (the recompute pass in backward restores them).

    Args:
        encoder: An encoder from :func:`build_encoder`.
        x: Input ``[N, C, H, W]``.

    Returns:
        The same 6 feature maps as ``encoder(x)``.
    """
    stages = resnet_stages(encoder)
    if stages is None:
        return list(_checkpoint(encoder, lambda t: tuple(encoder(t)), x))
    features = [x]
    for stage in stages:
        features.append(_checkpoint(stage, stage, features[-1]))
    return features


def feature_channels(encoder: nn.Module) -> Sequence[int]:
    """Channels of the 6 feature maps of ``encoder`` (index 0 is the input)."""
    return tuple(int(c) for c in encoder.out_channels)
