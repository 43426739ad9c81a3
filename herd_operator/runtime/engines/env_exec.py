"""Starts a worker on another host with its environment from stdin, not its command line.

    ssh HOST 'exec PYTHON -I .../env_exec.py -- COMMAND [ARG...]'   (stdin: one JSON object)

Horovod starts a worker on another host as `ssh HOST 'cd DIR; env K=V ... COMMAND'`: every
value (the rank's variables, the rendezvous, and the whole exportable environment of the
driver, the operator's own included) is on the command line of the ssh client on this node
and of the shell on the other, where `ps` shows it to every user of either node. The job's
driver (`hvd_driver`) runs this instead, and writes `{"cwd": DIR, "env": {K: V, ...}}` to
ssh's stdin, which ssh carries over its encrypted channel. This reads that object (at most
`MAX_PAYLOAD_BYTES`), checks it, changes to DIR, and execs COMMAND with the variables added
to the login environment sshd gave it, as `env K=V COMMAND` adds them.

Standard library only, and run by its path with `-I` (isolated mode): it must start on a
node where only the shared file system and the interpreter can be counted on (the
operator's package may be on a PYTHONPATH the login environment lacks), and nothing of
that environment (PYTHONPATH, PYTHONSTARTUP, a user site) may run before it.
"""

from __future__ import annotations

import json
import os
import sys

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
"""Bound on what is read from stdin: an environment of a few hundred variables is tens of
kilobytes, and Linux (with the usual 8 MiB stack limit) takes at most 2 MiB of arguments
and environment together for an exec anyway."""

FAILED = 2
"""Exit status when the payload is refused (nothing was started)."""
CANNOT_RUN = 127
"""Exit status when COMMAND cannot be executed, as a shell gives it."""

_FIELDS = ("cwd", "env")


class PayloadError(ValueError):
    """The object on stdin is not what the driver writes; the message says what is wrong."""


def encode_payload(env: dict[str, str], cwd: str) -> bytes:
    """What the driver writes to ssh's stdin for one worker."""
    return json.dumps({"cwd": cwd, "env": env}, separators=(",", ":")).encode()


def parse_payload(raw: bytes) -> tuple[dict[str, str], str | None]:
    """(the variables, the directory) from the bytes read on stdin; PayloadError if they
    are not one JSON object of the driver's form, with the field named."""
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise PayloadError(f"the environment on stdin is over {MAX_PAYLOAD_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise PayloadError(f"stdin is not a JSON object: {err}") from None
    if not isinstance(data, dict):
        raise PayloadError(f"stdin is not a JSON object: a {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PayloadError(f"unknown field {unknown[0]!r} on stdin (allowed: cwd, env)")
    cwd = data.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd or "\0" in cwd):
        raise PayloadError("'cwd' must be a non-empty string without NUL")
    env = data.get("env")
    if not isinstance(env, dict):
        raise PayloadError("'env' is missing or not an object of name: value strings")
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise PayloadError(f"env: {name!r} is not a variable name (non-empty, no '=' or NUL)")
        if not isinstance(value, str) or "\0" in value:
            raise PayloadError(f"env: the value of {name} must be a string without NUL")
    return env, cwd


def _read_bounded(fd: int) -> bytes:
    chunks, size = [], 0
    while size <= MAX_PAYLOAD_BYTES:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--":
        print("usage: python -I env_exec.py -- COMMAND [ARG...]  (environment on stdin)")
        return FAILED
    command = argv[1:]
    try:
        env, cwd = parse_payload(_read_bounded(sys.stdin.fileno()))
    except (OSError, PayloadError) as err:
        print(f"herd env-exec: {err}", file=sys.stderr, flush=True)
        return FAILED
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError as err:  # as Horovod's `cd DIR > /dev/null 2>&1 ;`: run on, but say it
            print(f"herd env-exec: staying in {os.getcwd()}: {err}", file=sys.stderr, flush=True)
    # The worker's stdin is /dev/null, as a local worker's is: not the spent channel.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        os.execvpe(command[0], command, {**os.environ, **env})
    except OSError as err:
        print(f"herd env-exec: cannot run {command[0]!r}: {err}", file=sys.stderr, flush=True)
    return CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
