"""The declarative API: HerdJob models, YAML loading and validation, status conditions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The names below are imported on first use (PEP 562), so that importing one light module
# (`specs.values`) or the models does not load the YAML loader too: a restarted operator
# serves its jobs' workers before it reads a spec file.
if TYPE_CHECKING:
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
        TrainingOptions,
        json_schema,
        spec_fingerprint,
    )

else:
    _HOMES = {
        "Condition": "specs.conditions",
        "ConditionStatus": "specs.conditions",
        "ConditionType": "specs.conditions",
        "get_condition": "specs.conditions",
        "is_true": "specs.conditions",
        "set_condition": "specs.conditions",
        "MAX_SPEC_BYTES": "specs.loading",
        "SpecError": "specs.loading",
        "SpecFile": "specs.loading",
        "SpecIndex": "specs.loading",
        "index_specs": "specs.loading",
        "is_spec_filename": "specs.loading",
        "load_spec_file": "specs.loading",
        "load_spec_text": "specs.loading",
        "scan_spec_dir": "specs.loading",
        "API_VERSION": "specs.models",
        "HOROVOD_ENGINE": "specs.models",
        "KIND": "specs.models",
        "EngineRef": "specs.models",
        "GpuRange": "specs.models",
        "HerdJob": "specs.models",
        "HerdJobSpec": "specs.models",
        "HorovodOptions": "specs.models",
        "ObjectMeta": "specs.models",
        "PolicyRef": "specs.models",
        "RestartPolicy": "specs.models",
        "TrainingOptions": "specs.models",
        "json_schema": "specs.models",
        "spec_fingerprint": "specs.models",
    }

    def __getattr__(name: str) -> object:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'specs' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value


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
    "TrainingOptions",
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
