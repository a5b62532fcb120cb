"""The host side of what crosses the sandbox boundary: archive extraction, path rules, and the
command channel's answer check (sdk/sandbox/archive.py, docker_server.py)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest

from agentrl.errors import SandboxError
from agentrl.sandbox.archive import extract_archive, resolve_path
from tests.hostile_archives import crafted_archives, host_snapshot, links_or_specials


@pytest.mark.parametrize("name", sorted(crafted_archives(Path("/nonexistent"))))
def test_crafted_archive_writes_nothing_outside(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("host file\n")
    before = host_snapshot(outside)
    dest = tmp_path / "dest"
    try:
        result = extract_archive(crafted_archives(outside)[name], dest, max_bytes=1 << 20)
    except SandboxError as error:
        assert "download" in str(error)
    else:
        assert result.skipped or result.files  # every member was either written or listed as left out
    assert host_snapshot(outside) == before
    assert links_or_specials(dest) == []
    assert not any(path.stat().st_mode & 0o7000 for path in dest.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "outside"]


def _tar(*members: tuple[str, bytes | None, int]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_regular_files_and_folders_are_written_with_safe_modes(tmp_path):
    archive = _tar(("./", None, 0o755), ("./pkg", None, 0o700), ("./pkg/run.sh", b"#!/bin/sh\n", 0o4777),
                   ("./pkg/data.txt", b"x" * 100, 0o666))
    result = extract_archive(archive, tmp_path, max_bytes=1 << 20)
    assert (result.files, result.folders, result.bytes, result.skipped) == (2, 1, 110, [])
    assert (tmp_path / "pkg" / "run.sh").read_bytes() == b"#!/bin/sh\n"
    assert (tmp_path / "pkg" / "run.sh").stat().st_mode & 0o7777 == 0o755  # exec kept, set-uid and o+w dropped
    assert (tmp_path / "pkg" / "data.txt").stat().st_mode & 0o7777 == 0o644


def test_an_existing_link_at_a_files_place_is_replaced_not_followed(tmp_path):
    target = tmp_path / "host.txt"
    target.write_text("host\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "f.txt").symlink_to(target)
    os.link(target, dest / "hard.txt")
    extract_archive(_tar(("f.txt", b"new\n", 0o644), ("hard.txt", b"new\n", 0o644)), dest, max_bytes=1 << 20)
    assert target.read_text() == "host\n"
    assert (dest / "f.txt").read_text() == "new\n" and not (dest / "f.txt").is_symlink()
    (dest / "sub").symlink_to(tmp_path)  # a link where a folder should be: the member is left out
    result = extract_archive(_tar(("sub/evil.txt", b"x", 0o644)), dest, max_bytes=1 << 20)
    assert not (tmp_path / "evil.txt").exists() and result.skipped



def test_a_hard_link_to_a_file_of_the_archive_becomes_a_copy_of_it(tmp_path):
    """`git clone` of a local repository hard-links its objects; a workdir carried out of a sandbox lost them
    (the clone's history broke on the host). Such a link is written as a copy of the file the archive wrote
    earlier, its bytes counted against the cap; a link to anything else stays out."""
    source = tmp_path / "source"
    (source / "objects").mkdir(parents=True)
    (source / "objects" / "pack").write_bytes(b"P" * 100)
    os.link(source / "objects" / "pack", source / "clone-pack")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(source, arcname=".")
        dangling = tarfile.TarInfo("to-host")
        dangling.type, dangling.linkname = tarfile.LNKTYPE, "/etc/passwd"
        tar.addfile(dangling)
        later = tarfile.TarInfo("to-later")
        later.type, later.linkname = tarfile.LNKTYPE, "later.txt"
        tar.addfile(later)
        info = tarfile.TarInfo("later.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"L\n"))
    archive = buffer.getvalue()
    assert sum(member.islnk() for member in tarfile.open(fileobj=io.BytesIO(archive)).getmembers()) == 3
    dest = tmp_path / "dest"
    result = extract_archive(archive, dest, max_bytes=1 << 20)
    copies = {path.name: path for path in (dest / "objects" / "pack", dest / "clone-pack")}
    assert all(path.read_bytes() == b"P" * 100 for path in copies.values())
    assert copies["pack"].stat().st_ino != copies["clone-pack"].stat().st_ino  # a copy, not a link on the host
    assert (result.files, result.bytes) == (3, 202)
    assert sorted(result.skipped) == [
        "to-host (hard link to '/etc/passwd', not a file written from this archive)",
        "to-later (hard link to 'later.txt', not a file written from this archive)"]
    assert not (dest / "to-host").exists() and links_or_specials(dest) == []
    with pytest.raises(SandboxError, match="more than max_file_bytes=150"):
        extract_archive(archive, tmp_path / "capped", max_bytes=150)  # the copy counts against the cap

def test_caps_on_size_members_and_compression(tmp_path):
    with pytest.raises(SandboxError, match="more than max_file_bytes=10"):
        extract_archive(_tar(("a", b"x" * 11, 0o644)), tmp_path / "a", max_bytes=10)
    with pytest.raises(SandboxError, match="more than 2 members"):
        extract_archive(_tar(("a", b"", 0o644), ("b", b"", 0o644), ("c", b"", 0o644)), tmp_path / "b",
                        max_bytes=100, max_members=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("empty"))
    with pytest.raises(SandboxError, match="not an uncompressed tar"):
        extract_archive(buffer.getvalue(), tmp_path / "c", max_bytes=100)
    with pytest.raises(SandboxError, match="not an uncompressed tar|malformed"):
        extract_archive(b"garbage" * 100, tmp_path / "d", max_bytes=100)


def _pax_header(data: bytes) -> bytes:
    """A raw pax header (type x) holding `data`, as a tar a sandbox's own program may write."""
    header = bytearray(512)
    header[0:14] = b"././@PaxHeader"
    header[100:108], header[124:136], header[156:157], header[257:263] = b"0000644\0", b"%011o\0" % len(data), b"x", \
        b"ustar\0"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + data + b"\0" * (-len(data) % 512)


def _header(name: bytes, size: int, kind: bytes) -> bytes:
    """A raw ustar header, as a tar a sandbox's own program may write."""
    header = bytearray(512)
    header[0:len(name)] = name
    header[100:108], header[124:136], header[156:157], header[257:263] = b"0000644\0", b"%011o\0" % size, kind, \
        b"ustar\0"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _pax_header(data: bytes) -> bytes:
    """A raw pax header (type x) holding `data`."""
    return _header(b"././@PaxHeader", len(data), b"x") + data + b"\0" * (-len(data) % 512)


def _record(key: bytes, value: bytes) -> bytes:
    """One whole pax record, `<length> <key>=<value>\\n`, its length counting its own digits."""
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


_TAIL = _tar(("hello.txt", b"hi\n", 0o644))
_HOSTILE = _pax_header(b"1" * 40_000)
_SIZE_ZERO = b"10 size=0\n"


@pytest.mark.parametrize("archive", [
    _pax_header(b"1" * 20_000) + _TAIL,
    _pax_header(b"2" * 70_000) + _TAIL,
    _pax_header(b"31 path=" + b"7" * 21 + b"\n") + _TAIL,
    _pax_header(b"12 path=abc\n" + b"9" * 300) + _TAIL,
    _pax_header(b"99 path=short\n") + _TAIL,
    _pax_header(_record(b"comment", b"1" * 60_000)) + _TAIL,
    _pax_header(_SIZE_ZERO) + _header(b"f", len(_HOSTILE) + len(_TAIL), b"0") + _HOSTILE + _TAIL,
    _header(b"d/", len(_HOSTILE), b"5") + _HOSTILE + _TAIL,
], ids=["digits", "over-64k", "wrong-length", "trailing-digits", "past-the-end", "long-run", "behind-a-size-override",
        "behind-a-folder"])
def test_extended_headers_tarfile_reads_in_quadratic_time_are_refused(tmp_path, archive):
    """A pax header of one long run of digits takes quadratic time in Python < 3.11.10's tarfile (CVE-2024-6232; a red
    team's 110 KB archive held the event loop for 20 s). Such headers, and pax headers that are not whole records,
    are refused as tarfile reaches them, also where a scan of the raw headers would not look (a review found a
    pax `size=0` override and a folder's size field hiding one: the members tarfile reads are the ones checked)."""
    with pytest.raises(SandboxError, match="download: .*(malformed archive|too large|runs of digits)"):
        extract_archive(archive, tmp_path / "dest", max_bytes=1 << 20)
    assert not (tmp_path / "dest" / "hello.txt").exists()


def test_many_well_formed_pax_headers_of_digits_are_refused_by_their_total_cost(tmp_path):
    """Each 64 KiB header of whole records of 255-digit values, 500 of them: 38 s of tarfile's time when only each
    header's size and its longest run were checked (the review); now their summed cost stops them."""
    record = _record(b"comment", b"1" * 255)
    data = record * (64 * 1024 // len(record))
    archive = (_pax_header(data) + _header(b"f", 0, b"0")) * 500 + b"\0" * 1024
    with pytest.raises(SandboxError, match="runs of digits"):
        extract_archive(archive, tmp_path / "dest", max_bytes=1 << 20)


def test_pax_headers_with_long_names_and_fractional_times_are_read(tmp_path):
    buffer = io.BytesIO()
    names = ["a" * 200 + "/b" * 100 + "/x.txt", "ü-ñ.txt", "1" * 255]
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = 2, 1_500_000_000.123456
            tar.addfile(info, io.BytesIO(b"ok"))
    result = extract_archive(buffer.getvalue(), tmp_path, max_bytes=1 << 20)
    assert (result.files, result.skipped) == (3, [])
    assert all((tmp_path / name).read_bytes() == b"ok" for name in names)


@pytest.mark.parametrize("mtime", [2**63 - 1, 10**15, -(2**40)])
def test_times_no_host_can_set_are_clamped(tmp_path, mtime):
    """`touch -d @9223372036854775807` in a workdir crashed grading with OverflowError (red team, 2026-12-07): the
    rollout became an error, taken out of training, instead of a scored 0. Times are kept within 0 .. 9999-12-31."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("f.txt")
        info.size, info.mtime = 2, mtime
        tar.addfile(info, io.BytesIO(b"ok"))
    result = extract_archive(buffer.getvalue(), tmp_path, max_bytes=1 << 20)
    assert result.files == 1 and (tmp_path / "f.txt").read_bytes() == b"ok"
    assert 0 <= (tmp_path / "f.txt").stat().st_mtime <= 253402300799


@pytest.mark.parametrize(("path", "expected"), [
    ("a.txt", "/workspace/a.txt"), ("sub/../a.txt", "/workspace/a.txt"), (".", "/workspace"),
    ("/etc/passwd", "/etc/passwd"), ("/workspace/../etc", "/etc"),
])
def test_resolve_path_allows(path, expected):
    assert resolve_path("/workspace", path, action="read_file") == expected


@pytest.mark.parametrize("path", ["../etc/passwd", "../../x", "sub/../../x", "..", ""])
def test_resolve_path_refuses(path):
    with pytest.raises(SandboxError, match="read_file"):
        resolve_path("/workspace", path, action="read_file")


def test_an_answer_with_a_wrong_token_closes_the_channel():
    from agentrl.sandbox.docker_server import ServerConnection

    connection = ServerConnection(api=None, container_id="test")
    connection.alive = True
    slot = [threading.Event(), None, "right-token"]
    connection._waiting[7] = slot
    connection._dispatch(json.dumps({"id": 8, "token": "x", "exit_code": 0}).encode())  # nobody waits for 8
    assert not connection.tampered and connection.alive
    connection._dispatch(json.dumps({"id": 7, "token": "guess", "exit_code": 0}).encode())
    assert connection.tampered and not connection.alive
    assert slot[0].is_set() and slot[1] is None  # the waiting caller gets no answer, not the forged one


def _docker_frames(data: bytes, *, chunk: int = 32768) -> bytes:
    """`data` as Docker's multiplexed stdout frames (8-byte header: stream 1, big-endian length)."""
    import struct

    return b"".join(struct.pack(">BxxxL", 1, len(data[i:i + chunk])) + data[i:i + chunk]
                    for i in range(0, len(data), chunk))


def test_a_line_longer_than_any_answer_closes_the_channel(monkeypatch):
    """The host held every byte of an answer line until its newline: a sandbox streaming without one grew the
    host's memory without bound (600 MB in a red-team pass). Past the longest answer the channel is closed as
    tampered; a line just under the limit is still read."""
    import socket

    from agentrl.sandbox import docker_server

    monkeypatch.setattr(docker_server, "MAX_ANSWER_LINE_BYTES", 100_000)
    host, sandbox = socket.socketpair()
    connection = docker_server.ServerConnection(api=None, container_id="test")
    connection.alive, connection._sock = True, host
    slot = [threading.Event(), None, "token"]
    connection._waiting[1] = slot
    answer = json.dumps({"id": 1, "token": "token", "pad": "x" * 90_000}).encode() + b"\n"
    sandbox.sendall(_docker_frames(answer))
    thread = threading.Thread(target=connection._read_loop, args=(b"",), daemon=True)
    thread.start()
    assert slot[0].wait(10) and slot[1]["pad"] == "x" * 90_000  # a long answer under the limit
    sandbox.sendall(_docker_frames(b"A" * 150_000))  # no newline
    thread.join(10)
    assert not thread.is_alive() and connection.tampered and not connection.alive
    sandbox.close()
    host.close()
