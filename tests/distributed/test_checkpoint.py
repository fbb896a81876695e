"""Checkpoints under real faults, on real processes: a run that is killed (SIGKILL mid-training, a kill
in the middle of a save, SIGTERM from a scheduler) and resumed with `--resume auto` logs the same
losses, bit for bit, as the run that was never interrupted; a checkpoint moves between 2 and 1
processes (FSDP by resharding, ZeRO by universal conversion) within fp32 tolerance; any checkpoint
exports to the same Hugging Face model as `final/`; damaged or foreign checkpoints are refused."""

from __future__ import annotations

import re
import json
import math
import os
import pickle
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import once
from safetensors.torch import load_file, save_file
from suite_runs import SAVE, resume_copy

REPO = Path(__file__).resolve().parents[2]

# Where each strategy is interrupted, and how (FINETUNE_FAULT=where:rank:step[:signal], see
# finetune.faults.fault_point), and the checkpoint the resumed run must continue from. The runs
# save every 5 steps (suite_runs.SAVE).
FAULTS = {
    "fsdp": ("after_step:1:7", 5),          # SIGKILL of one rank mid-training
    "zero3": ("during_save:1:10", 5),       # SIGKILL while writing step 10: that checkpoint must not count
}
# (a scheduler's SIGTERM and Ctrl-C, which stop with a checkpoint, are test_interrupt's)
KEPT = {  # saves every 5 steps and at the end
    "fsdp": ["step_000000005", "step_000000010", "step_000000012"],
    "zero3": ["step_000000005", "step_000000010", "step_000000012"],
}
CROSS_RTOL = 1e-5  # another world size sums in another order; fp32 curves agree to ~1e-8 here


def records(run):
    return [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("tokens"))
            for r in run.train_records + run.eval_records]


def weights(path):
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="session")
def uninterrupted(strategy_run):
    """The uninterrupted run of a strategy: the same launch test_strategies checks against the reference."""
    return strategy_run


@pytest.mark.parametrize("strategy", list(FAULTS))
def test_interrupted_run_resumes_exactly(strategy, launch, uninterrupted, tmp_path_factory):
    reference = uninterrupted(strategy)
    fault, resume_step = FAULTS[strategy]
    out = tmp_path_factory.mktemp(f"fault-{strategy}")
    first = launch(2, f"strategy={strategy}", *SAVE, output_dir=out, check=False, extra_env={"FINETUNE_FAULT": fault})
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert first.returncode != 0, "a killed rank must fail the launch"
    assert f"step_{resume_step:09d}" in checkpoints, checkpoints

    second = launch(2, f"strategy={strategy}", *SAVE, "--resume", "auto", output_dir=out)
    assert f"resumed from {out / 'checkpoints' / f'step_{resume_step:09d}'} at step {resume_step}" in second.stderr
    if fault.startswith("during_save"):
        assert f"ignoring incomplete checkpoint {out / 'checkpoints' / '.step_000000010.partial'}" in second.stderr
    assert records(second) == records(reference), "a resumed run must log exactly what the uninterrupted one did"
    assert_same_weights(out / "final", reference.output_dir / "final")
    resumes = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "resumed_from" in line]
    assert [r["step"] for r in resumes] == [resume_step]
    # keep_last=3: the three newest complete checkpoints, nothing half-written left behind
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == KEPT[strategy], left


