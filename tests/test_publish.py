"""finetune.files.publish: a directory appears under its name whole or not at all; a replaced one
is never missing; with first_wins a concurrent writer's copy is kept. Staging directories are new ones
of their own: nothing a user made beside the target is ever taken or removed."""

import os
from pathlib import Path

import pytest

from finetune.files import publish, staging


def _dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "file.txt").write_text(text)
    return path


def test_publish_new_and_replace(tmp_path):
    target = tmp_path / "final"
    assert publish(_dir(tmp_path / ".final.tmp", "one"), target)
    assert (target / "file.txt").read_text() == "one" and not (tmp_path / ".final.tmp").exists()
    assert publish(_dir(tmp_path / ".final.tmp", "two"), target)
    assert (target / "file.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # nothing left aside


def test_first_wins_keeps_the_other_writers_copy(tmp_path):
    target = _dir(tmp_path / "asset", "first")
    assert not publish(_dir(tmp_path / ".asset.mine", "second"), target, first_wins=True)
    assert (target / "file.txt").read_text() == "first" and not (tmp_path / ".asset.mine").exists()


def test_publish_over_an_existing_target_leaves_a_users_previous_alone(tmp_path):
    """Replacing `final` moves it aside into a directory of its own, never into `.final.previous`, which a
    user (or anyone) may hold."""
    target = _dir(tmp_path / "final", "old")
    users = _dir(tmp_path / ".final.previous", "the user's")
    assert publish(_dir(tmp_path / ".final.new", "new"), target)
    assert (target / "file.txt").read_text() == "new"
    assert (users / "file.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".final.previous", "final"]


def test_staging_never_takes_or_removes_an_existing_name(tmp_path):
    """`finetune export CKPT DIR/model` used to remove DIR/model.tmp: the staging directory is made new
    (mkdtemp), with the mode a directory gets from the umask, and only it is removed on the way out,
    published or not."""
    for name in ("model.tmp", ".model.tmp"):
        _dir(tmp_path / name, "the user's")
    with staging(tmp_path / "model") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.") and tmp.name.endswith(".tmp")
        assert not list(tmp.iterdir())
        umask = os.umask(0)
        os.umask(umask)
        assert tmp.stat().st_mode & 0o777 == 0o777 & ~umask
        (tmp / "file.txt").write_text("new")
        publish(tmp, tmp_path / "model")
    with pytest.raises(RuntimeError):
        with staging(tmp_path / "other") as failed:
            (failed / "half").write_text("x")
            raise RuntimeError("the write failed")
    assert not failed.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.tmp", "model", "model.tmp"]
    assert all((tmp_path / n / "file.txt").read_text() == "the user's" for n in ("model.tmp", ".model.tmp"))
