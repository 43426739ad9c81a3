"""The CPU of every process a command started, by what the process was: a measure for the
test suite's heaviest files (docs/benchmarks.md, the CI section).

A cgroup (tests/cpu_by_file.py) says what a test file cost in all; this says which of its
processes cost it. Linux's process accounting (`acct(2)`) writes a record for each process
as it exits (pid, parent, start, user and system CPU in 10 ms ticks, command name), whoever
its parent and however short it lived; this command turns it on, runs COMMAND as a child
subreaper (so that what is orphaned under it, daemons and what they fork, stays in its
tree), samples /proc's command lines to name the Python processes (every `python` looks the
same in a record), and prints the CPU by kind of process, heaviest first:

    python -m devtools.process_cpu [--json FILE] -- COMMAND...

Needs root (`acct` is system-wide: it records every process on the machine while on; only
COMMAND's tree is counted). Not for CI: a measurement tool.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

RECORD = struct.Struct("<ccHIIIIIIf8H16s")
"""`struct acct_v3` of <linux/acct.h>: 64 bytes."""
TICK = 0.01
"""acct's comp_t times are in AHZ (100 a second) ticks."""
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Exited:
    pid: int
    ppid: int
    start: float
    elapsed: float
    user: float
    system: float
    comm: str

    @property
    def end(self) -> float:
        return self.start + self.elapsed


