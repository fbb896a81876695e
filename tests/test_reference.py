"""The DPO reference's inputs, as pure logic on real files: what identifies a model (finetune/checkpointing/identity.py),
the precomputed log-probs' key, file and checks (finetune/training/reference.py), what a resume refuses when the
model changed (resume.check_identity), and the one line a user error on any rank prints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.checkpointing.identity import identity_change, model_identity
from finetune.recipe import Recipe, RecipeError
from finetune.training.reference import check_precomputed, precompute_key, precomputed_path, read_precomputed
from finetune.checkpointing.resume import ResumePoint, check_identity, reference_record
from finetune.checkpointing.resume import changes as resume_changes


def model_dir(path: Path, weights: bytes = b"\x01" * 4096) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    return path


def rewrite_keeping_size_and_mtime(f: Path, content: bytes) -> None:
    s = f.stat()
    assert len(content) == s.st_size
    f.write_bytes(content)
    os.utime(f, ns=(s.st_atime_ns, s.st_mtime_ns))


# ---------------------------------------------------------------- defect 3: what identifies a model


def test_a_directory_is_identified_by_its_weights_content(tmp_path):
    """Rewritten at the same size with the same modification time (what the old key read) it is another model;
    a tokenizer file is not a weight (the precompute key has the tokenizer's own fingerprint)."""
    d = model_dir(tmp_path / "m")
    before = model_identity(str(d))
    assert sorted(before["files"]) == ["config.json", "model.safetensors"]
    (d / "tokenizer.json").write_text('{"changed": 1}')
    assert model_identity(str(d)) == before
    rewrite_keeping_size_and_mtime(d / "model.safetensors", b"\x02" * 4096)
    after = model_identity(str(d))
    assert after != before
    assert identity_change(before, after) == "model.safetensors changed"
    assert model_identity(str(model_dir(tmp_path / "copy"))) == before, "a copy elsewhere is the same model"


def hub_cache(root: Path, repo: str, commit: str) -> None:
    """A Hugging Face cache holding `repo` at `commit` (refs/main names it), as hf_hub_download leaves it."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (base / "snapshots" / commit / "config.json").write_text("{}")
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(commit)


def test_a_hub_id_is_identified_by_the_revision_the_cache_resolves(tmp_path):
    old, new = "a" * 40, "b" * 40
    hub_cache(tmp_path, "org/model", old)
    before = model_identity("org/model", cache_dir=str(tmp_path))
    assert before == {"hub": "org/model", "revision": old}
    hub_cache(tmp_path, "org/model", new)  # the cached repo moved to a new commit
    after = model_identity("org/model", cache_dir=str(tmp_path))
    assert after["revision"] == new
    assert identity_change(before, after) == f"its hub revision {old} -> {new}"


def datasets(tmp_path: Path):
    """What the key reads of the prepared pairs: their fingerprints and where their cache is."""
    return SimpleNamespace(train=SimpleNamespace(_fingerprint="train-fp", cache_files=[{"filename": str(tmp_path / "c" / "x")}]),
                           eval=SimpleNamespace(_fingerprint="eval-fp"))


TOKENIZER = SimpleNamespace(get_vocab=lambda: {"a": 0}, chat_template=None, bos_token="<s>", eos_token="</s>")
RECIPE = Recipe(objective="dpo", precompute_reference=True, output_dir="/runs/dpo")


def test_the_precompute_file_is_keyed_by_the_model_identity(tmp_path):
    data = datasets(tmp_path)
    a, b = {"files": {"model.safetensors": "1"}}, {"files": {"model.safetensors": "2"}}
    key_a, key_b = precompute_key(RECIPE, data, a, TOKENIZER), precompute_key(RECIPE, data, b, TOKENIZER)
    assert key_a["data"] == key_b["data"] and key_a["model"] != key_b["model"]
    assert precomputed_path(RECIPE, data, key_a) != precomputed_path(RECIPE, data, key_b)
    assert precomputed_path(RECIPE, data, key_a) == precomputed_path(RECIPE, data, precompute_key(
        RECIPE, data, json.loads(json.dumps(a)), TOKENIZER))
    revisions = [precompute_key(RECIPE, data, {"hub": "org/m", "revision": r}, TOKENIZER) for r in ("a" * 40, "b" * 40)]
    assert revisions[0] != revisions[1]


# ---------------------------------------------------------------- defect 2: the file's integrity


VALUES = {"train": [[-1.5, -2.25], [-3.0, -4.0], [-0.5, -0.75]], "eval": [[-1.0, -1.0], [-2.0, -3.0]]}


@pytest.fixture
def written(tmp_path):
    from finetune.training.reference import _write

    data = datasets(tmp_path)
    key = precompute_key(RECIPE, data, {"files": {"model.safetensors": "1"}}, TOKENIZER)
    path = _write(precomputed_path(RECIPE, data, key), VALUES, key)
    return path, key, data


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_the_file_reads_back_with_its_sha256(written):
    path, key, _ = written
    values, digest = read_precomputed(path, key)
    assert values == VALUES and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert read_precomputed(path, key, digest)[0] == VALUES


@pytest.mark.parametrize("damage", ["truncated", "garbled", "not json", "empty"])
def test_a_damaged_file_is_one_line_naming_it(written, damage):
    path, key, _ = written
    raw = path.read_bytes()
    damaged = {"truncated": raw[: len(raw) // 2], "garbled": raw.replace(b"-2.25", b"-9.25"),
               "not json": b"\x00" * len(raw), "empty": b""}[damage]
    path.write_bytes(damaged)
    with pytest.raises(RecipeError) as e:
        read_precomputed(path, key)
    text = one_line(e)
    assert str(path) in text and "delete it to compute them again" in text, text


def test_the_file_of_another_model_or_data_is_refused(written):
    path, key, _ = written
    with pytest.raises(RecipeError, match="of another model"):
        read_precomputed(path, key | {"model": "another"})
    with pytest.raises(RecipeError, match="of other pairs.*delete it"):
        read_precomputed(path, key | {"data": "another"})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()  # a resume on other data: the file is not at fault
    with pytest.raises(RecipeError, match="of other pairs.*the resumed run's data differ"):
        read_precomputed(path, key | {"data": "another"}, digest)


def test_a_resume_reads_only_the_file_its_checkpoint_recorded(written, tmp_path):
    """Rewritten at the same size (valid, but other values) it is refused on resume by its sha256; the
    recorded file is found where it was even when the key moved (the model changed and the user allowed
    it), and its model part is then not compared."""
    path, key, data = written
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {"path": str(path), "sha256": digest}
    assert check_precomputed(RECIPE, precomputed_path(RECIPE, data, key), record) == (path, digest)
    moved = key | {"model": "another"}
    found, sha = check_precomputed(RECIPE, precomputed_path(RECIPE, data, moved), record)
    assert found == path and read_precomputed(found, moved, sha)[0] == VALUES

    from finetune.training.reference import _write

    other = dict(VALUES, train=[[-1.5, -2.75], *VALUES["train"][1:]])  # the same size, another value
    _write([path], other, key)
    assert path.stat().st_size == len(path.read_bytes())
    with pytest.raises(RecipeError) as e:
        check_precomputed(RECIPE, precomputed_path(RECIPE, data, key), record)
    text = one_line(e)
    assert f"{path} is not the reference log-probs file this run was trained with" in text and "restore" in text
    with pytest.raises(RecipeError, match="changed since this run started"):
        read_precomputed(path, key, digest)
    path.unlink()
    with pytest.raises(RecipeError) as e:
        check_precomputed(RECIPE, precomputed_path(RECIPE, data, key), record)
    assert "are in none of" in one_line(e)


def point(recipe: Recipe, manifest: dict | None = None, path: str = "/runs/a/checkpoints/step_000000005"):
    return ResumePoint(path=Path(path), step=5, world_size=1, global_batch_size=16, strategy=recipe.strategy,
                       recipe=json.loads(json.dumps(recipe.to_dict())), manifest=manifest or {})


def test_what_is_gone_is_said_only_where_something_was(tmp_path):
    """A checkpoint that never had a precomputed file (trained with a reference model) is not told its file
    is gone: it is told why there is none."""
    assert reference_record(None) is None
    without = reference_record(point(dataclasses.replace(RECIPE, precompute_reference=False)))
    with pytest.raises(RecipeError) as e:
        check_precomputed(RECIPE, [tmp_path / "x.json"], without)
    text = one_line(e)
    assert "trained with precompute_reference=false" in text and "gone" not in text, text
    assert "resume with precompute_reference=false" in text
    recorded = {"path": "/x/reference-logps-1.json", "sha256": "0" * 64}
    assert reference_record(point(RECIPE, {"reference_logps": recorded})) == recorded


# ---------------------------------------------------------------- defect 4: the model changed under a resume


@pytest.mark.parametrize("overrides,reads", [
    ({"objective": "dpo"}, "the DPO reference"),
    ({"lora": True}, "a LoRA run's base weights"),
    ({"objective": "dpo", "lora": True}, "a LoRA run's base weights"),
])
def test_a_resume_that_reads_the_model_again_refuses_another_model(tmp_path, overrides, reads):
    d = model_dir(tmp_path / "m")
    recipe = Recipe(model=str(d), output_dir=str(tmp_path / "out"), **overrides)
    saved = point(recipe, {"model_identity": model_identity(str(d))})
    check_identity(saved, recipe, allow_model_change=False)  # unchanged
    rewrite_keeping_size_and_mtime(d / "model.safetensors", b"\x03" * 4096)
    with pytest.raises(RecipeError) as e:
        check_identity(saved, recipe, allow_model_change=False)
    text = one_line(e)
    assert f"model={d} is not the model checkpoint" in text and "model.safetensors changed" in text, text
    assert reads in text and "--allow-model-change" in text
    check_identity(saved, recipe, allow_model_change=True)


@pytest.mark.parametrize("overrides", [{}, {"objective": "dpo", "precompute_reference": True},
                                       {"objective": "dpo", "dpo_loss": "simpo"}])
def test_a_resume_that_holds_every_weight_in_its_checkpoint_ignores_the_model(tmp_path, overrides):
    d = model_dir(tmp_path / "m")
    recipe = Recipe(model=str(d), output_dir=str(tmp_path / "out"), **overrides)
    saved = point(recipe, {"model_identity": {"files": {"model.safetensors": "other"}}})
    check_identity(saved, recipe, allow_model_change=False)


def test_a_checkpoint_without_an_identity_is_not_compared(tmp_path):
    recipe = Recipe(model=str(model_dir(tmp_path / "m")), objective="dpo")
    check_identity(point(recipe), recipe, allow_model_change=False)


# ---------------------------------------------------------------- defect 5: SFT checkpoint resumed as DPO


def test_resuming_an_sft_checkpoint_as_dpo_is_refused_with_the_route():
    sft = Recipe(output_dir="/runs/a")
    with pytest.raises(RecipeError) as e:
        resume_changes(point(sft), dataclasses.replace(sft, objective="dpo"))
    text = one_line(e)
    assert "objective=sft, this run has objective=dpo" in text, text
    assert "python -m finetune.export /runs/a/checkpoints/step_000000005 OUT" in text
    assert "new objective=dpo run with model=OUT" in text
    dpo = Recipe(output_dir="/runs/a", objective="dpo")
    with pytest.raises(RecipeError, match="objective=dpo, this run has objective=sft"):
        resume_changes(point(dpo), dataclasses.replace(dpo, objective="sft"))


# ---------------------------------------------------------------- a user error on a rank other than 0


def test_a_user_error_on_any_rank_is_said_once(monkeypatch, capsys):
    import torch.distributed as dist

    from finetune.commands.train import say_once

    store = dist.HashStore()
    monkeypatch.setenv("RANK", "1")
    say_once("error: found on rank 1", store)
    monkeypatch.setenv("RANK", "0")
    say_once("error: found on rank 0 too", store)
    assert capsys.readouterr().err == "error: found on rank 1\n"
    say_once("error: without a process group", None)  # rank 0 says it
    monkeypatch.setenv("RANK", "1")
    say_once("error: not said twice", None)
    assert capsys.readouterr().err == "error: without a process group\n"
