"""The model-file contract: what a local-damage ONNX file holds, and how it is opened (no torch).

A **damage model** (``local-damage export``) takes uint8 RGB chip pairs ``pre`` / ``post``
``[N, S, S, 3]`` (normalisation inside the graph) and returns ``logits`` ``[N, K]`` and
``embedding`` ``[N, D]`` (the L2-normalised ``z``), with ``change_map`` ``[N, 1, S, S]`` when
exported with ``--change-map``. A **building localiser** (``local-damage localize export``) takes
``image`` ``[N, H, W, 3]`` uint8 and returns ``building`` ``[N, H, W]``, with metadata ``task``
``"localize"``.

Metadata props (``ModelProto.metadata_props``) carry every value as JSON text: the class names,
the chip spec, the input size, the training config, validation metrics, calibration and the
adapted head, so a model file describes itself. The exporters write with :func:`set_metadata` and
:func:`save_onnx`; every reader opens a file with :func:`open_session`, which parses them back.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data_prep.errors import LocalDamageError
from data_prep.store import atomic_path

#: Model file layout written by this version.
FORMAT_VERSION = 1
#: Model file layouts this version reads.
SUPPORTED_FORMAT_VERSIONS = (1,)
#: Metadata props every damage model must have.
REQUIRED_METADATA = ("format_version", "class_names", "chip_spec", "input_size")
#: Inputs of a damage model: uint8 ``[N, S, S, 3]`` chips of the pre and post image.
INPUT_NAMES = ("pre", "post")
#: Outputs of every damage model.
OUTPUT_NAMES = ("logits", "embedding")
#: Optional output of models exported with ``--change-map``: the latent correlation map.
CHANGE_MAP = "change_map"

#: ``task`` metadata of a building localiser.
LOCALIZE_TASK = "localize"
#: Input of a localiser: uint8 ``[N, H, W, 3]`` images, H and W multiples of 32.
LOCALIZER_INPUT = "image"
#: Output of a localiser: the building probability of every pixel, ``[N, H, W]``.
LOCALIZER_OUTPUT = "building"
#: Metadata props every localiser must have.
LOCALIZER_METADATA = ("format_version", "task", "tile_size", "scale", "threshold", "min_area_px")

#: The CPU provider alone (exports and their checks compare on the CPU).
CPU_ONLY = ("CPUExecutionProvider",)
#: Execution providers tried in this order when none are given.
PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


class ModelError(LocalDamageError, ValueError):
    """A file that is not a valid local-damage ONNX model; the message names the file and why."""


def parse_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """Metadata props as Python values: each parsed as JSON, raw text where it is not JSON."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[key] = json.loads(value)
        except (json.JSONDecodeError, TypeError):
            out[key] = value
    return out


def read_metadata(proto) -> dict[str, Any]:
    """``metadata_props`` of an ``onnx.ModelProto`` parsed as by :func:`parse_metadata`."""
    return parse_metadata({p.key: p.value for p in proto.metadata_props})


def set_metadata(proto, props: Mapping[str, Any], only: bool = False) -> None:
    """Set ``metadata_props`` of an ``onnx.ModelProto`` in place, each value as JSON text.

    With ``only=True`` every other prop (e.g. notes left by the quantizer) is removed.
    """
    keep = [(p.key, p.value) for p in proto.metadata_props if p.key not in props and not only]
    del proto.metadata_props[:]
    for key, value in keep:
        proto.metadata_props.add(key=key, value=value)
    for key, value in props.items():
        proto.metadata_props.add(key=str(key), value=json.dumps(value, default=str))


def save_onnx(proto, path: str | os.PathLike) -> Path:
    """Check and write an ONNX model atomically (a temporary beside ``path``, then a rename)."""
    import onnx

    path = Path(path)
    onnx.checker.check_model(proto)
    with atomic_path(path, suffix=".onnx") as tmp:
        onnx.save(proto, str(tmp))
    return path


def session_options(threads: int | None):
    """ONNX Runtime session options: every graph optimisation, ``threads`` intra-op threads
    (default: onnxruntime's choice), one inter-op thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    return options


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime has it (onnxruntime-gpu), then CPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    chosen = [p for p in PREFERRED_PROVIDERS if p in available]
    return chosen or ["CPUExecutionProvider"]


def open_session(
    path: str | os.PathLike,
    providers: Sequence[str] | None = None,
    threads: int | None = None,
    what: str = "model",
):
    """``(session, metadata)``: an ONNX Runtime session over ``path`` and its metadata props
    parsed from JSON; ``what`` names the file in the errors (``model``, ``localiser model``).

    Raises:
        ModelError: the file is missing or not a loadable ONNX model.
    """
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: {what} file not found")
    try:
        session = ort.InferenceSession(
            str(path),
            session_options(threads),
            providers=list(providers) if providers else default_providers(),
        )
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        raise ModelError(
            f"{path}: not a loadable ONNX model ({type(exc).__name__}: {exc})"
        ) from exc
    return session, parse_metadata(session.get_modelmeta().custom_metadata_map)


def model_task(path: str | os.PathLike) -> str | None:
    """The ``task`` metadata prop of an ONNX file (:data:`LOCALIZE_TASK` for a localiser), None
    when it has none or cannot be read. Cached by path, size and modification time."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return None
    return _model_task(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _model_task(path: str, size: int, mtime: int) -> str | None:
    try:
        import onnx

        proto = onnx.load(path, load_external_data=False)
    except Exception:  # not ONNX: the loader says so when the file is used
        return None
    for prop in proto.metadata_props:
        if prop.key == "task":
            value = parse_metadata({"task": prop.value})["task"]
            return value if isinstance(value, str) else None
    return None
