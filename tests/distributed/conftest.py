"""Real multi-process launches over gloo: `accelerate launch --multi_gpu --num_processes N`, the exact
command a CPU user types. The tiny model, tokenizer and data are built once per session."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from finetune.training.metrics import read_metrics, run_history
from forkserver import forkable
from suite_runs import SAVE, STRATEGIES

REPO = Path(__file__).resolve().parents[2]

# Small and fast, but long enough for the curves to say something: 12 optimizer steps of a global
# batch of 16 rows, evaluated twice. The loss in chunks of 8 tokens (about 20 per micro batch; the
# tiny vocabulary would otherwise make one chunk), so that every strategy runs the chunked loss's loop.
# No loss.png (a second of rank 0's time per launch; test_run_experience draws and checks one).
FAST = ["max_steps=12", "log_every=1", "eval_every=6", "eval_max_samples=32", "global_batch_size=16",
        "micro_batch_size=4", "warmup_steps=2", "mixed_precision=no", "loss_chunk_tokens=8", "plot_loss=false"]


@dataclass
class Run:
    output_dir: Path
    returncode: int
    stdout: str
    stderr: str
    env: dict

    @property
    def train_records(self) -> list[dict]:
        return [r for r in run_history(read_metrics(self.output_dir / "metrics.jsonl")) if "loss" in r]

    @property
    def eval_records(self) -> list[dict]:
        return [r for r in run_history(read_metrics(self.output_dir / "metrics.jsonl"))
                if any(k.startswith("eval_") for k in r)]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.train_records]


def run_root(tmp_path_factory) -> Path:
    """A directory every pytest process of this run shares: under pytest-xdist (.ci/run runs `pytest -n 3`) the
    parent of the workers' own temporary directories, which is this run's alone; otherwise this session's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def run_lock(path: Path):
    """An exclusive lock on `path` among the pytest processes of this run (held until the block ends)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def launch_env(finetune_cache) -> dict:
    """The session's cache (tests/conftest.py finetune_cache: under pytest-xdist one for every worker of the run)
    for every launch: the tiny assets and tokenized data are made once, and a run one worker launched resumes in
    another with the same model files."""
    from finetune import assets

    cache = finetune_cache
    env = dict(os.environ, FINETUNE_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(cache / "datasets"), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    with run_lock(cache / ".lock"):
        assets.tiny_model_dir()
        assets.tiny_tasks_file()
    return env


# DeepSpeed's CPU backend creates these where LOCAL_SIZE equals the world size as it starts, and nothing
# removes them (finetune.distributed.deepspeed_cpu_local_size): a run must leave none.
SHM, SHM_LEFT = Path("/dev/shm"), "deepspeed_allreduce_buffer_*"


class ForkServer:
    """tests/distributed/forkserver.py, started on the first launch it serves and stopped with the session."""

    def __init__(self, env: dict, workdir: Path):
        self.env, self.workdir, self.proc, self.replies, self.count = env, workdir, None, None, 0

    def _start(self) -> None:
        read, write = os.pipe()
        log = open(self.workdir / "server.log", "w")
        env = dict(self.env, DS_ACCELERATOR="cpu")  # a rank sets it before DeepSpeed is imported (train.main)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), str(write)],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True,
                                     pass_fds=(write,))
        os.close(write)
        self.replies = os.fdopen(read)
        ready = self.replies.readline()
        if not ready:
            raise RuntimeError(f"the fork server did not start: {(self.workdir / 'server.log').read_text()[-3000:]}")

    def launch(self, nprocs: int, args: list[str], env: dict, timeout: int) -> tuple[int, str, str, bool, float]:
        """(exit code, stdout, stderr, timed out, CPU seconds of the ranks) of one launch."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        request = {"nprocs": nprocs, "args": args, "env": env, "cwd": str(REPO), "port": _free_port(),
                   "timeout": timeout, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the fork server died: {(self.workdir / 'server.log').read_text()[-3000:]}")
        reply = json.loads(line)
        return reply["returncode"], out.read_text(), err.read_text(), reply["timed_out"], reply["cpu_s"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# FINETUNE_TEST_LAUNCH=real: every launch through `accelerate launch` / `python finetune/run.py` (forkserver.py)
ALL_REAL = os.environ.get("FINETUNE_TEST_LAUNCH", "") == "real"


@pytest.fixture(scope="session")
def launch(launch_env, tmp_path_factory):
    """launch(nprocs, *overrides) -> Run; nprocs=1 runs plain `python finetune/run.py`. A launch runs its
    ranks as forks of tests/distributed/forkserver.py (the imports paid once per session: a 2-process tiny
    run costs about 8 CPU-seconds instead of 28), with the environment and the handling of a failed rank
    that `accelerate launch` gives. The real command (`accelerate launch ...`) runs for the first
    multi-process launch of each strategy in the run, for real=True,
    front=True, and an extra_env the server cannot give a forked rank (forkserver.forkable)."""
    server = ForkServer(launch_env, tmp_path_factory.mktemp("forkserver"))
    # the strategies a real launch trained, in any pytest process of this run: a file each
    launched_for_real = run_root(tmp_path_factory) / "launched-for-real"
    launched_for_real.mkdir(exist_ok=True)

    def run(nprocs: int, *overrides: str, recipe: str = "tiny", output_dir: Path | None = None,
            check: bool = True, timeout: int = 600, extra_env: dict | None = None, front: bool = False,
            real: bool = False) -> Run:
        """front=True launches through `finetune train` (finetune/cli.py) instead of accelerate directly."""
        out = output_dir or tmp_path_factory.mktemp("run")
        args = ["--recipe", recipe, *FAST, f"output_dir={out}", *overrides]
        if front:
            cmd = [sys.executable, "-m", "finetune.cli", "train", recipe, "--num_processes", str(nprocs),
                   "--main_process_port", str(_free_port()), *args[2:]]
        elif nprocs == 1:
            cmd = [sys.executable, "finetune/run.py", *args]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(nprocs), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port()), "finetune/run.py", *args]
        env = dict(launch_env, **(extra_env or {}))
        # the launch path itself is checked too: the first multi-process launch of each strategy in the run is
        # real, and so is every launch that the server cannot give. Not one per recipe: every rank imports every
        # objective's code (finetune.commands.train) before it reads its recipe, so a recipe changes nothing a
        # forked rank starts from; the launches whose launcher itself matters (a kill of the launcher, the
        # launcher's store under a split of processes) pass real=True.
        strategy = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("strategy=")), None)
        marker = launched_for_real / (strategy or default_strategy(recipe))
        real = real or (nprocs > 1 and not marker.exists())
        forked = not (real or front or ALL_REAL or not forkable(extra_env or {}))
        shm_before = set(SHM.glob(SHM_LEFT))
        started, children = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        if forked:
            code, stdout, stderr, timed_out, cpu = server.launch(nprocs, args, env, timeout)
            if timed_out:
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        else:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        log_launch(nprocs, forked, time.monotonic() - started, cpu, code)
        if not forked and nprocs > 1 and code == 0:
            marker.touch()
        left = sorted(set(SHM.glob(SHM_LEFT)) - shm_before)
        for path in left:  # removed before failing: each holds 64 MiB of the machine's RAM
            path.unlink(missing_ok=True)
        result = Run(Path(out), code, stdout, stderr, launch_env)
        if check and code != 0:
            how = "forked by tests/distributed/forkserver.py" if forked else " ".join(cmd)
            said = [line for line in stderr.splitlines() if line.startswith("error")][:3]  # first: CI shows the head
            raise AssertionError(f"launch failed ({code}): {' | '.join(said) or 'no error line'}\n{how}\n"
                                 f"{' '.join(cmd)}\n{stderr[-6000:]}")
        assert not left, f"the launch left DeepSpeed's shared-memory buffers in /dev/shm: {[p.name for p in left]}"
        return result

    yield run
    server.stop()


