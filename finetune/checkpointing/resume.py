"""Which checkpoint a run continues from, and whether it can: decided once, by `resolve`, before
any model loads or process group exists.

`resolve` reads and verifies the manifest (files and sizes, DCP metadata within the allow-list),
checks that the checkpoint is of this model, strategy and data, names what the resumed run changes
(refusing what a checkpoint cannot honour), keeps the checkpoint's global batch, and converts a
DeepSpeed checkpoint to the universal format when the world size changed. What it returns is all
the rest of the run needs: `plan.resume`, read by Checkpointer.load. (The file checksums are
checked at the load itself, each rank hashing its share: checkpoint.verify_checksums.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune.assets import resolve_model
from finetune.checkpointing.layout import (MANIFEST, UNIVERSAL, checkpoints_dir, complete_checkpoints,
                                           partial_checkpoints)
from finetune.checkpointing.manifest import (DATA_KEYS, HARD_KEYS, UnreadableManifest, checksum_mismatches,
                                             damaged_by_checksum, fingerprint, manifest_digest, read_manifest, seal,
                                             seal_problem, verify)
from finetune.checkpointing.run_state import check_small_files, in_flight_files
from finetune.files import publish, staging
from finetune.lock import launch_id
from finetune.plan import data_parallel_size, derive_grad_accum, world_size_from_env
from finetune import objective_rules
from finetune.recipe import Recipe, RecipeError, reference_kind
from finetune.strategy import NAMES as STRATEGY_NAMES, strategy_for


# Keys whose values live on in the checkpoint's optimizer and scheduler state (or its tensors' layout):
# a resumed run would silently keep the old value, so a change is refused rather than ignored.
STATE_KEYS = ("lr", "lr_scheduler", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
              "mixed_precision", "offload_optimizer", "offload_params", "fsdp_version", "ddp_shard_optimizer",
              "lora_alpha", "lora_dropout", "load_in_4bit")
# GRPO's keys that make its prompt schedule and rollouts: a change would make a resumed step train on other
# prompts (or retrain a finished rollout's), so it is refused.
ROLLOUT_KEYS = ("num_generations", "num_iterations")
# What a change of these does on resume (any other key not named above applies as it would in a new run).
RESUME_EFFECTS = {
    "max_steps": "the run's length; the lr schedule is recomputed for it from this step on",
    "epochs": "the run's length; the lr schedule is recomputed for it from this step on",
    "micro_batch_size": "the global batch is kept, accumulation is recomputed",
    "sequence_parallel": "each sequence split across this many ranks from this step on; the same global batches",
    "shard_size": "the DCP shards loaded on the new mesh: hybrid sharding over groups of this size from this step on",
    "zero_hpz_partition_size": "hpZ's secondary copy within groups of this size from this step on (the checkpoint "
                               "holds the primary partitions)",
    "padding_free": "the same rows at every step, laid out as one row per micro-batch (true) or padded rows "
                    "(false) from this step on",
}


def resolve(resume: str | None, recipe: Recipe, allow_data_change: bool, world_size: int, rank: int = 0,
            convert: bool = True, log=print, allow_model_change: bool = False
            ) -> tuple[ResumePoint | None, Recipe, list[str]]:
    """--resume auto|PATH -> (the checked point or None, the recipe to plan with, the changes to report).

    The recipe keeps the checkpoint's global batch (the data position is counted in global batches;
    on another world size or micro batch the accumulation is recomputed from it). convert=False
    (a dry run, or the `finetune` front that launches the ranks) leaves the universal conversion
    to the ranks that train."""
    point = find(resume, Path(recipe.output_dir), log)
    if point is None:
        return None, recipe, []
    problem = nvme_resume_problem(point.path, recipe)
    if problem:
        raise RecipeError(problem)
    check_fits(point, recipe, allow_data_change)
    check_model(point, resolve_model(recipe.model))
    changed = changes(point, recipe)
    check_in_flight_held(point, recipe)
    check_identity(point, recipe, allow_model_change)
    asked = recipe.micro_batch_size * derive_grad_accum(recipe, world_size) * data_parallel_size(recipe, world_size)
    if asked != point.global_batch_size:
        recipe = replace(recipe, global_batch_size=point.global_batch_size)
    if convert and strategy_for(recipe.strategy).converts_on_world_size_change and point.world_size != world_size:
        point = replace(point, load_from=ensure_universal(point, rank, Path(recipe.output_dir), log=log))
    return point, recipe, changed


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int
    world_size: int
    global_batch_size: int
    strategy: str
    recipe: dict  # the recipe the checkpoint was trained with (its recipe.json; every save writes one)
    manifest: dict = field(default_factory=dict, repr=False)  # read and verified once, by find
    load_from: Path | None = None  # what Checkpointer.load reads, when not `path`: its universal conversion

    @property
    def fingerprint(self) -> dict:
        """The model, strategy and data the checkpoint was made with."""
        return self.manifest["fingerprint"]

    @property
    def source(self) -> Path:
        return self.load_from or self.path


def check_start(resume: str | None, output_dir: str, dry_run: bool = False) -> None:
    """Whether a run may start in output_dir (the recipe's): not over an earlier run's checkpoints unless
    it continues them (--resume), and then only its own line of them (check_lineage)."""
    complete = complete_checkpoints(checkpoints_dir(output_dir))
    if not resume and complete and not dry_run:
        raise RecipeError(f"output_dir={output_dir} holds checkpoints of an earlier run; continue it with "
                          "--resume auto, or choose another output_dir")
    if resume:
        check_lineage(resume, Path(output_dir), complete)


def check_lineage(resume: str, output_dir: Path, complete: list[Path]) -> None:
    """A run continues only its own line of checkpoints.

    `--resume PATH` writes its next checkpoints into output_dir/checkpoints. If that directory holds
    checkpoints of another run, or checkpoints of this run newer than PATH, the resumed run would
    replace some of them (same step names) and rotation and `--resume auto` would then mix two
    histories. So PATH must be the newest checkpoint of output_dir, or output_dir must hold none.
    `complete` lists output_dir's complete checkpoints, oldest first.
    """
    if not complete or resume == "auto":
        return
    target = Path(resume).expanduser().resolve()
    root = complete[-1].parent.resolve()
    names = ", ".join(p.name for p in complete[-3:])
    if target.parent != root:
        raise RecipeError(f"--resume {resume}: output_dir={output_dir} already holds checkpoints of another run "
                          f"({names}), which the resumed run would overwrite; resume into an output_dir without "
                          "checkpoints, or continue that run with --resume auto")
    newer = [p.name for p in complete if p.name > target.name]
    if newer:
        raise RecipeError(f"--resume {resume}: {root} holds newer checkpoints ({', '.join(newer)}), which the resumed "
                          "run would overwrite; move them out of that directory first, or --resume auto to "
                          "continue from the newest")

def kept_checkpoint(output_dir) -> str:
    """What a run that stops now leaves to continue from, in words (--resume auto continues from it): its newest
    complete checkpoint, or none yet, where --resume auto starts the run again."""
    saved = complete_checkpoints(checkpoints_dir(output_dir))
    if saved:
        return f"its newest checkpoint, {saved[-1].name}, is intact"
    return "no checkpoint had been saved yet (--resume auto starts it again)"


def find(resume: str | None, output_dir: Path, log=print) -> ResumePoint | None:
    """--resume auto: the newest complete checkpoint (incomplete ones, and ones whose manifest cannot be
    read, are named and skipped), else None. --resume PATH: that checkpoint, verified."""
    if not resume:
        return None
    root = checkpoints_dir(output_dir)
    if resume == "auto":
        for partial in partial_checkpoints(root):
            log(f"ignoring incomplete checkpoint {partial} (its save did not finish)")
        candidates = complete_checkpoints(root)
        if not candidates:
            log(f"--resume auto: no complete checkpoint in {root}; starting fresh")
            return None
        path = manifest = None
        for candidate in reversed(candidates):
            try:
                manifest = read_manifest(candidate)
            except UnreadableManifest as e:
                log(f"skipping {e}")
                continue
            path = candidate
            break
        if path is None:  # starting fresh would overwrite them: leave the decision to the user
            raise RecipeError(f"--resume auto: no checkpoint in {root} has a readable {MANIFEST} "
                              f"({', '.join(c.name for c in candidates)}); nothing was deleted; move them away "
                              "to start fresh, or resume one with --resume PATH once its manifest is restored")
    else:
        path, manifest = Path(resume).expanduser(), None
        if not path.is_dir():
            raise RecipeError(f"--resume {resume}: no such checkpoint directory")
    manifest = verify(path, manifest=manifest)  # the one read of the manifest (sizes, DCP metadata)
    check_small_files(path, manifest)
    return ResumePoint(path=path, step=manifest["step"], world_size=manifest["world_size"],
                       global_batch_size=manifest["global_batch_size"], strategy=manifest["fingerprint"]["strategy"],
                       manifest=manifest,
                       recipe=json.loads((path / "recipe.json").read_text()) if (path / "recipe.json").is_file() else {})


def check_fits(point: ResumePoint, recipe: Recipe, allow_data_change: bool) -> None:
    """Refuse a checkpoint of another model or strategy; other data only when asked to."""
    saved = point.fingerprint
    current = fingerprint(recipe)
    for key in HARD_KEYS:
        if key == "model":
            continue  # compared as resolved paths once the model is located (see loop)
        if key == "strategy" and saved.get(key) in STRATEGY_NAMES and current.get(key) in STRATEGY_NAMES and \
                strategy_for(saved[key]).checkpoint_format == strategy_for(current[key]).checkpoint_format:
            continue  # the same shards (fsdp and hsdp: DCP, loaded on any mesh)
        if saved.get(key) != current.get(key):
            raise RecipeError(f"checkpoint {point.path} was written with {key}={saved.get(key)}, this run has "
                              f"{key}={current.get(key)}: its shards cannot be loaded; set {key}={saved.get(key)}, "
                              "or export it (python -m finetune.export) and fine-tune the export in a new run")
    # a key the checkpoint's fingerprint lacks came later (tokenizer, chat_template, max_prompt_len) or is
    # optional: it had the value of the checkpoint's recipe.json, else the default
    defaults = json.loads(json.dumps(Recipe().to_dict()))
    saved = {k: saved.get(k, point.recipe.get(k, defaults[k])) for k in DATA_KEYS} | \
        {k: saved.get(k) for k in HARD_KEYS}
    current = {k: current.get(k, defaults[k]) for k in DATA_KEYS} | {k: current.get(k) for k in HARD_KEYS}
    changed = [k for k in DATA_KEYS if saved.get(k) != current.get(k)]
    if changed and not allow_data_change:
        what = ", ".join(f"{k}: {saved.get(k)} -> {current.get(k)}" for k in changed)
        raise RecipeError(f"checkpoint {point.path} was trained on other data ({what}); the data position would not "
                          "mean the same; restore those values, or pass --allow-data-change to continue anyway")


def check_in_flight_held(point: ResumePoint, recipe: Recipe) -> None:
    """What the resumed run's next steps train on but cannot make again (the objective's in_flight rule)
    must be in the checkpoint, listed by its manifest (run_state.save_in_flight): said before any model
    loads, not at the first step."""
    needed = getattr(objective_rules.rules(recipe), "in_flight", lambda r, step: None)(recipe, point.step)
    if needed and not set(in_flight_files(needed[0])) <= set(point.manifest["files"]):
        raise RecipeError(f"checkpoint {point.path} {needed[1]}")


def changes(point: ResumePoint, recipe: Recipe) -> list[str]:
    """The recipe fields this resumed run changes, each with what the change does; refuses (one line,
    all of them) the changes a checkpoint cannot honour. Data and model keys are check_fits' job."""
    saved, current = point.recipe, json.loads(json.dumps(recipe.to_dict()))
    changed = {k: (saved[k], current[k]) for k in current
               if k in saved and saved[k] != current[k] and k not in HARD_KEYS + DATA_KEYS}
    if "objective" in changed:
        old, new = changed["objective"]
        why = (f"a {new.upper()} run's reference is the model as that run started, which would be the base model, "
               "not this policy" if new in ("dpo", "kto") else
               "its optimizer state and data position belong to the other objective")
        raise RecipeError(f"checkpoint {point.path} was trained with objective={old}, this run has objective={new}: "
                          f"{why}; export the checkpoint (python -m finetune.export {point.path} OUT) and start a new objective={new} "
                          "run with model=OUT in another output_dir")
    schedule = [k for k in ROLLOUT_KEYS if k in changed] if recipe.objective == "grpo" else []
    if schedule:
        what = ", ".join(f"{k}: {changed[k][0]} -> {changed[k][1]}" for k in schedule)
        raise RecipeError(f"checkpoint {point.path} cannot continue with {what}: the checkpoint's prompt schedule and "
                          "rollouts were made with the old value (a step's prompts are its global batch of "
                          "completions / num_generations, a rollout serves num_iterations steps), so its steps "
                          f"would train on other prompts; restore it, or export the checkpoint (python -m "
                          f"finetune.export {point.path} OUT) and start a new run with model=OUT in another output_dir")
    problem = getattr(objective_rules.rules(recipe), "resume_problem", lambda r, c: None)(recipe, changed)
    if problem:
        raise RecipeError(f"checkpoint {point.path} cannot continue with {problem}; restore it, or export the "
                          f"checkpoint (python -m finetune.export {point.path} OUT) and start a new run with "
                          "model=OUT in another output_dir")
    refused = [k for k in changed if k in STATE_KEYS]
    batch = _global_batch_change(point, recipe, changed)
    if batch:
        refused.append(batch)
    if refused:
        what = ", ".join(f"{k}: {changed[k][0]} -> {changed[k][1]}" if k in changed else k for k in refused)
        raise RecipeError(f"checkpoint {point.path} cannot continue with {what}: the checkpoint's optimizer, "
                          "schedule and data position were made with the old values and would override or "
                          "contradict them; restore them, or export the checkpoint (python -m finetune.export) "
                          "and start a new run from it")
    return [f"{k}: {old} -> {new} ({RESUME_EFFECTS.get(k, 'applies from this step on')})"
            for k, (old, new) in changed.items() if k not in ("grad_accum", "global_batch_size", "output_dir")]


