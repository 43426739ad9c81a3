"""NVIDIA's dcgm-exporter, both ways: its metrics as the memory signal, herd's jobs as its labels.

Reading. Sites that run dcgm-exporter already have every GPU's framebuffer memory in
Prometheus. `DcgmScrapeGpuSource` (the exporters' `/metrics` pages) and
`DcgmPrometheusGpuSource` (PromQL) turn its series into the `GpuReading`s the observer
samples, so the memory policy needs no herd exporter on the nodes. The series used:

    DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE   framebuffer memory used / free, in MiB
    DCGM_FI_DEV_FB_RESERVED, DCGM_FI_DEV_FB_TOTAL   where the site's counters list them
    DCGM_FI_DEV_GPU_UTIL (%), DCGM_FI_DEV_POWER_USAGE (W)   when present

with the labels dcgm-exporter writes on GPU series (its GPU template,
internal/pkg/rendermetrics/render_metrics.go in NVIDIA/dcgm-exporter): `gpu` (the GPU's
index), `UUID`, `pci_bus_id`, `device`, `modelName`, MIG instances with
`GPU_I_PROFILE`/`GPU_I_ID`, `hostname` (`Hostname` up to release 4.5.3-4.8.2; both are
read) when it knows the node's name, then extra labels such as `hpc_job`. The host of a
GPU is that label, else the host of the page or of Prometheus' `instance`. MIG instances
are skipped: the pool hands out whole GPUs. Total memory is FB_TOTAL where exported, else
used + free (+ reserved).

Writing. dcgm-exporter's `--hpc-job-mapping-dir DIR` labels each GPU's series with
`hpc_job="<job>"` read from files in DIR, as its HPC mapper reads them at every scrape
(internal/pkg/transformation/hpc.go: `getGPUFiles`, `readFile`, `Process`). Every entry of
DIR that is not a directory and whose name is a GPU id (ASCII digits, or
`<gpu>.<instance>` for a MIG instance since release 4.5.3-4.8.2; `strconv.Atoi` before)
is read; each of its lines is a job (bufio.Scanner: a blank line is a job named ""), and
a GPU with several lines gets one copy of each series per line; a GPU without a file, or
with an empty one, keeps its series unlabelled. A file that is listed and then cannot be
opened fails the whole scrape (HTTP 500). Sites fill DIR from their Slurm prolog and
epilog, one line per Slurm job on each of its GPUs, so herd shares the files:
`JobMappingWriter` adds a line with the herd job's name to the file of each GPU a herd
job holds and takes out only its own lines, never deletes a file, and replaces each
whole. The files are named by the GPU's id on the node, not its slot in herd's pool
(`physical_gpu_ids`, `slot_gpu_ids`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from herd_operator.exporters.gpu import GpuReading
from herd_operator.exporters.sources import MetricSample, PrometheusGpuSource, ScrapeGpuSource
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic

log = logging.getLogger(__name__)

MIB = 1 << 20
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
DCGM_FAMILIES = (FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL, GPU_UTIL, POWER_USAGE)
HPC_JOB_LABEL = "hpc_job"
"""The label dcgm-exporter gives the job names it reads from the mapping files."""
HOSTNAME_LABELS = ("hostname", "Hostname")
"""dcgm-exporter's label for the node's name on GPU series: `hostname` since its commit
"Rename Hostname label to hostname" (d5e5f51, after release 4.5.3-4.8.2), `Hostname` in
every release before; a site runs either, so both are read."""
DEFAULT_PORT = 9400
"""dcgm-exporter's default listening port (`--address :9400`)."""
LEDGER_PREFIX = ".herd-lines."
"""`.herd-lines.<gpu>` in the mapping directory: the lines herd put in that GPU's file."""
MAX_MAPPING_FILE_BYTES = 64 * 1024
"""The largest mapping file herd reads to keep others' lines (a line longer than 64 KiB is
already more than dcgm-exporter's line scanner takes, and it fails the scrape)."""
GPU_ID_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


