"""Quantities of bytes as Kubernetes writes them (`8Gi`, `512Mi`, `1.5G`): what
`spec.gpus.memory` takes. Apart from the models because the pattern, the parsing and the
field's type are one rule that the models, the schema and the reconciler all read.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, Field

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
"""A Kubernetes-style quantity of bytes (`8Gi`, `512Mi`, `1.5G`, `1000000`): what
`spec.gpus.memory` takes. Binary suffixes are powers of 1024, decimal ones of 1000."""
_QUANTITY_UNITS = {
    "": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
}  # fmt: skip


def parse_quantity(text: str) -> int:
    """The bytes of a `QUANTITY_PATTERN` quantity, rounded up; ValueError on another shape."""
    match = re.fullmatch(QUANTITY_PATTERN.strip("^$"), text)
    if match is None:
        raise ValueError(f"{text!r} is not a quantity of bytes (examples: 8Gi, 512Mi, 1.5G)")
    number = text[: len(text) - len(match.group(2) or "")]
    return math.ceil(float(number) * _QUANTITY_UNITS[match.group(2) or ""])


def _positive_quantity(text: str) -> str:
    if parse_quantity(text) < 1:
        raise ValueError(f"{text!r}: GPU memory must be at least 1 byte")
    return text


Quantity = Annotated[
    str, AfterValidator(_positive_quantity), Field(json_schema_extra={"pattern": QUANTITY_PATTERN})
]
"""A string field holding a quantity of at least 1 byte (its error names the field)."""
