"""Several hosts and a real Slurm on one machine: for the multi-node tests and benchmark.

Each host is a network namespace with its own address, host name and `/etc/hosts`; a
bridge in a namespace of its own joins them, and the root namespace gets no address and
no route, so no test traffic leaves the namespaces. Each compute host runs its own sshd
(horovodrun reaches the other nodes over ssh, as on a real allocation) and a slurmd; the
first host runs slurmctld. One munged with a private key and socket serves them all (a
socket is a file: every namespace sees it). Fake GPUs for Slurm's GRES are character
devices made with mknod; the workers train on the CPU (virtual GPUs).

Everything is started by `namespace_cluster()` and torn down when it ends, also when the
test fails: processes first (each with its whole process group), then the namespaces.
Needs root, `ip netns` and Debian's openssh-server; with Slurm (the default) also slurmctld,
slurmd, slurm-client and munge (scripts/bootstrap.sh installs them all as root);
`cluster_unavailable()` says why not. Without Slurm (`slurm=False`) the hosts and their sshd
are all there is: what a benchmark that names the hosts itself needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NEEDED_FOR_HOSTS = ("ip", "nsenter", "unshare", "/usr/sbin/sshd", "ssh", "ssh-keygen")
NEEDED_FOR_SLURM = ("munged", "slurmctld", "slurmd", "sbatch")
SSHD_CONFIG = """\
Port 22
HostKey {root}/ssh/host_ed25519
AuthorizedKeysFile {root}/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
ClientAliveInterval 5
PidFile none
"""
# Keepalives: a node whose link goes down is dropped by ssh in ~6 s instead of hanging
# horovodrun until a TCP timeout.
SSH_CONFIG = """\
Host *
  User root
  IdentityFile {root}/ssh/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 5
  ServerAliveInterval 2
  ServerAliveCountMax 3
