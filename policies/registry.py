"""Finds a policy by name and validates its parameters.

A policy is named in a spec by `spec.policy.name`: a built-in name, or a name that an
installed package registers under the entry point group `herd_operator.policies` in its
package metadata. Nothing else is resolved: a spec is data, and naming a module in it
(`package.module:ClassName`) must not make the operator import that module, so such a name
is refused like any unknown one, without importing anything.

The group's entry points are read once and each plug-in class is loaded once per process
(reading the installed packages' metadata took milliseconds per reconcile). A plug-in
installed while the operator runs is seen after `reset_plugin_cache()` or a restart.

A policy class has a pydantic model `Params` for its `spec.policy.params` and is built with
an instance of it, and says what it observes (`Policy.observes`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, cast

from pydantic import BaseModel, ValidationError

from herd_operator.policies.base import Decision, JobObservations, Policy, PolicyError, Signal
from herd_operator.policies.goodput import GoodputPolicy
from herd_operator.policies.memory import MemoryPolicy
from herd_operator.policies.schedule import SchedulePolicy
from herd_operator.policies.static import StaticPolicy
from herd_operator.specs import HerdJob, HerdJobSpec, PolicyRef
from herd_operator.specs.loading import error_message, format_location

ENTRY_POINT_GROUP = "herd_operator.policies"
LEGACY_OBSERVES: frozenset[Signal] = frozenset({Signal.EPOCHS})
"""What a plug-in that does not declare `observes` is given: what every policy was given
before policies declared it (plus the GPU usage if the class sets `needs_usage = True`)."""
_SIGNALS: frozenset[Signal] = frozenset(Signal)

log = logging.getLogger(__name__)


class PolicyClass(Protocol):
    Params: type[BaseModel]

    def __call__(self, params: Any) -> Policy: ...


BUILTIN_POLICIES: dict[str, PolicyClass] = {
    "static": cast(PolicyClass, StaticPolicy),
    "memory": cast(PolicyClass, MemoryPolicy),
    "schedule": cast(PolicyClass, SchedulePolicy),
    "goodput": cast(PolicyClass, GoodputPolicy),
}


@dataclass(frozen=True)
class _Refused:
    """Why an installed plug-in cannot be used: kept, so that a broken plug-in's module is
    not run again on every reconcile, and raised as a new error each time it is asked for."""

    message: str


@dataclass(frozen=True)
class _Plugins:
    """What the registry knows of the installed plug-ins, filled as they are asked for."""

    points: dict[str, EntryPoint]
    """The group's entry points by name; the first found wins a name taken twice."""
    loaded: dict[str, PolicyClass | _Refused]
    """Each entry point asked for: its class, or why it is not one."""


_plugins: _Plugins | None = None
# Reentrant: a plug-in's module may look a policy up while it is being imported.
_plugins_lock = threading.RLock()


def reset_plugin_cache() -> None:
    """Forget the installed plug-ins: the next lookup reads the entry points again.

    For a plug-in installed (or mended) while the process runs, and for tests that install
    one. A plug-in module already imported stays imported (Python does not unload it)."""
    global _plugins
    with _plugins_lock:
        _plugins = None


def _installed() -> _Plugins:
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            points: dict[str, EntryPoint] = {}
            for point in entry_points(group=ENTRY_POINT_GROUP):
                points.setdefault(point.name, point)
            _plugins = _Plugins(points, {})
        return _plugins


def builtin_params_models() -> dict[str, type[BaseModel]]:
    """Each built-in policy's parameter model, by name (for the spec's JSON Schema)."""
    return {name: cls.Params for name, cls in BUILTIN_POLICIES.items()}


def builtin_summaries() -> dict[str, str]:
    """Each built-in policy's one line (its class docstring's first), by name: the schema's
    description of `spec.policy.name` lists them, so it names every built-in there is."""
    return {
        name: (cls.__doc__ or name).strip().split("\n", 1)[0]
        for name, cls in BUILTIN_POLICIES.items()
    }


def plugin_names() -> list[str]:
    """The names installed plug-ins register, sorted; a built-in's name stays the built-in."""
    return sorted(set(_installed().points) - set(BUILTIN_POLICIES))


def allowed_names() -> str:
    """The names a spec may use and how to add one, for an error message."""
    return (
        f"allowed: {', '.join(sorted(BUILTIN_POLICIES))} (built-in),"
        f" {', '.join(plugin_names()) or 'none'} (installed plug-ins); a plug-in registers its"
        f" class under the entry point group {ENTRY_POINT_GROUP!r} in its package's metadata"
        " and is installed where the operator runs (docs/policies.md)"
    )


def find_policy_class(name: str) -> PolicyClass:
    """Resolve a policy name; raises PolicyError naming `spec.policy.name`.

    Only a built-in or an installed entry point is resolved; for any other name nothing
    is imported."""
    builtin = BUILTIN_POLICIES.get(name)
    if builtin is not None:
        return builtin
    with _plugins_lock:
        plugins = _installed()
        point = plugins.points.get(name)
        if point is None:
            # Not kept: unknown names cost two dict lookups, and specs can invent any number.
            raise PolicyError("spec.policy.name", f"{_describe_unknown(name)}; {allowed_names()}")
        found = plugins.loaded.get(name)
        if found is None:
            found = plugins.loaded[name] = _load_plugin(name, point)
    if isinstance(found, _Refused):
        raise PolicyError("spec.policy.name", found.message)
    return found