def _global_batch_change(point: ResumePoint, recipe: Recipe, changed: dict) -> str:
    """The data position is counted in global batches, so a resumed run keeps the checkpoint's: on
    another world size or micro batch its accumulation is recomputed. An explicit grad_accum or
    global_batch_size that asks for another global batch is refused instead of being reverted."""
    if "global_batch_size" in changed and recipe.global_batch_size not in (0, point.global_batch_size):
        return (f"global_batch_size={recipe.global_batch_size} (the checkpoint's global batch is "
                f"{point.global_batch_size})")
    if "grad_accum" in changed and not recipe.global_batch_size:
        asked = recipe.micro_batch_size * recipe.grad_accum * data_parallel_size(recipe, world_size_from_env())
        if asked != point.global_batch_size:
            return (f"grad_accum={recipe.grad_accum} (a global batch of {asked}; the checkpoint's is "
                    f"{point.global_batch_size}: leave grad_accum as it was, it is recomputed to keep it)")
    return ""


def reads_model_again(recipe: Recipe) -> str | None:
    """What a resumed run takes from `model=` besides the checkpoint (None: nothing, the checkpoint holds
    every weight it trains with)."""
    if recipe.lora:
        return "a LoRA run's base weights"
    if reference_kind(recipe) == "frozen":
        return f"the {recipe.objective.upper()} reference (a frozen copy of the model as training started)"
    return None


