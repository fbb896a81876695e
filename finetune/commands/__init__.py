"""The command lines: each module parses its arguments, reports a user error as one `error:` line with
exit code 2, and calls the library.

  cli.py     `finetune train|plan|data|export|chat`, the front that checks before it launches
  train.py   the training run (`finetune/run.py`, which launchers start by path)
  plan.py    `python -m finetune.plan`: per-GPU memory under every strategy
  data.py    `python -m finetune.data`: the rows a run trains on
  export.py  `python -m finetune.export`: a checkpoint -> a Hugging Face model
  chat.py    `finetune chat`: talk to any output of a run (final/, an adapter, a checkpoint)
"""
