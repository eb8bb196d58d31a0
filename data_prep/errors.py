"""The error family of local-damage: every problem a user can cause and fix is a
:class:`LocalDamageError`.

Each package raises its own subclass (``ImageError`` for imagery, ``ModelError`` for model files,
``ConfigError`` for configs, ...); the message names the input at fault and what to do. The
console script catches this family once and prints the message; any other exception is a bug and
keeps its traceback. It lives at the bottom of the house (``data_prep`` imports nothing of the
project), so every package can raise it.
"""

from __future__ import annotations

import glob
import os


class LocalDamageError(Exception):
    """A problem with the user's input, files, model or environment (not a bug); the message
    says which input and what to do."""


class UsageError(LocalDamageError):
    """A command's options that are out of range or do not go together; the message names the
    option and what to give instead. The console script prints it as every error of the family
    (``error: ...``, exit status 2)."""


#: Characters of a shell filename pattern.
PATTERN_CHARS = "*?["


def not_found(path: str | os.PathLike, what: str = "file not found") -> str:
    """``what``, with a hint when ``path`` is a shell filename pattern that reached the command
    as it is: one that matched no file (the shell passes an unmatched pattern on unexpanded) or
    one that was quoted (then it names the files it would match)."""
    text = str(path)
    if not any(c in text for c in PATTERN_CHARS):
        return what
    matches = sorted(glob.glob(os.path.expanduser(text)))
    if not matches:
        return (
            f"{what}: {text!r} is a filename pattern that matched no file, so the shell passed "
            "it on as it is; check the folder and the pattern (ls it)"
        )
    return (
        f"{what}: {text!r} is a filename pattern the shell did not expand (quoted?); it matches "
        f"{len(matches)} file(s), e.g. {matches[0]}: leave it unquoted"
    )
