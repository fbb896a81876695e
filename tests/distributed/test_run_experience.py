"""What a person watching a run sees: tracker files readable by TensorBoard's own reader, a loss plot
with every point, a summary naming the right paths, quiet logs, and a failing rank that ends the
whole launch promptly instead of leaving the others hanging in a collective."""

from __future__ import annotations

import json
import time

from PIL import Image


def test_tensorboard_plot_and_summary(watched_run):
    """Launched the way the README starts a run: `finetune train` checks, then starts 2 processes (the
    session's WATCHED run, conftest.py: ZeRO-3, 4 steps, an eval every 2, which test_samples_run also
    checks)."""
    run = watched_run
    assert "finetune: accelerate launch --multi_gpu" in run.stderr
    out = run.output_dir

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = sorted((out / "finetune").rglob("events.out.tfevents.*"))
    assert event_files, "TensorBoard wrote no event file"
    scalars, texts = {}, {}
    for f in event_files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in acc.Tags()["tensors"]:  # text summaries: the samples at each eval
            texts.setdefault(tag, []).extend((e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag))
    assert [s for s, _ in sorted(scalars["train/loss"])] == list(range(1, 5))
    assert [s for s, _ in sorted(scalars["eval/loss"])] == [0, 2, 4]
    logged = {r["step"]: r["loss"] for r in run.train_records}
    for step, value in scalars["train/loss"]:
        assert abs(value - logged[step]) < 1e-5 * abs(logged[step])
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(scalars)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s for s, _ in sorted(texts["samples/text_summary"])] == [0, 2, 4]
    last = dict(texts["samples/text_summary"])[4]
    assert all(s["reference"] in last for s in samples if s["step"] == 4)

    png = Image.open(out / "loss.png")
    assert png.format == "PNG" and png.size[0] >= 600 and png.size[1] >= 400
    # warmup: the learning rate changes, so it has a panel of its own
    assert json.loads(png.text["Description"]) == {"train_loss": 4, "eval_loss": 3, "learning_rate": 4, "last_step": 4}

    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_model"] == str(out / "final") and (out / "final" / "config.json").is_file()
    assert summary["loss_plot"] == str(out / "loss.png")
    assert summary["metrics"] == str(out / "metrics.jsonl")
    assert summary["checkpoints"].startswith(str(out / "checkpoints"))
    assert len(summary["peak_memory_per_rank"]) == 2 and all(b > 0 for b in summary["peak_memory_per_rank"])
    assert summary["final_eval_loss"] == run.eval_records[-1]["eval_loss"]
    assert "run summary" in run.stderr and str(out / "final") in run.stderr and str(out / "loss.png") in run.stderr
    # quiet by default: no INFO chatter from DeepSpeed or Accelerate, no tracebacks
    noisy = [line for line in run.stderr.splitlines() if "[INFO]" in line or "Traceback" in line]
    assert not noisy, noisy[:5]
    # accelerate's defaults (the front passes them); DeepSpeed's op built, which every rank printed
    assert "were not passed to `accelerate launch`" not in run.stderr
    assert "built successfully" not in run.stdout + run.stderr


def test_failing_rank_ends_the_launch(launch):
    """A crash (a bug, not a user error) on rank 1, through `finetune train`: the launch ends promptly with
    the rank's traceback and line and its exit code 1, without torch's ChildFailedError report after it."""
    t0 = time.monotonic()
    run = launch(2, "strategy=zero3", check=False, extra_env={"FINETUNE_FAULT": "after_step:1:3:RAISE"}, timeout=300,
                 front=True)
    seconds = time.monotonic() - t0
    assert run.returncode == 1, run.stderr[-3000:]
    assert "error: rank 1 failed: RuntimeError: injected fault" in run.stderr
    assert "ChildFailedError" not in run.stderr and "Root Cause" not in run.stderr, run.stderr[-3000:]
    assert seconds < 150, f"the launch took {seconds:.0f}s to end after rank 1 failed"


def test_a_user_error_after_the_launch_is_one_line_and_exit_2(launch, tmp_path):
    """A user error only the launched ranks can find (here the disk fills in rank 1's background write of
    step 4, async_save=true), through `finetune train`: the rank's one `error:` line, said once, and the
    rank's exit code 2; not torch's ChildFailedError traceback and failure table and exit code 1. The
    run's staging directory (FINETUNE_STAGING_DIR) goes with the failed save."""
    out, staging = tmp_path / "out", tmp_path / "staging"
    staging.mkdir()
    run = launch(2, "strategy=ddp", "max_steps=6", "save_every=2", "async_save=true", "eval_every=0",
                 "eval_at_start=false", output_dir=out, check=False, front=True,
                 extra_env={"FINETUNE_FAULT": "async_mid_shard:1:4:ENOSPC", "FINETUNE_STAGING_DIR": str(staging)})
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-4000:]
    assert errors[0].startswith(f"error: saving checkpoint step_000000004 into {out / 'checkpoints'} failed on rank 1: "
                                "the filesystem is full"), errors[0]
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "failed (exitcode"):
        assert noise not in run.stderr, run.stderr[-4000:]
    assert run.stderr.rstrip().endswith(errors[0]), "the error is the last line"
    assert list(staging.iterdir()) == [], f"left in the staging directory: {list(staging.iterdir())}"


def test_a_chat_template_that_fails_in_python_is_one_line(launch, tmp_path):
    """A chat template whose expression raises a Python error (a TypeError here, not a Jinja syntax error
    or raise_exception) stops both ranks with one line naming the template file, exit 2, before the
    model loads, and releases output_dir's lock."""
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(64)))
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] + loop.index }}{% endfor %}")
    out = tmp_path / "out"
    run = launch(2, f"dataset={data}", "dataset_format=messages", f"chat_template={template}", output_dir=out,
                 check=False)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-4000:]
    assert errors[0].startswith(f"error: the chat template (chat_template={template}) failed on a conversation "
                                "(TypeError: "), errors[0]
    assert "error: rank" not in run.stderr and run.stderr.count("Traceback") <= 1  # the launcher's report
    assert run.returncode != 0 and not (out / "finetune.lock").exists()