@pytest.fixture(scope="module")
def resumed_on_one(launch, uninterrupted, tmp_path_factory):
    """resumed_on_one(strategy) -> the 1-process resume of a copy of the 2-process run's step 5, launched
    once: test_two_processes_to_one checks it, and the universal-conversion test starts from the
    conversion its zero2 resume made."""
    def resume(strategy):
        out = resume_copy(uninterrupted(strategy), 5, tmp_path_factory)
        return launch(1, f"strategy={strategy}", *SAVE, "--resume", "auto", output_dir=out)

    return once(resume)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_two_processes_to_one(strategy, resumed_on_one, uninterrupted):
    """Step 5 of 2 processes is 10 micro-steps; on 1 process the accumulation is 4, which does not
    divide 10: a resume that kept counting micro-steps from the checkpoint froze (ddp, fsdp) or
    stepped mid-batch (ZeRO). The global batches and the curve must continue as if uninterrupted.
    fsdp stands for ddp (the same micro-step counting; DCP resharding instead of whole tensors);
    zero2 for zero1 (DeepSpeed's universal conversion of a stage 1/2 checkpoint); zero3 for stage 3."""
    reference = uninterrupted(strategy)
    resumed = resumed_on_one(strategy)
    out = resumed.output_dir
    assert "(2 -> 1 processes)" in resumed.stderr
    recipe = json.loads((out / "recipe.json").read_text())
    assert (recipe["world_size"], recipe["grad_accum"], recipe["global_batch_size"]) == (1, 4, 16)
    assert_close_after(resumed, reference, 5)
    assert_weights_moved(reference.output_dir / "checkpoints" / "step_000000005", out / "final")


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_one_process_to_two(strategy, launch, uninterrupted, tmp_path_factory):
    reference = uninterrupted(strategy, nprocs=1)
    out = resume_copy(reference, 5, tmp_path_factory)
    resumed = launch(2, f"strategy={strategy}", *SAVE, "--resume", "auto", output_dir=out)
    assert "(1 -> 2 processes)" in resumed.stderr
    assert_close_after(resumed, reference, 5)


def assert_weights_moved(resumed_from, final):
    """Training went on after the resume: final/ is not the checkpoint the run resumed from (the bug
    this guards against logged losses and a learning rate while every optimizer step was skipped)."""
    from transformers import AutoModelForCausalLM

    from finetune.checkpointing.export import checkpoint_state_dict

    template = AutoModelForCausalLM.from_pretrained(final).state_dict()
    start, end = checkpoint_state_dict(resumed_from, template), weights(final)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert not torch.equal(start[name].float(), end[name].float()), f"{name} did not change after the resume"


def assert_close_after(resumed, reference, step):
    want = [r for r in records(reference) if r[0] > step]
    got = records(resumed)
    assert [(r[0], r[3]) for r in got] == [(r[0], r[3]) for r in want], "same steps, same global batches"
    for g, w in zip(got, want):
        for a, b in ((g[1], w[1]), (g[2], w[2])):
            assert (a is None) == (b is None)
            if a is not None:
                assert math.isclose(a, b, rel_tol=CROSS_RTOL), (got, want)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_export_of_last_checkpoint_equals_final(strategy, uninterrupted, export_in_process, tmp_path):
    run = uninterrupted(strategy)
    out = tmp_path / "exported"
    proc = export_in_process(run.output_dir / "checkpoints" / "step_000000012", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe logits identical" in proc.stdout
    assert_same_weights(out, run.output_dir / "final")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template


# ------------------------------------------------------------------ refusals: cheap, no training starts


def damaged_copy(run, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(run.output_dir / "checkpoints" / "step_000000012", out / "checkpoints" / "step_000000012")
    ckpt = out / "checkpoints" / "step_000000012"
    shard = sorted((ckpt / "pytorch_model").glob("*optim_states.pt"))[1]
    damage(shard)
    return out, ckpt, shard


def flip_a_byte(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,words", [
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_bytes(f.read_bytes()[:1000]), "has 1000 bytes"),
    (flip_a_byte, "does not match the xxh3_128 checksum"),  # same size: only the checksum sees it
], ids=["missing", "truncated", "same-size"])
def test_damaged_checkpoint_is_refused_and_kept(damage, words, run_in_process, export_in_process, uninterrupted,
                                                tmp_path):
    run = uninterrupted("zero3")
    out, ckpt, shard = damaged_copy(run, tmp_path, damage)
    before = sorted(p.name for p in ckpt.rglob("*"))
    refused = run_in_process("strategy=zero3", "--resume", str(ckpt), output_dir=out)
    assert refused.returncode == 2
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("error: checkpoint") and words in message and shard.name in message
    assert "nothing was deleted" in message and "Traceback" not in refused.stderr
    after = sorted(p.name for p in ckpt.rglob("*"))
    # rank 0 checks the checksums before converting for the other world size (and leaves its reason
    # for the other ranks in output_dir's .universal.failed): nothing in the checkpoint changes
    assert after == before
    exported = export_in_process(ckpt, tmp_path / "exported")
    assert exported.returncode == 2 and words in exported.stderr and not (tmp_path / "exported").exists()


