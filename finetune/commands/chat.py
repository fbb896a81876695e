"""`finetune chat PATH [PROMPT]`: answers from final/, final_merged/, a LoRA adapter or a checkpoint."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import warnings
from pathlib import Path

from finetune.chat import answer, context_warnings, load, prompt_format
from finetune.training.metrics import setup_logging
from finetune.recipe import RecipeError
from finetune.generation import PROMPT_FORMATS, render_prompt


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
    args = parser.parse_intermixed_args(argv)  # options before or after PROMPT
    if args.max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise RecipeError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not args.path.exists():
        raise RecipeError(f"{args.path} does not exist; give final/ of a run, an adapter folder or a checkpoint")
    return args


def load_model_of(path: Path, base: str | None):
    """finetune.chat.load, with what a file it reads can raise as one line."""
    try:
        return load(path, base)
    except pickle.UnpicklingError as e:  # a file outside the allow-lists (finetune.checkpointing.checkpoint.safe_loading)
        # torch's message is many lines, advising weights_only=False; its reason is after "WeightsUnpickler error:"
        reason = str(e).split("WeightsUnpickler error:", 1)[-1]
        reason = next((line.strip() for line in reason.splitlines() if line.strip()), type(e).__name__)
        raise RecipeError(f"{path}: a pickle in it cannot be loaded safely ({reason}); it is damaged or not "
                          "finetune's; nothing in it was run; use a checkpoint from a source you trust") from None
    except RecipeError:
        raise
    except Exception as e:  # a file in it is damaged or not what its name says: whatever the reader raised
        what = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RecipeError(f"{path} cannot be loaded ({type(e).__name__}: {what}); give final/ or final_merged/ of a "
                          "run, a LoRA adapter folder or a checkpoint, as finetune wrote them") from None


def main(argv=None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # one process; a GPU is used when there is one
    warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        import torch

        setup_logging("warning", 0)
        model, tokenizer, recipe = load_model_of(args.path, args.base)
        fmt = prompt_format(args.format, tokenizer, recipe, args.path)
        if torch.cuda.is_available():
            model = model.to("cuda")
        generator = torch.Generator().manual_seed(args.seed)

        def reply(text: str) -> str:
            for line in context_warnings(model, recipe, len(render_prompt(tokenizer, text, fmt, args.input))):
                print(line, file=sys.stderr, flush=True)
            return answer(model, tokenizer, text, fmt, args.max_new_tokens, args.temperature, generator, args.input)

        if args.prompt is not None:
            print(reply(args.prompt), flush=True)
            return 0
        if sys.stdin is None or sys.stdin.closed:  # started with standard input closed (`<&-`)
            raise RecipeError("no PROMPT and no standard input to read prompts from; give a PROMPT, or prompts one "
                              "per line on standard input")
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
        try:
            for line in sys.stdin:
                if line.strip():
                    print(reply(line.rstrip("\n")), flush=True)
        except (OSError, UnicodeDecodeError) as e:  # a descriptor that cannot be read, a directory, not text
            raise RecipeError(f"standard input cannot be read ({type(e).__name__}: {e}); give prompts one per line "
                              "of text, or a PROMPT") from None
        return 0
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
