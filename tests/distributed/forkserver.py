"""The suite's launcher for most launches: a server that imports torch, transformers, Accelerate,
DeepSpeed, peft and finetune once per pytest session, then forks each launch's ranks. What a rank runs
after the fork is finetune/run.py's main, in the environment `accelerate launch --multi_gpu
--num_processes N` gives it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, Accelerate's and torchrun's
variables), in a session of its own (as torchrun starts workers), with stdout and stderr unbuffered into
the launch's files; when a rank fails the others get SIGTERM, then SIGKILL after 30 s (torchrun's way: to
each rank's process group, as soon as the failure is seen; torchrun looks every 0.1 s, this server every 0.02).
What a forked launch does not print is the launcher's own report of a failure (torch's ChildFailedError
traceback and table): no test needs it, and the tests of what a user sees after a failure launch through
`finetune train` (front=True), which is always real.
1 process is `python finetune/run.py` (no launcher variables).

Why: a launched process spends most of its start importing (torch, transformers' modeling code, DeepSpeed:
about 8 CPU-seconds per process here), and the `accelerate launch` process imports torch and Accelerate too
(3.5 more). Measured on this 2-core machine (FINETUNE_TEST_LAUNCH_LOG, tests/distributed/test_reward.py):
its 2-process launch took 28.0 CPU-seconds launched for real and 7.7 forked, its 1-process one 11.1 and 2.5;
the server's own imports (about 10 CPU-seconds) are paid once per session. The real launch path stays in the
suite (tests/distributed/conftest.py decides): the first multi-process launch of each strategy in a run (all
pytest-xdist workers together), every `finetune train` (front=True), every launch marked real=True and every
launch with an environment this server cannot give a forked rank (forkable()). FINETUNE_TEST_LAUNCH=real sends
every launch through the real path.

Protocol: one JSON request per line on the server's stdin, one JSON reply per line on the pipe whose fd is
its first argument.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

# The variables a rank finds under `accelerate launch --multi_gpu --mixed_precision no --dynamo_backend no`
# (dumped from a real launch of torch 2.13 / Accelerate 1.15), less two that only matter with torchrun's
# agent: TORCHELASTIC_USE_AGENT_STORE (rank 0 hosts the store here, as under a plain env:// start) and
# TORCHELASTIC_ERROR_FILE.
LAUNCHER_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    "ACCELERATE_MIXED_PRECISION": "no", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
    "ROLE_NAME": "default", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}

# A launch's extra environment that a fork cannot give: what the libraries this server imports read as they are
# imported (torch's and DeepSpeed's settings, HF_DATASETS_CACHE, ...); the fork has imported them already, with
# the session's environment. Such a launch runs the real command. PYTHONPATH is given: its entries are put on
# sys.path as the interpreter would. finetune reads its own variables (FINETUNE_*) when it runs.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "CUDA", "NCCL", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                        "TOKENIZERS", "ACCELERATE", "DS_", "DEEPSPEED", "PYTHON", "LD_", "MALLOC", "ARROW", "JE_", "VLLM")


def _reread_torch_logs() -> None:
    import torch._logging

    torch._logging._init_logs()  # what torch runs as it is imported: reads TORCH_LOGS


# Import-time variables that a forked rank is given all the same, each with the call that makes its library read
# it again: torch's logging settings (torch._logging reads TORCH_LOGS as torch is imported).
REREAD_AFTER_FORK = {"TORCH_LOGS": _reread_torch_logs}


def forkable(extra_env: dict) -> bool:
    return all(key == "PYTHONPATH" or key in REREAD_AFTER_FORK or not key.startswith(IMPORT_TIME_PREFIXES)
               for key in extra_env)


def _reread(before: dict) -> None:
    """In the forked child, once its environment is the launch's: re-read what changed of REREAD_AFTER_FORK."""
    for key, reread in REREAD_AFTER_FORK.items():
        if os.environ.get(key) != before.get(key):
            reread()


# What every rank imports before it trains (FINETUNE_FORKSERVER_TRACE=DIR writes what a forked rank still
# imported itself, one file per rank, to keep this list whole).
PREIMPORT = ("torch", "torch.distributed", "torch.utils.cpp_extension", "transformers", "transformers.modeling_utils",
             "transformers.models.llama.modeling_llama", "transformers.models.auto.tokenization_auto", "accelerate",
             "deepspeed", "deepspeed.runtime.engine", "peft", "safetensors.torch", "datasets", "finetune.commands.train",
             "finetune.training.loop", "finetune.model", "finetune.data", "finetune.strategy")