def test_foreign_checkpoints_are_refused(run_in_process, uninterrupted, tmp_path):
    run = uninterrupted("zero3")
    ckpt = run.output_dir / "checkpoints" / "step_000000012"
    other_strategy = run_in_process("strategy=zero2", "--resume", str(ckpt), "--dry-run", output_dir=tmp_path / "a")
    assert other_strategy.returncode == 2
    assert "written with strategy=zero3, this run has strategy=zero2" in other_strategy.stderr
    other_data = run_in_process("strategy=zero3", "max_seq_len=96", "--resume", str(ckpt), "--dry-run",
                                output_dir=tmp_path / "b")
    assert other_data.returncode == 2 and "max_seq_len: 128 -> 96" in other_data.stderr
    assert "--allow-data-change" in other_data.stderr
    allowed = run_in_process("strategy=zero3", "max_seq_len=96", "--resume", str(ckpt), "--dry-run",
                             "--allow-data-change", output_dir=tmp_path / "c")
    assert allowed.returncode == 0
    other_lr = run_in_process("strategy=zero3", "lr=5e-4", "--resume", str(ckpt), "--dry-run",
                              output_dir=tmp_path / "d")
    assert other_lr.returncode == 2 and "lr: 0.003 -> 0.0005" in other_lr.stderr, other_lr.stderr[-2000:]
    longer = run_in_process("strategy=zero3", "max_steps=20", "--resume", str(ckpt), "--dry-run",
                            output_dir=tmp_path / "e")
    assert "resume: max_steps: 12 -> 20 (the run's length; the lr schedule is recomputed" in longer.stderr
    old = tmp_path / "old"
    shutil.copytree(ckpt, old / "checkpoints" / ckpt.name)
    fresh_over_old = run_in_process("strategy=zero3", output_dir=old)
    assert fresh_over_old.returncode == 2 and "--resume auto" in fresh_over_old.stderr


def test_resume_auto_without_checkpoints_starts_fresh(run_in_process, tmp_path):
    dry = run_in_process("strategy=ddp", "--resume", "auto", "--dry-run", output_dir=tmp_path / "new")
    assert "no complete checkpoint" in dry.stderr and "starting fresh" in dry.stderr


def test_checkpoint_files_are_never_unpickled(uninterrupted, export_in_process, tmp_path):
    """A ZeRO file replaced by a pickle that would run code: export (which reads every ZeRO file)
    refuses it, and the code never runs."""
    run = uninterrupted("zero3")
    marker = tmp_path / "code-ran"

    def poison(shard):
        shard.write_bytes(pickle.dumps(_RunsCode(str(marker))))

    out, ckpt, shard = damaged_copy(run, tmp_path, poison)
    consistent_manifest(ckpt, shard)  # the loader, not the checksum, must refuse it
    proc = export_in_process(ckpt, tmp_path / "exported")
    assert proc.returncode == 2
    assert not marker.exists(), "a checkpoint file ran code while being loaded"
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: checkpoint {ckpt}: {shard.relative_to(ckpt)} is refused"), message
    assert "(it could run code); nothing in it was run" in message and "Traceback" not in proc.stderr


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# Every file a command reads of a checkpoint, per strategy's format: what torch.load reads (Accelerate's
# optimizer.bin, scheduler.bin and RNG states, DeepSpeed's ZeRO files, the ZeroRedundancyOptimizer's), DCP's
# .metadata, the safetensors files (weights, RNG states) and the JSON ones (loop state, recipe, hf/). "+":
# put there after the save (not in the manifest), as a resume on 3 processes would read random_states_2.pkl.
# ":archive": the payload inside a torch.save archive (a real optimizer state beside it), not a bare pickle.
PLANTED = {
    "ddp": ["optimizer.bin", "optimizer.bin:archive", "scheduler.bin", "random_states_0.pkl", "+random_states_2.pkl",
            "rng/rank_0.safetensors", "model.safetensors", "loop_state.json", "recipe.json", "hf/config.json",
            "hf/tokenizer.json"],
    "ddp_zero_redundancy_optimizer": ["zero_redundancy_optimizer.pt"],
    "zero3": ["pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt",
              "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt:archive", "random_states_1.pkl"],
    "fsdp": ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "scheduler.bin"],
}


