"""`[accelerate launch ...] finetune/run.py --recipe NAME [key=value ...]`: the file launchers start.
The command itself is finetune/commands/train.py."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.commands.train import exit_without_teardown, main, parse_args, prepare  # noqa: E402,F401

if __name__ == "__main__":
    exit_without_teardown(main())