def _describe_unknown(name: str) -> str:
    if ":" in name:
        return (
            f"{name!r} is a module:Class reference, which is not loaded (a spec does not"
            " make the operator import a module)"
        )
    return f"unknown policy {name!r}"


def _load_plugin(name: str, point: EntryPoint) -> PolicyClass | _Refused:
    try:
        found: Any = point.load()
    except (Exception, SystemExit) as err:
        # A module runs code when imported: whatever it raises (even SystemExit) is this
        # spec's problem, never the operator's end. Logged with its traceback once: the
        # job's condition repeats only the message, and the import is not tried again.
        log.warning("plug-in policy %r (%s) cannot be loaded", name, point.value, exc_info=True)
        return _Refused(f"cannot load plug-in {name!r}: {_describe_error(err)}")
    params = getattr(found, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)) or not callable(found):
        return _Refused(
            f"plug-in {name!r} ({point.value}) is not a policy class"
            " (it needs a pydantic 'Params' model)"
        )
    return cast(PolicyClass, found)


def load_policy(ref: PolicyRef) -> Policy:
    """Build the policy a spec names, validating `spec.policy.params` with its model."""
    cls = find_policy_class(ref.name)
    try:
        params = cls.Params.model_validate(ref.params)
    except ValidationError as err:
        problems = [
            (_params_field(error["loc"]), error_message(error, cls.Params))
            for error in err.errors(include_url=False)
        ]
        raise PolicyError(*problems[0], more=problems[1:]) from err
    try:
        policy = cls(params)
    except (Exception, SystemExit) as err:
        raise PolicyError(
            "spec.policy.name", f"{ref.name!r} cannot be built: {_describe_error(err)}"
        ) from err
    if ref.name in BUILTIN_POLICIES:  # the built-ins declare it (their tests check)
        return policy
    return _with_observes(policy, ref.name)


def params_warnings(spec: HerdJobSpec) -> list[str]:
    """What is odd but allowed in a valid spec's policy params: a GPU count they name outside
    the job's [min, max] (`static` with `gpus: 8` and `max: 4` runs on 4, silently). Said by
    `validate` and, as a Warning event, by the operator when it records the spec.

    A policy's Params tell their counts by a `gpu_counts()` method ((field, count) pairs);
    one without it (a plug-in's) gets no warnings. Params that do not validate get none
    either: their errors are said elsewhere."""
    try:
        params = find_policy_class(spec.policy.name).Params.model_validate(spec.policy.params)
        gpu_counts = getattr(params, "gpu_counts", None)
        counts: list[tuple[str, int]] = list(gpu_counts()) if callable(gpu_counts) else []
    except (Exception, SystemExit):  # an unknown policy, bad params, a plug-in's own error
        return []
    low, high = spec.gpus.min, spec.gpus.max
    warnings = []
    for field, count in counts:
        if count > high:
            bound = f"more than spec.gpus.max ({high}): the job runs on {high} at most"
        elif count < low:
            bound = f"fewer than spec.gpus.min ({low}): the job runs on {low} at least"
        else:
            continue
        warnings.append(f"spec.policy.params.{field}: {count} GPUs is {bound}")
    return warnings


def _params_field(location: tuple[int | str, ...]) -> str:
    """Where in the spec a params error is: `spec.policy.params.low`."""
    where = format_location(location) if location else ""
    if not where or where.startswith("["):
        return f"spec.policy.params{where}"
    return f"spec.policy.params.{where}"


def _describe_error(err: BaseException) -> str:
    text = str(err)
    if isinstance(err, SystemExit):
        return f"it tried to exit the process (SystemExit {text or 0})"
    return text or type(err).__name__


class LegacyPlugin:
    """A plug-in written before policies declared what they observe, with what it is given.

    A wrapper rather than an attribute set on the plug-in: its instance may refuse one
    (`__slots__`), and one set on its class would be inherited by its subclasses, which may
    say `needs_usage` themselves."""

    __slots__ = ("observes", "policy")

    def __init__(self, policy: Policy, observes: frozenset[Signal]) -> None:
        self.policy = policy
        self.observes = observes

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        return self.policy.desired(job, observed, now)


def _with_observes(policy: Policy, name: str) -> Policy:
    """The plug-in if it declares what it observes; an older one wrapped with its old view."""
    declared: object = getattr(policy, "observes", None)
    if declared is None:
        legacy = LEGACY_OBSERVES
        if getattr(policy, "needs_usage", False):
            legacy |= {Signal.USAGE}
        return LegacyPlugin(policy, legacy)
    # Once per reconcile: a subset test, not a loop (plain strings equal their Signal).
    if not (isinstance(declared, set | frozenset) and declared <= _SIGNALS):
        raise PolicyError(
            "spec.policy.name",
            f"{name!r} declares it observes {declared!r}: expected a frozenset of"
            f" {', '.join(sorted(_SIGNALS))}",
        )
    return policy
