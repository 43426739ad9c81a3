"""The pool of the Slurm allocation the operator runs in: its nodes and their GPUs.

Inside `salloc`/`sbatch`, Slurm names the allocation's nodes in `SLURM_JOB_NODELIST`
(its compressed host list, e.g. `nid[001234-001236,001240]`) and the GPUs in one of
several variables, depending on how they were asked for and where the shell runs:

- `SLURM_GPUS_PER_NODE`: `--gpus-per-node=4` or `=a100:4` (the same on every node);
- `SLURM_GPUS_ON_NODE`: the GPUs of the node this process runs on (batch script, steps);
- `SLURM_JOB_GPUS`: the indices of this node's GPUs, e.g. `0,1,2,3`.

The nodes of one allocation are taken to be alike (Slurm's own `--gpus-per-node`
assumes it). The host list is expanded here rather than by `scontrol show hostnames`,
so the operator does not need Slurm's client or configuration on its node; the tests
compare the two on many forms.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from herd_operator.exporters.nvml import nvml_gpu_count
from herd_operator.runtime.pools.base import PoolOptions, StaticPool
from herd_operator.specs.values import Pool

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
    pool = Pool.from_counts(dict.fromkeys(nodes, count))
    kind = "virtual GPUs" if virtual else "GPUs"
    description = (
        f"Slurm job {job}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({nodelist}) "
        f"x {count} {kind} ({variable})"
    )
    return StaticPool(pool, virtual, description)


def detect_slurm(options: PoolOptions) -> StaticPool | None:
    """The pool source for POOL_SOURCES: the allocation this operator runs in.

    Its GPUs are real when NVML sees GPUs on this node (the nodes of one allocation are
    alike), else virtual: CPU workers stand in for Slurm's GRES GPUs (tests, CPU nodes).
    """
    if not _nodelist(options.environ):
        return None  # not in an allocation: NVML is not asked
    return slurm_pool(options.environ, virtual=nvml_gpu_count() == 0)
