"""The training command: `[accelerate launch ...] finetune/run.py --recipe NAME [key=value ...]`
(finetune/run.py is the file launchers start; it calls main here).

Every mistake a user can make in the recipe, the command line or the data files is reported here as
one line on stderr with exit code 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from finetune.files import why_not_creatable
from finetune.recipe import FIELDS, RecipeError, available_recipes, describe_fields
from finetune.training.stopping import stop_with_front


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _say(message: str) -> None:
    if _rank() == "0":  # every rank checks the same things; one says so
        print(message, file=sys.stderr, flush=True)


def say_once(message: str, store=None) -> None:
    """A user error found while training, when the process group exists: each rank finds its own (a file
    another rank reads differently, or rank 0 still waiting in a collective), so the first rank to find
    one says it, once, whichever rank that is. The ranks agree through the process group's key-value
    store (under torchrun the launcher's, alive while any rank is), not a collective, which a rank that
    is waiting in another collective would never join. Without a store: rank 0 says it."""
    import datetime

    if store is None:
        store = _default_store()
    first = _rank() == "0"
    if store is not None:
        try:
            store.set_timeout(datetime.timedelta(seconds=10))
            first = store.add("finetune/error-said", 1) == 1
        except Exception:  # the store's host is gone: fall back on rank 0 saying it
            pass
    if first:
        print(message, file=sys.stderr, flush=True)


def _default_store():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


def output_dir_problem(output_dir: Path) -> str | None:
    """A file where the directory should be, or a place this user cannot write: found now, not at
    the first save after the model has loaded."""
    if output_dir.exists():
        if not output_dir.is_dir():
            return f"output_dir={output_dir} is a file, not a directory; choose another output_dir"
        if not os.access(output_dir, os.W_OK | os.X_OK):
            return (f"output_dir={output_dir} is not writable (permissions or a read-only filesystem); "
                    "choose a writable output_dir")
        return None
    problem = why_not_creatable(output_dir)
    if problem:
        reason, choice = problem
        return f"output_dir={output_dir} cannot be created: {reason}; choose {choice} output_dir"
    return None


def take_output_dir(output_dir: Path, dry_run: bool, lock: bool = True) -> None:
    """Rank 0 locks output_dir; the other ranks (and `finetune train` checking before it launches)
    refuse when rank 0 will (see finetune/lock.py)."""
    from finetune.lock import OutputDirLock, check_not_busy

    if dry_run:
        return
    if _rank() == "0" and lock:
        OutputDirLock(output_dir).acquire(log=lambda m: print(m, file=sys.stderr, flush=True))
    else:
        check_not_busy(output_dir)


def let_go_of_output_dir(abandon: bool = False) -> None:
    """Release rank 0's output_dir lock; abandon: the run wrote nothing, so directories made for the
    lock go too."""
    from finetune.lock import release_all

    release_all(abandon)


def _stop_before_training(signum, frame):
    """SIGINT/SIGTERM before the loop has its own handler (finetune.training.stopping.StopRequest): there
    is nothing to save yet, so stop at once, without tracebacks, and free output_dir."""
    if _rank() == "0":  # os.write: a print here could re-enter one the signal interrupted
        os.write(2, f"stopped by {signal.Signals(signum).name} before the first training step; nothing to "
                    "save\n".encode())
    let_go_of_output_dir(abandon=True)
    os._exit(128 + signum)


def _die_with_launcher() -> None:
    """Under torchrun (accelerate launch) each worker runs in its own session, so only the launcher
    sees a terminal's Ctrl-C. It forwards the first one (the loop saves and stops); a second Ctrl-C
    makes the launcher exit without forwarding anything, and then the workers are killed here, at
    once, by the kernel (PR_SET_PDEATHSIG), instead of running on as orphans."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher was already gone before the call
        os._exit(128 + signal.SIGKILL)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other user error
        hint = ""
        for word in message.split():
            key = word.lstrip("-").split("=", 1)[0]
            if word.startswith("--") and "=" in word and key in FIELDS:
                hint = f"; recipe keys take no dashes: {word.lstrip('-')}"
                break
        raise RecipeError(f"{message}{hint} (see finetune/run.py --help)")


def parse_args(argv):
    """Options and key=value overrides in any order (`--recipe tiny max_steps=8 --dry-run lr=1e-4`)."""
    parser = _Parser(
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
    parser.add_argument("--allow-model-change", action="store_true",
                        help="resume even though the model's weights differ from those the checkpoint's run started "
                             "from (a DPO reference or a LoRA base is read from them again)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan, do not train")
    parser.add_argument("overrides", nargs="*", help="key=value, typed by the recipe field")
    return parser.parse_intermixed_args(argv)


def prepare(args, lock: bool = True):
    """Everything cheap that can be wrong, checked in order; returns the plan, made once, with its
    checked resume point (finetune.checkpointing.resume). lock=False: check that output_dir is free without taking
    it (the `finetune` front, whose launched ranks take it and convert checkpoints if need be)."""
    from finetune.checkpointing import resume
    from finetune.checkpointing.layout import FINAL
    from finetune.data import prevalidate_recipe
    from finetune.checkpointing.staging import staging_problem
    from finetune.plan import make_plan, world_size_from_env
    from finetune.recipe import chat_template_text, resolve

    recipe = resolve(args.recipe, args.overrides)
    chat_template_text(recipe)
    out = Path(recipe.output_dir)
    problem = output_dir_problem(out)
    if problem and not args.dry_run:
        raise RecipeError(problem)
    take_output_dir(out, args.dry_run, lock)
    prevalidate_recipe(recipe)
    final = out / FINAL
    if final.exists() and not args.dry_run:
        raise RecipeError(f"output_dir={recipe.output_dir} already holds a finished model ({final}); choose another "
                          "output_dir, or move that one away")
    resume.check_start(args.resume, recipe.output_dir, args.dry_run)
    rank = int(os.environ.get("RANK", "0"))
    say = (lambda m: None) if rank else (lambda m: print(m, file=sys.stderr))
    point, recipe, changes = resume.resolve(args.resume, recipe, args.allow_data_change, world_size_from_env(), rank,
                                            convert=lock and not args.dry_run, log=say,
                                            allow_model_change=args.allow_model_change)
    plan = make_plan(recipe, dry_run=args.dry_run, resume=point)
    staging = staging_problem(recipe, plan.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size)))
    if staging and not args.dry_run:  # async_save where host memory cannot stage a checkpoint
        raise RecipeError(staging)
    for unchecked in filter(None, (problem, staging)):  # planning on another machine than the one that trains
        plan = replace(plan, unchecked=plan.unchecked + (unchecked,))
    for change in changes:
        say(f"resume: {change}")
    return plan


