"""Shared-secret authentication between the allocator and its workers.

The operator writes a random token to a file only its user can read; workers on
every node read the same file (a shared filesystem) and prove they know the token
with an HMAC over fresh nonces, so the token itself never crosses the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

TOKEN_BYTES = 32
NONCE_BYTES = 16
_TOKEN_HEX_CHARS = 2 * TOKEN_BYTES
# A token file holds 64 hex characters and a newline; anything much bigger is not one.
_MAX_TOKEN_FILE_BYTES = 4096


class TokenFileError(Exception):
    """The token file is missing, unreadable, too permissive or malformed."""


def ensure_token_file(path: Path) -> bytes:
    """Return the token stored at ``path``, creating the file (mode 0600) if missing."""
    if not path.exists():
        _create_token_file(path)
    return read_token_file(path)


def read_token_file(path: Path) -> bytes:
    """Read and validate the token at ``path``; refuse files that others may access."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise TokenFileError(f"cannot open token file {path}: {error.strerror}") from error
    try:
        # fstat the opened file, not the path, so a swapped file cannot slip past the check.
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            raise TokenFileError(
                f"token file {path} has mode {mode:#o}; it must not be readable or writable "
                f"by group or others (run: chmod 600 {path})"
            )
        raw = os.read(fd, _MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse_token(path, raw)


def prove(token: bytes, *parts: str) -> str:
    """HMAC-SHA256 (hex) of ``parts``, each length-prefixed so no two part lists collide."""
    message = bytearray()
    for part in parts:
        encoded = part.encode("utf-8")
        message += len(encoded).to_bytes(8, "big")
        message += encoded
    return hmac.new(token, bytes(message), hashlib.sha256).hexdigest()


def verify(token: bytes, proof: str, *parts: str) -> bool:
    """Whether ``proof`` equals ``prove(token, *parts)``, compared in constant time."""
    expected = prove(token, *parts).encode("ascii")
    # Compare bytes: compare_digest rejects non-ASCII str, and a peer controls ``proof``.
    return hmac.compare_digest(expected, proof.encode("utf-8", "surrogatepass"))


def new_nonce() -> str:
    """A fresh random nonce, hex-encoded."""
    return secrets.token_hex(NONCE_BYTES)


def _create_token_file(path: Path) -> None:
    _make_private_dirs(path.parent)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL with mode 0600 from the start: the file is never readable by others, and
    # the umask can only make it stricter.
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            os.write(fd, (secrets.token_hex(TOKEN_BYTES) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        # A hard link puts the complete file in place atomically like a rename, but never
        # replaces a token another process created meanwhile (whose holders would break).
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    finally:
        temporary.unlink()


def _make_private_dirs(directory: Path) -> None:
    missing: list[Path] = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for created in reversed(missing):
        with contextlib.suppress(FileExistsError):
            created.mkdir(mode=0o700)


def _parse_token(path: Path, raw: bytes) -> bytes:
    if len(raw) > _MAX_TOKEN_FILE_BYTES:
        raise TokenFileError(f"token file {path} is malformed: larger than a token")
    # The content is never quoted in messages: it may be a real token.
    try:
        text = raw.decode("ascii").strip()
        token = bytes.fromhex(text)
    except ValueError:
        raise TokenFileError(
            f"token file {path} is malformed: expected {_TOKEN_HEX_CHARS} hex characters"
        ) from None
    if len(token) < TOKEN_BYTES:
        raise TokenFileError(
            f"token file {path} holds a token that is too short: "
            f"{len(token)} bytes, expected {TOKEN_BYTES}"
        )
    if len(token) > TOKEN_BYTES:
        raise TokenFileError(
            f"token file {path} is malformed: {len(token)} bytes, expected {TOKEN_BYTES}"
        )
    return token
