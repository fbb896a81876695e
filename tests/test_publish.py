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


def _build_on_rank(rank: int, world: int, init: str, cache: str, name: str) -> None:
    import torch.distributed as dist

    os.environ["FINETUNE_CACHE"] = cache
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if rank == 1:  # rank 1 alone asks: transformers' save_pretrained writes nothing on it
            from finetune.assets import tiny_model_dir

            tiny_model_dir(name)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_builtin_model_built_by_rank_1_is_whole(tmp_path, monkeypatch):
    """A 2-process distillation run's builtin teacher is built by whichever rank asks first; built by rank 1
    it was published with its tokenizer files alone (save_pretrained writes on rank 0 only), and every later
    run in that cache failed to read its config. Built on rank 1 of a real gloo group, it is whole, equal to
    the one built outside any group, and an older cache's tokenizer-only directory is built again."""
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from finetune.assets import ASSET_VERSION, tiny_model_dir

    cache = tmp_path / "cache"
    mp.start_processes(_build_on_rank, args=(2, f"file://{tmp_path / 'store'}", str(cache), "tiny-llama-h64"),
                       nprocs=2, start_method="spawn")
    built = cache / ASSET_VERSION / "tiny-llama-h64"
    assert (built / "config.json").is_file() and (built / "model.safetensors").is_file()
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "alone"))
    alone = tiny_model_dir("tiny-llama-h64")
    a, b = (AutoModelForCausalLM.from_pretrained(d) for d in (built, alone))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    for f in ("config.json", "generation_config.json", "model.safetensors"):  # an older cache's leftover
        (alone / f).unlink()
    assert (tiny_model_dir("tiny-llama-h64") / "config.json").is_file()
