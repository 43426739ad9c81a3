"""The declarative API: HerdJob models, YAML loading and validation, status conditions."""

from __future__ import annotations

from specs.conditions import (
    Condition,
    ConditionStatus,
    ConditionType,
    get_condition,
    is_true,
    set_condition,
)
from specs.loading import (
    MAX_SPEC_BYTES,
    SpecError,
    SpecFile,
    SpecIndex,
    index_specs,
    is_spec_filename,
    load_spec_file,
    load_spec_text,
    scan_spec_dir,
)
from specs.models import (
    API_VERSION,
    HOROVOD_ENGINE,
    KIND,
    EngineRef,
    GpuRange,
    HerdJob,
    HerdJobSpec,
    HorovodOptions,
    ObjectMeta,
    PolicyRef,
    RestartPolicy,
    json_schema,
    spec_fingerprint,
)

__all__ = [
    "API_VERSION",
    "HOROVOD_ENGINE",
    "KIND",
    "MAX_SPEC_BYTES",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "EngineRef",
    "GpuRange",
    "HerdJob",
    "HerdJobSpec",
    "HorovodOptions",
    "ObjectMeta",
    "PolicyRef",
    "RestartPolicy",
    "SpecError",
    "SpecFile",
    "SpecIndex",
    "get_condition",
    "index_specs",
    "is_spec_filename",
    "is_true",
    "json_schema",
    "load_spec_file",
    "load_spec_text",
    "scan_spec_dir",
    "set_condition",
    "spec_fingerprint",
]