def check_identity(point: ResumePoint, recipe: Recipe, allow_model_change: bool,
                   identity: dict | None = None) -> None:
    """Refuse (one line) to resume, from a model whose weights changed since the checkpoint's run started,
    a run that reads them again (reads_model_again), unless allow_model_change. A checkpoint of an older
    finetune records no identity: nothing to compare."""
    from finetune.checkpointing.identity import identity_change, model_identity

    saved = point.manifest.get("model_identity")
    what = reads_model_again(recipe)
    if not saved or what is None or allow_model_change:
        return
    model = resolve_model(recipe.model)
    change = identity_change(saved, identity if identity is not None else model_identity(model))
    if change:
        raise RecipeError(f"model={recipe.model} is not the model checkpoint {point.path} was trained from "
                          f"({change}), and the resumed run reads {what} from it; restore that model, or pass "
                          "--allow-model-change to continue from the weights it holds now")


def reference_record(point: ResumePoint | None) -> dict | None:
    """What a resumed checkpoint says of the precomputed reference log-probs its run was trained with:
    {"path", "sha256"}, or {"why": why it has none}; None on a fresh run (see reference.check_precomputed)."""
    if point is None:
        return None
    saved = point.manifest.get("reference_logps")
    if saved:
        return saved
    if point.recipe.get("precompute_reference"):
        why = (f"checkpoint {point.path} was written by an older finetune, which did not record the reference "
               "log-probs file it was trained with")
    else:
        why = (f"checkpoint {point.path} was trained with precompute_reference=false (its reference, the model, is "
               "read again on resume), so no reference log-probs file belongs to it")
    return {"why": why}