"""
# SlurmdTimeout: a test takes a node's link down for about a minute; a real outage that long
# would make Slurm drop the node from the allocation (see docs/slurm.md), which is not what
# the tests are about.
SLURM_CONF = """\
ClusterName=herdtest
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={root}/slurm/state
SlurmdSpoolDir={root}/slurm/spool/%n
SlurmctldPidFile={root}/slurm/slurmctld.pid
SlurmdPidFile={root}/slurm/slurmd.%n.pid
SlurmctldLogFile={root}/slurm/log/slurmctld.log
SlurmdLogFile={root}/slurm/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=15
MinJobAge=60
GresTypes=gpu
NodeName={nodes} CPUs=2 RealMemory=2000 Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def cluster_unavailable(slurm: bool = True) -> str | None:
    """Why this machine cannot host the test cluster (with Slurm or not), None when it can."""
    if os.geteuid() != 0:
        return "network namespaces" + (" and a real Slurm" if slurm else "") + " need root"
    needed = NEEDED_FOR_HOSTS + (NEEDED_FOR_SLURM if slurm else ())
    missing = [name for name in needed if shutil.which(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (scripts/bootstrap.sh installs them as root)"
    probe = f"herdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NamespaceCluster:
    root: Path
    compute: int = 3
    gpus_per_node: int = 2
    slurm: bool = True
    subnet: str = "10.231.0"
    tag: str = field(default_factory=lambda: f"herd{os.getpid() % 100000}")
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def controller(self) -> str:
        return "h0"

    @property
    def nodes(self) -> list[str]:
        return [f"h{index}" for index in range(1, self.compute + 1)]

    @property
    def hosts(self) -> list[str]:
        return [self.controller, *self.nodes]

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + int(host[1:])}"

    def netns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def bin_dir(self) -> Path:
        """Put first on PATH: its `ssh` uses the cluster's keys and config."""
        return self.root / "bin"

    @property
    def environ(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm" / "slurm.conf")}

    def on(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: its network, host name and /etc/hosts (cgroups kept)."""
        hosts_file = self.root / "hosts" / host
        return [
            "nsenter", f"--net=/run/netns/{self.netns(host)}",
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
            "on-host", str(hosts_file), host, *argv,
        ]  # fmt: skip

    def run(self, host: str, argv: Sequence[str], timeout: float = 60) -> str:
        result = subprocess.run(
            self.on(host, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.environ,
            check=False,
        )
        if result.returncode:
            raise RuntimeError(f"{' '.join(argv)} on {host}: {result.stderr.strip()}")
        return result.stdout

    def spawn(
        self,
        host: str | None,
        argv: Sequence[str],
        log: str,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` (None: here) in a session of its own, output to `log`;
        `env` is added to the cluster's environment. Stopped by `close()`."""
        out = open(self.root / "log" / log, "wb")  # noqa: SIM115 (the process keeps it)
        command = self.on(host, argv) if host else list(argv)
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**self.environ, **(env or {})},
            start_new_session=True,
        )
        out.close()
        self.processes.append(process)
        return process

    # ---- start ----

    def start(self) -> None:
        spools = [f"slurm/spool/{node}" for node in self.nodes]
        for directory in ("log", "hosts", "ssh", "bin", "munge", "slurm/state", "slurm/log",
                          "slurm/dev", *spools):  # fmt: skip
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        self._network()
        self._ssh()
        if self.slurm:
            self._munge()
            self._slurm()

    def _network(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{self.address(h)} {h}" for h in self.hosts)]
        switch = f"{self.tag}-sw"
        self._ip("netns", "add", switch)
        self.namespaces.append(switch)
        self._ip("-n", switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", switch, "link", "set", "br0", "up")
        for host in self.hosts:
            namespace = self.netns(host)
            self._ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            veth = f"v{host}"
            self._ip("-n", switch, "link", "add", veth, "type", "veth",
                     "peer", "name", "eth0", "netns", namespace)  # fmt: skip
            self._ip("-n", switch, "link", "set", veth, "master", "br0")
            self._ip("-n", switch, "link", "set", veth, "up")
            self._ip("-n", namespace, "link", "set", "lo", "up")
            self._ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            self._ip("-n", namespace, "link", "set", "eth0", "up")
            (self.root / "hosts" / host).write_text("\n".join(lines) + "\n")

    def _ssh(self) -> None:
        ssh = self.root / "ssh"
        for key in ("host_ed25519", "id_ed25519"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)], check=True
            )
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        (ssh / "sshd_config").write_text(SSHD_CONFIG.format(root=self.root))
        (ssh / "ssh_config").write_text(SSH_CONFIG.format(root=self.root))
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {ssh / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for node in self.nodes:
            self.spawn(node, ["/usr/sbin/sshd", "-D", "-e", "-f", str(ssh / "sshd_config")],
                       f"sshd.{node}.log")  # fmt: skip
        for node in self.nodes:
            self._until(lambda node=node: self._reaches(node), f"sshd on {node}", 15)

    def _reaches(self, node: str) -> bool:
        try:
            return self.run(self.controller, [str(self.bin_dir / "ssh"), node, "hostname"],
                            timeout=10).strip() == node  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def _munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.spawn(None, [
            "munged", "-F", "--force", f"--key-file={key}", f"--socket={munge / 'socket'}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'seed'}",
        ], "munged.log")  # fmt: skip
        self._until(lambda: (munge / "socket").exists(), "munged's socket", 10)

    def _slurm(self) -> None:
        slurm = self.root / "slurm"
        devices = []
        for node_index, node in enumerate(self.nodes):
            first = node_index * self.gpus_per_node
            for gpu in range(first, first + self.gpus_per_node):
                os.mknod(slurm / "dev" / f"nvidia{gpu}", 0o600 | 0o020000, os.makedev(195, gpu))
            last = first + self.gpus_per_node - 1
            devices.append(
                f"NodeName={node} Name=gpu File={slurm}/dev/nvidia[{first}-{last}]"
                if last > first
                else f"NodeName={node} Name=gpu File={slurm}/dev/nvidia{first}"
            )
        (slurm / "gres.conf").write_text("AutoDetect=off\n" + "\n".join(devices) + "\n")
        (slurm / "slurm.conf").write_text(
            SLURM_CONF.format(
                root=self.root,
                controller=self.controller,
                nodes=f"h[1-{self.compute}]",
                gpus=self.gpus_per_node,
            )
        )
        self.spawn(self.controller, ["slurmctld", "-D", "-i"], "slurmctld.out")
        for node in self.nodes:
            self.spawn(node, ["slurmd", "-D"], f"slurmd.{node}.out")
        self._until(self._all_idle, "every slurmd idle", 60)

    def _all_idle(self) -> bool:
        try:
            out = self.run(self.controller, ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"])
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return len(out.split()) == self.compute

    # ---- use ----

    def sbatch(self, script: Path) -> str:
        return self.run(self.controller, ["sbatch", "--parsable", str(script)]).strip()

    def job_state(self, job: str) -> str:
        out = self.run(self.controller, ["squeue", "-h", "-j", job, "-o", "%T"])
        return out.strip() or "GONE"

    def link(self, host: str, up: bool) -> None:
        self._ip("-n", self.netns(host), "link", "set", "eth0", "up" if up else "down")

    # ---- stop ----

    def close(self) -> None:
        """Stop every process this cluster started, then remove its namespaces."""
        if self.slurm:
            with contextlib.suppress(Exception):
                self.run(self.controller, ["scancel", "--full", "-u", "root"], timeout=10)
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        self._kill_leftovers()
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def _kill_leftovers(self) -> None:
        """Processes that are nobody's child here: slurmstepd and the batch script, and
        workers that horovodrun started over ssh. They all carry this cluster's SLURM_CONF
        (sbatch passes the submitter's environment on, and Horovod copies it to workers)."""
        conf = str(self.root / "slurm" / "slurm.conf")
        for _ in range(3):
            found = []
            for process in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    if process.pid != os.getpid() and (
                        process.environ().get("SLURM_CONF") == conf
                        or any(str(self.root) in part for part in process.cmdline())
                    ):
                        process.kill()
                        found.append(process)
            if not found:
                return
            psutil.wait_procs(found, timeout=5)

    # ---- helpers ----

    @staticmethod
    def _ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True)

    @staticmethod
    def _until(probe: object, what: str, timeout: float) -> None:
        assert callable(probe)
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.1)


@contextlib.contextmanager
def namespace_cluster(
    root: Path, compute: int = 3, gpus: int = 2, slurm: bool = True
) -> Iterator[NamespaceCluster]:
    cluster = NamespaceCluster(root, compute, gpus, slurm)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
