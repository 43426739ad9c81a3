"""Metrics in the loop: a real Prometheus scrapes the operator, and the memory policy
decides on what PromQL returns."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from tests.integration.harness import REPO, digits_command, operator_harness, spec_document
from tests.integration.prometheus import prometheus

DASHBOARD = REPO / "deploy" / "grafana" / "herd-dashboard.json"
# Emitted only for fields real GPUs have (NVML); checked against the collector over fake NVML
# in tests/unit/test_gpu_collector.py.
NVML_ONLY = {"herd_gpu_utilization_ratio", "herd_gpu_power_watts"}
# Exported only with --process-metrics (a pid label per process); checked with it on in
# tests/unit/test_dashboard.py.
OPT_IN = {"herd_gpu_process_memory_used_bytes"}


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    exprs.append(dashboard["templating"]["list"][1]["definition"])
    return set(re.findall(r"\bherd_[a-z0-9_]+", " ".join(exprs)))


def exposed_names(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("herd_")
    }


def value(result: list[dict]) -> float:  # type: ignore[type-arg]
    return float(result[0]["value"][1])


def test_prometheus_scrapes_the_operator_and_promql_drives_the_memory_policy(
    tmp_path: Path,
) -> None:
    targets = tmp_path / "state" / "prometheus" / "targets.json"
    with (
        prometheus(tmp_path / "prom", targets) as prom,
        operator_harness(tmp_path, metrics_port=0, prometheus_url=prom.url) as herd,
    ):
        memory = {"name": "memory", "params": {"cooldownSeconds": 0}}
        herd.write_spec(
            # `training.epochs`: the dashboard's progress and ETA panels need an expected end.
            spec_document(
                "idle",
                1,
                2,
                digits_command(400, "--step-delay", "0.02"),
                policy=memory,
                training={"epochs": 400},
            )
        )
        herd.wait_for(
            lambda: any(t["health"] == "up" for t in prom.targets()),
            "Prometheus to scrape the operator",
        )
        herd.wait_for(
            lambda: (r := prom.query('herd_job_gpus_allocated{herd_job="idle"}')) and value(r) == 2,
            "the grant of 2 in Prometheus",
            job="idle",
        )

        # The series come with the grant; the memory once the workers bound to the GPUs.
        used = herd.wait_for(
            lambda: (
                len(r := prom.query('herd_gpu_memory_used_bytes{herd_job="idle"}')) == 2
                and all(float(s["value"][1]) > 50 * 2**20 for s in r)
                and r
            ),
            "the memory of the job's workers on its 2 virtual GPUs",
            job="idle",
        )
        assert {s["metric"]["kind"] for s in used} == {"virtual"}
        # The same memory charged to the job by its workers' pids, one series per GPU, and
        # each of its GPUs holding one job (issue 30's accounting for shared GPUs).
        charged = herd.wait_for(
            lambda: (
                len(r := prom.query('herd_job_gpu_memory_used_bytes{herd_job="idle"}')) == 2
                and all(float(s["value"][1]) > 50 * 2**20 for s in r)
                and r
            ),
            "the job's memory per GPU charged to it",
            job="idle",
        )
        gpus = {(s["metric"]["host"], s["metric"]["gpu"]) for s in charged}
        assert gpus == {(s["metric"]["host"], s["metric"]["gpu"]) for s in used}
        jobs = {
            (s["metric"]["host"], s["metric"]["gpu"]): float(s["value"][1])
            for s in prom.query("herd_gpu_jobs")
        }
        assert {gpu: jobs[gpu] for gpu in gpus} == dict.fromkeys(gpus, 1.0)
        # The allocator's input for sharing: the job's peak per worker, from the same readings.
        # The peak is kept by the operator's own 1 s sampling loop, not by the scrape, so it
        # may lag Prometheus by a round (a CI run under load read 26 MB here just after the
        # scrape showed more than 50): wait for the loop rather than assert at once.
        watch = herd.operator.gpu_memory
        assert watch is not None
        herd.wait_for(
            lambda: (p := watch.peaks.peak("idle")) is not None and p > 50 * 2**20,
            "the sampling loop's peak of the job's workers",
            job="idle",
        )
        assert value(prom.query('herd_pool_gpus{state="free"}')) == 2
        assert value(prom.query('herd_allocator_requests_total{op="bind",result="ok"}')) >= 2

        # The only memory signal this operator has is PromQL: a shrink proves the loop.
        shrink = herd.wait_for(
            lambda: [e.message for e in herd.events("idle") if e.reason == "Resized"],
            "the memory policy to shrink the idle job",
            job="idle",
            timeout=180,
        )
        assert "memory 0." in shrink[0] and "< 0.25" in shrink[0], shrink
        stale = herd.condition("idle", "MetricsStale")
        assert stale is not None and stale["status"] == "False", stale

        # Every metric the dashboard queries exists in the real exposition (some only at
        # times: `active` after the resize once the workers report their new world size).
        address = herd.operator._metrics_address

        def missing() -> set[str]:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                exposed = exposed_names(response.read().decode())
            return {
                name
                for name in dashboard_metric_names() - NVML_ONLY - OPT_IN
                if not any(e == name or e.startswith(name + "_") for e in exposed)
            }

        herd.wait_for(lambda: not missing(), "every metric the dashboard queries", job="idle")
        assert json.loads(targets.read_text())[0]["labels"] == {"herd_role": "operator"}
