"""The Grafana dashboard (deploy/grafana/herd-dashboard.json), checked without a Grafana.

Against what the operator and the exporters really export (their registries' exposition,
built here from a store, an allocator's view and GPU readings), and against PromQL's
grammar (`promtool check rules` parses every query, when promtool is installed).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.gpu import GpuReading, ProcessMemory
from herd_operator.runtime.metrics import OperatorMetrics, StateCollector
from herd_operator.runtime.store import Store
from herd_operator.specs import Condition, ConditionStatus, HerdJob
from herd_operator.specs.status import GpuCounts, HerdJobStatus, Progress, ResizeCost
from herd_operator.specs.values import Placement, Pool, ResizeMode

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "herd-dashboard.json"
METRIC = re.compile(r"\b(herd_[a-z0-9_]+)(\{[^}]*\})?")
JOB_FILTER = 'herd_job=~"$job"'
RESIZE = ResizeCost(
    before=2, after=1, seconds=3.0, engine="torchrun", mode=ResizeMode.RESTART, completed_at=1.5
)


class Gpus:
    """Two NVML GPUs with every field read, one of them busy with two processes."""

    def read(self) -> list[GpuReading]:
        return [
            GpuReading("n1", 0, "GPU-0", "nvml", 3 << 30, 80 << 30, 0.5, 300.0,
                       (ProcessMemory(11, 1 << 30), ProcessMemory(12, 2 << 30))),
            GpuReading("n1", 1, "GPU-1", "nvml", 0, 80 << 30, 0.0, 60.0),
        ]  # fmt: skip


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every family the operator serves (state, instruments) and an exporter serves (GPUs,
    with per-process metrics on), with one running memory-policy job so that each has
    samples."""
    store = Store(tmp_path_factory.mktemp("state") / "state.db")
    job = HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "resnet"},
            "spec": {
                "command": ["python"],
                "gpus": {"min": 1, "max": 2},
                "policy": {"name": "memory"},
            },
        }
    )
    store.record_spec("resnet", "resnet.yaml", job, "f", 1.0)
    running = Condition(
        type="Running", status=ConditionStatus.TRUE, reason="Training",
        last_transition_time=1.0, observed_generation=1,
    )  # fmt: skip
    status = HerdJobStatus(
        conditions=(running,), gpus=GpuCounts(min=1, max=2, desired=2, allocated=1, active=1),
        epoch=1, metrics={"loss": 0.5, "val/acc": 0.9},
        progress=Progress(epochs=10, completed=2, epoch_seconds=4.0, world_size=1,
                          estimated_completion=40.0),
        last_resize=RESIZE,
    )  # fmt: skip
    store.put_status("resnet", status, 2.0)
    store.add_usage("resnet", 1, 3 << 30, 80 << 30, 3.0)
    placements = {"resnet": Placement((("n1", (0,)),))}
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.resize_completed("resnet", RESIZE)
    metrics.reconcile_duration.observe(0.01)
    metrics.loops.started("pruner")  # a loop that ran a step and failed one
    metrics.loops.succeeded("pruner")
    metrics.loops.failed("pruner")
    registry.register(
        StateCollector(
            store, lambda: Pool.from_counts({"n1": 2}), lambda: placements,
            lambda: {("bind", "ok"): 1},
        )
    )  # fmt: skip
    registry.register(
        GpuCollector(
            Gpus(), lambda: {("n1", 0): "resnet"}, per_process=True,
            pid_owners=lambda: {("n1", 11): "resnet"},
        )
    )  # fmt: skip
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def families(exposition: str) -> dict[str, set[str]]:
    """Sample name -> its label names, as a scrape shows them."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query: panels, annotations, the job variable."""
    board = dashboard()
    found = [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"])
        for panel in board["panels"]
        for target in panel["targets"]
    ]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in board["annotations"]["list"]]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # Grafana's label_values(selector, label): the selector is the query.
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
            assert selector is not None, variable["definition"]
            found.append((f"variable {variable['name']!r}", selector.group(1)))
    return found


def test_every_metric_the_dashboard_queries_is_exported(families: dict[str, set[str]]) -> None:
    missing = {
        (where, name)
        for where, expr in queries()
        for name, _ in METRIC.findall(expr)
        if name not in families
    }
    assert not missing, f"queried but exported by nobody: {sorted(missing)}"


