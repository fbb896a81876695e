"""What every benchmark part shares: paths, the launch environment, the locally built models and the
generated dataset, launching commands, machine and version facts, markdown tables.

Nothing here measures anything; the parts (bench/parts/memory.py, throughput.py, packing.py, checkpoints.py,
bench/gpu/gpu.py) do, and bench/run.py puts them together.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
CACHE = Path(os.environ.get("BENCH_CACHE", BENCH / ".cache"))  # models, data, tokenized data (git-ignored)
PY = sys.executable
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------- environment and launching


def launch_env(**extra: str) -> dict:
    """The environment of every launched process: offline, one thread per process (2 processes share
    2 cores), the bench's own caches, the repository importable."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               FINETUNE_CACHE=str(CACHE / "finetune"), HF_DATASETS_CACHE=str(CACHE / "datasets"),
               DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(script: str, args: list[str], nprocs: int = 2) -> list[str]:
    """The command a CPU user types: `accelerate launch --multi_gpu --num_processes 2 SCRIPT ...`."""
    return [PY, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nprocs),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script, *args]


def shown(cmd: list[str]) -> str:
    """A command as a person would type it (the interpreter and launcher module shortened)."""
    out = []
    for i, c in enumerate(cmd):
        if c == PY:
            continue
        if c == "-m" and i + 1 < len(cmd) and cmd[i + 1] == "accelerate.commands.launch":
            continue
        if c == "accelerate.commands.launch":
            out.append("accelerate launch")
            continue
        if c == "--main_process_port":
            continue
        if i > 0 and cmd[i - 1] == "--main_process_port":
            continue
        out.append(c)
    if cmd and cmd[0] == PY and (len(cmd) < 3 or cmd[2] != "accelerate.commands.launch"):
        out.insert(0, "python")
    return " ".join(out)


@dataclass
class Launch:
    cmd: list[str]
    returncode: int
    seconds: float
    log: Path
    hung_at_exit: bool = False  # finished its work (done file written) but did not exit; killed by the bench
    other_load: float | None = None  # CPU cores used by processes not started by this launch, on average

    @property
    def ok(self) -> bool:
        return self.returncode == 0 or self.hung_at_exit

    def error(self, lines: int = 3) -> str:
        """The last meaningful lines of the log: what a reader needs to see why it failed."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        keep = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        errs = [ln for ln in keep if "Error" in ln or "error" in ln]
        return " | ".join((errs or keep)[-lines:])[:600]


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine (user, nice, system, irq, softirq), in clock ticks."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
        return user + nice + system + irq + softirq
    except (OSError, ValueError, IndexError):
        return 0


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, utime + stime in clock ticks) of every live process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        out[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


def _tree(root: int, procs: dict) -> set[int]:
    """root and all its descendants (torch's launcher starts its workers in sessions of their own, so
    the tree is followed by parent pid, not by session)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def run(cmd: list[str], log: Path, timeout: float = 900, env: dict | None = None, done=None,
        exit_grace: float = 60) -> Launch:
    """Run a command with stdout+stderr into `log`; never raises on failure (the
    caller records it). `done()` says that the work is complete (its result files are written): a
    launch still alive `exit_grace` seconds after that is killed and marked hung_at_exit. Also measures
    the CPU used meanwhile by everything else on the machine (`other_load`, in cores): the noise."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    busy0, ours, members = _busy_ticks(), {}, set()
    hung, rc, done_at = False, None, None
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or launch_env(), stdout=f, stderr=subprocess.STDOUT,
                                )
        while rc is None:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            procs = _processes()
            members |= _tree(proc.pid, procs)
            for pid in members & procs.keys():
                ours[pid] = procs[pid][1]
            now = time.perf_counter()
            if done is not None and done_at is None and done():
                done_at = now
            if done_at is not None and now - done_at > exit_grace:
                hung = True
                f.write(f"\n[bench] finished its work but had not exited {exit_grace:.0f}s later: killed\n")
            elif now - t0 > timeout:
                f.write(f"\n[bench] timed out after {timeout:.0f}s: killed\n")
            else:
                continue
            _kill_tree(proc, members)
            rc = 124
    seconds = time.perf_counter() - t0
    ticks = os.sysconf("SC_CLK_TCK")
    other = max(0.0, (_busy_ticks() - busy0 - sum(ours.values())) / ticks / seconds) if seconds > 0 else None
    return Launch(cmd, rc, seconds, log, hung_at_exit=hung, other_load=other)


def _kill_tree(proc: subprocess.Popen, members: set[int]) -> None:
    """End the launch and every process it started (and only those): workers first, then the launcher."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = _tree(proc.pid, _processes()) | (members & _processes().keys())
        for pid in sorted(alive - {proc.pid}) + [proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1)
        if not (members & _processes().keys()):
            return


