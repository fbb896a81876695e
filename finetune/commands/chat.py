"""`finetune chat PATH [PROMPT]`: answers from final/, final_merged/, a LoRA adapter or a checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from finetune.chat import answer, load, prompt_format
from finetune.metrics import setup_logging
from finetune.recipe import RecipeError
from finetune.generation import PROMPT_FORMATS


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other user error
        raise RecipeError(f"{message} (see finetune chat --help)")


def parse_args(argv):
    parser = _Parser(prog="finetune chat", description="Answers from a trained model: final/, final_merged/, a "
                     "LoRA adapter folder or a checkpoint. Without PROMPT: a prompt per line on a terminal, or "
                     "each line of standard input.")
    parser.add_argument("path", type=Path, help="e.g. runs/tiny/final or runs/tiny/checkpoints/step_000000200")
    parser.add_argument("prompt", nargs="?", help="one prompt; its answer is printed")
    parser.add_argument("--format", choices=PROMPT_FORMATS,
                        help="chat: the chat template; alpaca, prompt_completion: as the run wrote prompts; raw: the "
                        "text as the model sees it (as samples.jsonl's prompt). Default: the run's data format, else "
                        "the chat template")
    parser.add_argument("--input", default="", help="alpaca: the input field (the prompt is the instruction)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="for --temperature above 0")
    parser.add_argument("--base", help="a LoRA adapter's or checkpoint's base model (default: the run's)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise RecipeError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not args.path.exists():
        raise RecipeError(f"{args.path} does not exist; give final/ of a run, an adapter folder or a checkpoint")
    return args


def main(argv=None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # one process; a GPU is used when there is one
    warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        import torch

        setup_logging("warning", 0)
        model, tokenizer, recipe = load(args.path, args.base)
        fmt = prompt_format(args.format, tokenizer, recipe, args.path)
        if torch.cuda.is_available():
            model = model.to("cuda")
        generator = torch.Generator().manual_seed(args.seed)

        def reply(text: str) -> str:
            return answer(model, tokenizer, text, fmt, args.max_new_tokens, args.temperature, generator, args.input)

        if args.prompt is not None:
            print(reply(args.prompt), flush=True)
            return 0
        if sys.stdin.isatty():
            print(f"{args.path} ({fmt} prompts; empty line or Ctrl-D to quit)", file=sys.stderr)
            while True:
                try:
                    text = input("> ")
                except (EOFError, KeyboardInterrupt):
                    print(file=sys.stderr)
                    return 0
                if not text.strip():
                    return 0
                print(reply(text), flush=True)
        for line in sys.stdin:
            if line.strip():
                print(reply(line.rstrip("\n")), flush=True)
        return 0
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
