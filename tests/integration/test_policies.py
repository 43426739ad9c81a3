"""Policies on real jobs: the memory signal is the measured memory of real workers.

The jobs that start more than one worker have their workers forked by the job's zygote
(`harness.ZYGOTE`): each grow here starts one to three workers, which is what the
policies are checked on, not how a worker starts (test_jobs and test_faults start theirs
the usual way)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from herd_operator.policies.registry import reset_plugin_cache
from tests.integration.harness import ZYGOTE, OperatorHarness, digits_command, spec_document
from tests.unit.plugin_policy import TEST_PLUGINS, install, write_distribution


@pytest.fixture
def test_plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The unit tests' policies installed as a plug-in distribution, for the operator that
    runs in this process."""
    site = tmp_path / "site-packages"
    write_distribution(site, "herd-test-plugins", TEST_PLUGINS)
    install(site, monkeypatch)
    yield site
    reset_plugin_cache()


def epochs_by_world_size(herd: OperatorHarness, name: str) -> dict[int, int]:
    """epoch -> world size, from the workers' own epoch reports (the last report wins)."""
    return {r.epoch: r.world_size for r in herd.reports(name) if r.epoch is not None}


def assert_no_epoch_lost(herd: OperatorHarness, name: str, epochs: int) -> None:
    reported = [r.epoch for r in herd.reports(name) if r.epoch is not None]
    assert reported == sorted(reported), f"{name}: the epoch counter went back: {reported}"
    assert set(reported) == set(range(epochs)), f"{name}: epochs reported {reported}"


def succeeded(herd: OperatorHarness, name: str) -> bool:
    condition = herd.condition(name, "Succeeded")
    return condition is not None and condition["status"] == "True"


def test_memory_policy_moves_gpus_from_the_idle_job_to_the_hungry_one(
    herd: OperatorHarness,
) -> None:
    # windowSeconds past any start: each decision reads a full epoch's samples. With the
    # default 60 s, workers that took longer than that to end their first epoch (3 starting
    # at once on 2 cores at load 13-20) were judged on a time window and shrunk before it.
    memory: dict[str, Any] = {
        "name": "memory",
        "params": {
            "low": 0.25,
            "high": 0.75,
            "cooldownSeconds": 0,
            "cooldownEpochs": 1,
            "windowSeconds": 600,
        },
    }
    # Each virtual GPU has 2 GiB (the harness); a torch worker alone uses ~0.3 GiB (~15%),
    # with --hold-mb 1400 it uses ~1.7 GiB (~85%).
    idle = digits_command(14, "--step-delay", "0.05")
    hungry = digits_command(16, "--step-delay", "0.05", "--hold-mb", "1400")
    # The idle job first takes 3 of the 4 GPUs; the hungry one starts on the last one. Its
    # higher priority keeps the allocator's fair share from splitting them 2/2 when the
    # hungry job arrives after the idle job's resize freeze (a race on a loaded machine):
    # only the memory policy moves GPUs here.
    herd.write_spec(spec_document("idle", 1, 3, idle, policy=memory, priority=1, horovod=ZYGOTE))
    herd.wait_for(
        lambda: (herd.job("idle") or {}).get("gpus", {}).get("allocated") == 3,
        "the idle job on 3 GPUs",
        job="idle",
    )
    herd.write_spec(spec_document("hungry", 1, 3, hungry, policy=memory, horovod=ZYGOTE))

    herd.wait_for(
        lambda: succeeded(herd, "idle") and succeeded(herd, "hungry"),
        "both jobs to finish",
        timeout=420,
        job="hungry",
    )

    idle_sizes = epochs_by_world_size(herd, "idle")
    hungry_sizes = epochs_by_world_size(herd, "hungry")
    assert idle_sizes[0] == 3 and min(idle_sizes.values()) == 1, f"idle: {idle_sizes}"
    assert hungry_sizes[0] == 1 and max(hungry_sizes.values()) == 3, f"hungry: {hungry_sizes}"
    assert_no_epoch_lost(herd, "idle", 14)
    assert_no_epoch_lost(herd, "hungry", 16)
    shrink = [e.message for e in herd.events("idle") if e.reason == "Resized"]
    grow = [e.message for e in herd.events("hungry") if e.reason == "Resized"]
    story = herd.diagnostics("idle") + "\n" + herd.diagnostics("hungry")
    assert all(e.reason != "BackOff" for e in herd.events()), story
    assert any("memory 0." in m and "< 0.25" in m for m in shrink), story
    assert any("memory 0." in m and "> 0.75" in m for m in grow), story


