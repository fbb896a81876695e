"""What a run prints besides its own lines, one line each at most, none where it says nothing:
transformers' LOAD REPORT table (with raw terminal colour codes; none for a reward model's new score
head), accelerate's "values were not passed" warning (the `finetune train` front passes them; a direct
`accelerate launch` gets one line when run through the front's launcher), DeepSpeed's "op built
successfully" on every rank of every launch (none), bitsandbytes' missing `kernels` on every LoRA run
(none)."""

import io
import logging

from finetune.training.metrics import OneLineLoadReport, QuietStdout, setup_logging


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def captured(name: str) -> Captured:
    handler = Captured()
    logging.getLogger(name).addHandler(handler)
    return handler


def load_report(load) -> list[str]:
    """The LOAD REPORT lines transformers' modeling_utils logs while `load()` runs, as our filter leaves them."""
    setup_logging("info", 0)
    handler = captured("transformers.modeling_utils")
    try:
        load()
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(handler)
    assert any(isinstance(f, OneLineLoadReport) for f in logging.getLogger("transformers.modeling_utils").filters)
    return [r.getMessage() for r in handler.records if "loaded" in r.getMessage() or "LOAD REPORT" in r.getMessage()]


def test_a_reward_models_new_score_head_is_not_reported():
    """A real from_pretrained of the tiny causal LM as a sequence classifier (tiny_reward's start): the score
    head is new and the lm_head unused, as they should be; transformers reported it as a table with
    ANSI escapes on every reward run."""
    from transformers import AutoModelForSequenceClassification

    from finetune.assets import tiny_model_dir

    assert load_report(lambda: AutoModelForSequenceClassification.from_pretrained(tiny_model_dir(), num_labels=1)) == []


def test_a_load_report_of_weights_really_missing_is_one_line_without_colour_codes(tmp_path):
    """The tiny model saved without one layer's weight: that one is reported, in one line, as is the new
    score head beside it."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    from finetune.assets import tiny_model_dir

    shutil.copytree(tiny_model_dir(), tmp_path / "model")
    weights = load_file(str(tmp_path / "model" / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, str(tmp_path / "model" / "model.safetensors"),
              metadata={"format": "pt"})
    [line] = load_report(lambda: AutoModelForSequenceClassification.from_pretrained(tmp_path / "model", num_labels=1))
    assert "\n" not in line and "\x1b" not in line, line
    assert "MISSING (newly initialized): " in line and "model.norm.weight" in line, line
    assert "score.weight" not in line and "lm_head.weight" not in line, line


def test_deepspeeds_op_built_line_is_not_printed():
    out = io.StringIO()
    stream = QuietStdout(out)
    stream.write("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\nstep 1")
    stream.write(" done\nDeepSpeed x built successfully")
    stream.flush()
    assert out.getvalue() == "step 1 done\n"


def test_bitsandbytes_missing_kernels_notice_is_not_printed():
    """bitsandbytes warns as peft imports it (every LoRA run, 4-bit or not) that the `kernels` package is
    missing; its own CPU 4-bit path serves without it."""
    setup_logging("info", 0)
    handler = captured("bitsandbytes.backends.cpu.ops")
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    try:
        ops.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                    "`pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        ops.warning("another notice")
    finally:
        ops.removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == ["another notice"]


def test_accelerate_launch_takes_no_defaults_from_the_front_and_says_them_in_one_line_otherwise():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from finetune.commands.cli import _defaults_notice, launch_command

    logger = logging.getLogger("accelerate.commands.launch")
    handler = captured("accelerate.commands.launch")
    logger.setLevel(logging.WARNING)
    try:
        cmd = launch_command({}, ["--recipe", "tiny"], 2)  # what `finetune train tiny --num_processes 2` runs
        _validate_launch_command(launch_command_parser().parse_args(cmd[5:]))
        assert [r.getMessage() for r in handler.records] == []
        logger.addFilter(_defaults_notice)
        _validate_launch_command(launch_command_parser().parse_args(
            ["--multi_gpu", "--num_processes", "2", "finetune/run.py", "--recipe", "tiny"]))
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(_defaults_notice)
    [line] = [r.getMessage() for r in handler.records]
    assert line.startswith("accelerate launch defaults: --num_machines 1") and "\n" not in line, line
