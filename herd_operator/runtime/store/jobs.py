"""Jobs: their specs and statuses as models, and the caches that parse each text once.

Specs and statuses cross the store's interface as models (``JobRecord``): the store
serializes them, parses each stored text once (later reads of the same text reuse the
model) and skips writing a status equal to the stored one. A stored text that no longer
parses spoils only its job: an unreadable status reads as empty, an unreadable spec raises
``UnreadableSpecError`` when asked for and is recorded again from the spec file. Apart
because the caches and the repair of unreadable rows are the subtle part of the store and
belong to this one table.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import uuid
from collections.abc import Callable

from herd_operator.runtime.store.connection import StoreBase, StoreError
from herd_operator.specs import HerdJob
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus

_log = logging.getLogger(__name__)


class UnreadableSpecError(StoreError):
    """A job's stored spec no longer parses (a damaged row, or a spec format this version
    no longer reads). Only that job's spec is affected; the operator records the spec
    file's again when the job is next reconciled with a good file."""


class JobsMixin(StoreBase):
    """The ``jobs`` table: one row per declared job, with its spec and status."""

    def _init_jobs(self) -> None:
        # Per job, the status text last read or written here with its model: a read of
        # the same text reuses the model, a write of the same text is skipped. Keyed by
        # the exact text, so a reader never gets a model of text it did not just read.
        self._statuses: dict[str, tuple[str, HerdJobStatus]] = {}
        # Per job, the spec of one (uid, generation), once a record's spec was asked for:
        # record_spec writes a spec only with a new generation and a re-declared job gets a
        # new uid, so the pair fixes the text, and no text needs to be kept to know the
        # cached model is still right.
        self._specs: dict[str, tuple[str, int, HerdJob]] = {}
        # Per job, the (uid, generation) whose stored spec was found not to parse.
        self._unreadable_specs: dict[str, tuple[str, int]] = {}

    def record_spec(
        self, name: str, spec_path: str, job: HerdJob, fingerprint: str, now: float
    ) -> JobRecord:
        """Record a job's good spec; a new fingerprint bumps the generation.

        With the same fingerprint the stored spec stays (only its path may move): the
        record returned is what is stored, like ``get_job``.
        """
        with self._lock:
            with self._write() as conn:
                row = conn.execute(
                    "SELECT uid, generation, fingerprint, spec_path FROM jobs WHERE name = ?",
                    (name,),
                ).fetchone()
                unreadable = row is not None and self._unreadable_specs.get(name) == (
                    row["uid"],
                    row["generation"],
                )
                if row is None:
                    conn.execute(
                        "INSERT INTO jobs (name, uid, spec_path, spec_json, fingerprint,"
                        " generation, status_json, created_at, updated_at)"
                        " VALUES (?, ?, ?, ?, ?, 1, '{}', ?, ?)",
                        (name, uuid.uuid4().hex, spec_path, _spec_json(job), fingerprint, now, now),
                    )
                elif row["fingerprint"] != fingerprint:
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, spec_json = ?, fingerprint = ?,"
                        " generation = generation + 1, updated_at = ? WHERE name = ?",
                        (spec_path, _spec_json(job), fingerprint, now, name),
                    )
                elif unreadable:
                    # The spec file says what the damaged text was (same fingerprint): repair
                    # the text and keep the generation, since nothing about the job changed.
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, spec_json = ?, updated_at = ?"
                        " WHERE name = ?",
                        (spec_path, _spec_json(job), now, name),
                    )
                    _log.info(
                        "state store %s: the spec of job %r is recorded again", self.path, name
                    )
                elif row["spec_path"] != spec_path:
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, updated_at = ? WHERE name = ?",
                        (spec_path, now, name),
                    )
                stored = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
            if unreadable:
                del self._unreadable_specs[name]
            if row is None or row["fingerprint"] != fingerprint or unreadable:
                # What was just written is this model: no need to parse it back.
                return self._job(stored, lambda: job)
            return self._job(stored)

    def get_job(self, name: str) -> JobRecord | None:
        """The job named ``name``, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
            return None if row is None else self._job(row)

    def has_job(self, name: str) -> bool:
        """Whether a job named ``name`` is recorded; parses nothing (adoption asks this
        before the operator serves, and parsing would build the spec models' validators)."""
        with self._read() as conn:
            return conn.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone() is not None

    def list_jobs(self) -> list[JobRecord]:
        """All jobs, by name."""
        with self._read() as conn:
            return [self._job(row) for row in conn.execute("SELECT * FROM jobs ORDER BY name")]

    def job_policies(self) -> dict[str, tuple[str, dict[str, object]]]:
        """Job -> (policy name, its params) as stored, without parsing the specs.

        For a scrape: parsing every spec on the first one cost ~0.3 s per 10,000 jobs,
        each parse under the store's lock. Jobs whose stored spec has no readable policy
        (a damaged row) are left out, like ``UnreadableSpecError`` would have them.
        """
        with self._read() as conn:
            try:
                rows = conn.execute(
                    "SELECT name, json_extract(spec_json, '$.spec.policy') FROM jobs"
                    " WHERE json_valid(spec_json)"
                ).fetchall()
            except sqlite3.OperationalError:  # an SQLite without JSON: read the texts
                rows = [
                    (row[0], _policy_text(row[1]))
                    for row in conn.execute("SELECT name, spec_json FROM jobs")
                ]
        policies: dict[str, tuple[str, dict[str, object]]] = {}
        for name, text in rows:
            try:
                policy = json.loads(text) if isinstance(text, str) else None
            except ValueError:
                continue
            if not isinstance(policy, dict):
                continue
            policy_name, params = policy.get("name"), policy.get("params", {})
            if isinstance(policy_name, str) and isinstance(params, dict):
                policies[name] = (policy_name, params)
        return policies

    def put_status(self, name: str, status: HerdJobStatus, now: float) -> bool:
        """Replace a job's status unless it equals the stored one; True if it was written.

        KeyError if there is no such job. Most reconciles change nothing, and an unchanged
        status is not written (nor its ``updated_at`` moved). "Stored" is the text this store
        last read or wrote for the job: the operator, the database's one writer (it holds
        the state dir's lock), reads a job before it writes the job's status.
        """
        with self._lock:
            cached = self._statuses.get(name)
            if cached is not None and cached[1] == status:  # cheaper than serializing
                return False
            text = status.model_dump_json(by_alias=True)
            if cached is not None and cached[0] == text:
                return False
            with self._write() as conn:
                updated = conn.execute(
                    "UPDATE jobs SET status_json = ?, updated_at = ? WHERE name = ?",
                    (text, now, name),
                ).rowcount
                if updated == 0:
                    raise unknown_job(name)
            self._statuses[name] = (text, status)
            return True

    def delete_job(self, name: str) -> bool:
        """Delete a job with its allocations, reports and usage; False if it did not exist."""
        with self._write() as conn:
            deleted: int = conn.execute("DELETE FROM jobs WHERE name = ?", (name,)).rowcount
            self._statuses.pop(name, None)
            self._specs.pop(name, None)
            self._unreadable_specs.pop(name, None)
            return deleted > 0

    def _job(self, row: sqlite3.Row, spec: Callable[[], HerdJob] | None = None) -> JobRecord:
        """The record of a row: its status parsed unless parsed before, its spec on demand.

        Called with the lock held (the caches are shared by the store's threads).
        """
        name: str = row["name"]
        text: str = row["status_json"]
        cached_status = self._statuses.get(name)
        if cached_status is not None and cached_status[0] == text:
            status = cached_status[1]
        else:
            try:
                status = _parse_status(text)
            except ValueError as exc:  # pydantic's ValidationError is one
                # Status is observed state: an unreadable one is rebuilt by the next
                # reconcile instead of failing every read of the store (`get`, /metrics,
                # the shutdown) for all jobs. Said once per unreadable text (it is cached).
                _log.warning(
                    "state store %s: the stored status of job %r is unreadable (%s);"
                    " showing it empty until the operator observes the job again",
                    self.path,
                    name,
                    str(exc).splitlines()[0],
                )
                status = HerdJobStatus()
            self._statuses[name] = (text, status)
        uid: str = row["uid"]
        generation: int = row["generation"]
        if spec is None:
            spec = functools.partial(self._spec, name, uid, generation, row["spec_json"])
        fingerprint: str = row["fingerprint"]
        if self._unreadable_specs.get(name) == (uid, generation):
            # The stored spec cannot serve as the last good one: a fingerprint no spec file
            # has makes the reconciler record the file's spec again (see record_spec).
            fingerprint = ""
        return JobRecord(
            name=name,
            uid=uid,
            spec_path=row["spec_path"],
            fingerprint=fingerprint,
            generation=generation,
            status=status,
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            load_spec=spec,
        )

    def _spec(self, name: str, uid: str, generation: int, text: str) -> HerdJob:
        """The spec of a record, parsed once per (uid, generation); ``text`` is its row's."""
        with self._lock:
            cached = self._specs.get(name)
            if cached is not None and cached[:2] == (uid, generation):
                return cached[2]
            try:
                spec = HerdJob.model_validate_json(text)
            except ValueError as exc:  # pydantic's ValidationError is one
                raise self._unreadable_spec(name, uid, generation, exc) from exc
            self._specs[name] = (uid, generation, spec)
            return spec

    def _unreadable_spec(
        self, name: str, uid: str, generation: int, exc: Exception
    ) -> UnreadableSpecError:
        """Said once per stored spec text (its job's uid and generation fix it)."""
        problem = str(exc).splitlines()[0]
        if self._unreadable_specs.get(name) != (uid, generation):
            self._unreadable_specs[name] = (uid, generation)
            _log.warning(
                "state store %s: the stored spec of job %r is unreadable (%s); the job shows"
                " without it until the operator records its spec file again",
                self.path,
                name,
                problem,
            )
        return UnreadableSpecError(
            f"state store {self.path}: the stored spec of job {name!r} is unreadable ({problem});"
            " it is recorded again from the spec file when the file is valid"
        )

    def _find_unreadable_specs(self) -> None:
        """Mark the specs that are not even JSON (a damaged row) at start, so the first
        reconcile records them again: parsing every spec would cost ~0.4 s per 10,000 jobs."""
        try:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT name, uid, generation FROM jobs WHERE NOT json_valid(spec_json)"
                ).fetchall()
        except sqlite3.OperationalError:  # an SQLite built without JSON: found on first use
            return
        for row in rows:
            self._unreadable_spec(
                row["name"], row["uid"], row["generation"], ValueError("not JSON")
            )

    def _forget_cached(self) -> None:
        with self._lock:
            self._statuses.clear()
            self._specs.clear()


def unknown_job(name: str) -> KeyError:
    """The error of a write for a job the store does not hold."""
    return KeyError(f"no job named {name!r} in the state store")


def require_job(conn: sqlite3.Connection, name: str) -> None:
    """KeyError unless the job ``name`` is stored (for a write of rows that belong to it)."""
    if conn.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone() is None:
        raise unknown_job(name)


def _spec_json(job: HerdJob) -> str:
    return job.model_dump_json(by_alias=True)


def _policy_text(spec_json: str) -> str | None:
    """The ``spec.policy`` of a stored spec as JSON text, None if it has none."""
    try:
        spec = json.loads(spec_json)
        return json.dumps(spec["spec"]["policy"])
    except (ValueError, KeyError, TypeError):
        return None


def _parse_status(text: str) -> HerdJobStatus:
    if text in ("", "{}"):  # a job not reconciled yet: no need to parse
        return _empty_status()
    return HerdJobStatus.model_validate_json(text)


@functools.cache
def _empty_status() -> HerdJobStatus:
    """One shared empty status (statuses are frozen), made on first use: made at import, it
    built the status models' validators before a restarted operator could serve."""
    return HerdJobStatus()
