"""Atomic writes: whole files only, with the permissions any other file of the run gets."""

from __future__ import annotations

import os
import stat

import pytest

from trex import atomic


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_published_file_has_the_umasks_permissions(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic.write_json(tmp_path / "summary.json", {"loss": 1.0})
        with atomic.replacing(tmp_path / "loss.png", suffix=".png") as tmp:
            open(tmp, "wb").write(b"png")
        with open(tmp_path / "plain.txt", "w") as f:  # what open() gives any other file
            f.write("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE(os.stat(tmp_path / "plain.txt").st_mode)
    assert want == 0o666 & ~umask
    for name in ("summary.json", "loss.png"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == want, name
    assert sorted(os.listdir(tmp_path)) == ["loss.png", "plain.txt", "summary.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    atomic.write_text(tmp_path / "f.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic.replacing(tmp_path / "f.txt") as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("disk full")
    assert (tmp_path / "f.txt").read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]