@pytest.mark.parametrize("strategy,planted", [(s, f) for s, files in PLANTED.items() for f in files])
def test_a_planted_payload_in_any_checkpoint_file_never_runs(strategy, planted, uninterrupted, run_in_process,
                                                            export_in_process, chat_in_process, tmp_path):
    """Issue 52's "done when": a pickle payload (it would create a marker file) in any file a resume, an
    export or a chat reads of a checkpoint, the manifest made to match as an attacker could: each command
    refuses it in one line naming the file, exit 2, before anything loads, and the payload never runs. In
    the test process: the three commands' checks are the ones every rank of a launch runs first."""
    import torch

    run = uninterrupted(strategy)
    marker = tmp_path / "code-ran"
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / "step_000000012"
    shutil.copytree(run.output_dir / "checkpoints" / ckpt.name, ckpt)
    rel, _, form = planted.lstrip("+").partition(":")
    target = ckpt / rel
    if form == "archive":
        torch.save({"state": {0: {"step": torch.tensor(3.0)}}, "hook": _RunsCode(str(marker))}, target)
    else:
        target.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    if not planted.startswith("+"):
        consistent_manifest(ckpt, target)
    flag = "ddp_shard_optimizer=true" if strategy == "ddp_zero_redundancy_optimizer" else None
    overrides = [f"strategy={strategy.split('_')[0]}", *([flag] if flag else []), *SAVE]
    commands = {"resume": lambda: run_in_process(*overrides, "--resume", str(ckpt), "--dry-run", output_dir=out),
                "export": lambda: export_in_process(ckpt, tmp_path / "exported"),
                "chat": lambda: chat_in_process(ckpt, "Say hi", "--max-new-tokens", "2")}
    if rel.startswith("hf/"):  # the model's config and tokenizer: what export and chat read, a resume does not
        del commands["resume"]
    for name, command in commands.items():
        proc = command()
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, (name, proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        assert errors[0].startswith(f"error: checkpoint {ckpt}") and rel in errors[0], (name, errors[0])
        assert not marker.exists(), f"{name}: the payload in {rel} ran"
    assert not (tmp_path / "exported").exists() and not (out / "finetune.lock").exists()


def consistent_manifest(ckpt, *changed):
    """Rewrite the manifest's size and checksum of files changed on purpose, as an attacker could."""
    from finetune.checkpointing.manifest import file_checksums

    manifest = json.loads((ckpt / "manifest.json").read_text())
    for f in changed:
        rel = str(f.relative_to(ckpt))
        manifest["files"][rel] = f.stat().st_size
        manifest["checksums"] |= file_checksums(ckpt, [rel])
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_planted_dcp_metadata_does_not_run(run_in_process, export_in_process, uninterrupted, tmp_path):
    """torch.distributed.checkpoint reads `.metadata` with pickle.load: a planted one (manifest made to
    match) is refused by resume and by export, with one line, and its code never runs."""
    run = uninterrupted("fsdp")
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / "step_000000012"
    shutil.copytree(run.output_dir / "checkpoints" / ckpt.name, ckpt)
    marker = tmp_path / "code-ran"
    metadata = ckpt / "pytorch_model_fsdp_0" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    consistent_manifest(ckpt, metadata)

    resumed = run_in_process("strategy=fsdp", *SAVE, "--resume", "auto", output_dir=out)
    exported = export_in_process(ckpt, tmp_path / "exported")
    for proc in (resumed, exported):
        assert proc.returncode == 2, proc.stderr[-3000:]
        message = proc.stderr.strip().splitlines()[-1]
        assert message.startswith(f"error: checkpoint {ckpt}: pytorch_model_fsdp_0/.metadata is refused"), message
        assert "not on the allow-list" in message and "Traceback" not in proc.stderr
    assert not marker.exists(), "a checkpoint's .metadata ran code"
    assert not (tmp_path / "exported").exists() and not (out / "final").exists()


def test_unreadable_manifest(launch, run_in_process, uninterrupted, tmp_path):
    """--resume auto skips a checkpoint whose manifest is empty, saying so, and continues from the one
    before; naming it with --resume PATH is one error line."""
    run = uninterrupted("ddp")
    out = tmp_path / "out"
    for name in ("step_000000010", "step_000000012"):
        shutil.copytree(run.output_dir / "checkpoints" / name, out / "checkpoints" / name)
    newest = out / "checkpoints" / "step_000000012"
    (newest / "manifest.json").write_text("")

    named = run_in_process("strategy=ddp", *SAVE, "--resume", str(newest), output_dir=out)
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert named.stderr.strip().splitlines()[-1].startswith(f"error: checkpoint {newest}: manifest.json is unreadable")

    resumed = launch(1, "strategy=ddp", *SAVE, "--resume", "auto", output_dir=out)
    skipped = [line for line in resumed.stderr.splitlines() if line.startswith("skipping")]
    assert len(skipped) == 1 and str(newest) in skipped[0] and "unreadable" in skipped[0]
    assert f"resumed from {out / 'checkpoints' / 'step_000000010'} at step 10" in resumed.stderr
    assert [r["step"] for r in resumed.train_records if r["step"] > 10] == [11, 12]
    assert (out / "final" / "model.safetensors").is_file()


def test_universal_conversion_is_verified_rebuilt_and_made_elsewhere_on_read_only_storage(
        launch, uninterrupted, resumed_on_one, tmp_path_factory):
    """A ZeRO resume on another process count converts the checkpoint to DeepSpeed's universal format,
    sealed by its own listing (resume.CONVERSION: every file's size and xxh3 checksum, and the
    checkpoint's manifest digest). A flipped byte in one fp32.pt is found at the next resume and the
    conversion rebuilt: the curve is the good conversion's. A checkpoint on read-only storage is
    converted into the new run's output_dir/universal-cache/ instead. The good conversion is the one
    test_two_processes_to_one[zero2]'s resume made (the same launch)."""
    from finetune.checkpointing.manifest import manifest_digest, seal_problem
    from finetune.checkpointing.resume import CONVERSION, UNIVERSAL_CACHE

    reference = uninterrupted("zero2")
    good = resumed_on_one("zero2")
    out = good.output_dir
    ckpt = out / "checkpoints" / "step_000000005"
    assert seal_problem(ckpt / "universal", CONVERSION, {"source_manifest": manifest_digest(ckpt)}) is None
    assert_close_after(good, reference, 5)

    damaged_out = tmp_path_factory.mktemp("damaged-universal")
    copy = damaged_out / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)  # the checkpoint with its conversion, as the good resume left it
    fp32 = sorted((copy / "universal").rglob("fp32.pt"))[0]
    flip_a_byte(fp32)
    rebuilt = launch(1, "strategy=zero2", *SAVE, "--resume", "auto", output_dir=damaged_out)
    rel = fp32.relative_to(copy / "universal")
    assert (f"the universal conversion {copy / 'universal'} does not verify ({rel} does not match the xxh3_128 "
            f"checksum in {CONVERSION}): converting {copy} again") in rebuilt.stderr, rebuilt.stderr
    assert records(rebuilt) == records(good)
    assert_same_weights(damaged_out / "final", out / "final")
    assert seal_problem(copy / "universal", CONVERSION, {"source_manifest": manifest_digest(copy)}) is None

    storage = tmp_path_factory.mktemp("read-only")
    shutil.copytree(reference.output_dir / "checkpoints" / ckpt.name, storage / ckpt.name)  # never converted
    before = sorted(str(p) for p in storage.rglob("*"))
    new_out = tmp_path_factory.mktemp("from-read-only") / "run"
    with read_only(storage):
        converted = launch(1, "strategy=zero2", *SAVE, "--resume", str(storage / ckpt.name), output_dir=new_out)
    cache = new_out / UNIVERSAL_CACHE / f"{ckpt.name}-{manifest_digest(storage / ckpt.name)[:16]}" / "universal"
    assert f"{storage / ckpt.name} cannot be written: converting it to the universal format in {cache}" \
        in converted.stderr, converted.stderr
    assert "Traceback" not in converted.stderr and "OSError" not in converted.stderr
    assert records(converted) == records(good)
    assert seal_problem(cache, CONVERSION, {"source_manifest": manifest_digest(storage / ckpt.name)}) is None
    assert sorted(str(p) for p in storage.rglob("*")) == before


