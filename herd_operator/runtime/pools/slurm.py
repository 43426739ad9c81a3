"""The pool of the Slurm allocation the operator runs in: its nodes and their GPUs.

Inside `salloc`/`sbatch`, Slurm names the allocation's nodes in `SLURM_JOB_NODELIST`
(its compressed host list, e.g. `nid[001234-001236,001240]`) and the GPUs in one of
several variables, depending on how they were asked for and where the shell runs:

- `SLURM_GPUS_PER_NODE`: `--gpus-per-node=4` or `=a100:4` (the same on every node);
- `SLURM_GPUS_ON_NODE`: the GPUs of the node this process runs on (batch script, steps);
- `SLURM_JOB_GPUS`: the indices of this node's GPUs, e.g. `0,1,2,3`.

Those variables are fixed when the job starts and say nothing of other nodes: `sbatch -N3
--gpus=4` gives nodes of 2, 1 and 1 GPUs while `SLURM_GPUS_ON_NODE` says 2, and a node
Slurm later takes out of the job (it stopped answering for `SlurmdTimeout`, under
`--no-kill`: "Removing failed node") is still in `SLURM_JOB_NODELIST`. So where Slurm's
client works, the pool is what `scontrol show job -d` says, each node with its own GPUs
(`parse_job_details`, a pure function tested on output of a real Slurm), asked again every
`SLURM_POLL_SECONDS` and whenever a lost node would come back (`SlurmPool.still_lists`):
Slurm's view of the allocation wins. Without the client the variables are used, with the
nodes taken to be alike, as `--gpus-per-node` has them (a `--gpus` total that does not
split evenly is refused). The host list is expanded here rather than by `scontrol show
hostnames`; the tests compare the two on many forms.
"""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from herd_operator.exporters.nvml import nvml_gpu_count
from herd_operator.runtime.pools.base import PoolListener, PoolOptions, StaticPool
from herd_operator.specs.values import Pool

log = logging.getLogger(__name__)

SLURM_POLL_SECONDS = 10.0
"""How often the allocation is asked of Slurm (one `scontrol` call: nothing for slurmctld)."""
SCONTROL_TIMEOUT_SECONDS = 10.0
REFRESH_AT_MOST_EVERY_SECONDS = 1.0
"""`still_lists` reuses an answer this recent, so a node that keeps calling from outside the
allocation does not make the operator call Slurm at each check."""

_RANGE = re.compile(r"^(?P<low>[0-9]+)(?:-(?P<high>[0-9]+))?$")
_GPU_COUNT = re.compile(r"^(?:(?P<type>[A-Za-z0-9_.-]+):)?(?P<count>[0-9]+)$")


class HostListError(ValueError):
    """A host list that is not in Slurm's syntax."""


def split_hostlist_entries(text: str) -> list[str]:
    """Split at the commas outside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    parts: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "[":
            if depth:
                raise HostListError(f"{text!r}: brackets cannot nest")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostListError(f"{text!r}: ']' without '['")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise HostListError(f"{text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_range(text: str, whole: str) -> list[str]:
    """`001-003` -> [`001`, `002`, `003`]: the width of the lower bound is kept."""
    match = _RANGE.match(text)
    if not match:
        raise HostListError(f"{whole!r}: {text!r} is not a number or a LOW-HIGH range")
    low_text, high_text = match["low"], match["high"] or match["low"]
    low, high = int(low_text), int(high_text)
    if high < low:
        raise HostListError(f"{whole!r}: the range {text!r} runs backwards")
    if high - low >= 1_000_000:
        raise HostListError(f"{whole!r}: the range {text!r} is too large")
    width = len(low_text)
    return [str(number).zfill(width) for number in range(low, high + 1)]


def _expand_host(pattern: str, whole: str) -> list[str]:
    """One host expression, possibly with several bracket groups: `r[1-2]n[01-02]`.

    In Slurm's order: the last group varies fastest, then the first, the second, and so on
    (`a[1-2]b[1-2]c[1-2]`: a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...).
    """
    texts: list[str] = []  # the text before each group, then after the last
    groups: list[list[str]] = []
    rest = pattern
    while "[" in rest:
        open_at = rest.index("[")
        close_at = rest.index("]", open_at)
        prefix, inside, rest = rest[:open_at], rest[open_at + 1 : close_at], rest[close_at + 1 :]
        if not inside:
            raise HostListError(f"{whole!r}: empty brackets")
        if rest and "[" not in rest:
            # As Slurm: text after the last group (`a[1-2]-ib`) is not a host list.
            raise HostListError(f"{whole!r}: {rest!r} after the last ']'")
        if rest[:1].isdigit():
            # Slurm rejects digits right after a bracket group (`a[1-2]0[1-2]`).
            raise HostListError(f"{whole!r}: a digit cannot follow ']'")
        texts.append(prefix)
        groups.append([n for part in inside.split(",") for n in _expand_range(part, whole)])
    if not groups:
        return [rest]
    *leading, last = groups
    names = []
    # product() varies its last argument fastest: pass the leading groups slowest-first.
    for numbers in itertools.product(*reversed(leading), last):
        ordered = [*reversed(numbers[:-1]), numbers[-1]]
        names.append("".join(text + number for text, number in zip(texts, ordered, strict=True)))
    return names


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as names, in Slurm's order, duplicates dropped
    (`scontrol show hostnames` keeps them; a pool has each node once).

    `nid[001234-001236,001240]` -> nid001234, nid001235, nid001236, nid001240.
    """
    text = text.strip()
    if not text:
        raise HostListError("the host list is empty")
    hosts: list[str] = []
    seen: set[str] = set()
    for part in split_hostlist_entries(text):
        part = part.strip()
        if not part:
            continue  # as Slurm: `a,,b` is a and b
        if not re.fullmatch(r"[A-Za-z0-9._\[\],-]+", part):
            raise HostListError(f"{text!r}: {part!r} holds a character no host name has")
        for host in _expand_host(part, text):
            if host not in seen:
                seen.add(host)
                hosts.append(host)
    if not hosts:
        raise HostListError(f"{text!r} names no host")
    return hosts


