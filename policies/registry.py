"""Finds a policy by name and validates its parameters.

A policy is named in a spec by `spec.policy.name`: a built-in name, a name that
a third-party package registers under the entry point group
`herd_operator.policies`, or `package.module:ClassName`. A policy class has a
pydantic model `Params` for its `spec.policy.params` and is built with an
instance of it, and says what it observes (`Policy.observes`).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol, cast

from pydantic import BaseModel, ValidationError

from policies.base import Policy, PolicyError, Signal
from policies.memory import MemoryPolicy
from policies.schedule import SchedulePolicy
from policies.static import StaticPolicy
from specs import PolicyRef

ENTRY_POINT_GROUP = "herd_operator.policies"
LEGACY_OBSERVES: frozenset[Signal] = frozenset({Signal.EPOCHS})
"""What a plug-in that does not declare `observes` is given: what every policy was given
before policies declared it (plus the GPU usage if the class sets `needs_usage = True`)."""
_SIGNALS: frozenset[Signal] = frozenset(Signal)


class PolicyClass(Protocol):
    Params: type[BaseModel]

    def __call__(self, params: Any) -> Policy: ...


BUILTIN_POLICIES: dict[str, PolicyClass] = {
    "static": cast(PolicyClass, StaticPolicy),
    "memory": cast(PolicyClass, MemoryPolicy),
    "schedule": cast(PolicyClass, SchedulePolicy),
}


def find_policy_class(name: str) -> PolicyClass:
    """Resolve a policy name; raises PolicyError naming `spec.policy.name`."""
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            found: Any = getattr(importlib.import_module(module_name), attr)
        except (Exception, SystemExit) as err:
            # A module runs code when imported: whatever it raises (even SystemExit, as
            # `unittest.__main__` does) is this spec's problem, never the operator's end.
            raise PolicyError(
                "spec.policy.name", f"cannot load {name!r}: {_describe_error(err)}"
            ) from err
    else:
        matches = entry_points(group=ENTRY_POINT_GROUP, name=name)
        if not matches:
            known = sorted(
                {*BUILTIN_POLICIES, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}
            )
            raise PolicyError(
                "spec.policy.name",
                f"unknown policy {name!r} (known: {', '.join(known)}; or use 'module:Class')",
            )
        try:
            found = next(iter(matches)).load()
        except (Exception, SystemExit) as err:  # a broken plug-in must not end the operator
            raise PolicyError(
                "spec.policy.name", f"cannot load plug-in {name!r}: {_describe_error(err)}"
            ) from err
    params = getattr(found, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)) or not callable(found):
        raise PolicyError(
            "spec.policy.name",
            f"{name!r} is not a policy class (it needs a pydantic 'Params' model)",
        )
    return cast(PolicyClass, found)


def load_policy(ref: PolicyRef) -> Policy:
    """Build the policy a spec names, validating `spec.policy.params` with its model."""
    cls = find_policy_class(ref.name)
    try:
        params = cls.Params.model_validate(ref.params)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        field = "spec.policy.params" + (f".{where}" if where else "")
        raise PolicyError(field, first["msg"]) from err
    try:
        policy = cls(params)
    except (Exception, SystemExit) as err:
        raise PolicyError(
            "spec.policy.name", f"{ref.name!r} cannot be built: {_describe_error(err)}"
        ) from err
    if ref.name not in BUILTIN_POLICIES:  # the built-ins declare it (their tests check)
        _check_observes(policy, ref.name)
    return policy


def _describe_error(err: BaseException) -> str:
    text = str(err)
    if isinstance(err, SystemExit):
        return f"it tried to exit the process (SystemExit {text or 0})"
    return text or type(err).__name__


def _check_observes(policy: Policy, name: str) -> None:
    """Check what a policy declares it observes; fill it in for an older plug-in."""
    declared: object = getattr(policy, "observes", None)
    if declared is None:
        # Filled in here, so the reconciler reads the attribute of every policy. On the
        # instance where it can be: set on a class, it would be inherited by the plug-in's
        # subclasses, which may say `needs_usage` themselves.
        legacy = LEGACY_OBSERVES
        if getattr(policy, "needs_usage", False):
            legacy |= {Signal.USAGE}
        try:
            policy.observes = legacy
        except (AttributeError, TypeError):  # __slots__ or a frozen instance
            try:
                type(policy).observes = legacy
            except (AttributeError, TypeError) as err:
                raise PolicyError(
                    "spec.policy.name", f"{name!r} does not declare what it observes: {err}"
                ) from err
        return
    # Once per reconcile: a subset test, not a loop (plain strings equal their Signal).
    if not (isinstance(declared, set | frozenset) and declared <= _SIGNALS):
        raise PolicyError(
            "spec.policy.name",
            f"{name!r} declares it observes {declared!r}: expected a frozenset of"
            f" {', '.join(sorted(_SIGNALS))}",
        )
