"""`herd-operator exporter`, the per-node process: registers with the operator and serves the
node's GPUs labelled with the job that holds them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.nvml import nvml_gpu_count
from tests.integration.harness import REPO, digits_command, operator_harness, spec_document

HERD = str(Path(sys.executable).with_name("herd-operator"))


def scrape(address: str) -> dict[tuple[str, str, str], float]:
    """(metric, gpu, herd_job) -> value for the herd_gpu_memory_* series."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels["gpu"], sample.labels["herd_job"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("herd_gpu_memory_")
    }


def mapped_jobs(directory: Path) -> dict[str, str]:
    """dcgm-exporter's view of its HPC job mapping dir: integer-named files, a job per line
    (an empty file labels nothing: the writer empties a GPU's file rather than delete it)."""
    return {
        path.name: text
        for path in directory.iterdir()
        if path.is_file() and path.name.isdigit() and (text := path.read_text())
    }


def test_exporter_registers_and_labels_gpus_with_their_job(tmp_path: Path) -> None:
    mapping_dir = tmp_path / "dcgm-job-map"
    with operator_harness(tmp_path, metrics_port=0) as herd:
        exporter = subprocess.Popen(
            [
                HERD,
                "exporter",
                "--state-dir",
                str(herd.layout.root),
                "--port",
                "0",
                "--listen",
                "127.0.0.1",
                "--host",
                "localhost",
                "--virtual-gpus",
                "4",
                "--virtual-gpu-memory",
                "1GiB",
                "--dcgm-job-mapping-dir",
                str(mapping_dir),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            targets = herd.layout.scrape_targets_file

            def exporter_address() -> str | None:
                groups = json.loads(targets.read_text()) if targets.exists() else []
                found = [g["targets"][0] for g in groups if g["labels"]["herd_role"] == "exporter"]
                return found[0] if found else None

            address = herd.wait_for(exporter_address, "the exporter to register")
            assert address.startswith("localhost:")
            assert scrape(address)[("herd_gpu_memory_total_bytes", "0", "")] == 2**30

            herd.write_spec(
                spec_document("pair", 2, 2, digits_command(300, "--step-delay", "0.05"))
            )
            herd.wait_for(
                lambda: (herd.job("pair") or {}).get("gpus", {}).get("active") == 2,
                "the job on 2 workers",
                job="pair",
            )
            series = herd.wait_for(
                lambda: (
                    (s := scrape(address))
                    # Both workers: one may load its model seconds after the other.
                    and all(
                        s.get(("herd_gpu_memory_used_bytes", gpu, "pair"), 0) > 50 * 2**20
                        for gpu in ("0", "1")
                    )
                    and s
                ),
                "the exporter to measure the job's workers",
                job="pair",
            )
            assert series[("herd_gpu_memory_used_bytes", "0", "pair")] > 50 * 2**20
            assert series[("herd_gpu_memory_used_bytes", "2", "")] == 0, "GPU 2 is free"
            # dcgm-exporter would label GPUs 0 and 1 hpc_job="pair", and GPU 2 not at all.
            herd.wait_for(
                lambda: mapped_jobs(mapping_dir) == {"0": "pair\n", "1": "pair\n"},
                "the exporter to write dcgm-exporter's job mapping",
                job="pair",
            )
        finally:
            exporter.send_signal(signal.SIGTERM)
            output, _ = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, output
        assert "registered with the operator" in output
        # A stopped exporter leaves the scrape targets and takes its lines out of the
        # mapping files at once.
        assert "unregistered from the operator" in output
        assert exporter_address() is None
        assert mapped_jobs(mapping_dir) == {}


def test_an_exporter_given_its_hosts_key_on_stdin_registers_and_the_key_stays_off_disk(
    tmp_path: Path,
) -> None:
    """`agent-key --host H | exporter --key-stdin --host H`, as the sbatch runs it through
    srun; about 5 s. With `run --no-agent-key-files` no agent key is on the state dir. As in
    the sbatch, no --virtual-gpus: the agent serves as many GPUs as the pool has on its host,
    and no --listen: it serves on loopback, where its name (localhost) is, not on every
    interface."""
    with operator_harness(tmp_path, 3, metrics_port=0, agent_key_files=False) as herd:
        assert not any(herd.layout.secrets_dir.glob("agent*"))
        state = str(herd.layout.root)
        printed = subprocess.run(
            [HERD, "agent-key", "--state-dir", state, "--host", "localhost"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        key = printed.stdout.strip()
        assert len(key) == 64
        # Not inside a Slurm job, whatever runs the tests: the count comes from the pool.
        without_slurm = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        # A pipe like srun's stdin: the key, then end of file.
        read_end, write_end = os.pipe()
        os.write(write_end, printed.stdout.encode())
        os.close(write_end)
        try:
            exporter = subprocess.Popen(
                [HERD, "exporter", "--state-dir", state, "--port", "0", "--host", "localhost",
                 "--key-stdin"],
                cwd=REPO, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=without_slurm,
            )  # fmt: skip
        finally:
            os.close(read_end)
        try:
            targets = herd.layout.scrape_targets_file

            def registered() -> str | None:
                text = targets.read_text() if targets.exists() else ""
                found = re.search(r"localhost:[0-9]+", text)
                return found[0] if found else None

            address = herd.wait_for(registered, "the exporter to register with the key from stdin")
            gpus = nvml_gpu_count() or 3  # NVML's GPUs are served as NVML sees them
            herd.wait_for(
                lambda: (
                    {gpu for name, gpu, _ in scrape(address) if name.endswith("total_bytes")}
                    == {str(index) for index in range(gpus)}
                ),
                f"the exporter to serve {gpus} GPUs",
            )
        finally:
            exporter.send_signal(signal.SIGTERM)
            output, _ = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, output
        assert "registered with the operator" in output and key not in output
        assert "registered with the operator as agent:localhost (its pool has 3 GPUs here)" in (
            output
        )
        assert re.search(r"on http://127\.0\.0\.1:[0-9]+/metrics \(loopback: ", output), output
        assert not any(herd.layout.secrets_dir.glob("agent*"))
