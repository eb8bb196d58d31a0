"""The training's user-facing errors, members of :class:`data_prep.errors.LocalDamageError`."""

from __future__ import annotations

from data_prep.errors import LocalDamageError


class TrainingError(LocalDamageError, ValueError):
    """A training request that cannot run as asked (too few labelled chips, a weights file of
    another kind)."""


class RunFileNotFoundError(LocalDamageError, FileNotFoundError):
    """A run folder, weights file or checkpoint that is not there (``--init``, ``--resume``), or
    the chip store a run was trained on."""
