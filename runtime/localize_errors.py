"""The localiser's user-facing errors, members of :class:`data_prep.errors.LocalDamageError`."""

from __future__ import annotations

from data_prep.errors import LocalDamageError


class LocalizeError(LocalDamageError, ValueError):
    """A localiser request that cannot run as asked: folds without tiles, a run or model of
    another kind, a figures file that is not ``localize evaluate`` output."""


class LocalizeFileNotFoundError(LocalDamageError, FileNotFoundError):
    """A file of a localiser run, its tiles or a figures file that is not there."""


class LocalizerExportError(LocalDamageError, RuntimeError):
    """An exported localiser whose ONNX Runtime output differs from PyTorch's (nothing written)."""
