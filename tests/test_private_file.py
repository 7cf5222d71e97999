"""Secrets on disk (``infergate up --keys-out``): a new file of our own,
renamed into place, never written through a symlink or into another
user's file. The tests run as root in CI, so "another user" is made with
chown."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from infergate.private_file import PrivateFileRefused, write_private

NOBODY = 65534


def test_a_new_file_is_private(tmp_path: Path) -> None:
    target = tmp_path / "keys.json"
    write_private(target, "secret\n")
    assert target.read_text() == "secret\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]  # no temporary left


def test_an_own_readable_file_is_replaced_not_reused(tmp_path: Path) -> None:
    target = tmp_path / "keys.json"
    target.write_text("old")
    target.chmod(0o644)
    before = target.stat().st_ino
    write_private(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.stat().st_ino != before  # a reader holding the old file keeps only that


def test_a_symlink_is_refused_and_what_it_points_to_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    victim.chmod(0o644)
    link = tmp_path / "keys.json"
    link.symlink_to(victim)
    with pytest.raises(PrivateFileRefused, match="symlink"):
        write_private(link, "secret")
    assert victim.read_text() == "root's file"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert link.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_file_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "keys.json"
    planted.write_text("")
    planted.chmod(0o666)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(PrivateFileRefused, match="another user"):
        write_private(planted, "secret")
    assert planted.read_text() == ""


def test_up_refuses_a_planted_symlink_before_starting_anything(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "keys.json"
    link.symlink_to(victim)
    done = subprocess.run(
        [sys.executable, "-m", "infergate", "up", "--port", "1", "--keys-out", str(link)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--keys-out:" in done.stderr
    assert "symlink" in done.stderr
    assert "Traceback" not in done.stderr
    assert victim.read_text() == "keep me"
