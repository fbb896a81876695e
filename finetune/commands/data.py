"""`python -m finetune.data --recipe NAME [key=value ...] [--show N] [--json]`: the rows a run trains on,
trained tokens marked, and a summary per source."""

from __future__ import annotations

import argparse
import json
import os
import sys

from finetune.assets import resolve_model
from finetune.data import (GREEN, RESET, BatchSchedule, build_datasets, prevalidate_recipe, prompt_columns,
                           show_pair, show_prompt, show_row, summary_lines, trained)
from finetune.model import load_tokenizer
from finetune.recipe import RecipeError, chat_template_text, resolve


def main(argv=None) -> int:
    """python -m finetune.data --recipe NAME [key=value ...] [--show N] [--json]"""
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise RecipeError(f"{message} (see python -m finetune.data --help)")

    parser = Parser(prog="python -m finetune.data",
                    description="Prepare the recipe's data as training would (same cache) and show the first rows "
                    "the run trains on, with the trained tokens marked (prompt rows, objective=grpo: the prompt as "
                    "generation continues it and the columns the reward functions get), and a summary per source.")
    parser.add_argument("--recipe", required=True, help="name in recipes/ or path to a .py file")
    parser.add_argument("--show", type=int, default=3, metavar="N", help="rows to print (default 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row (input_ids, labels; a "
                        "preference pair's chosen_ and rejected_ input_ids and labels; a prompt row's prompt, "
                        "prompt_input_ids and other columns) on stdout; the summary goes to stderr")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("overrides", nargs="*", help="key=value, as for finetune/run.py")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
        if args.show < 0:
            raise RecipeError(f"--show {args.show}: must be >= 0")
        recipe = resolve(args.recipe, args.overrides)
        chat_template_text(recipe)
        prevalidate_recipe(recipe)
        import datasets

        datasets.disable_progress_bars()
        tokenizer = load_tokenizer(recipe, resolve_model(recipe.model))
        data = build_datasets(recipe, tokenizer)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    # the order of epoch 0: the first rows printed are the first rows the run trains on, whatever its world size
    order = BatchSchedule(len(data.train), 1, 1, 1, recipe.seed).permutation(0)[:args.show].tolist()
    for position, index in enumerate(order):
        row = data.train[index]
        source = data.sources[int(data.row_sources[index])]["source"] if data.row_sources is not None else None
        if args.json:
            print(json.dumps({"position": position, "row": index, "source": source} | row))
            continue
        what = f" from {source}" if source and len(data.sources) > 1 else ""
        header = f"--- row {index}{what} (trained {'first' if position == 0 else f'#{position + 1}'}): "
        if "prompt_input_ids" in row:  # a prompt row (objective=grpo): generated from, nothing trained
            others = prompt_columns(row)
            order = "first" if position == 0 else f"#{position + 1}"
            print(f"--- row {index}{what} (prompt {order} of the run): {len(row['prompt_input_ids'])} tokens; the "
                  f"reward functions get {', '.join(['prompts', 'completions', 'completion_ids'] + others)}")
            print(show_prompt(tokenizer, row, colour))
            continue
        if "chosen_input_ids" in row:  # a preference pair
            print(header + "; ".join(f"{side} {len(row[f'{side}_input_ids'])} tokens, {trained(row[f'{side}_labels'])} "
                                     "trained" for side in ("chosen", "rejected")))
            print(show_pair(tokenizer, row, colour))
            continue
        label = "" if "desirable" not in row else \
            f"; label {'true (desirable)' if row['desirable'] else 'false (undesirable)'}"  # an unpaired row (KTO)
        print(header + f"{len(row['input_ids'])} tokens, {trained(row['labels'])} trained{label}")
        print(show_row(tokenizer, row["input_ids"], row["labels"], row.get("position_ids"), colour))
    summary = summary_lines(data, recipe)
    if not args.json:
        print("---")
        if "prompt_input_ids" not in data.train.column_names:
            print("trained tokens in " + (f"{GREEN}green{RESET}" if colour else "[[brackets]]"))
    for line in summary:
        print(line.removeprefix("data "), file=sys.stderr if args.json else sys.stdout)
    return 0



if __name__ == "__main__":
    sys.exit(main())
