"""A spec's fingerprint: what makes two specs the same job, and so one generation.

Apart from the models because it is a rule over them (which fields a spec from before each
field's time leaves out, so an upgrade neither reruns nor relaunches a job), not a field.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from herd_operator.specs.models import (
    DEFAULT_GLOO_TIMEOUT_SECONDS,
    DEFAULT_GROW_TIMEOUT_SECONDS,
    DEFAULT_HOROVOD_LAUNCHER,
    HOROVOD_ENGINE,
    HerdJob,
)


def spec_fingerprint(job: HerdJob) -> str:
    """sha256 of the spec's canonical JSON; labels and formatting do not change it."""
    # A horovod job's engine options are said again by `horovod`: leaving `engine` out keeps
    # the fingerprint (and generation) of specs written before it, and makes both spellings
    # the same spec.
    horovod = job.spec.engine.kind == HOROVOD_ENGINE
    # Likewise an unset `training` leaves the fingerprint of specs from before it as it was.
    excluded: dict[str, Any] = {}
    if horovod:
        excluded["engine"] = True
    if job.spec.training is None:
        excluded["training"] = True
    else:  # and no expected epochs, max batch nor measured steps, which it had not
        training = job.spec.training
        unset = {
            name
            for name in ("epochs", "max_batch", "measure_steps")
            if getattr(training, name) is None
        }
        if not training.resumable:  # nor `resumable: false`, the default
            unset.add("resumable")
        if unset:
            excluded["training"] = unset
    # Nor a time limit or dependencies, which specs before them had not.
    if job.spec.active_deadline_seconds is None:
        excluded["active_deadline_seconds"] = True
    if not job.spec.depends_on:
        excluded["depends_on"] = True
    # And `suspend: false`, the default. Suspending or resuming is a new generation, as a
    # Kubernetes Job's `spec.suspend` is; it needs no relaunch of its own (the engine's
    # `relaunch_reason` does not read it).
    if not job.spec.suspend:
        excluded["suspend"] = True
    # Nor GPU sharing off, which specs before it had not (sharing needs no relaunch either:
    # the allocator applies it to the job's next grant).
    gpus = {"share"} if not job.spec.gpus.share else set()
    if job.spec.gpus.memory is None:
        gpus.add("memory")
    if job.spec.gpus.memory_split is None:
        gpus.add("memory_split")
    if gpus:
        excluded["gpus"] = gpus
    # And the default launcher, which specs from before the field run under now.
    defaults = {"launcher"} if job.spec.horovod.launcher == DEFAULT_HOROVOD_LAUNCHER else set()
    if not job.spec.horovod.preload:  # and no preload, which specs before it had
        defaults.add("preload")
    if job.spec.horovod.gloo_timeout_seconds == DEFAULT_GLOO_TIMEOUT_SECONDS:  # nor these
        defaults.add("gloo_timeout_seconds")
    if job.spec.horovod.grow_timeout_seconds == DEFAULT_GROW_TIMEOUT_SECONDS:
        defaults.add("grow_timeout_seconds")
    if defaults:
        excluded["horovod"] = defaults
    spec = job.spec.model_dump(mode="json", by_alias=True, exclude=excluded or None)
    canonical = json.dumps(
        spec,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