@contextmanager
def read_only(path):
    """`path` read-only even for root: a read-only bind mount of it on itself (chmod does not stop root);
    without the right to mount, the immutable attribute (chattr +i), or chmod when not root."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        undo = ["chmod", "755", str(path)]
    elif subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0:
        undo = ["umount", str(path)]
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode != 0:
            subprocess.run(undo, check=True)
            pytest.fail(f"could bind-mount {path} but not remount it read-only")
    else:
        subprocess.run(["chattr", "-R", "+i", str(path)], check=True)
        undo = ["chattr", "-R", "-i", str(path)]
    try:
        probe = Path(path) / "probe"
        with pytest.raises(OSError):
            probe.touch()
        yield
    finally:
        subprocess.run(undo, check=True)


# ------------------------------------------------------------------ storage and planted files: one line, lock released


@contextmanager
def tmpfs(path, options):
    """A real small (or read-only) filesystem at `path` when this process may mount one (root); yields
    whether it did."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


# Where no filesystem can be mounted: DCP's writer fails with ENOSPC for the files of step 4, as it does
# on a full disk (a sitecustomize.py, which every launched process imports at start-up).
ENOSPC_WRITER = '''
import errno, os
if os.environ.get("FINETUNE_TEST_ENOSPC"):
    import torch.distributed.checkpoint.filesystem as fs
    original = fs._write_item
    def _write_item(transforms, stream, *args, **kwargs):
        if os.environ["FINETUNE_TEST_ENOSPC"] in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(transforms, stream, *args, **kwargs)
    fs._write_item = _write_item
'''