def check_model(point: ResumePoint, model_path: str) -> None:
    saved = point.fingerprint["model"]
    if saved != model_path:
        raise RecipeError(f"checkpoint {point.path} holds a fine-tune of {saved}, this run loads {model_path}; "
                          f"set model={saved}")


# ---------------------------------------------------------------- DeepSpeed on another world size


CONVERSION = "conversion.json"  # the universal conversion's own listing: files, sizes, checksums (manifest.seal)
UNIVERSAL_CACHE = "universal-cache"  # in output_dir: conversions of checkpoints on storage this run cannot write


def ensure_universal(point: ResumePoint, rank: int, output_dir: Path, timeout_s: float = 3600, log=print) -> Path:
    """The checkpoint in DeepSpeed's universal format, for a resume on another world size: converted
    once, verified before every reuse.

    Rank 0 decides (a separate CPU job, before the process group exists) and tells the other ranks
    which directory to load in output_dir's `.universal.ready` (or why it failed in `.universal.failed`),
    each naming this launch, so that a marker of an earlier launch is never taken for this one's."""
    ready, failed = output_dir / ".universal.ready", output_dir / ".universal.failed"
    launch = launch_id()
    if rank == 0:
        try:
            target = _universal(point, output_dir, log)
        except RecipeError as e:
            _mark(failed, launch, str(e))
            raise
        _mark(ready, launch, str(target))
        return target
    deadline = time.monotonic() + timeout_s
    while True:
        said = _marked(ready, launch)
        if said is not None:
            return Path(said)
        if _marked(failed, launch) is not None:
            raise RecipeError(f"converting {point.path} to a universal checkpoint failed on rank 0")
        if time.monotonic() > deadline:
            raise RecipeError(f"timed out waiting for rank 0 to convert {point.path} to a universal checkpoint")
        time.sleep(0.5)


