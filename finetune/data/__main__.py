"""python -m finetune.data: the command is finetune/commands/data.py."""

import runpy

runpy.run_module("finetune.commands.data", run_name="__main__")
