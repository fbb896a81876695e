"""What a run prints besides its own lines, one line each at most: transformers' LOAD REPORT table (with
raw terminal colour codes) for a reward model's new score head, accelerate's "values were not passed"
warning (the `finetune train` front passes them; a direct `accelerate launch` gets one line when run
through the front's launcher), DeepSpeed's "op built successfully" on every rank (rank 0's only)."""

import io
import logging

from finetune.training.metrics import OneLineLoadReport, OtherRankStdout, setup_logging


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


def test_a_reward_models_load_report_is_one_line_without_colour_codes():
    """A real from_pretrained of the tiny causal LM as a sequence classifier: the score head is new, the
    lm_head unused; transformers reports it as a table with ANSI escapes."""
    from transformers import AutoModelForSequenceClassification

    from finetune.assets import tiny_model_dir

    setup_logging("info", 0)
    handler = captured("transformers.modeling_utils")
    try:
        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir(), num_labels=1)
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(handler)
    [record] = [r for r in handler.records if "LlamaForSequenceClassification" in r.getMessage()]
    line = record.getMessage()
    assert "\n" not in line and "\x1b" not in line, line
    assert "MISSING (newly initialized): score.weight" in line and "UNEXPECTED" in line and "lm_head.weight" in line
    assert any(isinstance(f, OneLineLoadReport) for f in logging.getLogger("transformers.modeling_utils").filters)


def test_the_other_ranks_do_not_repeat_deepspeeds_op_built_line():
    out = io.StringIO()
    stream = OtherRankStdout(out)
    stream.write("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\nstep 1")
    stream.write(" done\nDeepSpeed x built successfully")
    stream.flush()
    assert out.getvalue() == "step 1 done\n"


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