def _universal(point: ResumePoint, output_dir: Path, log) -> Path:
    """A conversion that verifies against its CONVERSION listing: beside the checkpoint
    (<checkpoint>/universal), else in output_dir/universal-cache/<checkpoint>-<manifest digest>/universal;
    when neither does, converted again, beside the checkpoint if it can be written there, else into the
    cache. The listing names the checkpoint's manifest, so a conversion of another save is never taken."""
    digest = manifest_digest(point.path)
    fields = {"source_manifest": digest}
    beside = point.path / UNIVERSAL
    cache = output_dir / UNIVERSAL_CACHE / f"{point.path.name}-{digest[:16]}" / UNIVERSAL
    problems = {}
    for candidate in (beside, cache):
        if candidate.is_dir():
            problem = seal_problem(candidate, CONVERSION, fields)
            if problem is None:
                return candidate
            problems[candidate] = problem
    target = beside if _writable(point.path) else cache
    for bad, problem in problems.items():
        log(f"the universal conversion {bad} does not verify ({problem}): converting {point.path} again")
    if target == cache:
        log(f"{point.path} cannot be written: converting it to the universal format in {cache}")
    bad = checksum_mismatches(point.path, point.manifest, sorted(point.manifest.get("checksums") or {}))
    if bad:  # the conversion reads every shard: check them first
        raise damaged_by_checksum(point.path, bad)
    try:
        if target == cache and cache.parent.parent.is_dir():  # one cached conversion at a time: they are large
            for old in cache.parent.parent.iterdir():
                if old != cache.parent:
                    shutil.rmtree(old, ignore_errors=True)
        with staging(target, "partial") as tmp:
            convert_into(point, tmp, fields)
            publish(tmp, target)
    except OSError as e:
        raise RecipeError(f"cannot write the universal conversion of {point.path} into {target.parent}: "
                          f"{e.strerror or e}; free space there, or resume on {point.world_size} processes, "
                          "which needs no conversion") from None
    return target