def test_schedule_policy_resizes_by_epoch(herd: OperatorHarness) -> None:
    schedule = {
        "name": "schedule",
        "params": {"initial": 2, "steps": [{"atEpoch": 3, "gpus": 4}, {"atEpoch": 6, "gpus": 2}]},
    }
    herd.write_spec(
        spec_document(
            "sched",
            1,
            4,
            digits_command(9, "--step-delay", "0.03"),
            policy=schedule,
            horovod=ZYGOTE,
        )
    )
    herd.wait_for(
        lambda: succeeded(herd, "sched"), "the scheduled job to finish", timeout=300, job="sched"
    )
    sizes = epochs_by_world_size(herd, "sched")
    assert_no_epoch_lost(herd, "sched", 9)
    # Within one epoch of each step: epochs 0-2 at 2, 4-5 at 4, 7-8 at 2.
    assert [sizes[e] for e in (0, 1, 2)] == [2, 2, 2], sizes
    assert [sizes[e] for e in (4, 5)] == [4, 4], sizes
    assert [sizes[e] for e in (7, 8)] == [2, 2], sizes


@pytest.mark.timeout(900)  # each wait below has its own bound; on a saturated machine they add up
def test_high_priority_job_is_admitted_by_shrinking_an_elastic_job(herd: OperatorHarness) -> None:
    elastic = digits_command(300, "--step-delay", "0.05")
    herd.write_spec(spec_document("elastic", 1, 4, elastic, horovod=ZYGOTE))
    # Training at 4, not only bound to 4 GPUs: workers still importing torch when the urgent
    # job came made its wait for their GPUs a wait for their start as well (over 90 s at
    # load 27 on 2 cores), and the shrink needs them past their first commit.
    herd.wait_for(
        lambda: (
            (herd.job("elastic") or {}).get("gpus", {}).get("active") == 4
            and any(r.world_size == 4 for r in herd.reports("elastic"))
        ),
        "the elastic job training on 4 workers",
        job="elastic",
        timeout=300,
    )
    herd.write_spec(spec_document("urgent", 3, 3, digits_command(2), priority=10, horovod=ZYGOTE))
    # Two bounds, each generous: the urgent job waited 82-117 s at load 15-27 for the
    # elastic job's 3 workers to leave their GPUs (a reset), then its driver and 3 workers
    # start, train and end; one 180 s bound for both failed with nothing stuck.
    herd.wait_for(
        lambda: (c := herd.condition("urgent", "Admitted")) and c["status"] == "True",
        "the urgent job admitted",
        timeout=300,
        job="urgent",
    )
    herd.wait_for(
        lambda: succeeded(herd, "urgent"), "the urgent job to finish", timeout=300, job="urgent"
    )
    shrink = [e.message for e in herd.events("elastic") if e.reason == "Resized"]
    assert any("4 -> 1" in m and "urgent" in m for m in shrink), shrink
    sizes = [r.world_size for r in herd.reports("elastic")]
    assert 1 in sizes, f"the elastic job never ran at its min: {sizes}"
    # Once the urgent job is done, the elastic job gets its GPUs back.
    herd.wait_for(
        lambda: (herd.job("elastic") or {})["gpus"]["active"] == 4,
        "the elastic job back on 4 workers",
        job="elastic",
        timeout=120,
    )


def test_an_installed_plugin_sizes_a_job_and_a_module_reference_is_refused(
    herd: OperatorHarness, test_plugin_site: Path
) -> None:
    herd.write_spec(
        spec_document("module", 1, 1, digits_command(1), policy={"name": "unittest.__main__:Main"})
    )
    # The plug-in `half` asks for half of max: 2 of 4.
    half = spec_document("half", 1, 4, digits_command(2), policy={"name": "half"}, horovod=ZYGOTE)
    herd.write_spec(half)
    herd.wait_for(lambda: succeeded(herd, "half"), "the plug-in's job to finish", job="half")
    assert set(epochs_by_world_size(herd, "half").values()) == {2}
    refused = [e.message for e in herd.events("module") if e.reason == "InvalidSpec"]
    assert refused, herd.diagnostics("module")
    assert "spec.policy.name: 'unittest.__main__:Main' is a module:Class reference" in refused[0]
    assert herd.job("module") is None  # never started
    assert "unittest.__main__" not in sys.modules
