"""The JSON Schema of a HerdJob file, for editors (yaml-language-server) and docs.

Apart from the models because it is an export of them (`herd-operator schema`), with the
additions a schema needs that validation does not: the engine's options where they are
given, what `get -o yaml` adds, and each built-in policy's params.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from herd_operator.specs.models import API_VERSION, HOROVOD_ENGINE, KIND, HerdJob, PolicyRef

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


SCHEMA_ID = f"urn:herd-operator:{API_VERSION}:{KIND}"
"""The schema's `$id`: stable across releases of this API version. A name, not a place:
editors find the schema by the path or URL in the spec's `# yaml-language-server:
$schema=` line, not by its `$id`."""


def json_schema(
    policy_params: Mapping[str, type[BaseModel]] | None = None,
    *,
    engine_options: Mapping[str, type[BaseModel]] | None = None,
    policy_summaries: Mapping[str, str] | None = None,
    engine_kinds: Sequence[str] = (),
) -> dict[str, Any]:
    """JSON Schema of a HerdJob file, for editors (yaml-language-server) and docs.

    `policy_params` maps policy names to their parameter models (the policies' registry
    knows them; `specs` does not import policies): `spec.policy.params` is checked against
    the model of the policy `spec.policy.name` names; other names' params stay open.
    `engine_options` likewise maps engine kinds other than horovod to their options' models
    (the runtime's engines know them).
    `policy_summaries` (name -> one line) makes the description of `spec.policy.name`; the
    `engine_kinds` (the runtime's engine registry) are the enum of `spec.engine.kind`. Both
    come from the registries, so the schema lists what the operator has.
    """
    schema = HerdJob.model_json_schema(by_alias=True)
    defs: dict[str, Any] = schema["$defs"]
    if engine_kinds:
        kind = defs["EngineRef"]["properties"]["kind"]
        kind["enum"] = sorted(engine_kinds)
        kind["description"] = "The engine: " + ", ".join(f"`{k}`" for k in kind["enum"]) + "."
    if policy_summaries:
        defs["PolicyRef"]["properties"]["name"]["description"] = policy_name_description(
            policy_summaries
        )
    # The horovod engine's options are described where they are given; an absent `kind`
    # means horovod too (`properties` only constrains what is there).
    defs["EngineRef"].update(
        {
            "if": {"properties": {"kind": {"const": HOROVOD_ENGINE}}},
            "then": {"properties": {"options": {"$ref": "#/$defs/HorovodOptions"}}},
        }
    )
    engine_branches = []
    for kind, model in sorted((engine_options or {}).items()):
        options = model.model_json_schema(by_alias=True)
        if defs.setdefault(model.__name__, options) != options:
            raise ValueError(f"two different schemas named {model.__name__!r}")
        then = {"properties": {"options": {"$ref": f"#/$defs/{model.__name__}"}}}
        engine_branches.append(
            {"if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]}, "then": then}
        )
    if engine_branches:
        defs["EngineRef"]["allOf"] = engine_branches
    # What `get NAME -o yaml` adds to a spec, allowed (and ignored) in a file.
    schema["$defs"]["ObjectMeta"]["properties"].update(
        {
            "uid": {
                "title": "UID",
                "type": "string",
                "readOnly": True,
                "description": "The job's identity, set by the operator; ignored in a spec file.",
            },
            "generation": {
                "title": "Generation",
                "type": "integer",
                "minimum": 1,
                "readOnly": True,
                "description": "How many times the spec changed, counted by the operator; "
                "ignored in a spec file.",
            },
            "creationTimestamp": {
                "title": "Creation timestamp",
                "type": "string",
                "format": "date-time",
                "readOnly": True,
                "description": "When the operator first saw the job (RFC 3339); ignored in a "
                "spec file.",
            },
        }
    )
    schema["properties"]["status"] = {
        "title": "Status",
        "type": "object",
        "readOnly": True,
        "description": "Observed state, written by the operator (`herd-operator get NAME "
        "-o yaml`); ignored in a spec file.",
    }
    default_policy = PolicyRef.model_fields["name"].default
    branches = []
    for name, model in sorted((policy_params or {}).items()):
        params = model.model_json_schema(by_alias=True)
        for nested_name, nested in params.pop("$defs", {}).items():
            if defs.setdefault(nested_name, nested) != nested:
                raise ValueError(f"two different schemas named {nested_name!r}")
        if defs.setdefault(model.__name__, params) != params:
            raise ValueError(f"two different schemas named {model.__name__!r}")
        # An absent name is the default policy's; any other branch needs the name given.
        when: dict[str, Any] = {"properties": {"name": {"const": name}}}
        if name != default_policy:
            when["required"] = ["name"]
        then = {"properties": {"params": {"$ref": f"#/$defs/{model.__name__}"}}}
        branches.append({"if": when, "then": then})
    if branches:
        defs["PolicyRef"]["allOf"] = branches
    _unwrap_descriptions(schema)
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": SCHEMA_ID,
        **schema,
        "title": f"{KIND} ({API_VERSION})",
    }


def policy_name_description(summaries: Mapping[str, str]) -> str:
    """The description of `spec.policy.name`: every built-in with its one line, then plug-ins."""
    default = PolicyRef.model_fields["name"].default
    builtins = [
        f"`{name}` ({'the default: ' if name == default else ''}{summary.rstrip('.')})"
        for name, summary in sorted(summaries.items())
    ]
    return (
        f"The policy: a built-in, {', '.join(builtins)}; or the name of an installed plug-in"
        " policy (docs/policies.md)."
    )


def _unwrap_descriptions(node: object) -> None:
    """Docstrings wrap at the source's line length; an editor's hover should not."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            description = item.get("description")
            if isinstance(description, str):
                paragraphs = description.split("\n\n")
                item["description"] = "\n\n".join(" ".join(p.split()) for p in paragraphs)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