def test_full_disk_during_an_fsdp_save(launch, tmp_path):
    """An fsdp run on 2 processes whose output_dir is a 2.6 MiB filesystem: the checkpoint of step 2
    (1.7 MB for the tiny model) fits, step 4's does not. Every rank stops with one line saying the
    filesystem is full and naming the intact checkpoint to continue from (once, not "unexpected pos
    704 vs 598" and DCP's CheckpointException, a BaseException that passed run.py's handlers); the
    partial checkpoint is removed, the lock released, and step 2 still verifies."""
    from finetune.checkpointing.manifest import verify

    disk = tmp_path / "disk"
    with tmpfs(disk, "size=2600k") as mounted:
        env = {}
        if not mounted:
            site = tmp_path / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(ENOSPC_WRITER)
            env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "FINETUNE_TEST_ENOSPC": "step_000000004"}
        out = disk / "out"
        run = launch(2, "strategy=fsdp", "max_steps=6", "save_every=2", output_dir=out, check=False, extra_env=env)
        assert run.returncode != 0
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, run.stderr[-4000:]
        good = out / "checkpoints" / "step_000000002"
        assert errors[0].startswith(f"error: saving checkpoint step_000000004 into {out / 'checkpoints'} failed on "
                                    "rank "), errors[0]
        assert "the filesystem is full" in errors[0], errors[0]
        assert errors[0].endswith(f"the partial checkpoint was removed and the newest complete checkpoint, {good}, "
                                  f"is intact; continue from it with --resume {good} once there is room (free "
                                  "space, lower keep_last, or move output_dir to a larger filesystem)")
        assert "error: rank" not in run.stderr and "CheckpointException" not in run.stderr
        assert run.stderr.count("Traceback") <= 1  # the launcher's report that its workers exited with 2
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000002"]
        assert not (out / "finetune.lock").exists() and not (out / "final").exists()
        verify(good, checksums=True)
        assert [r["step"] for r in run.train_records] == [1, 2, 3, 4]


