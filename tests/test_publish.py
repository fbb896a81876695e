"""finetune.files.publish: a directory appears under its name whole or not at all; a replaced one
is never missing; with first_wins a concurrent writer's copy is kept."""

from pathlib import Path

from finetune.files import publish


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