# In the vLLM venv (scripts/test_vllm.sh) a rank imports vLLM too: 6.6 CPU-seconds more each. It starts no
# thread as it is imported, and reads its VLLM_* variables when an engine asks for them.
PREIMPORT_IF_INSTALLED = ("vllm", "vllm.entrypoints.llm")

STOP_GRACE_S = 30  # torchrun: SIGTERM to the other workers, SIGKILL after 30 s


def rank_env(rank: int, nprocs: int, port: int) -> dict:
    if nprocs == 1:
        return {}
    return dict(LAUNCHER_ENV, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs), ROLE_WORLD_SIZE=str(nprocs), MASTER_PORT=str(port))


def _rank(request: dict, rank: int, out: int, err: int, closing: list[int]) -> None:
    """In the forked child: become the rank, run finetune/run.py's main, never return."""
    code = 1
    try:
        os.setsid()
        for fd in closing:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        before = dict(os.environ)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(rank_env(rank, request["nprocs"], request["port"]))
        _reread(before)
        os.chdir(request["cwd"])
        sys.argv = ["finetune/run.py", *request["args"]]
        sys.path[0] = os.path.join(request["cwd"], "finetune")  # as `python finetune/run.py` starts
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra  # the launch's own PYTHONPATH, after the script's directory
        sys.path.insert(0, request["cwd"])  # what run.py adds
        _trace_imports(rank)
        from finetune.commands.train import exit_without_teardown, main

        exit_without_teardown(main())
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _trace_imports(rank: int) -> None:
    """FINETUNE_FORKSERVER_TRACE=DIR: as the rank exits (os._exit, which train.main's exit takes), the modules it
    imported after the fork go to DIR/imports.<pid>.<rank>."""
    directory = os.environ.get("FINETUNE_FORKSERVER_TRACE")
    if not directory:
        return
    before, exit_now = set(sys.modules), os._exit

    def traced_exit(code):
        with open(os.path.join(directory, f"imports.{os.getpid()}.{rank}"), "w") as f:
            f.write("\n".join(sorted(set(sys.modules) - before)) + "\n")
        exit_now(code)

    os._exit = traced_exit


def _launch(request: dict, closing: list[int]) -> dict:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    out, err = os.open(request["stdout"], flags, 0o644), os.open(request["stderr"], flags, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["nprocs"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, out, err, closing)
        pids.append(pid)
    os.close(out)
    os.close(err)
    codes: dict[int, int] = {}
    cpu = 0.0
    deadline = time.monotonic() + request["timeout"]
    failed_at = killed = timed_out = None
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid:
            cpu += usage.ru_utime + usage.ru_stime
            if pid in pids:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    _signal([p for p in pids if p not in codes], signal.SIGTERM)
            continue
        now = time.monotonic()
        if now > deadline and timed_out is None:
            timed_out = now
            _signal([p for p in pids if p not in codes], signal.SIGKILL)
        elif failed_at is not None and now - failed_at > STOP_GRACE_S and killed is None:
            killed = now
            _signal([p for p in pids if p not in codes], signal.SIGKILL)
        time.sleep(0.02)
    ordered = [codes[p] for p in pids]
    first_failure = next((c for c in ordered if c != 0), 0)
    return {"returncode": 1 if first_failure and request["nprocs"] > 1 else first_failure, "ranks": ordered,
            "timed_out": timed_out is not None, "cpu_s": round(cpu, 2)}


def _signal(pids: list[int], sig: int) -> None:
    """To each rank's process group, as torchrun's agent signals its workers (each leads a session of its own)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def warm_up() -> None:
    """What every rank's first from_pretrained builds, built once here: transformers' table of checkpoint key
    conversions for every model type (a module-level cache; several hundred regular expressions compiled),
    0.15 CPU-seconds per rank after this server's imports (2026-11-29), about a minute over the suite's launches."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")


def serve(request_fd: int, reply_fd: int) -> None:
    import importlib

    import importlib.util

    for name in PREIMPORT:
        importlib.import_module(name)
    if importlib.util.find_spec(PREIMPORT_IF_INSTALLED[0]) is not None:
        for name in PREIMPORT_IF_INSTALLED:
            importlib.import_module(name)
    warm_up()
    requests = os.fdopen(request_fd, "r")
    replies = os.fdopen(reply_fd, "w")
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        reply = _launch(json.loads(line), [request_fd, reply_fd])
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    replies.close()
    os._exit(0)  # no interpreter teardown: it takes seconds with torch and DeepSpeed loaded, and does nothing


if __name__ == "__main__":
    serve(0, int(sys.argv[1]))
