"""Shared-secret authentication between the allocator and its clients.

The operator writes a random master token to a file only its user can read. Each
client speaks as an identity: ``admin`` (the master token itself), ``job:<name>``
(a job's processes) or ``agent:<host>`` (the node agent of one host). The key of a
job or of a host's agent is derived from the master token and the job's or host's name,
so the server needs no per-client state and a restarted operator with the same master
token accepts the credentials its predecessor handed out. A job's key proves only that
job's identity, a host's agent key only that host's: neither can be turned into the
master token nor into another job's or host's key. Clients prove they know
their key with an HMAC over fresh nonces, so no key ever crosses the network.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TOKEN_BYTES = 32
NONCE_BYTES = 16
_TOKEN_HEX_CHARS = 2 * TOKEN_BYTES
# A token file holds 64 hex characters and a newline; anything much bigger is not one.
_MAX_TOKEN_FILE_BYTES = 4096
_HEX_TEXT = re.compile(rb"(?:[0-9a-fA-F]{2})+")


MAX_HOST_CHARS = 253
# A DNS name (letters, digits, '-', '_', '.') or an IP address (IPv6 without brackets,
# possibly with a zone). No spaces, quotes, slashes or control characters: a host name
# ends up in log lines, scrape target files and URLs.
_HOST_PATTERN = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9_.:%-]*")
# What a job's metadata.name is (specs.models.is_job_name); repeated here so the code
# that runs inside every worker does not import the spec models.
_JOB_NAME_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

IdentityKind = Literal["admin", "job", "agent"]


TokenProblem = Literal["open", "kind", "owner", "mode", "content"]


class TokenFileError(Exception):
    """The token file is missing, unreadable, too permissive or malformed.

    ``problem`` says which, so that a caller that knows whose file it is can say what to do:
    ``open`` (cannot be opened), ``kind`` (not a regular file), ``owner`` (another user's),
    ``mode`` (others may access it; the message says the chmod) or ``content`` (not one
    line of 64 hex characters). The message never quotes the file's content.
    """

    def __init__(self, message: str, problem: TokenProblem = "content") -> None:
        super().__init__(message)
        self.problem: TokenProblem = problem


def checked_job_name(name: str) -> str:
    """``name`` if it is a job's name; ValueError naming it if not. Whatever builds a path
    from a job's name checks it first: a name is a DNS-1123 label (no '/', no '..'), so
    ``<name>.log`` cannot leave its directory."""
    if _JOB_NAME_PATTERN.fullmatch(name) is None:
        shown = repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"
        raise ValueError(
            f"{shown} is not a job name (lowercase letters, digits and '-', starting and"
            " ending with a letter or digit, at most 63 characters)"
        )
    return name


def is_host(text: str) -> bool:
    """Whether ``text`` is a plausible host name or IP address, safe to log and to file."""
    return len(text) <= MAX_HOST_CHARS and _HOST_PATTERN.fullmatch(text) is not None


@dataclass(frozen=True)
class Identity:
    """Who a client speaks for, as proved in the handshake."""

    kind: IdentityKind
    name: str = ""
    """The job's name for ``job``, the host for ``agent``; empty for ``admin``."""

    @classmethod
    def parse(cls, text: str) -> Identity:
        """``admin``, ``job:<name>`` or ``agent:<host>``; raises ValueError otherwise."""
        if text == "admin":
            return ADMIN
        kind, separator, name = text.partition(":")
        if separator and kind == "job" and _JOB_NAME_PATTERN.fullmatch(name):
            return cls("job", name)
        if separator and kind == "agent" and is_host(name):
            return cls("agent", name)
        raise ValueError("identity must be 'admin', 'job:<job name>' or 'agent:<host>'")

    def __str__(self) -> str:
        return self.kind if self.kind == "admin" else f"{self.kind}:{self.name}"


ADMIN = Identity("admin")


def job_identity(name: str) -> Identity:
    return Identity.parse(f"job:{name}")


def agent_identity(host: str) -> Identity:
    return Identity.parse(f"agent:{host}")


def derive_key(master: bytes, identity: Identity) -> bytes:
    """The key ``identity`` proves itself with: the master token for admin, else an HMAC of
    it and the job's or the host's name (each job and each host's agent has its own)."""
    if identity.kind == "admin":
        return master
    if identity.kind == "job":
        return job_key(master, identity.name)
    return agent_key(master, identity.name)


def job_key(master: bytes, job: str) -> bytes:
    return bytes.fromhex(prove(master, "herd-job-key", job))


def agent_key(master: bytes, host: str) -> bytes:
    """The key of the agent of ``host``: it proves ``agent:<host>`` and nothing else."""
    return bytes.fromhex(prove(master, "herd-agent-key", agent_identity(host).name))


def parse_key(text: str, source: str) -> bytes:
    """A key given as hex text (a line on stdin); the error names ``source``, never the text."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise TokenFileError(
            f"{source}: expected a key of {_TOKEN_HEX_CHARS} hex characters"
        ) from None
    if len(key) != TOKEN_BYTES:
        raise TokenFileError(
            f"{source}: expected a key of {_TOKEN_HEX_CHARS} hex characters, got {2 * len(key)}"
        )
    return key


def write_token_file(path: Path, token: bytes) -> None:
    """Put ``token`` at ``path`` (mode 0600 from its creation), replacing what is there."""
    _make_private_dirs(path.parent)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            os.write(fd, (token.hex() + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def ensure_token_file(path: Path) -> bytes:
    """Return the token stored at ``path``, creating the file (mode 0600) if missing."""
    if not path.exists():
        _create_token_file(path)
    return read_token_file(path)


def read_token_file(path: Path) -> bytes:
    """Read and validate the token at ``path``; refuse files that others may access."""
    try:
        # Non-blocking: a FIFO put in the file's place must not hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise TokenFileError(f"cannot open token file {path}: {error.strerror}", "open") from error
    try:
        # fstat the opened file, not the path, so a swapped file cannot slip past the check.
        status = os.fstat(fd)
        _check_token_status(path, status)
        raw = os.read(fd, _MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse_token(path, raw)


def _check_token_status(path: Path, status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise TokenFileError(
            f"token file {path} is not a regular file ({_file_kind(status.st_mode)})", "kind"
        )
    if status.st_uid != os.geteuid():
        # Another user could have read it or written a token of their choosing (root reads
        # any file, so the mode alone does not say this).
        raise TokenFileError(
            f"token file {path} is owned by uid {status.st_uid}, not by this user"
            f" (uid {os.geteuid()})",
            "owner",
        )
    mode = stat.S_IMODE(status.st_mode)
    if mode & 0o077:
        raise TokenFileError(
            f"token file {path} has mode {mode:#o}; it must not be readable or writable "
            f"by group or others (run: chmod 600 {path})",
            "mode",
        )


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))
    return next((kind for test, kind in kinds if test(mode)), "device or other special file")


def prove(token: bytes, *parts: str) -> str:
    """HMAC-SHA256 (hex) of ``parts``, each length-prefixed so no two part lists collide."""
    message = bytearray()
    for part in parts:
        encoded = part.encode("utf-8")
        message += len(encoded).to_bytes(8, "big")
        message += encoded
    # hmac.digest: the one-shot C path (OpenSSL), a few times faster than an hmac object,
    # which counts in a burst of thousands of handshakes.
    return hmac.digest(token, bytes(message), "sha256").hex()


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
    """The token of a file that holds one line of 64 hex characters (surrounding blanks
    allowed). Stricter than ``bytes.fromhex``, which skips blanks and newlines inside: a
    token split over two lines, or two short ones, is a damaged file, not a token."""
    if len(raw) > _MAX_TOKEN_FILE_BYTES:
        raise TokenFileError(f"token file {path} is malformed: larger than a token")
    # The content is never quoted in messages: it may be a real token.
    text = raw.strip()
    if not text:
        raise TokenFileError(f"token file {path} is empty")
    lines = len(text.splitlines())
    if lines > 1:
        raise TokenFileError(
            f"token file {path} is malformed: it holds {lines} lines, a token is one line of"
            f" {_TOKEN_HEX_CHARS} hex characters"
        )
    if _HEX_TEXT.fullmatch(text) is None:
        raise TokenFileError(
            f"token file {path} is malformed: expected {_TOKEN_HEX_CHARS} hex characters"
        )
    token = bytes.fromhex(text.decode("ascii"))
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
