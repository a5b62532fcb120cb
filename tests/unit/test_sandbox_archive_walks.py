"""pack_folder / remove_tree / extract_archive on trees a sandbox can make: deep chains and too many files.

A 2,000-deep chain of folders used to crash grading with RecursionError (tarfile.add and
shutil.rmtree recurse) and leak the staging folder; now packing and removal walk without
recursion, and the caps raise WorkdirRejected (scored 0 by the graders, not an error).
"""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from agentrl.sandbox.archive import MAX_DEPTH, WorkdirRejected, extract_archive, pack_folder, remove_tree


def _chain(root, depth: int) -> None:
    """`depth` nested folders `d` under `root` and a file at the bottom (made through folder fds: no recursion)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(leaf, b"deep")
    os.close(leaf)
    os.close(fd)


def test_remove_tree_removes_a_2000_deep_chain(tmp_path):
    root = tmp_path / "staging"
    _chain(root, 2000)
    (root / "link").symlink_to(tmp_path)  # removed, never followed
    remove_tree(root)
    assert not root.exists() and tmp_path.exists()


def test_pack_folder_refuses_past_the_depth_cap_without_recursing(tmp_path):
    _chain(tmp_path / "deep", 1200)
    try:
        with pytest.raises(WorkdirRejected, match=f"more than {MAX_DEPTH} folders deep"):
            pack_folder(tmp_path)
    finally:
        remove_tree(tmp_path / "deep")


def test_pack_folder_packs_files_and_folders_but_no_links(tmp_path):
    _chain(tmp_path / "tree", 3)
    (tmp_path / "tree" / "link").symlink_to("/etc/passwd")
    with tarfile.open(fileobj=io.BytesIO(pack_folder(tmp_path)), mode="r:") as tar:
        names = tar.getnames()
    assert "tree/d/d/d/leaf.txt" in names and not any(name.endswith("link") for name in names)


def test_pack_folder_and_extract_cap_the_member_count(tmp_path):
    for index in range(11):
        (tmp_path / str(index)).write_text("x")
    with pytest.raises(WorkdirRejected, match="more than 10 files"):
        pack_folder(tmp_path, max_members=10)
    archive = pack_folder(tmp_path)
    with pytest.raises(WorkdirRejected, match="more than 10 members"):
        extract_archive(archive, tmp_path / "out", max_bytes=1 << 20, max_members=10)


def test_extract_refuses_a_member_past_the_depth_cap(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("/".join(["d"] * (MAX_DEPTH + 1)) + "/leaf")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(WorkdirRejected, match="folders deep"):
        extract_archive(buffer.getvalue(), tmp_path / "out", max_bytes=1 << 20)