def convert_into(point: ResumePoint, tmp: Path, fields: dict) -> None:
    """DeepSpeed's ds_to_universal of the checkpoint's ZeRO files into tmp (reading them weights-only:
    safe_loading's `to-universal`), with everything else Accelerate reads copied beside, sealed."""
    cmd = [sys.executable, "-m", "finetune.checkpointing.safe_loading", "to-universal",
           "--input_folder", str(point.path / "pytorch_model"),
           "--output_folder", str(tmp / "pytorch_model"), *conversion_workers(point)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RecipeError(f"converting {point.path} to a universal checkpoint failed: "
                          f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    for item in point.path.iterdir():  # everything Accelerate reads besides the ZeRO shards
        if item.is_file():
            shutil.copy2(item, tmp / item.name)
    (tmp / "latest").write_text("pytorch_model")
    seal(tmp, CONVERSION, fields)  # last: a conversion without it is never reused


def conversion_workers(point: ResumePoint, cpus: int | None = None, available: int | None = None) -> list[str]:
    """ds_to_universal's worker processes: one per CPU, up to one per saved rank, as many as the host's
    available memory holds (each extract worker loads one rank's ZeRO files, about 3x their size at
    its peak). The conversion is per-rank and per-parameter work in parallel processes; on 2 cores a
    58M-parameter zero2 checkpoint of 2 ranks took 79.7 s with 1 worker and 42.8 s with 2
    (bench/studies/universal_conversion.py, docs/async-checkpoints.md)."""
    from finetune.checkpointing.staging import mem_available

    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = available if available is not None else (mem_available() or 0)
    shards = [size for rel, size in point.manifest["files"].items() if rel.endswith("optim_states.pt")]
    per_worker = 3 * max(shards, default=1)
    workers = max(1, min(cpus, point.world_size, available // per_worker if available else 1))
    return ["--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]


def _writable(directory: Path) -> bool:
    """Whether a file can be made in `directory` (a read-only mount or an immutable directory stops even
    root, which os.access would not always say)."""
    probe = directory / f".write-probe.{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
        return True
    except OSError:
        return False


def _mark(path: Path, launch: str, text: str) -> None:
    """`launch`, then `text`, in path, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{launch}\n{text}")
    os.replace(tmp, path)


def _marked(path: Path, launch: str) -> str | None:
    """The text of a mark of this launch; None when there is none."""
    try:
        first, _, rest = path.read_text().partition("\n")
    except OSError:
        return None
    return rest if first == launch else None


def nvme_resume_problem(checkpoint, recipe: Recipe) -> str | None:
    """Resuming with offload_optimizer=nvme, or from a checkpoint written with it, is refused.

    DeepSpeed's load_checkpoint with NVMe optimizer offload copies the swapped optimizer files back
    (`pytorch_model/offloaded_tensors/`) and skips the ZeRO optimizer file: Adam's step count
    starts again from 0, and the optimizer partitions too small to swap (under 1 MiB per rank:
    norms) keep their initial weights and moments, so the resumed run's losses differ from the
    uninterrupted run's (docs/design-notes.md has the measurement). offload_params=nvme with the
    optimizer on cpu resumes bit for bit.
    """
    from pathlib import Path

    written = (Path(checkpoint) / "pytorch_model" / "offloaded_tensors").is_dir()
    if recipe.offload_optimizer != "nvme" and not written:
        return None
    from importlib.metadata import version

    what = "was written with offload_optimizer=nvme" if written else "is resumed with offload_optimizer=nvme"
    return (f"--resume {checkpoint}: the checkpoint {what}, which deepspeed {version('deepspeed')} does not resume "
            "correctly (Adam's step count restarts and the small optimizer partitions return to their initial "
            "values); runs that must resume: offload_optimizer=cpu (offload_params=nvme resumes correctly)")
