"""The allocator's last decision: which job holds which GPU, and which GPUs are draining.

A restarted operator adopts its jobs from these rows, so the placements and the drains are
written together, all or nothing. Apart from the jobs because the allocator's decisions,
not the reconciler, write them: all the rows at once, one decision at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import asdict

from herd_operator.runtime.store.connection import StoreBase, StoreError
from herd_operator.runtime.store.jobs import require_job
from herd_operator.runtime.store.shares import log_share_changes
from herd_operator.specs.values import Allocation, Drain, Placement, ServiceRecord, Slot

_log = logging.getLogger(__name__)


class AllocationsMixin(StoreBase):
    """The ``allocations`` and ``drains`` tables (and the log of shared GPUs, ``shares``)."""

    def record_allocation(self, allocation: Allocation, now: float) -> None:
        """``replace_allocations`` with what the allocator's decision holds."""
        self.replace_allocations(
            allocation.placements,
            now,
            allocation.draining,
            allocation.shared,
            allocation.service,
            allocation.memory,
        )

    def replace_allocations(
        self,
        placements: Mapping[str, Placement],
        now: float,
        draining: Mapping[Slot, Drain] | None = None,
        shared: AbstractSet[str] = frozenset(),
        service: Mapping[str, ServiceRecord] | None = None,
        memory: Mapping[str, int] | None = None,
    ) -> None:
        """Replace all allocations with ``placements`` (job -> placement), and the draining
        GPUs with ``draining``, in one transaction: a restarted operator must find a GPU that
        a job was shrunk off still held (its workers may be on it), never in between.

        A job with an empty placement holds nothing and is not stored (the allocator's
        decisions name pending jobs too). ``shared``: the jobs that share GPUs by memory; a
        GPU may be placed for several of them. ValueError if a GPU is placed twice otherwise,
        or a host of a placement has no GPUs; KeyError if a job that holds GPUs does not
        exist. On error nothing changes. ``service``: what the allocator's queue counted of
        each job (``service()`` reads it back), in the same transaction; None: left as is.
        ``memory``: bytes one worker of each sharing job is counted for; each GPU whose
        sharing jobs or their memory changed is logged (``shares.log_share_changes``).
        """
        held = {job: placement for job, placement in placements.items() if placement.size}
        rows: list[tuple[str, int, str, int, int, int]] = []
        owner: dict[tuple[str, int], str] = {}
        for job, placement in held.items():
            # A Placement has no host twice and no GPU twice on a host already.
            for host_ordinal, (host, gpus) in enumerate(placement.hosts):
                if not gpus:
                    raise ValueError(f"job {job!r}: host {host!r} has an empty GPU list")
                for local_rank, gpu in enumerate(gpus):
                    other = owner.get((host, gpu))
                    if other is not None and not (job in shared and other in shared):
                        raise ValueError(
                            f"GPU {host}:{gpu} is placed twice (jobs {other!r} and {job!r})"
                        )
                    owner[(host, gpu)] = job
                    rows.append((host, gpu, job, host_ordinal, local_rank, int(job in shared)))
        with self._write() as conn:
            for job in held:
                require_job(conn, job)
            conn.execute("DELETE FROM allocations")
            conn.executemany(
                "INSERT INTO allocations (host, gpu, job, host_ordinal, local_rank, shared)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            placed = [(host, gpu, job, shared) for host, gpu, job, _, _, shared in rows]
            log_share_changes(conn, placed, memory or {}, now)
            conn.execute("DELETE FROM drains")
            conn.executemany(
                "INSERT INTO drains (host, gpu, job, given_back_at, pids_json, after_loss)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (host, gpu, drain.job, drain.given_back_at,
                     json.dumps([list(pid) for pid in drain.pids]), int(drain.after_loss))
                    for (host, gpu), drain in (draining or {}).items()
                ],
            )  # fmt: skip
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('allocations_updated_at', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (repr(float(now)),),
            )
            if service is not None:
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('service', ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (json.dumps({job: asdict(record) for job, record in service.items()}),),
                )

    def service(self) -> dict[str, ServiceRecord]:
        """What the allocator's queue counted of each job, as last recorded (empty if
        nothing was, or if it cannot be read: the queue then counts from zero, as a new
        operator's would, and says so in the log)."""
        with self._read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'service'").fetchone()
        if row is None:
            return {}
        try:
            return {
                job: ServiceRecord(**fields) for job, fields in json.loads(row["value"]).items()
            }
        except (ValueError, TypeError, AttributeError) as err:
            _log.warning("state store: the queue's service records are unreadable (%s)", err)
            return {}

    def allocations(self) -> dict[str, Placement]:
        """Job -> placement, jobs by name, hosts and GPUs in the order they were given."""
        hosts: dict[str, list[tuple[str, list[int]]]] = {}
        with self._read() as conn:
            rows = conn.execute(
                "SELECT job, host, gpu FROM allocations ORDER BY job, host_ordinal, local_rank"
            ).fetchall()
        for row in rows:
            placement = hosts.setdefault(row["job"], [])
            if not placement or placement[-1][0] != row["host"]:
                placement.append((row["host"], []))
            placement[-1][1].append(row["gpu"])
        return {
            job: Placement(tuple((host, tuple(gpus)) for host, gpus in placement))
            for job, placement in hosts.items()
        }

    def shared_jobs(self) -> frozenset[str]:
        """The jobs whose allocations share GPUs by memory (``replace_allocations``'s
        ``shared``)."""
        with self._read() as conn:
            rows = conn.execute("SELECT DISTINCT job FROM allocations WHERE shared = 1").fetchall()
        return frozenset(row["job"] for row in rows)

    def draining(self) -> dict[Slot, Drain]:
        """The GPUs jobs gave back and their workers may still be on, as last recorded
        (empty for a store from before drains were recorded: schema 3 or older)."""
        try:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT host, gpu, job, given_back_at, pids_json, after_loss FROM drains"
                ).fetchall()
        except StoreError as err:
            if "no such table" in str(err):
                return {}
            raise
        drains: dict[Slot, Drain] = {}
        for row in rows:
            try:
                pids = tuple((str(host), int(pid)) for host, pid in json.loads(row["pids_json"]))
            except (ValueError, TypeError) as err:
                # Still a drain: the GPU stays held until the job reports its smaller size.
                _log.warning("state store: drain of %s:%s: unreadable pids (%s)",
                             row["host"], row["gpu"], err)  # fmt: skip
                pids = ()
            drains[(row["host"], row["gpu"])] = Drain(
                row["job"], row["given_back_at"], pids, bool(row["after_loss"])
            )
        return drains

    def allocations_updated_at(self) -> float | None:
        """When ``replace_allocations`` last ran, or None if it never did."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT value FROM meta WHERE key = 'allocations_updated_at'"
            ).fetchone()
        return None if row is None else float(row["value"])