def print_dry_run(plan, recipe_name: str) -> None:
    """What --dry-run prints, here and in the `finetune train` front: the plan, the data as stored (rows,
    format, KTO's labels; nothing tokenized) and the memory estimate."""
    from finetune.data import overview_lines
    from finetune.memory_tables import memory_report

    print(plan.describe())
    for line in overview_lines(plan.recipe):
        print(line)
    print(memory_report(plan.recipe, plan.world_size, recipe_name, gpus_per_node=plan.world_size // plan.num_machines))


def check_model_and_data(plan) -> None:
    """What the launched ranks find only once started (each after its own imports, one error per rank
    under the launcher's traceback), checked in the `finetune` front before it launches: vLLM where
    generation_backend=vllm, the model's
    config against the recipe (sequence_parallel and the attention heads, rows concatenated in a model
    that carries state along the sequence), a distillation's teacher (its config and tokenizer: there,
    readable, a causal LM of the student's vocabulary), and the data as tokenized (a source left with no trained
    token or pair, fewer rows than one global batch, fewer eval rows than sample_prompts). Config and
    tokenizer are a few small files. Tokenizing here costs the run nothing: the datasets cache keeps
    the result under a content fingerprint and the ranks read it from there (as after `finetune data`)."""
    from finetune import data as D
    from finetune import sequence_parallel as SP
    from finetune.model import concatenation_problem, load_config, load_tokenizer
    from finetune.training.generators import check_installed
    from finetune.training.samples import eval_prompts

    r = plan.recipe
    check_installed(r)  # generation_backend=vllm without vLLM: found here, not by every rank after its start
    model_path, config = load_config(r)
    problem = concatenation_problem(r, config) or SP.config_problem(r, config)
    if problem:
        raise RecipeError(problem)
    tokenizer = load_tokenizer(r, model_path)
    if r.teacher_model:  # objective=distill: there, readable, a causal LM of the student's vocabulary
        from finetune.training.objectives.distill import check_teacher

        check_teacher(r, tokenizer, config)
    datasets = D.build_datasets(r, tokenizer)
    problem = D.BatchSchedule(len(datasets.train), r.micro_batch_size, plan.grad_accum,
                              plan.data_parallel_size, r.seed).problem()
    if problem:
        raise RecipeError(problem)
    if datasets.eval is not None and r.sample_prompts:
        eval_prompts(datasets.eval, r.sample_prompts, tokenizer, r.eval_max_samples)


def main(argv=None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_before_training)
    _die_with_launcher()
    stop_with_front()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        plan = prepare(args)
    except RecipeError as e:
        let_go_of_output_dir(abandon=True)
        _say(f"error: {e}")
        return 2
    from finetune.versions import untested_releases

    for note in untested_releases():
        _say(note)
    if args.dry_run:
        print_dry_run(plan, args.recipe)
        return 0
    if plan.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than have DeepSpeed warn it guessed
    from finetune.training.loop import train

    try:
        train(plan)
    except RecipeError as e:  # found only once data or model were reached (hub datasets, for example)
        let_go_of_output_dir()
        say_once(f"error: {e}")
        return 2
    except Exception as e:  # a bug or a machine fault: say where, then exit so the launcher stops the others
        import traceback

        let_go_of_output_dir()
        traceback.print_exc()
        print(f"error: rank {_rank()} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: teardown could block in a collective the other ranks never join
    let_go_of_output_dir()
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
