"""The `finetune` console script (pyproject.toml); the command is finetune/commands/cli.py."""

from finetune.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
