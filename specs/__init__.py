"""The declarative API: HerdJob models, YAML loading and validation, status conditions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The names below are imported on first use (PEP 562), so that importing one light module
# (`herd_operator.specs.values`) or the models does not load the YAML loader too: a
# restarted operator serves its jobs' workers before it reads a spec file.
if TYPE_CHECKING:
    from herd_operator.specs.conditions import (
        Condition,
        ConditionStatus,
        ConditionType,
        get_condition,
        is_true,
        set_condition,
    )
    from herd_operator.specs.fingerprint import spec_fingerprint
    from herd_operator.specs.loading import (
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
    from herd_operator.specs.models import (
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
    )
    from herd_operator.specs.schema import json_schema

else:
    _HOMES = {
        "Condition": "herd_operator.specs.conditions",
        "ConditionStatus": "herd_operator.specs.conditions",
        "ConditionType": "herd_operator.specs.conditions",
        "get_condition": "herd_operator.specs.conditions",
        "is_true": "herd_operator.specs.conditions",
        "set_condition": "herd_operator.specs.conditions",
        "MAX_SPEC_BYTES": "herd_operator.specs.loading",
        "SpecError": "herd_operator.specs.loading",
        "SpecFile": "herd_operator.specs.loading",
        "SpecIndex": "herd_operator.specs.loading",
        "index_specs": "herd_operator.specs.loading",
        "is_spec_filename": "herd_operator.specs.loading",
        "load_spec_file": "herd_operator.specs.loading",
        "load_spec_text": "herd_operator.specs.loading",
        "scan_spec_dir": "herd_operator.specs.loading",
        "API_VERSION": "herd_operator.specs.models",
        "HOROVOD_ENGINE": "herd_operator.specs.models",
        "KIND": "herd_operator.specs.models",
        "EngineRef": "herd_operator.specs.models",
        "GpuRange": "herd_operator.specs.models",
        "HerdJob": "herd_operator.specs.models",
        "HerdJobSpec": "herd_operator.specs.models",
        "HorovodOptions": "herd_operator.specs.models",
        "ObjectMeta": "herd_operator.specs.models",
        "PolicyRef": "herd_operator.specs.models",
        "RestartPolicy": "herd_operator.specs.models",
        "TrainingOptions": "herd_operator.specs.models",
        "json_schema": "herd_operator.specs.schema",
        "spec_fingerprint": "herd_operator.specs.fingerprint",
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
