"""`finetune`, the one command in front: train, plan, data, export, chat.

`finetune train RECIPE [key=value ...]` checks the recipe, data, launcher and resume point in this one
process first, so a mistake is one `error:` line and exit code 2 instead of one line per rank followed
by the launcher's traceback; only then does it start `accelerate launch` (or a plain process when one
is enough). `accelerate launch finetune/run.py --recipe ...` keeps working: this is a front, not a
second way to train.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

RUN_SCRIPT = Path(__file__).resolve().parents[1] / "run.py"  # what launchers start
USAGE = """usage: finetune COMMAND ...

commands:
  train RECIPE [key=value ...] [--resume auto|PATH] [--dry-run] [--num_processes N] [--config_file YAML]
                         check everything cheap in one process, then launch the run
  plan --recipe RECIPE --gpus N --gpu-mem 80GB [key=value ...]
  plan --recipe RECIPE --nodes N --gpus-per-node G [--inter-node-gbps B] [--intra-node-gbps B]
                         per-GPU memory and communication under every strategy, and the fastest that fits
  data --recipe RECIPE [key=value ...] --show N [--json]
                         the rows a run trains on, trained tokens marked, and a per-source summary
  export CHECKPOINT OUT_DIR
                         any checkpoint -> a plain Hugging Face model, verified
  chat PATH [PROMPT] [--temperature T] [--max-new-tokens N]
                         answers from final/, final_merged/, a LoRA adapter or a checkpoint

`finetune COMMAND --help` says more about each."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "train":
        return train(rest)
    if command == "plan":
        from finetune.commands.plan import main as plan_main

        return plan_main(rest)
    if command == "data":
        from finetune.commands.data import main as data_main

        return data_main(rest)
    if command == LAUNCH and rest[:1] == ["accelerate"]:
        return accelerate_launch(rest[1:])
    if command == "export":
        from finetune.commands.export import main as export_main

        return export_main(rest)
    if command == "chat":
        from finetune.commands.chat import main as chat_main

        return chat_main(rest)
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    print(USAGE if not command else f"error: unknown command {command!r}; use train, plan, data, export or chat\n\n{USAGE}",
          file=sys.stderr)
    return 2


def _launcher_options(argv: list[str]) -> tuple[dict, list[str]]:
    """Split off the options that say how to launch (they are the launcher's, not the run's)."""
    options, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if name in ("--num_processes", "--config_file", "--num_machines", "--machine_rank", "--main_process_ip",
                    "--main_process_port"):
            if inline:
                options[name] = inline
            elif i + 1 < len(argv):
                options[name] = argv[i + 1]
                i += 1
            else:
                raise ValueError(f"{name} needs a value")
        else:
            rest.append(arg)
        i += 1
    return options, rest


def _config_processes(config_file: str) -> int:
    import yaml

    with open(config_file) as f:
        config = yaml.safe_load(f) or {}
    return int(config.get("num_processes") or 1)


def _processes(options: dict) -> int:
    """Given, else the launcher config's, else one per visible GPU, else one."""
    if "--num_processes" in options:
        return int(options["--num_processes"])
    if "--config_file" in options:
        return _config_processes(options["--config_file"])
    import torch

    return max(1, torch.cuda.device_count())


def launch_command(options: dict, run_args: list[str], processes: int) -> list[str]:
    if processes == 1 and "--config_file" not in options and "--num_machines" not in options:
        return [sys.executable, str(RUN_SCRIPT), *run_args]
    cmd = [sys.executable, "-m", "finetune.cli", LAUNCH, "accelerate"]
    if "--config_file" in options:
        cmd += ["--config_file", options["--config_file"]]
    else:
        cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--num_processes", str(processes)]
    if "--config_file" not in options and "--num_machines" not in options:
        cmd += ["--num_machines", "1"]  # said, so that accelerate does not warn that it took the default
    for name in ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port"):
        if name in options:
            cmd += [name, options[name]]
    return cmd + [str(RUN_SCRIPT), *run_args]