def wait_quiet(max_wait: float = 60, limit: float = 0.25, window: float = 3) -> float:
    """Wait (at most max_wait seconds) until the rest of the machine uses under `limit` cores over a
    `window`-second sample; returns the seconds waited. Timed comparisons start on a quiet machine
    where they can, and record the load they got anyway (Launch.other_load)."""
    t0 = time.perf_counter()
    ticks = os.sysconf("SC_CLK_TCK")
    while True:
        b0 = _busy_ticks()
        time.sleep(window)
        if (_busy_ticks() - b0) / ticks / window < limit or time.perf_counter() - t0 > max_wait:
            return time.perf_counter() - t0


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- models, built locally from a config


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 4096

    def describe(self) -> str:
        return (f"Llama-style, hidden {self.hidden_size}, {self.num_hidden_layers} layers, "
                f"{self.num_attention_heads} heads, intermediate {self.intermediate_size}, vocab {self.vocab_size}, "
                f"untied embeddings")

    def num_parameters(self) -> int:
        from finetune.arch import Architecture

        return self.architecture().num_parameters()

    def architecture(self):
        from finetune.arch import Architecture

        return Architecture(hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                            num_attention_heads=self.num_attention_heads,
                            num_key_value_heads=self.num_key_value_heads, source=self.name)


MODELS = {
    # ~100M parameters: the memory benchmark's model (issue 5).
    "llama-100m": ModelSpec("llama-100m", 768, 8, 12, 2048),
    # ~20M: the quick mode's memory model (most of it is the 32000-token embedding and head).
    "llama-20m": ModelSpec("llama-20m", 256, 4, 4, 704),
    # ~7M with an 8192-token vocabulary: the quick mode's training model (fast steps on 2 cores).
    "llama-7m": ModelSpec("llama-7m", 256, 4, 4, 704, vocab_size=8192),
    # ~0.95B (TinyLlama's shape without its grouped-query attention): the GPU benchmark.
    "llama-1b": ModelSpec("llama-1b", 2048, 16, 32, 5632),
}


def build_model(spec: ModelSpec, root: Path | None = None, device: str = "cpu") -> Path:
    """save_pretrained a randomly initialised Llama of `spec` (seed 0) with the toolkit's builtin
    character tokenizer, once; later calls return the directory. from_pretrained(path) loads it."""
    root = root or CACHE / "models"
    target = root / spec.name
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.assets import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, rms_norm_eps=1e-5)
    tmp = root / f".{spec.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    tmp.rename(target)
    return target


# ---------------------------------------------------------------- a dataset of variable-length examples


def varlen_dataset(n: int = 3000, seed: int = 7, mu: float = 3.4, sigma: float = 0.9) -> Path:
    """prompt_completion rows whose lengths vary widely: a body of log-normal length (median e^mu
    characters, which the character tokenizer makes tokens; 10 to 600) appears in the prompt and,
    reversed, as the completion, so a row is about 2 x body + 20 tokens: mostly short, a long tail,
    the shape of instruction data where packing pays. The task is learnable, so loss curves fall."""
    path = CACHE / "data" / f"varlen-{n}-{seed}-{mu}-{sigma}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike",
             "nov", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "victor", "whisky", "yankee", "zulu"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        for _ in range(n):
            chars = int(min(600, max(10, rng.lognormvariate(mu, sigma))))
            text = []
            while sum(len(w) + 1 for w in text) < chars:
                text.append(rng.choice(words))
            body = " ".join(text)
            f.write(json.dumps({"prompt": f"Reverse: {body}\nAnswer: ",
                                "completion": " ".join(reversed(text))}) + "\n")
    tmp.rename(path)
    return path


# ---------------------------------------------------------------- the machine and the versions


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "os": platform.platform(),
            "python": platform.python_version()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "datasets", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------- tables and numbers


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; also readable printed to a terminal."""
    cells = [[str(c) for c in header]] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def save_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                               else str(o)) + "\n")
