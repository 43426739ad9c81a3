"""The plug-in API: what a policy written outside this project imports, from one module.

    from herd_operator.policies.api import Decision, HerdJob, JobObservations, Signal, clamp

A plug-in (docs/policies.md, "Writing your own policy") imports from here only: these names
keep their meaning across releases, while the modules that define them may move. The rest
of the package is the operator's own business.
"""

from herd_operator.policies.base import (
    Decision,
    JobObservations,
    Policy,
    PolicyError,
    Signal,
    clamp,
)
from herd_operator.specs import HerdJob
from herd_operator.specs.values import Report, UsageSample

__all__ = [
    "Decision",
    "HerdJob",
    "JobObservations",
    "Policy",
    "PolicyError",
    "Report",
    "Signal",
    "UsageSample",
    "clamp",
]