def train(argv: list[str]) -> int:
    from finetune.commands.train import check_model_and_data, parse_args, prepare, print_dry_run
    from finetune.recipe import RecipeError

    if not argv or argv[0] in ("-h", "--help"):
        from finetune.recipe import describe_fields

        print("usage: finetune train RECIPE [key=value ...] [--resume auto|PATH] [--allow-data-change]\n"
              "                      [--allow-model-change] [--dry-run]\n"
              "                      [--num_processes N] [--config_file YAML] [--num_machines N --machine_rank R\n"
              "                       --main_process_ip IP --main_process_port PORT]\n\n"
              "RECIPE is a name in recipes/ or a .py file; key=value overrides a recipe field"
              + (":\n\nrecipe keys (override with key=value):\n" + describe_fields() if argv else
                 " (finetune train --help lists them)."))
        return 0 if argv else 2
    try:
        options, rest = _launcher_options(argv)
        processes = _processes(options)
        machines = int(options.get("--num_machines", 1))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if processes < 1:
        print(f"error: --num_processes {processes}: must be at least 1", file=sys.stderr)
        return 2
    run_args = ["--recipe", rest[0], *rest[1:]]
    # Check as the launched ranks will: same world size, same launcher settings.
    saved = dict(os.environ)
    os.environ.update(WORLD_SIZE=str(processes), ACCELERATE_NUM_MACHINES=str(machines), TOKENIZERS_PARALLELISM="false")
    try:
        args = parse_args(run_args)
        plan = prepare(args, lock=False)
        if not args.dry_run:
            check_model_and_data(plan)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if args.dry_run:
        print_dry_run(plan, args.recipe)
        return 0
    cmd = launch_command(options, run_args, processes)
    shown = ["accelerate", "launch", *cmd[5:]] if cmd[1:5] == ["-m", "finetune.cli", LAUNCH, "accelerate"] else cmd
    print("finetune: " + " ".join(shown), file=sys.stderr, flush=True)
    return supervise(cmd, Path(plan.recipe.output_dir))


def supervise(cmd: list[str], output_dir: Path) -> int:
    """Run the launcher and pass the signals that ask a run to stop on to it, like a direct `accelerate
    launch` in a terminal gets them.

    The launcher runs in a session of its own, so that only this front receives what a terminal (Ctrl-C),
    a container runtime (`docker stop`, Kubernetes: SIGTERM to the entrypoint's pid) or a scheduler sends;
    had both received a Ctrl-C, the launcher would take the front's forwarded copy for a second one. The
    first SIGINT or SIGTERM is forwarded: the launcher passes it to the workers, which save a checkpoint
    and stop (finetune.training.stopping); the front waits for that, then exits 128 + the signal (130, 143). A
    second signal stops at once: the launcher and the workers are killed (the newest complete checkpoint
    stays) and their output_dir lock released. Should the front itself die, the kernel sends the
    launcher SIGTERM (stopping.stop_with_front): the run still saves and stops rather than train on orphaned.
    """
    import psutil

    env = dict(os.environ)
    # the launcher's wait for the workers after a signal, before it kills them: long enough for a checkpoint
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    env[FRONT_PID] = str(os.getpid())  # see stopping.stop_with_front
    # the handlers are in place before the launcher starts: a signal while it starts is forwarded once it has
    started = {"child": None, "launcher": None, "forwarded": False}
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        child = started["child"]
        if len(received) == 1:
            if child is not None:
                started["forwarded"] = True
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass
            return
        from finetune.lock import release_for

        if started["launcher"] is not None:
            release_for(output_dir, _kill_tree(started["launcher"]))
        os.write(2, b"error: interrupted twice: stopped at once, without a checkpoint of this step (the newest "
                    b"complete checkpoint is kept; continue from it with --resume auto)\n")
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(cmd, env=env, start_new_session=True)
    started["launcher"] = psutil.Process(child.pid)  # a zombie until waited for: its pid stays ours
    started["child"] = child
    if received and not started["forwarded"]:
        started["forwarded"] = True
        child.send_signal(received[0])
    code = child.wait()
    if code < 0:  # the launcher was killed by the signal (it came before its own handlers): as a shell says it
        code = 128 - code
    if received and code in (0, 128 + received[0]):  # stopped as asked
        return 128 + received[0]
    return code


