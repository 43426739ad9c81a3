"""The operator's settings: what `herd-operator run` (and the benchmarks, the demo and the
tests) hand to `Operator`.

Apart from the operator's wiring so that the modules the operator is assembled from
(`telemetry`) read the settings without importing the operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from herd_operator.policies.queueing import QueueConfig
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.runtime.drains import DEFAULT_DRAIN_SECONDS
from herd_operator.runtime.pools import PoolSource
from herd_operator.runtime.pools.heartbeat import DEFAULT_NODE_TIMEOUT_SECONDS
from herd_operator.runtime.pruner import DEFAULT_RETENTION_SECONDS, PRUNE_INTERVAL_SECONDS
from herd_operator.runtime.store import MAX_GRANTS_PER_JOB
from herd_operator.specs.conditions import REPORT_DEADLINE_SECONDS


@dataclass(frozen=True)
class OperatorConfig:
    """Everything `herd-operator run` sets (its flags, in cli/run.py), with the defaults."""

    specs_dir: Path
    state_dir: Path
    pool: PoolSource
    listen_host: str = "127.0.0.1"
    listen_port: int | None = None
    """The allocator's port; None: the previous operator's (its jobs' workers know that
    one), else any free port."""
    advertise_host: str | None = None
    """Address workers use to reach the allocator (default: listen_host)."""
    network_interface: str | None = None
    """The interface between the pool's nodes, for Horovod (None: a pool on this host)."""
    node_timeout_seconds: float = DEFAULT_NODE_TIMEOUT_SECONDS
    """A node whose agent was heard and then silent this long is lost (none of its free GPUs
    granted) until its agent calls again, whatever probes say; one whose agent missed two
    calls is suspect at once (`pools/heartbeat.py`)."""
    resync_seconds: float = 5.0
    relist_seconds: float = 10.0
    report_deadline_seconds: float = REPORT_DEADLINE_SECONDS
    """A launch none of whose workers reported within this long gets `Reporting=False`."""
    grace_seconds: float = 10.0
    watch_events: bool = True
    min_resize_interval: float = 30.0
    """A job's size is left alone this long after it changed (each change resets Horovod)."""
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    """How long a GPU taken from a job may drain before a DrainOverdue warning (it stays
    held until its workers are seen to leave it)."""
    spare_by_gain: bool = False
    """The allocator lends GPUs nobody wants by the gain policies report (`Allocator`)."""
    smallest_first: bool = False
    """The allocator admits pending jobs smallest min first (`Allocator`)."""
    share_by_gain: bool = False
    """The allocator divides the GPUs above the mins by the gain policies report (`Allocator`)."""
    share_by_speedup: bool = False
    """The allocator divides the GPUs above the mins by the harmonic mean of the jobs'
    speedups, Pollux's objective (`Allocator`)."""
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS
    """With `smallest_first`: a job pending this long is admitted first."""
    queue: QueueConfig | None = None
    """The allocator's queue: order by service attained or work left, with preemption
    (`policies/queueing.py`); None: arrival order, no preemption (`run --queue fifo`)."""
    sharing: SharingLimits | None = None
    """GPUs shared by memory among jobs that opt in (`run --share-gpus`); None: off, every
    job gets whole GPUs."""
    virtual_gpu_memory_bytes: int = 2 << 30
    """Capacity of one virtual GPU (CPU machines), against which worker memory is measured."""
    sample_seconds: float = 1.0
    """How often the memory of each job's GPUs is sampled."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Serve Prometheus metrics here (0: any free port; None: not at all)."""
    prometheus_url: str | None = None
    """Read the GPU memory signal back from this Prometheus server (PromQL) instead of
    from this host's GPUs or the registered exporters."""
    gpu_metrics: Literal["herd", "dcgm"] = "herd"
    """Whose metrics give the memory signal: herd's exporters, or NVIDIA's dcgm-exporter
    (its DCGM_FI_DEV_FB_* series, from `prometheus_url` or `dcgm_exporter_urls`)."""
    dcgm_exporter_urls: tuple[str, ...] = ()
    """dcgm-exporter pages to scrape (default: port 9400 of every host of the pool)."""
    process_metrics: bool = False
    """Export each GPU process's memory with a `pid` label (a new series per restart)."""
    dcgm_job_mapping_dir: Path | None = None
    """Keep dcgm-exporter's HPC job mapping files for this host's GPUs here (one-host pools;
    node exporters keep their own node's)."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    leave_jobs_running: bool = False
    """On shutdown, stop only the operator: the next one on this state dir adopts the jobs."""
    runtime_dir: Path | None = None
    """Where to make the private directory for grant files and discovery scripts (default:
    $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)."""
    grant_history_per_job: int = MAX_GRANTS_PER_JOB
    """Grant changes kept per job in the store (the newest)."""
    deleted_job_retention_seconds: float = DEFAULT_RETENTION_SECONDS
    """A deleted job's grant history, log and leftover files go this long after its last
    grant change or write."""
    prune_interval_seconds: float = PRUNE_INTERVAL_SECONDS
    agent_key_files: bool = True
    """Write each pool host's agent key to the state dir (0600), where `herd-operator
    exporter` reads it; False where the agents get theirs on stdin (`agent-key`)."""


class OperatorError(Exception):
    """The operator cannot start (bad state dir, another operator running, port in use)."""
