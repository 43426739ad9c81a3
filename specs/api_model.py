"""The base of every model a spec holds, and the JSON Schema settings they share.

Apart from `models.py` because it is how a model is written (camelCase in YAML, frozen,
titled and described for editors), not what a spec says; policies' params and engines'
options use it too.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

_TITLE_WORDS = {"gpu": "GPU", "gpus": "GPUs", "api": "API"}
"""Words a title spells in capitals wherever they stand."""


def _title(words: list[str]) -> str:
    shown = [_TITLE_WORDS.get(word.lower(), word.lower()) for word in words]
    return " ".join([shown[0][:1].upper() + shown[0][1:], *shown[1:]]) if shown else ""


def field_title(name: str, info: object) -> str:
    """A field's title in the JSON Schema, from its Python name: `elastic_timeout_seconds`
    -> "Elastic timeout seconds" (pydantic's default, from the camelCase alias, gives
    "Elastictimeoutseconds")."""
    return _title(name.split("_"))


def model_title(model: type) -> str:
    """A model's title in the JSON Schema: `HorovodOptions` -> "Horovod options"."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z0-9]*|[a-z0-9]+", model.__name__)
    return _title(words) or model.__name__


SCHEMA_CONFIG = ConfigDict(
    # Each field's docstring is its description in the JSON Schema: what an editor shows
    # on hover. Written for the person who writes the YAML.
    use_attribute_docstrings=True,
    field_title_generator=field_title,
    model_title_generator=model_title,
)
"""The JSON Schema settings of every model a spec holds (policies' params too)."""


class ApiModel(BaseModel):
    """Base of every API model: camelCase in YAML, snake_case in Python, immutable."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        # Validators are built on first use, not at import: a restarted operator serves its
        # jobs' workers before it reads a spec (the chaos test's restart-to-serving time).
        defer_build=True,
        **SCHEMA_CONFIG,
    )
