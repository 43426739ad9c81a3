from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator.auth import (
    ADMIN,
    Identity,
    TokenFileError,
    agent_identity,
    agent_key,
    derive_key,
    ensure_token_file,
    is_host,
    job_identity,
    job_key,
    new_nonce,
    parse_key,
    prove,
    read_token_file,
    verify,
    write_token_file,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def test_ensure_creates_private_file_and_reuses_it(tmp_path: Path, permissive_umask: None) -> None:
    path = tmp_path / "run" / "herd" / "token"

    token = ensure_token_file(path)

    assert len(token) == 32
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert _mode(path.parent.parent) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())
    assert ensure_token_file(path) == token
    assert read_token_file(path) == token
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]


def test_new_tokens_differ(tmp_path: Path) -> None:
    assert ensure_token_file(tmp_path / "a") != ensure_token_file(tmp_path / "b")


def test_token_is_private_from_the_moment_it_is_written(
    tmp_path: Path, permissive_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes_at_link: list[int] = []
    real_link = os.link

    def recording_link(source: Path, target: Path) -> None:
        modes_at_link.append(_mode(Path(source)))
        real_link(source, target)

    monkeypatch.setattr(os, "link", recording_link)
    ensure_token_file(tmp_path / "token")

    assert modes_at_link == [0o600]


def test_concurrent_creator_wins_and_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    other_token = bytes(range(32))
    real_link = os.link

    def link_after_another_process(source: Path, target: Path) -> None:
        fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, other_token.hex().encode())
        os.close(fd)
        real_link(source, target)

    monkeypatch.setattr(os, "link", link_after_another_process)

    assert ensure_token_file(path) == other_token
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o660, 0o604, 0o602, 0o620])
def test_refuses_file_others_can_access(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    token_hex = "ab" * 32
    path.write_text(token_hex + "\n")
    path.chmod(mode)

    with pytest.raises(TokenFileError) as caught:
        read_token_file(path)

    message = str(caught.value)
    assert message == (
        f"token file {path} has mode {mode:#o}; it must not be readable or writable "
        f"by group or others (run: chmod 600 {path})"
    )
    assert token_hex not in message


def test_ensure_refuses_existing_permissive_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("cd" * 32)
    path.chmod(0o644)

    with pytest.raises(TokenFileError, match="mode 0o644"):
        ensure_token_file(path)
    assert path.read_text() == "cd" * 32


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("zz" * 32, "is malformed: expected 64 hex characters"),
        ("", "is empty"),
        ("\n\n", "is empty"),
        (
            "ef" * 16 + "\n" + "ef" * 16,
            "is malformed: it holds 2 lines, a token is one line of 64 hex characters",
        ),
        ("ef " * 32, "is malformed: expected 64 hex characters"),
        ("ef" * 16, "holds a token that is too short: 16 bytes, expected 32"),
        ("ef" * 33, "is malformed: 33 bytes, expected 32"),
        ("é" * 32, "is malformed: expected 64 hex characters"),
        ("0" * 5000, "is malformed: larger than a token"),
    ],
)
def test_refuses_malformed_token_without_quoting_it(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(0o600)

    with pytest.raises(TokenFileError) as caught:
        read_token_file(path)

    assert str(caught.value) == f"token file {path} {expected}"
    if content:
        assert content[:8] not in str(caught.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "absent"
    with pytest.raises(TokenFileError, match=rf"^cannot open token file {re.escape(str(path))}: "):
        read_token_file(path)


def test_proof_depends_on_token_and_part_boundaries() -> None:
    token = b"\x01" * 32
    proof = prove(token, "client", "ab", "c")

    assert re.fullmatch(r"[0-9a-f]{64}", proof)
    assert prove(token, "client", "ab", "c") == proof
    assert prove(token, "client", "a", "bc") != proof
    assert prove(token, "client", "abc") != proof
    assert prove(b"\x02" * 32, "client", "ab", "c") != proof


def test_verify() -> None:
    token = b"\x03" * 32
    proof = prove(token, "server", "s", "n")

    assert verify(token, proof, "server", "s", "n")
    assert not verify(token, proof, "client", "s", "n")
    assert not verify(b"\x04" * 32, proof, "server", "s", "n")
    assert not verify(token, proof.upper(), "server", "s", "n")
    assert not verify(token, "", "server", "s", "n")
    # Peers control the proof: odd text must compare unequal, not raise.
    assert not verify(token, "é\ud800", "server", "s", "n")


def test_nonces_are_fresh_hex() -> None:
    nonces = {new_nonce() for _ in range(100)}

    assert len(nonces) == 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", nonce) for nonce in nonces)


# ---- identities and derived keys ----

MASTER = bytes(range(32))


@pytest.mark.parametrize(
    ("text", "identity"),
    [
        ("admin", ADMIN),
        ("job:a", Identity("job", "a")),
        ("job:resnet-50", Identity("job", "resnet-50")),
        ("agent:nid001234", Identity("agent", "nid001234")),
        ("agent:10.0.0.7", Identity("agent", "10.0.0.7")),
        ("agent:fe80::1%eth0", Identity("agent", "fe80::1%eth0")),
    ],
)
def test_identity_round_trips(text: str, identity: Identity) -> None:
    assert Identity.parse(text) == identity
    assert str(identity) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "root",
        "job:",
        "job:A",
        "job:-a",
        "job:" + "a" * 64,
        "job:a\nadmin",
        "agent:",
        "agent:a b",
        "agent:host/x",
        "agent:h\x00",
        "agent:" + "h" * 254,
        "admin:x",
    ],
)
def test_malformed_identities_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="identity must be"):
        Identity.parse(text)