def decode_comp(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def read_records(data: bytes) -> list[Exited]:
    """acct v3 records, in the order the processes exited."""
    if len(data) % RECORD.size:
        raise ValueError(f"accounting file of {len(data)} bytes: not whole v3 records")
    records = []
    for offset in range(0, len(data), RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1] != b"\x03":
            raise ValueError(f"accounting record at {offset}: version {fields[1]!r}, not 3")
        pid, ppid, btime, etime = fields[6], fields[7], fields[8], fields[9]
        times = fields[10:18]
        records.append(
            Exited(
                pid=pid,
                ppid=ppid,
                start=float(btime),
                elapsed=float(etime) * TICK,
                user=decode_comp(times[0]) * TICK,
                system=decode_comp(times[1]) * TICK,
                comm=fields[18].rstrip(b"\0").decode(errors="replace"),
            )
        )
    return records


def descendants(records: Sequence[Exited], root: int, root_start: float) -> list[Exited]:
    """The records of `root`'s tree. A record's parent is the process of its ppid that was
    alive when it exited (pids are reused); one whose parent did not exit before the end is
    `root` itself when ppid is root's pid and root lived then, else no one of ours."""
    by_pid: dict[int, list[Exited]] = {}
    for record in records:
        by_pid.setdefault(record.pid, []).append(record)
    ours: dict[Exited, bool] = {}

    def parent_of(record: Exited) -> Exited | None:
        # btime is whole seconds: 1 s of slack either way.
        for candidate in by_pid.get(record.ppid, []):
            if candidate.start - 1 <= record.end <= candidate.end + 1 and candidate != record:
                return candidate
        return None

    def belongs(record: Exited, depth: int = 0) -> bool:
        if record in ours:
            return ours[record]
        if record.ppid == root and record.start >= root_start - 1:
            result = True
        elif depth > 200:
            result = False
        else:
            parent = parent_of(record)
            result = parent is not None and belongs(parent, depth + 1)
        ours[record] = result
        return result

    return [record for record in records if belongs(record)]


def boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime")


class CommandLines(threading.Thread):
    """(pid, start second) -> command line of every process seen in /proc while it runs."""

    def __init__(self, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.seen: dict[tuple[int, int], list[str]] = {}
        self.stop = threading.Event()
        self._boot = boot_time()
        self._hz = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                starts = int(stat.rsplit(")", 1)[1].split()[19])
                key = (pid, int(self._boot + starts / self._hz))
                # Read again each time: a process may exec another command (the last wins).
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                if raw:
                    self.seen[key] = [part.decode(errors="replace") for part in raw.split(b"\0")]
            except (OSError, IndexError, ValueError):
                continue

    def of(self, record: Exited) -> list[str] | None:
        for second in (int(record.start), int(record.start) + 1, int(record.start) - 1):
            argv = self.seen.get((record.pid, second))
            if argv and argv != [""]:
                return argv
        return None


def kind(comm: str, argv: Sequence[str] | None) -> str:
    """What a process was: its command name, and for Python what it ran."""
    if not argv or not (comm.startswith("python") or comm in ("herd-operator", "pytest")):
        return comm
    words = [word for word in argv if word]
    if "-m" in words[:-1]:
        module = words[words.index("-m") + 1]
        return f"python -m {module}"
    if "-c" in words:
        return "python -c"
    for index, word in enumerate(words[1:], start=1):
        if word.endswith(".py") or word.endswith("herd-operator") or word.endswith("pytest"):
            name = Path(word).name
            if name == "herd-operator" and index + 1 < len(words):
                return f"herd-operator {words[index + 1]}"
            return name
    name = Path(words[0]).name
    if name == "herd-operator" and len(words) > 1:
        return f"herd-operator {words[1]}"
    return name


@dataclass
class Kind:
    """The processes of one kind: how many, and their CPU-s."""

    name: str
    processes: int = 0
    user: float = 0.0
    system: float = 0.0


def still_running(root: int) -> Kind:
    """CPU so far of the processes of `root`'s tree that are still alive."""
    parents: dict[int, int] = {}
    times: dict[int, tuple[float, float]] = {}
    hz = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = (int(fields[11]) / hz, int(fields[12]) / hz)

    def under(pid: int) -> bool:
        for _ in range(100):
            pid = parents.get(pid, 0)
            if pid == root:
                return True
            if pid <= 1:
                return False
        return False

    mine = [pid for pid in parents if under(pid)]
    return Kind(
        "(still running at the end)",
        len(mine),
        sum(times[pid][0] for pid in mine),
        sum(times[pid][1] for pid in mine),
    )


def table(records: Iterable[Exited], names: CommandLines) -> list[Kind]:
    """The records summed by kind of process, heaviest first."""
    kinds: dict[str, Kind] = {}
    for record in records:
        name = kind(record.comm, names.of(record))
        row = kinds.setdefault(name, Kind(name))
        row.processes += 1
        row.user += record.user
        row.system += record.system
    return sorted(kinds.values(), key=lambda row: -(row.user + row.system))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.process_cpu")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument(
        "--linger", type=float, default=20.0, help="seconds to wait for orphans to end"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given (after --)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    with tempfile.NamedTemporaryFile(prefix="acct-", delete=False) as handle:
        accounting = Path(handle.name)
    if libc.acct(str(accounting).encode()):
        raise OSError(ctypes.get_errno(), f"acct({accounting}): needs root")
    names = CommandLines()
    names.start()
    started = time.time()
    try:
        child = subprocess.Popen(command)
        status = None
        while status is None:
            # Reap what is orphaned into this subreaper; the command's own exit ends the run.
            try:
                pid, code = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child.pid:
                status = os.waitstatus_to_exitcode(code)
        child.returncode = status
        linger_until = time.monotonic() + args.linger
        while time.monotonic() < linger_until:  # orphans still ending (a daemon's stop)
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.1)
            except ChildProcessError:
                break
    finally:
        names.stop.set()
        names.join()
        libc.acct(None)
    ended = time.time()
    records = descendants(read_records(accounting.read_bytes()), os.getpid(), started)
    accounting.unlink()
    rows = table(records, names)
    left = still_running(os.getpid())
    if left.processes:
        rows.append(left)
    user = sum(row.user for row in rows)
    system = sum(row.system for row in rows)
    print(f"{len(records)} processes, {user + system:.1f} CPU-s ({user:.1f} user, "
          f"{system:.1f} system) in {ended - started:.0f} s", file=sys.stderr)  # fmt: skip
    print("| Process | n | CPU-s | user | system |\n|---|---:|---:|---:|---:|", file=sys.stderr)
    for row in rows:
        print(f"| {row.name} | {row.processes} | {row.user + row.system:.1f} | {row.user:.1f} "
              f"| {row.system:.1f} |", file=sys.stderr)  # fmt: skip
    if args.json:
        each = [
            {
                "pid": record.pid,
                "ppid": record.ppid,
                "start": record.start,
                "elapsed": round(record.elapsed, 2),
                "user": round(record.user, 2),
                "system": round(record.system, 2),
                "comm": record.comm,
                "argv": names.of(record),
            }
            for record in records
        ]
        kinds = [dataclasses.asdict(row) for row in rows]
        args.json.write_text(json.dumps({"kinds": kinds, "processes": each}, indent=1) + "\n")
    return status if status is not None else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command gets it and ends
    sys.exit(main())