@dataclass
class _DcgmGpu:
    uuid: str
    # family -> (time, value); the newest wins (a GPU mapped to two jobs is listed twice).
    values: dict[str, tuple[float, float]] = field(default_factory=dict)

    def reading(self, host: str, index: int) -> GpuReading:
        def value(name: str) -> float | None:
            return self.values[name][1] if name in self.values else None

        used, free = value(FB_USED), value(FB_FREE)
        total = value(FB_TOTAL)
        if total is None and used is not None and free is not None:
            total = used + free + (value(FB_RESERVED) or 0.0)
        util, power = value(GPU_UTIL), value(POWER_USAGE)
        return GpuReading(
            host=host,
            index=index,
            uuid=self.uuid,
            kind="dcgm",
            memory_used_bytes=None if used is None else round(used * MIB),
            memory_total_bytes=None if total is None else round(total * MIB),
            utilization_ratio=None if util is None else util / 100,
            power_watts=power,
        )


def dcgm_readings(
    samples: Iterable[MetricSample],
    now: float,
    max_age: float,
    host_of: Callable[[Mapping[str, str]], str | None],
) -> list[GpuReading]:
    """One reading per (host, gpu) from dcgm-exporter's series, fresh samples only.

    `host_of` names the host of a series that has no `hostname` (or older `Hostname`)
    label (None: skipped).
    """
    gpus: dict[tuple[str, int], _DcgmGpu] = {}
    for sample in samples:
        if sample.name not in DCGM_FAMILIES or "GPU_I_ID" in sample.labels:
            continue
        when = now if sample.timestamp is None else sample.timestamp
        if now - when > max_age or not math.isfinite(sample.value):
            continue
        host = _hostname(sample.labels) or host_of(sample.labels)
        try:
            index = int(sample.labels["gpu"])
        except (KeyError, ValueError):
            continue  # not a GPU series (an NVSwitch, a CPU): nothing of the pool
        if not host:
            continue
        uuid = sample.labels.get("UUID") or sample.labels.get("uuid") or ""
        gpu = gpus.setdefault((host, index), _DcgmGpu(uuid))
        previous = gpu.values.get(sample.name)
        if previous is None or when > previous[0]:
            gpu.values[sample.name] = (when, sample.value)
    return [gpu.reading(host, index) for (host, index), gpu in gpus.items()]


def _hostname(labels: Mapping[str, str]) -> str | None:
    for label in HOSTNAME_LABELS:
        if labels.get(label):
            return labels[label]
    return None


def _url_host(url: str) -> str | None:
    return urllib.parse.urlsplit(url).hostname


def _instance_host(labels: Mapping[str, str]) -> str | None:
    instance = labels.get("instance", "")
    if not instance:
        return None
    return urllib.parse.urlsplit(f"//{instance}").hostname


class DcgmScrapeGpuSource(ScrapeGpuSource):
    """GPU readings scraped from dcgm-exporter's `/metrics` pages (one per node)."""

    def page_readings(self, samples: list[MetricSample], url: str) -> list[GpuReading]:
        return dcgm_readings(samples, time.time(), self.max_age, lambda _: _url_host(url))


class DcgmPrometheusGpuSource(PrometheusGpuSource):
    """GPU readings from dcgm-exporter's series in a Prometheus server that scrapes it."""

    families = DCGM_FAMILIES

    def series_readings(self, samples: list[MetricSample]) -> list[GpuReading]:
        return dcgm_readings(samples, time.time(), self.max_age_seconds, _instance_host)


def dcgm_exporter_urls(hosts: Iterable[str], port: int = DEFAULT_PORT) -> list[str]:
    """The `/metrics` URL of a dcgm-exporter on each host, at its default port."""
    return [
        f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
        for host in hosts
    ]