def test_hosts() -> None:
    assert is_host("localhost") and is_host("nid001234.chn") and is_host("::1")
    for bad in ("", "a b", "a\nb", "a\rb", "x'y", "-flag", "[::1]", "a/b", "h" * 254):
        assert not is_host(bad), bad


def test_derived_keys_separate_identities_and_are_stable() -> None:
    keys = {
        derive_key(MASTER, identity)
        for identity in (ADMIN, job_identity("a"), job_identity("b"), agent_identity("h"))
    }
    assert len(keys) == 4
    assert derive_key(MASTER, ADMIN) == MASTER
    # Pure functions of the master token: an operator restarted with the same token
    # accepts the keys its predecessor handed out. Each host's agent has its own key.
    assert derive_key(MASTER, job_identity("a")) == derive_key(bytes(MASTER), job_identity("a"))
    assert derive_key(MASTER, agent_identity("h")) == agent_key(MASTER, "h")
    assert derive_key(MASTER, agent_identity("h")) != derive_key(MASTER, agent_identity("g"))
    assert derive_key(b"\x01" * 32, job_identity("a")) != derive_key(MASTER, job_identity("a"))
    assert all(len(key) == 32 for key in keys)


def test_an_agent_key_is_its_hosts_alone_and_no_job_or_master_key() -> None:
    hosts = ("nid001", "nid002", "nid0010", "10.0.0.1", "::1")
    keys = {host: agent_key(MASTER, host) for host in hosts}
    assert len(set(keys.values())) == len(hosts)
    # The host is one length-prefixed part of the HMAC: a job of the same name, or an
    # agent name that runs into the label, derives another key.
    assert agent_key(MASTER, "a") != job_key(MASTER, "a")
    assert MASTER not in keys.values()
    assert agent_key(MASTER, "nid001") == bytes.fromhex(prove(MASTER, "herd-agent-key", "nid001"))
    with pytest.raises(ValueError, match="identity must be"):
        agent_key(MASTER, "a b")


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "got 0"), ("zz" * 32, "expected a key of 64 hex"), ("ab" * 31, "got 62"),
     ("ab" * 33, "got 66")],
)  # fmt: skip
def test_a_key_on_stdin_must_be_64_hex_characters(text: str, problem: str) -> None:
    assert parse_key("ab" * 32 + "\n", "stdin") == bytes.fromhex("ab" * 32)
    with pytest.raises(TokenFileError, match=problem) as caught:
        parse_key(text, "--key-stdin: stdin")
    assert str(caught.value).startswith("--key-stdin: stdin: ")
    assert "zz" not in str(caught.value)


def test_write_token_file_is_private_and_readable_back(
    tmp_path: Path, permissive_umask: None
) -> None:
    path = tmp_path / "secrets" / "a.token"
    key = derive_key(MASTER, job_identity("a"))
    write_token_file(path, key)
    write_token_file(path, key)  # a relaunch writes it again
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert read_token_file(path) == key
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.token"]
