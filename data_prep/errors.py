"""The error family of local-damage: every problem a user can cause and fix is a
:class:`LocalDamageError`.

Each package raises its own subclass (``ImageError`` for imagery, ``ModelError`` for model files,
``ConfigError`` for configs, ...); the message names the input at fault and what to do. The
console script catches this family once and prints the message; any other exception is a bug and
keeps its traceback. It lives at the bottom of the house (``data_prep`` imports nothing of the
project), so every package can raise it.
"""

from __future__ import annotations


class LocalDamageError(Exception):
    """A problem with the user's input, files, model or environment (not a bug); the message
    says which input and what to do."""