SHUTDOWN_TIMEOUT_S = 900
FRONT_PID = "FINETUNE_FRONT_PID"
LAUNCH = "_launch"  # `python -m finetune.cli _launch accelerate ARGS`: accelerate launch, quiet when signalled


def _kill_tree(root) -> set[int]:
    """SIGKILL a process and everything it started (torch starts each worker in a session of its own,
    so a process group does not reach them); the pids killed."""
    import psutil

    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return {proc.pid for proc in procs}


def _forwarding_notices(record) -> bool:
    """False for the launcher's notices that it forwards a signal (one line per worker) and that a worker
    failed ("failed (exitcode: 2) local_rank: 0 ..."): the workers say what they do and why they stop
    (failed_rank below says it for a worker killed by a signal). Its warning that a worker did not stop in
    time and was killed stays."""
    return not str(record.msg).startswith(("Received %s death signal", "Sending process %s closing signal",
                                           "failed (exitcode: %s)"))


def failed_rank(failures: dict) -> tuple[int, str | None]:
    """The exit code of a launch whose workers failed (torch's ChildFailedError.failures: global rank ->
    ProcessFailure), and the line to print, if any: the code of the rank that failed first, as that rank
    exited (2: a user error, whose one `error:` line the rank printed; 1: a crash, with its traceback),
    not torch's traceback and failure table and exit code 1. The launcher stops the other ranks once one
    fails, so those that ended by a signal, or in the same second (ProcessFailure's timestamps are whole
    seconds) with a code the stop gave them, come after one that exited with a code of its own. A rank
    killed by a signal (SIGKILL: the kernel's out-of-memory killer, or from outside) printed nothing:
    one line says so, and the code is a shell's, 128 + the signal."""
    import signal as signals

    def order(item):
        rank, failure = item
        by_signal = failure.exitcode < 0 or failure.exitcode > 128
        return failure.timestamp, by_signal, rank

    rank, failure = min(failures.items(), key=order)
    if failure.exitcode >= 0:
        return failure.exitcode, None
    number = -failure.exitcode
    try:
        name = signals.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    why = " (the kernel's out-of-memory killer, or from outside the run)" if number == signals.SIGKILL else ""
    return 128 + number, (f"error: rank {rank} was killed by {name}{why}; --resume auto continues from the newest "
                          "complete checkpoint")


def _defaults_notice(record: logging.LogRecord) -> bool:
    """accelerate's "values were not passed to `accelerate launch`" warning (4 lines and advice to run
    `accelerate config`) as one line: finetune takes precision and strategy from the recipe, not from
    accelerate's config."""
    text = record.getMessage()
    if "were not passed to `accelerate launch`" in text:
        values = [line.strip().replace("`", "").replace(" was set to a value of", "").replace(" was set to", "")
                  for line in text.splitlines()[1:] if line.strip().startswith("`--")]
        record.msg = f"accelerate launch defaults: {', '.join(v.split(' to improve')[0] for v in values)}"
        record.args = None
    return True


def accelerate_launch(argv: list[str]) -> int:
    """`accelerate launch ARGS` in this process. Signalled, torch's launcher forwards the signal to the
    workers, waits for them and raises SignalException, whose traceback says nothing the workers did
    not: that becomes the exit code 128 + the signal, without the traceback. A worker that fails makes
    it raise ChildFailedError (a traceback, a failure table, exit code 1): that becomes the failed
    rank's own exit code (failed_rank), the rank having said why."""
    from accelerate.commands.launch import launch_command as accelerate_command
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from finetune.training.stopping import stop_with_front

    stop_with_front()
    args = launch_command_parser().parse_args(argv)
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_forwarding_notices)
    logging.getLogger("accelerate.commands.launch").addFilter(_defaults_notice)
    try:
        accelerate_command(args)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        code, line = failed_rank(e.failures)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt:  # before torch's handlers are in place: no worker was started yet
        return 128 + signal.SIGINT
    return 0
