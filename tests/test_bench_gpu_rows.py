"""bench/gpu/gpu.py's matrix and row handling (`bench/run.py --gpu`), no launches: every finetune variant
has the Trainer's counterpart (compile=true against torch_compile=True), a run's outputs are removed
once its row is read but for the files the row is read from, and --deadline / --reuse decide which
rows run."""

import json
import os
from pathlib import Path

from bench.gpu import gpu
from bench.helpers import trainer_baseline
from finetune.recipe import Recipe


def test_every_finetune_row_has_a_trainer_row_of_the_same_variant():
    """compile=true was a finetune-only row compared with the eager Trainer; now ddp and fsdp compile
    each have a Trainer row with torch_compile=True."""
    for cuda in (True, False):
        matrix = gpu.cases(cuda)
        trainer = {(c["strategy"], c["variant"]) for c in matrix if c["toolkit"] == "trainer"}
        ours = [(c["strategy"], c["variant"]) for c in matrix if c["toolkit"] == "finetune"]
        assert set(ours) == trainer and len(ours) == len(set(ours)) == 6, matrix
        assert {("ddp", "compile=true"), ("fsdp", "compile=true")} <= trainer
        names = [gpu.case_name(c) for c in matrix]
        assert len(names) == len(set(names))  # each row has its own output directory, log and row file


def test_trainer_takes_torch_compile_under_compile_true():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128)
    for strategy in ("ddp", "fsdp"):
        kw = trainer_baseline.trainer_kwargs(Recipe(strategy=strategy, compile=True), None, config, on_cpu=False)
        assert kw["torch_compile"] is True, kw
        kw = trainer_baseline.trainer_kwargs(Recipe(strategy=strategy), None, config, on_cpu=False)
        assert "torch_compile" not in kw, kw


def write(path: Path, size: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return size


def test_prune_outputs_keeps_only_what_the_row_is_read_from(tmp_path):
    out = tmp_path / "finetune-ddp-default"
    kept = {name: json.dumps({"name": name}) for name in ("metrics.jsonl", "summary.json", "recipe.json")}
    for name, text in kept.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    removed = (write(out / "checkpoints" / "step-30" / "model.safetensors", 30_000)
               + write(out / "checkpoints" / "step-30" / "optimizer" / "rank0.pt", 20_000)
               + write(out / "final" / "model.safetensors", 25_000) + write(out / "loss.png", 1_000)
               + write(out / "metrics.jsonl.lock", 10))
    (out / "final" / "link").symlink_to(out / "final" / "model.safetensors")
    removed += (out / "final" / "link").lstat().st_size
    (out / "summary.json.d").mkdir()  # a directory that has a kept file's name prefix is not kept
    assert gpu.prune_outputs(out) == removed
    assert sorted(p.name for p in out.iterdir()) == sorted(kept)
    assert {name: (out / name).read_text() for name in kept} == kept
    assert gpu.prune_outputs(out) == 0  # nothing left to remove
    assert gpu.prune_outputs(tmp_path / "never-made") == 0


def test_prune_outputs_removes_a_directory_named_like_a_kept_file(tmp_path):
    out = tmp_path / "run"
    size = write(out / "summary.json" / "x.bin", 100)  # not a file: not what the row reads
    assert gpu.prune_outputs(out) == size and not (out / "summary.json").exists()


def test_next_step_skips_reuses_or_runs_with_what_is_left():
    case = {"toolkit": "finetune", "strategy": "ddp", "variant": "default", "overrides": [], "skip": None}
    assert gpu.next_step(dict(case, skip="liger_kernel not installed"), None, None, 600) == (
        "skip", "liger_kernel not installed")
    assert gpu.next_step(case, None, None, 600) == ("run", 600)
    assert gpu.next_step(case, None, 1000.0, 600) == ("run", 600)
    assert gpu.next_step(case, None, 200.0, 600) == ("run", 200.0)  # stopped at the deadline
    action, why = gpu.next_step(case, None, gpu.ROW_MIN_S - 1, 600)
    assert action == "skip" and why.startswith("--deadline: 59 s left") and "--reuse runs it" in why
    done = {"toolkit": "finetune", "ok": True, "tokens_per_s": 5.0}
    assert gpu.next_step(case, done, 0.0, 600) == ("reuse", dict(done, reused=True))  # no time needed
    assert gpu.next_step(case, dict(done, ok=False), None, 600) == ("run", 600)  # a failed row runs again
