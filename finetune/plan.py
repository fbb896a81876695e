"""Derived facts about a run, from the recipe and the launch environment, before anything is loaded.

The plan is where the recipe meets the machine: world size, accumulation, global batch, device, and
whether the launcher agrees with the recipe. Everything here is cheap and raises RecipeError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from finetune.recipe import Recipe, RecipeError
from finetune.strategy import Strategy, strategy_for


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    world_size: int
    num_machines: int
    grad_accum: int
    device: str  # "cuda" or "cpu"
    unchecked: tuple[str, ...] = ()  # machine-dependent problems a dry run reports instead of raising
    resume: object | None = None  # the checked checkpoint this run continues from: a resume.ResumePoint

    @property
    def resumes_on_other_world_size(self) -> bool:
        return self.resume is not None and self.resume.world_size != self.world_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different rows: the processes, less the sequence-parallel ranks sharing a row."""
        return data_parallel_size(self.recipe, self.world_size)

    @property
    def global_batch_size(self) -> int:
        return self.recipe.micro_batch_size * self.grad_accum * self.data_parallel_size

    @cached_property
    def strategy(self) -> Strategy:
        """The recipe's strategy object, built once per plan (dataclasses.replace makes a new plan, and a
        new one for its recipe)."""
        return strategy_for(self.recipe.strategy)

    @property
    def is_deepspeed(self) -> bool:
        return self.strategy.is_deepspeed

    @property
    def zero_stage(self) -> int:
        return self.strategy.zero_stage

    def describe(self) -> str:
        r = self.recipe
        offload = []
        if r.offload_params != "none":
            offload.append(f"params->{r.offload_params}")
        if r.offload_optimizer != "none":
            offload.append(f"optimizer->{r.offload_optimizer}")
        notes = "".join(f"\nnot runnable on this machine: {p}" for p in self.unchecked)
        sp = r.sequence_parallel
        ranks = (f"{self.data_parallel_size} data-parallel (sequence_parallel={sp}: each sequence split across {sp} "
                 "ranks)" if sp > 1 else f"{self.world_size}")
        batch = f"{self.global_batch_size}"
        if r.objective == "grpo":  # the batch trains on completions; a step reads global / num_generations prompts
            batch = (f"{self.global_batch_size // r.num_generations} prompts x {r.num_generations} = "
                     f"{self.global_batch_size} completions")
        if not r.global_batch_size and self.data_parallel_size > 1:  # not fixed: another process count, another batch
            ranks += (" (global_batch_size=0: the batch grows with the processes; set global_batch_size to keep it "
                      "the same on any count)")
        layout = self.strategy.layout_text(r, self.world_size, self.num_machines)
        return (f"{r.strategy}{layout} on {self.world_size} {self.device} process(es), {self.num_machines} machine(s); "
                f"global batch {batch} = micro {r.micro_batch_size} x accum {self.grad_accum} x "
                f"{ranks}; precision {r.mixed_precision}; offload {', '.join(offload) or 'none'}{notes}")


