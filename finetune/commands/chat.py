"""`finetune chat PATH [PROMPT]`: answers from final/, final_merged/, a LoRA adapter or a checkpoint."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import warnings
from pathlib import Path

from finetune.chat import (DEFAULT_MAX_NEW_TOKENS, answer, answer_with_tools, context_warnings, load, max_new_tokens_of,
                           prompt_format, tools_of)
from finetune.training.metrics import setup_logging
from finetune.recipe import RecipeError
from finetune.generation import PROMPT_FORMATS, render_prompt


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other user error
        raise RecipeError(f"{message} (see finetune chat --help)")


SEPARATOR = "---"  # the default line between prompts on standard input


def parse_args(argv):
    parser = _Parser(prog="finetune chat", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Answers from a trained model: final/, final_merged/, a LoRA adapter folder or a "
                     "checkpoint, with its prompts rendered as the run rendered them and its answers as long as the "
                     "run's own.", epilog=f"""prompts:
  PROMPT            one prompt; only its answer is printed
  standard input    prompts separated by a line holding only the separator ({SEPARATOR!r} by default, --separator);
                    a prompt may span lines (GRPO prompts often do). Each prompt is printed, every line
                    prefixed with '> ', then its answer, then the separator line
  a terminal        one prompt per line; an empty line or Ctrl-D ends

examples:
  finetune chat runs/tiny/final "Reverse the word." --input stone
  printf 'Copy: abc\nAnswer:\n---\nCapitals: dog\nAnswer:\n' | finetune chat runs/tiny_grpo/final""")
    parser.add_argument("path", type=Path, help="e.g. runs/tiny/final or runs/tiny/checkpoints/step_000000200")
    parser.add_argument("prompt", nargs="?", help="one prompt; its answer is printed (default: read standard input)")
    parser.add_argument("--format", choices=PROMPT_FORMATS,
                        help="how a prompt becomes tokens. chat: the chat template with its generation prompt; "
                        "alpaca, prompt_completion: as the run wrote such prompts; prompt: a GRPO run's text prompts "
                        "(the tokenizer's BOS, then the text); raw: the text as the model sees it (as samples.jsonl's "
                        "prompt). Default: the format the run trained on (its recipe.json), else chat")
    parser.add_argument("--input", default="", help="alpaca: the input field (the prompt is the instruction); "
                        "default: none")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the longest answer, in tokens. Default: the run's own answer length: max_completion_len "
                        "for a GRPO run, sample_max_new_tokens (32 unless the recipe set it) otherwise; "
                        f"{DEFAULT_MAX_NEW_TOKENS} for a model without a recipe.json")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as the run's samples (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="for --temperature above 0 (default 0)")
    parser.add_argument("--base", help="a LoRA adapter's or checkpoint's base model (default: the run's model)")
    parser.add_argument("--tools", help="tools the model may call, module:function names, comma-separated (each a "
                        "function with type hints and a docstring): their schemas go into the prompt, the calls it "
                        "writes are run between its turns and their answers fed back, each shown as a [tool] line "
                        "(docs/agents.md). Default: the tools of the run's recipe.json, if it names any")
    parser.add_argument("--separator", default=SEPARATOR,
                        help=f"the line between prompts on standard input (default {SEPARATOR!r})")
    args = parser.parse_intermixed_args(argv)  # options before or after PROMPT
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise RecipeError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not args.path.exists():
        raise RecipeError(f"{args.path} does not exist; give final/ of a run, an adapter folder or a checkpoint")
    return args


def split_prompts(lines, separator: str) -> list[str]:
    """The prompts of standard input: the text between lines that hold only `separator`, each kept whole
    (its inner newlines included; the newline before a separator belongs to no prompt); blank ones
    dropped."""
    prompts, current = [], []
    for line in lines:
        if line.rstrip("\r\n") == separator:
            prompts.append("".join(current))
            current = []
        else:
            current.append(line)
    prompts.append("".join(current))
    return [p.removesuffix("\n") for p in prompts if p.strip()]


def check_prompt(text: str, what: str) -> str:
    """A prompt a tokenizer can read. Python hands over bytes that are not UTF-8 (an argument, or standard
    input in the UTF-8 mode a C locale turns on) as lone surrogates, U+DC80-U+DCFF, each standing for its
    byte; the tokenizer then failed with a TypeError. Named here with the byte, as the data's check
    (finetune.data.formats.check_text) names a lone surrogate in a file."""
    from finetune.data.formats import check_text

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise RecipeError(f"{what} is not UTF-8 text (byte 0x{code - 0xDC00:02x} at character {e.start}: Latin-1 "
                              "or Windows-1252?); give it as UTF-8 (for example: iconv -f latin1 -t utf-8)") from None
        check_text(text, "finetune chat", what)
    return text


def load_model_of(path: Path, base: str | None):
    """finetune.chat.load, with what a file it reads can raise as one line."""
    try:
        return load(path, base)
    except pickle.UnpicklingError as e:  # a file outside the allow-lists (finetune/checkpointing/safe_loading.py)
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
        max_new_tokens = args.max_new_tokens or max_new_tokens_of(recipe)
        funcs = tools_of(args.tools, recipe)
        if funcs and fmt != "chat":
            raise RecipeError(f"--tools with {fmt} prompts: a tool's schema and its calls are rendered by the chat "
                              "template; pass --format chat")

        check_prompt(args.input, "--input")

        def reply(text: str) -> str:
            check_prompt(text, "the prompt")
            for line in context_warnings(model, recipe, len(render_prompt(tokenizer, text, fmt, args.input))):
                print(line, file=sys.stderr, flush=True)
            if funcs:  # the calls it makes, then its last answer
                said, calls = answer_with_tools(model, tokenizer, text, funcs, max_new_tokens, args.temperature,
                                                generator)
                return "\n".join([*calls, said])
            return answer(model, tokenizer, text, fmt, max_new_tokens, args.temperature, generator, args.input)

        if args.prompt is not None:
            print(reply(args.prompt), flush=True)
            return 0
        if sys.stdin is None or sys.stdin.closed:  # started with standard input closed (`<&-`)
            raise RecipeError("no PROMPT and no standard input to read prompts from; give a PROMPT, or prompts one "
                              "per line on standard input")
        if sys.stdin.isatty():
            print(f"{args.path} ({fmt} prompts, answers of at most {max_new_tokens} tokens; empty line or Ctrl-D to "
                  "quit)", file=sys.stderr)
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
            prompts = split_prompts(sys.stdin, args.separator)
        except (OSError, UnicodeDecodeError) as e:  # a descriptor that cannot be read, a directory, not text
            raise RecipeError(f"standard input cannot be read ({type(e).__name__}: {e}); give prompts as text, "
                              f"separated by lines of {args.separator!r}, or a PROMPT") from None
        for i, text in enumerate(prompts):  # all of them before the first answer
            check_prompt(text, f"standard input's prompt {i + 1}")
        for text in prompts:
            print("\n".join(f"> {line}" for line in text.split("\n")), flush=True)
            print(reply(text), flush=True)
            print(args.separator, flush=True)
        return 0
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
