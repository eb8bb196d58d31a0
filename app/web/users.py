"""The analysts of a labelling campaign: a users file of names and password hashes.

One line per analyst, ``name:hash``; ``#`` starts a comment. The hash is scrypt (the standard
library's :func:`hashlib.scrypt`, a memory-hard key derivation) with a random salt, written as
``scrypt$n$r$p$salt$key`` (hex), so the file holds no password. ``local-damage users add FILE
NAME`` writes it; ``local-damage app --users FILE`` asks each analyst to log in, and each
correction records who made it. :class:`Users` is the app's login check: it reads the file again
when it changes, so an analyst added during a campaign can log in without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
from pathlib import Path

from app.web.sessions import AppError
from data_prep.store import atomic_path

#: scrypt's cost parameters (n = 2**14, r = 8: 16 MiB and tens of milliseconds per check).
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
#: What an analyst's name may hold: letters, digits and ``. _ @ -``, 1 to 64 characters.
NAME = re.compile(r"[\w.@-]{1,64}")


def hash_password(password: str) -> str:
    """A salted scrypt hash of ``password`` as the users file stores it."""
    if not password:
        raise AppError("the password is empty")
    salt = secrets.token_bytes(16)
    key = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${key.hex()}"


def verify(password: str, hashed: str) -> bool:
    """Whether ``password`` is the one ``hashed`` was made from (constant-time comparison)."""
    try:
        kind, n, r, p, salt, key = hashed.split("$")
        if kind != "scrypt":
            return False
        got = hashlib.scrypt(
            password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p)
        )
        return hmac.compare_digest(got, bytes.fromhex(key))
    except ValueError:
        return False


def read_users(path: str | os.PathLike) -> dict[str, str]:
    """Name -> password hash of every analyst of a users file.

    Raises:
        AppError: the file is missing, or a line is not ``name:scrypt$...`` (the message names
            the file and the line), or a name appears twice.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise AppError(f"users file {path}: {exc.strerror or exc}") from exc
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, hashed = line.partition(":")
        if not NAME.fullmatch(name) or not hashed.startswith("scrypt$") or hashed.count("$") != 5:
            raise AppError(
                f"users file {path}, line {number}: expected name:scrypt$... (a name of letters, "
                "digits, '.', '_', '@', '-', and a hash written by `local-damage users add`)"
            )
        if name in users:
            raise AppError(f"users file {path}, line {number}: {name!r} is listed twice")
        users[name] = hashed
    return users


def add_user(path: str | os.PathLike, name: str, password: str) -> bool:
    """Add analyst ``name`` to a users file (created if missing), or set a new password when
    listed already; returns whether the analyst is new. Written atomically.

    Raises:
        AppError: a name that is not allowed, an empty password, an unreadable file.
    """
    if not NAME.fullmatch(name or ""):
        raise AppError(f"analyst name {name!r}: use 1 to 64 letters, digits, '.', '_', '@' or '-'")
    path = Path(path)
    users = read_users(path) if path.exists() else {}
    new = name not in users
    users[name] = hash_password(password)
    lines = ["# local-damage analysts: name:scrypt hash (local-damage users add FILE NAME)"]
    lines += [f"{n}:{h}" for n, h in users.items()]
    with atomic_path(path, suffix=".txt") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return new


class Users:
    """The app's login check over a users file (Gradio's ``auth`` callable).

    Args:
        path: the users file; read now (a bad file is refused before the app starts) and again
            whenever it changes.

    Raises:
        AppError: as :func:`read_users`; also when the file lists nobody.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._users: dict[str, str] = {}
        self._load()
        if not self._users:
            raise AppError(f"users file {self.path} lists no analyst; add one with `users add`")

    def _load(self) -> dict[str, str]:
        with self._lock:
            try:
                st = self.path.stat()
            except OSError as exc:
                raise AppError(f"users file {self.path}: {exc.strerror or exc}") from exc
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._users, self._stamp = read_users(self.path), stamp
            return self._users

    @property
    def names(self) -> list[str]:
        """The analysts the file lists now."""
        return list(self._load())

    def __call__(self, username: str, password: str) -> bool:
        try:
            hashed = self._load().get(username)
        except (AppError, OSError):  # the file broken or gone mid-campaign: nobody new logs in
            return False
        return hashed is not None and verify(password, hashed)