def world_size_from_env(env=os.environ) -> int:
    return int(env.get("WORLD_SIZE", "1"))


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    """Processes that read different rows: sequence_parallel ranks share each row (at least 1, so that
    a dry run on fewer processes than sequence_parallel still plans)."""
    return max(1, world_size // getattr(recipe, "sequence_parallel", 1))


def derive_grad_accum(recipe: Recipe, world_size: int) -> int:
    """Keep the global batch fixed when asked to (global_batch_size > 0), whatever the world size."""
    if not recipe.global_batch_size:
        return recipe.grad_accum
    dp = data_parallel_size(recipe, world_size)
    per_step = recipe.micro_batch_size * dp
    if recipe.objective == "grpo":  # global_batch_size counts prompts; each rank holds whole groups
        return grpo_grad_accum(recipe, dp)
    if recipe.global_batch_size % per_step:
        below = recipe.global_batch_size // per_step * per_step
        nearest = " or ".join(str(v) for v in (below, below + per_step) if v > 0)
        ranks = "processes" if dp == world_size else "data-parallel ranks (processes / sequence_parallel)"
        raise RecipeError(
            f"global_batch_size={recipe.global_batch_size} is not a multiple of micro_batch_size x {ranks} = "
            f"{recipe.micro_batch_size} x {dp} = {per_step}; use global_batch_size={nearest}, "
            "or a micro_batch_size that divides it"
        )
    return recipe.global_batch_size // per_step


def grpo_grad_accum(recipe: Recipe, dp: int) -> int:
    """GRPO: the global batch is global_batch_size prompts x num_generations completions, each rank
    holding global_batch_size / dp prompts' whole groups, in micro-batches of micro_batch_size completions."""
    prompts, g, m = recipe.global_batch_size, recipe.num_generations, recipe.micro_batch_size
    if prompts % dp or (prompts // dp * g) % m:
        raise RecipeError(
            f"global_batch_size={prompts} prompts do not split into whole groups on {dp} processes in micro-batches "
            f"of micro_batch_size={m} completions (each process holds global_batch_size / {dp} prompts x "
            f"num_generations={g} completions); use a global_batch_size that is a multiple of {dp} and a "
            "micro_batch_size that divides each process's completions")
    return prompts // dp * g // m


def check_launcher(recipe: Recipe, env=os.environ) -> None:
    """The recipe decides the strategy; a launcher config that says otherwise is an error, not a vote."""
    fix = ("the recipe decides the strategy; launch with a plain multi-process config such as "
           "accelerate_configs/multi_gpu_8.yaml, or change strategy= to match")
    strategy = strategy_for(recipe.strategy)
    problem = strategy.launcher_problem(env)
    if problem:
        raise RecipeError(f"{problem}; {fix}")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if stage and stage.isdigit() and int(stage) != strategy.zero_stage:
            raise RecipeError(f"the launcher config asks for ZeRO stage {stage} but strategy={recipe.strategy}; {fix}")
        if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
            raise RecipeError("the launcher config names a deepspeed_config_file, but the DeepSpeed config is built "
                              "from the recipe; remove deepspeed_config_file from the launcher config")
    launched_mp = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_mp != "no" and launched_mp != recipe.mixed_precision:
        raise RecipeError(f"the launcher says mixed_precision={launched_mp} but the recipe says "
                          f"mixed_precision={recipe.mixed_precision}; the recipe decides: drop it from the launcher "
                          "config or set the same value in the recipe")


def gpu_only_problems(recipe: Recipe) -> list[str]:
    problems = []
    # bf16 runs on CPU under every strategy (tests/distributed/test_bf16.py: the GPU's bf16 code paths,
    # slowly); fp16 needs a loss scaler, which Accelerate only has for GPUs.
    if recipe.mixed_precision == "fp16":
        problems.append("mixed_precision=fp16 needs a CUDA GPU and this machine has none; "
                        "use mixed_precision=no (fp32) or bf16 on CPU")
    strategy_problem = strategy_for(recipe.strategy).gpu_only_problem(recipe)
    if strategy_problem:
        problems.append(strategy_problem)
    if recipe.attn_implementation == "flash_attention_2":
        problems.append("attn_implementation=flash_attention_2 needs a CUDA GPU; use attn_implementation=sdpa")
    if recipe.loss_impl == "liger":
        problems.append("loss_impl=liger needs a CUDA GPU (Liger-Kernel is Triton); use loss_impl=chunked on CPU")
    return problems


# Only 0.50.2 was tested (CPU, 2 processes); 0.45 is a floor by release notes, not by a run: quant_storage
# and the FSDP quant_state recovery predate it, 4-bit on CPU came with the 0.4x releases.
BITSANDBYTES_MIN = (0, 45)


def bitsandbytes_problem(find_spec=None, version=None) -> str | None:
    """load_in_4bit needs bitsandbytes (NF4 on CUDA and on CPU). Checked before anything loads; the
    planner (python -m finetune.plan) does not need it."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    if (find_spec or importlib.util.find_spec)("bitsandbytes") is None:
        return ("load_in_4bit=true (QLoRA) needs bitsandbytes, which is not installed: pip install bitsandbytes "
                "(or pip install -e .[qlora]), or load_in_4bit=false")
    try:
        text = version or installed("bitsandbytes")
    except PackageNotFoundError:
        return None
    parts = tuple(int(p) for p in text.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and parts < BITSANDBYTES_MIN:
        return (f"load_in_4bit=true (QLoRA) needs bitsandbytes >= {'.'.join(map(str, BITSANDBYTES_MIN))} (found "
                f"{text}): pip install -U bitsandbytes")
    return None


def nvme_problems(recipe: Recipe, cuda_available: bool) -> list[str]:
    """offload=nvme needs a directory that exists (DeepSpeed would create a mistyped one and fill
    it) and DeepSpeed's async_io op, which needs libaio; without them the run fails minutes in,
    after the model has loaded."""
    if "nvme" not in (recipe.offload_optimizer, recipe.offload_params):
        return []
    problems = []
    path = recipe.nvme_path
    if not os.path.exists(path):
        problems.append(f"nvme_path={path} does not exist; create it on a local NVMe disk (mkdir -p {path}), "
                        "or fix the path")
    elif not os.path.isdir(path):
        problems.append(f"nvme_path={path} is a file, not a directory; give a directory on a local NVMe disk")
    elif not os.access(path, os.W_OK | os.X_OK):
        problems.append(f"nvme_path={path} is not writable; give a directory this user can write")
    aio = None if problems else async_io_problem(cuda_available)  # one problem at a time; this one costs seconds
    return problems + ([aio] if aio else [])


def async_io_problem(cuda_available: bool) -> str | None:
    """Whether DeepSpeed can load or build its async_io op here. Cheap next to a failed run: an
    import of DeepSpeed and a link test of libaio (AsyncIOBuilder.is_compatible); the op itself
    is compiled on first use (about a minute) and cached in ~/.cache/torch_extensions."""
    import importlib.util
    import shutil

    if not cuda_available:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as run.py sets it; DeepSpeed would warn it guessed
    if importlib.util.find_spec("deepspeed") is None:
        return "offload to nvme needs DeepSpeed: pip install deepspeed"
    try:
        if importlib.util.find_spec("deepspeed.ops.aio.async_io_op") is not None:
            return None  # built into the DeepSpeed install (DS_BUILD_AIO=1)
    except ImportError:
        pass
    fix = ("offload to nvme needs DeepSpeed's async_io op, built on first use with libaio: "
           "apt-get install libaio-dev (or yum install libaio-devel)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"{fix}, and a C++ compiler ({compiler} is not on PATH): apt-get install g++"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return f"{fix}, and ninja: pip install ninja"
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        return f"{fix}; libaio was not found (if it is installed elsewhere, set CFLAGS=-I... and LDFLAGS=-L...)"
    return None


STALE_BUILD_LOCK_S = 30 * 60  # the slowest op build we measured (async_io, 2 loaded cores) took 8 minutes


def build_lock_scheme(cpp_extension=None) -> str:
    """How this torch's extension builder (torch.utils.cpp_extension, which DeepSpeed's op builders call)
    guards a build directory's `lock` file:
    "baton": torch 2.13 and older (FileBaton): the file's existence is the lock; a build creates it and
             removes it at its end, so a build that was killed leaves it, and every later build or load
             of that op waits on it forever;
    "os_lock": torch 2.14 (filelock's FileLock): an flock held on the file while building or loading;
             the file stays after every build and load, blocks nobody, and the kernel lets go of the
             lock when its holder dies."""
    if cpp_extension is None:
        from torch.utils import cpp_extension
    jit = getattr(cpp_extension, "_jit_compile", None)
    return "baton" if jit is not None and "FileBaton" in jit.__code__.co_names else "os_lock"


def lock_is_held(path: str) -> bool:
    """Whether a process holds an OS-level (flock) lock on path now: a non-blocking try, let go at once."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without flock: nothing to tell
        return False
    finally:
        os.close(fd)  # closing lets go of the probe's lock
    return False


def deepspeed_ops(recipe: Recipe, cuda_available: bool) -> set[str]:
    """The DeepSpeed ops (their torch_extensions directories) a run of this recipe builds or loads: the
    CPU communication op on a machine without CUDA (deepspeed.comm's TorchBackend), DeepSpeed's CPU Adam
    with the optimizer offloaded (zero.deepspeed_config), async_io with anything on NVMe."""
    if not strategy_for(recipe.strategy).is_deepspeed:
        return set()
    ops = set() if cuda_available else {"deepspeed_shm_comm"}
    if recipe.offload_optimizer != "none":
        ops.add("cpu_adam")
    if "nvme" in (recipe.offload_optimizer, recipe.offload_params):
        ops.add("async_io")
    return ops


def extensions_root() -> str:
    """The directory torch builds extensions in (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python, cuda>)."""
    from torch.utils.cpp_extension import _get_build_directory

    root = os.path.dirname(_get_build_directory("finetune_probe", verbose=False))
    try:
        os.rmdir(os.path.join(root, "finetune_probe"))  # _get_build_directory creates it
    except OSError:
        pass
    return root


def stale_build_locks(ops, root: str, now: float, scheme: str, older_than_s: float = STALE_BUILD_LOCK_S
                      ) -> list[tuple[str, float]]:
    """The `lock` files of these ops' build directories that would make a build or load wait forever,
    with their ages: under "baton", those older than any real build (the file is the lock, and no build
    takes that long); under "os_lock", none (a file no one holds is left behind by design, and one held
    is a build or load running now, let go of by the kernel if its process dies)."""
    if scheme != "baton":
        return []
    found = []
    for op in sorted(ops):
        lock = os.path.join(root, op, "lock")
        try:
            age = now - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue
        if age > older_than_s:
            found.append((lock, age))
    return found


def stale_build_lock_problems(recipe: Recipe, now: float | None = None, root: str | None = None,
                              scheme: str | None = None, cuda_available: bool = False) -> list[str]:
    """DeepSpeed compiles its ops on first use in torch's extensions directory, under a `lock` file per op
    (build_lock_scheme says what it means). A lock that would keep a build or load of an op this run uses
    waiting forever, without a word, is named here with the one command that fixes it."""
    import time

    ops = deepspeed_ops(recipe, cuda_available)
    if not ops:
        return []
    root = extensions_root() if root is None else root
    now = time.time() if now is None else now
    return [f"a build of the {os.path.basename(os.path.dirname(lock))} op was interrupted {age / 3600:.1f} h ago and "
            f"left its lock file {lock}; DeepSpeed would wait for it forever: delete it (rm {lock}) and run again"
            for lock, age in stale_build_locks(ops, root, now, scheme or build_lock_scheme())]


def clear_stale_build_locks(older_than_s: float = STALE_BUILD_LOCK_S, ops=None) -> list[str]:
    """Removes the lock files stale_build_locks finds among every op's directory (or `ops`'), and returns
    them (scripts/setup.sh, before it builds an op; after a build it cut short, with older_than_s=0).
    Under torch 2.14's scheme nothing is removed: deleting a lock someone holds would let a second
    build start beside it, and one no one holds blocks nobody."""
    import time

    root = extensions_root()
    if ops is None:
        ops = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))] if os.path.isdir(root) else []
    removed = []
    for lock, _ in stale_build_locks(ops, root, time.time(), build_lock_scheme(), older_than_s):
        try:
            os.remove(lock)
            removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