def parse_gpu_count(text: str, variable: str) -> int:
    """`4`, `a100:4` or several `type:count` entries (`a100:2,v100:2`) -> their sum."""
    total = 0
    for entry in text.split(","):
        match = _GPU_COUNT.match(entry.strip())
        if not match:
            raise ValueError(f"{variable}={text!r}: expected COUNT or TYPE:COUNT (e.g. a100:4)")
        total += int(match["count"])
    return total


def gpus_per_node(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """GPUs on each node of the allocation and the variable that said so; None without any."""
    for variable in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        value = environ.get(variable, "").strip()
        if value:
            return parse_gpu_count(value, variable), variable
    indices = environ.get("SLURM_JOB_GPUS", "").strip()
    if indices:
        return len([index for index in indices.split(",") if index.strip()]), "SLURM_JOB_GPUS"
    return None


def _nodelist(environ: Mapping[str, str]) -> str:
    return environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""


def slurm_pool(environ: Mapping[str, str], virtual: bool = False) -> StaticPool | None:
    """The allocation's pool, None outside a Slurm allocation.

    Raises ValueError inside one whose GPUs cannot be told (no GPU variable: `salloc`
    without `--gpus-per-node`) or whose variables do not parse.
    """
    nodelist = _nodelist(environ)
    if not nodelist:
        return None
    job = environ.get("SLURM_JOB_ID", "?")
    try:
        nodes = expand_hostlist(nodelist)
    except HostListError as err:
        raise ValueError(f"SLURM_JOB_NODELIST: {err}") from None
    found = gpus_per_node(environ)
    if found is None:
        raise ValueError(
            f"inside Slurm job {job} ({nodelist}) but no SLURM_GPUS_PER_NODE, "
            "SLURM_GPUS_ON_NODE or SLURM_JOB_GPUS says how many GPUs each node has: "
            "allocate with --gpus-per-node=N, or pass --hosts 'NODELIST:N'"
        )
    count, variable = found
    if count < 1:
        raise ValueError(f"{variable} gives {count} GPUs per node: no GPU to share")
    _check_gpus_split_evenly(environ, len(nodes), count)
    pool = Pool.from_counts(dict.fromkeys(nodes, count))
    kind = "virtual GPUs" if virtual else "GPUs"
    description = (
        f"Slurm job {job}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({nodelist}) "
        f"x {count} {kind} ({variable})"
    )
    return StaticPool(pool, virtual, description)


def _check_gpus_split_evenly(environ: Mapping[str, str], nodes: int, count: int) -> None:
    """`--gpus=N` (a total) over nodes that do not all get N/nodes: the variables cannot say
    which node has how many, and taking the batch node's count for all would be wrong."""
    total = environ.get("SLURM_GPUS", "").strip()
    if not total or environ.get("SLURM_GPUS_PER_NODE", "").strip():
        return
    asked = parse_gpu_count(total, "SLURM_GPUS")
    if asked != nodes * count:
        job = environ.get("SLURM_JOB_ID", "?")
        raise ValueError(
            f"Slurm job {job} has {asked} GPUs (SLURM_GPUS) over {nodes} nodes, not {count} on"
            " each: which node has how many is known only to Slurm, and its client"
            " (scontrol) could not be asked here; allocate with --gpus-per-node, or pass"
            " --hosts 'node1:N,node2:M'"
        )


# ---- `scontrol show job -d` ----

_GRES_INDEX = re.compile(r"IDX:(?P<indices>[^)]*)")
_GRES_COUNT = re.compile(r"^gpu(?::[A-Za-z0-9_.-]+)?:(?P<count>[0-9]+)")


@dataclass(frozen=True)
class SlurmAllocation:
    """A job's allocation as `scontrol show job -d` gives it."""

    job_id: str
    state: str
    nodes: tuple[str, ...]
    """The nodes the job holds now (its `NodeList`), in Slurm's order."""
    gpus: Mapping[str, tuple[int, ...]]
    """Each node's GPU indices, from its `Nodes=... GRES=gpu:N(IDX:...)` line."""

    def pool(self) -> Pool:
        """The nodes the job holds that have GPUs, each with its own."""
        return Pool(tuple((node, self.gpus[node]) for node in self.nodes if self.gpus.get(node)))


def _split_outside_parentheses(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif char == "," and not depth:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def parse_gres_gpus(text: str) -> tuple[int, ...]:
    """A node's GPU indices from its GRES field: `gpu:2(IDX:0-1)`, `gpu:a100:4(IDX:0-3)`,
    `gpu(IDX:0,2)` (Slurm 18's `GRES_IDX`), several types, other GRES beside (`nic:1`).
    Without `IDX` the GPUs are numbered from 0. Raises ValueError for a field it cannot read."""
    indices: list[int] = []
    for entry in _split_outside_parentheses(text.strip()):
        if not (entry == "gpu" or entry.startswith(("gpu:", "gpu("))):
            continue
        found = _GRES_INDEX.search(entry)
        if found is not None:
            for part in found["indices"].split(","):
                if not part:
                    continue
                low, _, high = part.partition("-")
                if not low.isdigit() or (high and not high.isdigit()):
                    raise ValueError(f"GRES {text!r}: {part!r} is not an index or a range")
                indices.extend(range(int(low), int(high or low) + 1))
            continue
        counted = _GRES_COUNT.match(entry)
        if counted is None:
            raise ValueError(f"GRES {text!r}: {entry!r} has neither IDX nor a count")
        indices.extend(range(int(counted["count"])))
    return tuple(sorted(set(indices)))


def parse_job_details(text: str) -> SlurmAllocation:
    """`scontrol show job -d <id>`'s output as an allocation. Raises ValueError, naming
    the field, for output it cannot read."""
    fields = dict(re.findall(r"(?:^|\s)(JobId|JobState|NodeList)=(\S+)", text))
    if "JobId" not in fields:
        raise ValueError("scontrol show job: no JobId= in the output")
    nodelist = fields.get("NodeList", "(null)")
    try:
        nodes = tuple(expand_hostlist(nodelist)) if nodelist != "(null)" else ()
    except HostListError as err:
        raise ValueError(f"scontrol show job: NodeList: {err}") from None
    gpus: dict[str, tuple[int, ...]] = {}
    for line in text.splitlines():
        found = re.match(r"\s*Nodes=(\S+)\s.*?\bGRES(?:_IDX)?=(\S*)", line)
        if found is None:
            continue
        try:
            hosts = expand_hostlist(found[1])
        except HostListError as err:
            raise ValueError(f"scontrol show job: Nodes: {err}") from None
        indices = parse_gres_gpus(found[2])
        for host in hosts:
            gpus[host] = indices
    return SlurmAllocation(fields["JobId"], fields.get("JobState", ""), nodes, gpus)


def read_job_details(job_id: str) -> str | None:
    """`scontrol show job -d <job_id>`'s output; None when Slurm's client is missing or
    fails (said in the log)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run(
            [scontrol, "show", "job", "-d", job_id],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("scontrol show job -d %s: %s", job_id, err)
        return None
    if done.returncode:
        log.warning("scontrol show job -d %s: %s", job_id, done.stderr.strip() or done.returncode)
        return None
    return done.stdout


def _describe(job_id: str, nodelist: str, pool: Pool, kind: str) -> str:
    counts = {len(gpus) for _, gpus in pool.hosts}
    nodes = len(pool.hosts)
    plural = "s" if nodes != 1 else ""
    if len(counts) == 1:
        return f"Slurm job {job_id}: {nodes} node{plural} ({nodelist}) x {counts.pop()} {kind}"
    each = ", ".join(f"{host} x {len(gpus)}" for host, gpus in pool.hosts)
    return f"Slurm job {job_id}: {nodes} node{plural} ({nodelist}), {pool.size} {kind}: {each}"


class SlurmPool:
    """The allocation's pool as Slurm says it now (see the module's docstring)."""

    def __init__(
        self,
        job_id: str,
        allocation: SlurmAllocation,
        virtual: bool,
        nodelist: str = "",
        read: Callable[[str], str | None] = read_job_details,
        poll_seconds: float = SLURM_POLL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self.virtual = virtual
        self._kind = "virtual GPUs" if virtual else "GPUs"
        self._read = read
        self._poll_seconds = poll_seconds
        self._clock = clock
        self._pool = allocation.pool()
        self._asked = clock()
        self._listener: PoolListener | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.description = (
            _describe(job_id, nodelist or ",".join(allocation.nodes), self._pool, self._kind)
            + " (scontrol show job -d)"
        )

    @property
    def pool(self) -> Pool:
        with self._lock:
            return self._pool

    def start(self, on_change: PoolListener) -> None:
        self._listener = on_change
        self._thread = threading.Thread(target=self._poll, name="slurm-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(SCONTROL_TIMEOUT_SECONDS + 1)

    def still_lists(self, host: str) -> bool:
        """Whether Slurm still gives the job `host`, asked now (or within the last second)."""
        self.refresh(max_age=REFRESH_AT_MOST_EVERY_SECONDS)
        return host in dict(self.pool.hosts)

    def refresh(self, max_age: float = 0.0) -> Pool:
        """Ask Slurm for the allocation; a changed pool goes to the listener. An answer that
        cannot be used (Slurm unreachable, the job ending, output not understood) keeps the
        pool as it is."""
        with self._lock:
            if self._clock() - self._asked < max_age:
                return self._pool
            self._asked = self._clock()
            text = self._read(self.job_id)
            if text is None:
                return self._pool
            try:
                allocation = parse_job_details(text)
            except ValueError as err:
                log.warning("Slurm job %s: %s; the pool stays as it is", self.job_id, err)
                return self._pool
            pool = allocation.pool()
            if allocation.state not in ("RUNNING", "") or not pool.size:
                log.warning(
                    "Slurm job %s is %s with %d GPU(s): the pool stays as it is",
                    self.job_id, allocation.state or "in no state", pool.size,
                )  # fmt: skip
                return self._pool
            if pool == self._pool:
                return pool
            left = sorted(set(dict(self._pool.hosts)) - set(dict(pool.hosts)))
            log.warning(
                "Slurm job %s now holds %s%s", self.job_id,
                ", ".join(f"{host}:{len(gpus)}" for host, gpus in pool.hosts),
                f" ({', '.join(left)} taken out of the allocation)" if left else "",
            )  # fmt: skip
            self._pool = pool
            if self._listener is not None:
                # Under the lock: two refreshes tell their pools in the order they read them.
                self._listener(pool)
            return pool

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_seconds):
            try:
                self.refresh()
            except Exception:  # the poll must outlive a failing listener
                log.exception("asking Slurm for the allocation")


def detect_slurm(options: PoolOptions) -> SlurmPool | StaticPool | None:
    """The pool source for POOL_SOURCES: the allocation this operator runs in.

    Its GPUs are real when NVML sees GPUs on this node, else virtual: CPU workers stand in
    for Slurm's GRES GPUs (tests, CPU nodes). Asked of `scontrol show job -d` where Slurm's
    client answers (and followed while the operator runs), else read from the variables.
    """
    if not _nodelist(options.environ):
        return None  # not in an allocation: NVML is not asked
    virtual = nvml_gpu_count() == 0
    job_id = options.environ.get("SLURM_JOB_ID", "").strip()
    text = read_job_details(job_id) if job_id else None
    if text is not None:
        try:
            allocation = parse_job_details(text)
        except ValueError as err:
            log.warning("Slurm job %s: %s; reading its variables instead", job_id, err)
        else:
            if allocation.pool().size:
                return SlurmPool(job_id, allocation, virtual, _nodelist(options.environ))
            log.warning("Slurm job %s: scontrol shows no GPU; reading its variables", job_id)
    return slurm_pool(options.environ, virtual=virtual)
