"""`python -m finetune.export CHECKPOINT OUT_DIR`: the command is finetune/commands/export.py, the
library finetune/checkpointing/export.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("finetune.commands.export", run_name="__main__")
