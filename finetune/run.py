"""Command line: `[accelerate launch ...] finetune/run.py --recipe NAME [key=value ...]`.

Every mistake a user can make in the recipe, the command line or the data files is reported here as
one line on stderr with exit code 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.recipe import RecipeError, available_recipes, describe_fields  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="finetune/run.py",
        description="Fine-tune a causal LM from a recipe. Recipes: " + ", ".join(available_recipes()),
        epilog="recipe keys (override with key=value):\n" + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", required=True, help="name in recipes/ or path to a .py file")
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="auto: the newest complete checkpoint in output_dir (else start fresh); or a checkpoint")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume even though dataset, format, sequence length or seed differ from the checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan, do not train")
    parser.add_argument("overrides", nargs="*", help="key=value, typed by the recipe field")
    return parser.parse_args(argv)


def prepare(args):
    """Everything cheap that can be wrong, checked in order; returns the plan."""
    from finetune.checkpoint import check_fits, complete_checkpoints, find_resume_point
    from finetune.data import prevalidate
    from finetune.plan import make_plan
    from finetune.recipe import chat_template_text, resolve

    recipe = resolve(args.recipe, args.overrides)
    chat_template_text(recipe)
    plan = make_plan(recipe, dry_run=args.dry_run)
    prevalidate(recipe.dataset, recipe.dataset_format)
    if recipe.eval_dataset:
        prevalidate(recipe.eval_dataset, recipe.dataset_format, key="eval_dataset")
    final = Path(recipe.output_dir) / "final"
    if final.exists() and not args.dry_run:
        raise RecipeError(f"output_dir={recipe.output_dir} already holds a finished model ({final}); choose another "
                          "output_dir, or move that one away")
    if not args.resume and complete_checkpoints(Path(recipe.output_dir) / "checkpoints") and not args.dry_run:
        raise RecipeError(f"output_dir={recipe.output_dir} holds checkpoints of an earlier run; continue it with "
                          "--resume auto, or choose another output_dir")
    quiet = os.environ.get("RANK", "0") != "0"
    point = find_resume_point(args.resume, Path(recipe.output_dir), log=(lambda m: None) if quiet else
                              (lambda m: print(m, file=sys.stderr)))
    if point is None:
        return plan
    check_fits(point, recipe, args.allow_data_change)
    if point.global_batch_size != plan.global_batch_size:
        # keep the checkpoint's global batch on a new world size: accumulation is recomputed
        recipe = replace(recipe, global_batch_size=point.global_batch_size)
        plan = make_plan(recipe, dry_run=args.dry_run)
    return replace(plan, resume=point)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        plan = prepare(args)
    except RecipeError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank checks the same things; one says so
            print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from finetune.memory import memory_report

        print(plan.describe())
        print(memory_report(plan.recipe, plan.world_size, args.recipe))
        return 0
    if plan.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than have DeepSpeed warn it guessed
    from finetune.loop import train

    try:
        train(plan)
    except RecipeError as e:  # found only once data or model were reached (hub datasets, for example)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug or a machine fault: say where, then exit so the launcher stops the others
        import traceback

        rank = os.environ.get("RANK", "0")
        traceback.print_exc()
        print(f"error: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: teardown could block in a collective the other ranks never join
    return 0


def exit_without_teardown(code: int) -> None:
    """End the process without tearing down the distributed process group.

    Teardown deadlocks now and then: a gloo worker thread frees a finished all-gather's tensors
    (which needs the GIL) while the main thread, freeing the DDP model whose reducer holds the last
    reference to the group, joins that thread with the GIL held (py-spy dumps of finished runs
    that never exited; the blocking ~ProcessGroupGloo is pytorch/pytorch#56297). So the loop keeps
    the model alive (loop.KEEP_UNTIL_EXIT) and nothing here frees it. Left to interpreter shutdown
    instead, the still-joinable worker threads can abort the process ("terminate called without an
    active exception"; pytorch/pytorch#179291). train() ends with a barrier, so every rank
    has written everything; there is nothing left for a teardown to do.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