def physical_gpu_ids(environ: Mapping[str, str]) -> tuple[tuple[int, ...] | None, str]:
    """The physical id of each of this node's GPU slots, in slot order, and what said so
    (for the log); None: slot i is GPU i.

    dcgm-exporter runs on the node, outside every job, and keys a GPU's file on the GPU's
    id on the node (DCGM's, NVML's index there); the pool numbers the GPUs it was given 0,
    1, ... On a node shared with other jobs (`SLURM_JOB_GPUS=2,3`), slot 0 is GPU 2 and
    GPUs 0 and 1 are another user's. Slurm gives the node's own ids whatever the job's
    device cgroup (inside which CUDA_VISIBLE_DEVICES counts from 0 again):

    - `SLURM_STEP_GPUS`: the GPUs of an `srun` step on its own node;
    - `SLURM_JOB_GPUS`: the batch script's (or `salloc` shell's) node, so only outside a
      step (no `SLURM_STEP_ID`): a step started without GPUs keeps the batch node's value,
      which names another node's GPUs;
    - `CUDA_VISIBLE_DEVICES` when it lists ids (not UUIDs), outside Slurm only: the GPUs
      this process was given. Inside a Slurm job it counts from 0 in a device cgroup, and
      a step may have inherited the batch node's.

    ValueError, naming the variable, for a Slurm variable that is not a list of ids.
    """
    in_slurm = bool(environ.get("SLURM_JOB_ID", "").strip())
    in_step = bool(environ.get("SLURM_STEP_ID", "").strip())
    for variable in GPU_ID_VARIABLES:
        text = environ.get(variable, "").strip()
        if (
            not text
            or (variable == "SLURM_JOB_GPUS" and in_step)
            or (variable == "CUDA_VISIBLE_DEVICES" and in_slurm)
        ):
            continue
        entries = [entry.strip() for entry in text.split(",")]
        if all(entry.isascii() and entry.isdigit() for entry in entries):
            return tuple(int(entry) for entry in entries), f"{variable}={text}"
        if variable.startswith("SLURM_"):
            raise ValueError(f"{variable}={text!r}: expected GPU ids separated by commas")
    return None, "no GPU ids from Slurm, nor a numeric CUDA_VISIBLE_DEVICES: slot i is GPU i"


def slot_gpu_ids(slots: Iterable[int], gpu_ids: Sequence[int]) -> dict[int, int]:
    """Each pool slot of this host -> its physical GPU id.

    The pool numbers a host's GPUs by Slurm's own ids where it asked Slurm (`scontrol show
    job -d`: `IDX:2-3`), and 0, 1, ... where it counted them (`SLURM_GPUS_PER_NODE`,
    `--hosts node:2`). Slots that are the ids already stay as they are; otherwise the k-th
    slot, in order, is the k-th id. A slot beyond the ids has none (left out).
    """
    ordered = sorted(slots)
    if set(ordered) == set(gpu_ids):
        return {slot: slot for slot in ordered}
    return dict(zip(ordered, gpu_ids, strict=False))


class _NotAFileOfLines(OSError):
    """A GPU's entry in the mapping directory is not a regular file herd can read and keep
    (a link, a FIFO, a directory, or over `MAX_MAPPING_FILE_BYTES`)."""