def make_plan(recipe: Recipe, env=os.environ, cuda_available: bool | None = None, dry_run: bool = False,
              resume: ResumePoint | None = None) -> Plan:
    """dry_run: a plan made on a machine other than the one that will train (a laptop planning for a
    GPU node) lists what needs a GPU instead of refusing."""
    check_launcher(recipe, env)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    problems = [] if cuda_available else gpu_only_problems(recipe)
    problems += nvme_problems(recipe, cuda_available)
    problems += stale_build_lock_problems(recipe, cuda_available=cuda_available)
    if recipe.load_in_4bit:
        problem = bitsandbytes_problem()
        if problem:
            problems.append(problem)
    if recipe.loss_impl == "liger" and cuda_available:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            problems.append("loss_impl=liger needs Liger-Kernel: pip install liger-kernel, or use loss_impl=chunked")
    world_size = world_size_from_env(env)
    from finetune.sequence_parallel import world_problem

    problem = world_problem(recipe, world_size)
    if problem:
        problems.append(problem)
    machines = int(env.get("ACCELERATE_NUM_MACHINES", env.get("GROUP_WORLD_SIZE", "1")) or 1)
    problem = strategy_for(recipe.strategy).layout_problem(recipe, world_size, machines)
    if problem:
        problems.append(problem)  # a dry run plans for another machine's processes
    if problems and not dry_run:
        raise RecipeError(problems[0])
    return Plan(
        recipe=recipe,
        world_size=world_size,
        num_machines=machines,
        grad_accum=derive_grad_accum(recipe, world_size),
        device="cuda" if cuda_available else "cpu",
        unchecked=tuple(problems),
        resume=resume,
    )


if __name__ == "__main__":  # python -m finetune.plan
    import runpy

    runpy.run_module("finetune.commands.plan", run_name="__main__")