def default_strategy(recipe: str) -> str:
    """The strategy a recipe runs when a launch does not override it."""
    from finetune.recipe import load_recipe_module

    return load_recipe_module(recipe).strategy


def log_launch(nprocs: int, forked: bool, wall: float, cpu: float, code: int) -> None:
    """FINETUNE_TEST_LAUNCH_LOG=FILE: one JSON line per launch (the test, processes, forked or real, wall and CPU
    seconds of its processes): what each launch costs (/work/coord/SUITE.md, docs/tests.md)."""
    path = os.environ.get("FINETUNE_TEST_LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "nprocs": nprocs,
                                "forked": forked, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "code": code,
                                "load1": round(os.getloadavg()[0], 2)}) + "\n")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




@pytest.fixture
def run_in_process(launch_env, monkeypatch):
    """`python finetune/run.py --recipe tiny ...` as a call of run.main in this process, for runs that
    end before training (refusals, --dry-run): tests/in_process.py, with the launches' environment."""
    from in_process import run_main

    for key in ("FINETUNE_CACHE", "HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, launch_env[key])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)

    def call(*overrides: str, output_dir: Path, recipe: str = "tiny") -> Run:
        code, out, err = run_main(["--recipe", recipe, *FAST, f"output_dir={output_dir}", *overrides])
        return Run(Path(output_dir), code, out, err, launch_env)

    return call


@contextmanager
def one_thread():
    """torch on one intra-op thread, as every launched process runs (OMP_NUM_THREADS=1 above): a
    command called in this process computes (merges, generates) with the kernels' single-thread
    reduction order, as the same command started from a shell with the launches' environment does."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def call_main(capsys, main, argv: list[str], output_dir: Path) -> Run:
    """A command's main(argv) called in this process on one thread, with what it printed."""
    capsys.readouterr()
    with one_thread():
        code = main(argv)
    captured = capsys.readouterr()
    return Run(Path(output_dir), code, captured.out, captured.err, {})


@pytest.fixture
def export_in_process(capsys):
    """`python -m finetune.export CKPT OUT` as a call of its main in this process."""

    def call(ckpt: Path, out: Path, *options: str) -> Run:
        from finetune.commands.export import main

        return call_main(capsys, main, [str(ckpt), str(out), *options], out)

    return call


@pytest.fixture
def chat_in_process(capsys):
    """`finetune chat ARGS` as a call of its main in this process (a prompt's answer is printed)."""

    def call(*argv: str) -> Run:
        from finetune.commands.chat import main

        return call_main(capsys, main, [str(a) for a in argv], argv[0])

    return call


def once(make):
    """make(...) -> a Run, memoised per arguments (defaults filled in): the fixtures below and in the test
    modules hand tests a `get` that launches each run the first time a test asks for it, and only then."""
    cache = {}
    signature = inspect.signature(make)

    def get(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple(bound.arguments.values())
        if key not in cache:
            cache[key] = make(*bound.args, **bound.kwargs)
        return cache[key]

    return get


def once_per_run(root: Path, name: str, make):
    """once(make), shared by every pytest process of the run (pytest-xdist's workers, run_root): the first
    process that asks launches the run, holding a lock on its slot, and writes the Run beside it; a process
    that asks later, or while it runs, waits for the lock and reads that Run. For the session's shared
    launches, which tests in several modules (so in several workers) read."""
    import hashlib

    signature = inspect.signature(make)

    def make_shared(*args):
        slot = root / "shared-runs" / f"{name}-{hashlib.sha1(repr(args).encode()).hexdigest()[:12]}"
        with run_lock(slot.with_suffix(".lock")):
            saved = slot.with_suffix(".json")
            if saved.exists():
                fields = json.loads(saved.read_text())
                return Run(Path(fields.pop("output_dir")), **fields)
            run = make(*args)
            saved.write_text(json.dumps(dataclasses.asdict(run), default=str))
            return run

    make_shared.__signature__ = signature
    return once(make_shared)


@pytest.fixture(scope="session")
def strategy_run(launch, tmp_path_factory):
    """strategy_run(name, nprocs=2) -> the Run of STRATEGIES[name] with SAVE, launched once per run."""
    return once_per_run(run_root(tmp_path_factory), "strategy",
                        lambda name, nprocs=2: launch(nprocs, *STRATEGIES[name], *SAVE))


# The run a person watching it sees (test_run_experience: tracker files, loss plot, summary, quiet logs),
# launched the way the README starts one (`finetune train`), which is also test_samples_run's ZeRO-3 run
# with parameters and optimizer offloaded (samples at eval equal `finetune chat` on its outputs): a low
# learning rate and 4 steps, so that the last samples differ from step 0's and are not yet the empty
# answers a few steps at the recipe's rate give; an eval every 2 steps, so that the trackers and the
# plot see one in the middle of the run as well.
WATCHED = ["strategy=zero3", "offload_params=cpu", "offload_optimizer=cpu", "lr=1e-4", "max_steps=4", "warmup_steps=1",
           "eval_every=2", "sample_max_new_tokens=16", "report_to=tensorboard", "plot_loss=true"]


@pytest.fixture(scope="session")
def watched_run(launch, tmp_path_factory):
    """The WATCHED run, launched once per run through `finetune train`."""
    return once_per_run(run_root(tmp_path_factory), "watched", lambda: launch(2, *WATCHED, front=True))()


@pytest.fixture(scope="session")
def reference(launch, tmp_path_factory):
    """One process, plain PyTorch data parallel of one, with the loss from the full logits (the loss
    before finetune/loss.py): the curve every strategy must reproduce with the chunked loss, so that
    the chunked and full losses agree under each strategy, sharded output projection included."""
    return once_per_run(run_root(tmp_path_factory), "reference",
                        lambda: launch(1, "strategy=ddp", "loss_impl=full"))()


def pytest_collection_modifyitems(items):
    for item in items:
        if "distributed" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session")
def fast_overrides() -> list[str]:
    """The overrides every launch here uses, for tests that build their own launcher command."""
    return list(FAST)


@pytest.fixture
def free_port() -> str:
    return str(_free_port())
