"""devtools.process_cpu's reading of process accounting: the records, the tree, the kinds."""

from __future__ import annotations

import pytest

from devtools.process_cpu import RECORD, Exited, decode_comp, descendants, kind, read_records


def record_bytes(pid: int, ppid: int, start: int, ticks: tuple[int, int], comm: bytes) -> bytes:
    times = (*ticks, 0, 0, 0, 0, 0, 0)
    return RECORD.pack(b"\0", b"\x03", 0, 0, 0, 0, pid, ppid, start, 150.0, *times, comm)


def test_comp_t_is_a_mantissa_with_a_base_8_exponent() -> None:
    assert decode_comp(0) == 0
    assert decode_comp(1234) == 1234
    assert decode_comp((2 << 13) | 100) == 100 * 64
    assert decode_comp(0x1FFF) == 8191


def test_records_carry_pid_parent_start_cpu_and_name() -> None:
    data = record_bytes(41, 7, 1_000, (250, (1 << 13) | 30), b"slurmd")
    data += record_bytes(42, 41, 1_001, (0, 3), b"python")
    first, second = read_records(data)
    assert (first.pid, first.ppid, first.start, first.comm) == (41, 7, 1_000.0, "slurmd")
    assert first.user == pytest.approx(2.5) and first.system == pytest.approx(2.4)
    assert first.elapsed == pytest.approx(1.5) and first.end == pytest.approx(1_001.5)
    assert (second.pid, second.comm, second.user) == (42, "python", 0.0)


def test_records_of_another_version_or_size_are_refused() -> None:
    with pytest.raises(ValueError, match="not whole v3 records"):
        read_records(b"\0" * 65)
    with pytest.raises(ValueError, match="version"):
        read_records(b"\0\x02" + b"\0" * 62)


def exited(pid: int, ppid: int, start: float, elapsed: float) -> Exited:
    return Exited(pid, ppid, start, elapsed, 1.0, 0.5, "x")


def test_the_tree_follows_parents_alive_at_the_exit_and_not_a_reused_pid() -> None:
    root = 100
    child = exited(200, root, 10, 50)  # root's child, 10-60
    grandchild = exited(300, 200, 20, 5)  # 200's child while 200 lived
    orphan_of_old = exited(301, 200, 100, 5)  # a later 200 (reused pid), not ours
    stranger = exited(400, 1, 15, 5)
    before_root = exited(500, root, 0, 1)  # pid `root` before root started
    records = [grandchild, child, orphan_of_old, stranger, before_root]
    assert descendants(records, root, root_start=5) == [grandchild, child]


@pytest.mark.parametrize(
    ("comm", "argv", "expected"),
    [
        ("sshd", ["sshd: root"], "sshd"),
        ("python", ["python", "examples/train_digits.py", "--epochs", "3"], "train_digits.py"),
        ("python", ["/v/bin/python", "-m", "herd_operator.agent.shim", "--"],
         "python -m herd_operator.agent.shim"),
        ("herd-operator", ["/v/bin/python", "/v/bin/herd-operator", "exporter", "--port", "0"],
         "herd-operator exporter"),
        ("python", ["/v/bin/python", "-I", "-S", "-c", "import os"], "python -c"),
        ("python", None, "python"),
    ],
)  # fmt: skip
def test_a_process_is_named_by_what_it_ran(
    comm: str, argv: list[str] | None, expected: str
) -> None:
    assert kind(comm, argv) == expected