def test_every_query_of_a_per_job_metric_selects_the_job_variable(
    families: dict[str, set[str]],
) -> None:
    unfiltered = [
        (where, name + selector)
        for where, expr in queries()
        if not where.startswith("variable")
        for name, selector in METRIC.findall(expr)
        if "herd_job" in families.get(name, set()) and JOB_FILTER not in selector
    ]
    assert not unfiltered, f"per-job series shown for every job: {unfiltered}"
    assert dashboard()["templating"]["list"][1]["allValue"] == ".*", "All keeps free GPUs"


def expected_unit(expr: str) -> str:
    """The Grafana unit a query's values have, from PromQL and the metric's base unit."""
    if expr.startswith("histogram_quantile"):
        return "s"
    if "rate(" in expr and "increase(" not in expr:
        return "ops"
    name = METRIC.findall(expr)[0][0]
    for suffix, unit in (("_bytes", "bytes"), ("_ratio", "percentunit"), ("_watts", "watt"),
                         ("_seconds", "s")):  # fmt: skip
        if name.endswith(suffix):
            return unit
    return "none"  # counts: GPUs, jobs, resizes, restarts, a 0/1 state


def overrides_by_ref(panel: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for override in panel["fieldConfig"]["overrides"]:
        assert override["matcher"]["id"] == "byFrameRefID", panel["title"]
        ref = override["matcher"]["options"]
        found[ref] = {p["id"]: p["value"] for p in override["properties"]}
    return found


def test_each_series_has_its_unit_and_each_axis_one_unit() -> None:
    for panel in dashboard()["panels"]:
        if panel["type"] != "timeseries":
            continue
        default = panel["fieldConfig"]["defaults"]["unit"]
        overrides = overrides_by_ref(panel)
        units_by_axis: dict[str, set[str]] = {}
        for target in panel["targets"]:
            override = overrides.get(target["refId"], {})
            unit = override.get("unit", default)
            assert unit == expected_unit(target["expr"]), (panel["title"], target["expr"])
            axis = override.get("custom.axisPlacement", "left")
            units_by_axis.setdefault(axis, set()).add(unit)
        assert all(len(units) == 1 for units in units_by_axis.values()), (
            panel["title"], units_by_axis,
        )  # fmt: skip


def test_the_per_process_panel_shows_each_process() -> None:
    [panel] = [
        p for p in dashboard()["panels"]
        if any("herd_gpu_process_memory_used_bytes" in t["expr"] for t in p["targets"])
    ]  # fmt: skip
    for target in panel["targets"]:
        assert not re.search(r"\b(sum|avg|max|min|count)\b", target["expr"]), target["expr"]
        assert "{{pid}}" in target["legendFormat"]


def test_a_table_lists_each_jobs_status() -> None:
    tables = [p for p in dashboard()["panels"] if p["type"] == "table"]
    status_tables = [p for p in tables if any("herd_job_status" in t["expr"] for t in p["targets"])]
    assert len(status_tables) == 1
    [table] = status_tables
    assert all(t.get("instant") and t.get("format") == "table" for t in table["targets"])
    renamed = {
        name
        for step in table["transformations"]
        if step["id"] == "organize"
        for name in step["options"]["renameByName"]
    }
    assert {"herd_job", "status"} <= renamed


def test_panels_do_not_overlap_and_ids_are_unique() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """Each query as a recording rule: `promtool check rules` parses its expression."""
    variables = {"$job": ".*", "${datasource}": "x"}
    rules = []
    for index, (_, expr) in enumerate(queries()):
        for name, value in variables.items():
            expr = expr.replace(name, value)
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_each_family_is_exposed_once(exposition: str) -> None:
    declared = [line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE")]
    assert len(declared) == len(set(declared)), sorted(declared)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_exposition_follows_prometheus_naming_conventions(exposition: str) -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_shared_gpus_panel_shows_each_job_on_each_gpu() -> None:
    [panel] = [
        p for p in dashboard()["panels"]
        if any("herd_job_gpu_memory_used_bytes" in t["expr"] for t in p["targets"])
    ]  # fmt: skip
    [memory] = [t for t in panel["targets"] if "herd_job_gpu_memory_used_bytes" in t["expr"]]
    assert not re.search(r"\b(sum|avg|max|min|count)\b", memory["expr"]), memory["expr"]
    assert "{{herd_job}}" in memory["legendFormat"] and "{{gpu}}" in memory["legendFormat"]
