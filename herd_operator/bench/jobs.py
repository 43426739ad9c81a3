"""A job spec for benchmarks that need one in the store but never run it.

Apart from `harness`, which the `scale` children import: their baseline's peak memory
must not include pydantic and the spec models.
"""

from __future__ import annotations

from herd_operator.specs import HerdJob


def bench_job(name: str) -> HerdJob:
    """A job for benchmarks that need one in the store but never run it."""
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["true"], "gpus": {"min": 1, "max": 1}},
        }
    )