class JobMappingWriter:
    """Keeps herd's lines in dcgm-exporter's HPC job mapping files in `directory`.

    `owners()` says which job holds each GPU of this host by its pool slot, or None when
    that is not known now (the operator cannot be reached: the files are left as they are,
    rather than unlabel GPUs that jobs still hold). `gpu_ids`: the physical ids (the names
    dcgm-exporter keys GPUs' files on) of this host's GPUs, in the order of the pool's
    slots here, which `slots()` gives (None while not known: the files are left as they
    are; without `slots`, the slots are 0, 1, ...); see `slot_gpu_ids`. Without `gpu_ids`
    each slot is the GPU of that id (`physical_gpu_ids` says which applies).

    Each call to `write()` brings the files in line, sharing them with whoever else writes
    there (a site's Slurm prolog writes its job ids into the same files, and dcgm-exporter
    takes every line of a file as a job): a held GPU's file holds the site's lines and
    then the job's name, a free GPU's file the site's lines only, which may leave it empty.
    A file is never deleted (a scrape that listed it and then fails to open it answers
    500) and always replaced whole (a temporary name that is not an integer, then a
    rename: a reader opens the old file or the new one). The lines herd put in a GPU's
    file are kept in `.herd-lines.<gpu>` beside it (not an integer: dcgm-exporter skips
    it), so that a writer started again (the agent restarted, the operator taken over)
    takes out the lines of jobs that ended meanwhile and no other line. A line of
    another writer that is the same text as herd's line counts once as herd's.
    """

    def __init__(
        self,
        directory: Path,
        owners: Callable[[], Mapping[int, str] | None],
        gpu_ids: Sequence[int] | None = None,
        slots: Callable[[], Sequence[int] | None] | None = None,
    ) -> None:
        self.directory = directory
        self.owners = owners
        self.gpu_ids = None if gpu_ids is None else tuple(gpu_ids)
        self.slots = slots
        # GPU id -> the lines herd may have in its file (from the ledgers, then as written).
        self._ours: dict[int, list[bytes]] | None = None
        self._lock = threading.Lock()
        self._failing = False
        self._unmapped_slots: set[int] = set()

    def write(self) -> None:
        """Bring the files in line with `owners()`; an error is logged when it starts."""
        with self._lock:
            try:
                owners = self.owners()
                by_id = None if owners is None else self._by_gpu_id(owners)
                if by_id is None:
                    return
                self._write(by_id)
            except OSError as err:
                if not self._failing:
                    log.warning(
                        "cannot write DCGM job mapping files in %s: %s", self.directory, err
                    )
                self._failing = True
                self._ours = None  # unknown now: read the ledgers again next time
                return
            if self._failing:
                log.info("DCGM job mapping files in %s written again", self.directory)
            self._failing = False

    def _by_gpu_id(self, owners: Mapping[int, str]) -> dict[int, str] | None:
        """`owners` by physical GPU id; None while the pool's slots here are not known."""
        if self.gpu_ids is None:
            return dict(owners)
        slots = range(len(self.gpu_ids)) if self.slots is None else self.slots()
        if slots is None:
            return None
        ids = slot_gpu_ids(slots, self.gpu_ids)
        by_id: dict[int, str] = {}
        for slot, job in owners.items():
            if slot in ids:
                by_id[ids[slot]] = job
            elif slot not in self._unmapped_slots:
                self._unmapped_slots.add(slot)
                log.warning(
                    "GPU slot %d of this host has no physical GPU id (%d known: %s); its "
                    "job is left out of the DCGM job mapping",
                    slot, len(self.gpu_ids), ",".join(map(str, self.gpu_ids)),
                )  # fmt: skip
        return by_id

    def _write(self, wanted: Mapping[int, str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._ours is None:
            self._ours = self._read_ledgers()
        first_error: OSError | None = None
        for gpu in sorted(set(wanted) | set(self._ours)):
            try:
                self._write_gpu(gpu, wanted.get(gpu))
            except OSError as err:  # the other GPUs' files are still brought in line
                first_error = first_error or err
        if first_error is not None:
            raise first_error

    def _write_gpu(self, gpu: int, job: str | None) -> None:
        assert self._ours is not None
        ours = self._ours.get(gpu, [])
        line = None if job is None else job.encode()
        path = self.directory / str(gpu)
        current = _read_lines(path)
        others = _without(current or [], ours)
        # A line already there with the job's name is taken as herd's: a second copy would
        # make dcgm-exporter render every series of the GPU twice, labels and all.
        lines = others if line is None or line in others else [*others, line]
        if (current is None and not lines) or current == lines:
            self._set_ours(gpu, [] if line is None else [line])
            return
        if line is not None and line not in ours:
            self._set_ours(gpu, [*ours, line])  # a crash before the rename leaves it known
        _replace(path, b"".join(each + b"\n" for each in lines))
        self._set_ours(gpu, [] if line is None else [line])

    def _set_ours(self, gpu: int, lines: list[bytes]) -> None:
        assert self._ours is not None
        if self._ours.get(gpu, []) == lines:
            return
        ledger = self.directory / f"{LEDGER_PREFIX}{gpu}"
        if lines or ledger.exists():
            _replace(ledger, b"".join(each + b"\n" for each in lines))
        if lines:
            self._ours[gpu] = lines
        else:
            self._ours.pop(gpu, None)

    def _read_ledgers(self) -> dict[int, list[bytes]]:
        """The lines herd wrote before (this writer or one before it), by GPU id; only the
        GPUs of `gpu_ids` where it is given (another herd on this node has the others)."""
        ours: dict[int, list[bytes]] = {}
        for entry in os.scandir(self.directory):
            name = entry.name
            if not name.startswith(LEDGER_PREFIX):
                continue
            digits = name[len(LEDGER_PREFIX) :]
            if not (digits.isascii() and digits.isdigit()):
                continue
            gpu = int(digits)
            if self.gpu_ids is not None and gpu not in self.gpu_ids:
                continue
            try:
                lines = _read_lines(Path(entry.path))
            except _NotAFileOfLines as err:  # not herd's: its own ledgers are regular files
                log.warning("DCGM job mapping: %s is left alone: %s", err.filename, err.strerror)
                continue
            if lines:
                ours[gpu] = lines
        return ours

    def clear(self) -> None:
        """Take herd's lines out of every GPU's file: herd no longer says who holds them."""
        with self._lock:
            try:
                self._write({})
            except OSError as err:
                log.warning("cannot clear DCGM job mapping files in %s: %s", self.directory, err)


def _without(lines: list[bytes], ours: list[bytes]) -> list[bytes]:
    """`lines` less one occurrence of each of `ours` (herd's lines: the rest is others')."""
    left = list(lines)
    for line in ours:
        if line in left:
            left.remove(line)
    return left


def _read_lines(path: Path) -> list[bytes] | None:
    """The lines of a mapping file as dcgm-exporter splits them (bufio.ScanLines: at each
    newline, a last line without one counted), each kept as it is, a carriage return
    included, for writing back; None when there is no such file.

    Opened without following a link, and only a regular file is read: the directory may
    be shared, and another user's link named `2` pointing at a file of this user's would
    otherwise have its content copied into a file every user can read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            link = "a symbolic link, not followed"
            raise _NotAFileOfLines(errno.ELOOP, link, str(path)) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise _NotAFileOfLines(errno.EINVAL, "not a regular file", str(path))
        data = handle.read(MAX_MAPPING_FILE_BYTES + 1)
    if len(data) > MAX_MAPPING_FILE_BYTES:
        raise _NotAFileOfLines(errno.EFBIG, "too large for a job mapping file", str(path))
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def _replace(path: Path, content: bytes) -> None:
    """Replace `path` whole with `content`, through a temporary file this process made.

    The directory may be shared with other users: a temporary name chosen in advance could
    be another user's link, and writing or chmodding it by path would change the file it
    points to. mkstemp creates a new file (O_CREAT|O_EXCL: never through a link) with a
    random name that is not an integer, so dcgm-exporter's reader skips it; its mode is
    set on the descriptor it opened (readable by all: dcgm-exporter often runs as another
    user), and the rename replaces the entry `path`, not a file a link there points to.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(content)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


class JobMappingLoop:
    """Runs `writer.write()` every `interval` seconds on a thread (a `Periodic`, the first
    write at once) until `stop()`, which removes the files unless `clear_on_stop` is False
    (the operator then clears them itself unless it hands its jobs over)."""

    def __init__(
        self,
        writer: JobMappingWriter,
        interval: float = 1.0,
        *,
        clear_on_stop: bool = True,
        health: LoopHealth | None = None,
    ) -> None:
        self.writer = writer
        self.interval = interval
        self.clear_on_stop = clear_on_stop
        self._loop = Periodic(
            "dcgm-job-mapping",
            writer.write,
            interval,
            what="writing the DCGM job mapping",
            immediately=True,
            health=health,
            logger=log,
        )
        self.name = self._loop.name

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS, *, clear: bool | None = None) -> None:
        """Stop writing; with `clear` (default: `clear_on_stop`), remove the files (no job is
        known to hold the GPUs)."""
        self._loop.stop(timeout)
        if self.clear_on_stop if clear is None else clear:
            self.writer.clear()