def test_a_full_disk_at_final_is_one_line_naming_the_checkpoint_to_export(launch, export_in_process, tmp_path):
    """final/ is written by rank 0 after the last checkpoint; a full disk there (ENOSPC raised where the
    files are written) stops every rank with one line, removes final.tmp, releases the lock, and names the
    export that makes final/ from the last checkpoint: that command works (its main, called here)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run = launch(2, "strategy=zero3", "max_steps=4", output_dir=out, check=False,
                 extra_env={"FINETUNE_FAULT": "final_write:0:0:ENOSPC"})
    assert run.returncode != 0  # the ranks exit 2; accelerate launch reports it as its own 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-4000:]
    ckpt, final = out / "checkpoints" / "step_000000004", out / "final"
    assert errors[0].startswith(f"error: writing {final} failed: the filesystem is full ("), errors[0]
    assert errors[0].endswith(f"the partial directory was removed and the checkpoint {ckpt} holds the same weights: "
                              f"once there is room, finetune export {ckpt} {final}"), errors[0]
    assert run.stderr.count("Traceback") <= 1  # the launcher's report that its workers exited with 2
    assert not final.exists() and not (out / "finetune.lock").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".final.")], "its staging directory is removed"
    exported = export_in_process(ckpt, final)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(final) is not None


def small_file_copy(run, tmp_path):
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / "step_000000012"
    shutil.copytree(run.output_dir / "checkpoints" / ckpt.name, ckpt)
    return out, ckpt


@pytest.mark.parametrize("plant,words", [
    # a damaged RNG state whose manifest was made to match, and one planted beside those of the run
    (lambda ckpt: (ckpt / "rng" / "rank_1.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
     "is damaged: rng/rank_1.safetensors is not a safetensors file"),
    (lambda ckpt: save_file({"torch": torch.zeros(7, dtype=torch.float32)}, str(ckpt / "rng" / "rank_0.safetensors")),
     "is damaged: rng/rank_0.safetensors holds 'torch', which is not a generator state"),
    (lambda ckpt: shutil.copy(ckpt / "rng" / "rank_0.safetensors", ckpt / "rng" / "rank_2.safetensors"),
     "rng/rank_2.safetensors is not in its manifest.json (put there after the save)"),
    (lambda ckpt: (ckpt / "loop_state.json").write_text(json.dumps(
        json.loads((ckpt / "loop_state.json").read_text()) | {"extra": 1})),
     "is damaged: loop_state.json holds unknown key(s) 'extra' (it holds step, tokens, samples"),
    (lambda ckpt: (ckpt / "loop_state.json").write_text('{"step": "12"}'),
     "is damaged: loop_state.json holds step='12', not a number"),
], ids=["rng-damaged", "rng-not-a-state", "rng-planted", "loop-state-extra-key", "loop-state-type"])
def test_planted_or_damaged_small_files_are_one_line(plant, words, run_in_process, uninterrupted, tmp_path):
    """loop_state.json and rng/ are checked with the manifest, before anything loads: one line naming
    the file, exit 2, the lock released, nothing deleted (they used to end in a traceback at the load)."""
    out, ckpt = small_file_copy(uninterrupted("fsdp"), tmp_path)
    plant(ckpt)
    if "not in its manifest" not in words:
        changed = [ckpt / "loop_state.json"] if "loop_state" in words else sorted((ckpt / "rng").iterdir())
        consistent_manifest(ckpt, *changed)  # the content, not the checksum, must refuse it
    before = sorted(p.name for p in ckpt.rglob("*"))
    refused = run_in_process("strategy=fsdp", *SAVE, "--resume", str(ckpt), output_dir=out)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: checkpoint {ckpt}") and words in message, message
    assert re.search(r"nothing (in it )?was (run or )?loaded", message), message
    assert sorted(p.name for p in ckpt.rglob("*")) == before
    assert not (out / "finetune.lock").exists()


def test_export_into_a_read_only_directory(uninterrupted, export_in_process, tmp_path):
    """Export into a read-only filesystem (a tmpfs mounted ro; chmod where the test is not root, which
    could write anyway): one line before the checkpoint is read, exit 2."""
    ckpt = uninterrupted("fsdp").output_dir / "checkpoints" / "step_000000012"
    place = tmp_path / "ro"
    with tmpfs(place, "ro,size=1m") as mounted:
        if not mounted:
            if os.geteuid() == 0:
                pytest.skip("root without permission to mount: no directory is read-only to this process")
            place.chmod(0o555)
        exported = export_in_process(ckpt, place / "model")
        assert exported.returncode == 2 and "Traceback" not in exported.stderr
        assert exported.stderr.strip().splitlines() == [
            f"error: {place / 'model'} cannot be created: {place} is not writable (permissions or a read-only "
            "filesystem); choose a writable OUT_DIR (nothing was written)"]
        assert not (place / "model").exists()
