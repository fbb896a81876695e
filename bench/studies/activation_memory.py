"""The planner's activation figure against torch's own count of the bytes a training step allocates:
llama-20m (bench/parts/common.py: hidden 256, 4 layers, 4 heads, intermediate 704, vocabulary 32000, random
weights) at 2K, 4K, 8K and 16K tokens per row, sequence_parallel 1 (one process, the whole row) and 2
(two processes over gloo, half a row each, DeepSpeed's Ulysses attention), with activation
checkpointing off and on, and on with activation_offload, fp32, sdpa, the default chunked loss.

    python bench/studies/activation_memory.py [--lengths 2048,4096,8192,16384] [--doc docs/benchmarks.md]

Each configuration is one launch (`torchrun --nproc_per_node N bench/studies/activation_memory.py --worker
...`) that builds the model with finetune's own load_model (activation checkpointing as a run sets
it), registers Ulysses attention with finetune.sequence_parallel.start, slices one row with its
Layout and runs one forward (finetune.loss.loss_sum) and backward, with the parameters' gradients
allocated beforehand (as in every micro-step after the first: the planner counts them in its grads
column). What is measured, per rank (the larger of the two under SP 2):

- peak: the most bytes held at once by the tensors the step allocated (a TorchDispatchMode sees every
  operator's outputs, keys them by storage and drops them when the storage is freed): the step's
  activations, temporaries and gradient buffers, exactly, in bytes (RSS, sections 7 and 11, is
  coarse: the allocator keeps freed pages);
- saved: the bytes autograd keeps for the backward (saved-tensor hooks, one count per storage); with
  activation_offload, the bytes it copied to CPU memory, which the peak leaves out (host memory on a
  GPU; each tensor's way back is counted as the device copy a GPU makes);
- the attention operators the step called (which SDPA kernel the Ulysses-gathered heads take).

The planner's figure is finetune.memory.activation_bytes for the same recipe (it runs no model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from bench.parts.common import (MODELS, PY, build_model, free_port, git_state, launch_env, machine, run, shown,  # noqa: E402
                    table, versions)

MODEL = MODELS["llama-20m"]
MIB = 2**20
# (activation_checkpointing, activation_offload)
MODES = {"off": (False, False), "ckpt": (True, False), "offload": (True, True)}


# ---------------------------------------------------------------- counting (worker side)


def live_bytes_mode():
    """A TorchDispatchMode counting the bytes of the storages the operators under it allocate, alive at
    once: `now`, and `peak` its maximum. An output that shares an argument's storage (a view, an
    in-place or out= result) is no allocation; a new storage is counted once and uncounted when freed
    (a weak reference to it expires)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.now, self.peak, self.ops, self.at = {}, 0, 0, set(), ""

        paused = False  # allocations made meanwhile are not counted (what offload keeps in CPU memory)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.paused:
                return out
            name = str(func.overloadpacket)
            if "attention" in name or "softmax" in name or "bmm" in name:
                self.ops.add(name.replace("aten.", ""))
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.now -= self.live.pop(key)[1]
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):  # a view or an in-place result shares an argument's storage: no allocation
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in given:
                    storage = t.untyped_storage()
                    ref = StorageWeakRef(storage)
                    if ref.cdata not in self.live:
                        self.live[ref.cdata] = (ref, storage.nbytes())
                        self.now += storage.nbytes()
            if self.now > self.peak:
                self.peak, self.at = self.now, name
            return out

    return LiveBytes()


def offload_counted_as_on_a_gpu(base, live):
    """finetune's ActivationOffload, with its CPU copies left out of the count (on a GPU they are host
    memory) and each tensor's way back counted as the device copy a GPU makes (on CPU `.to` returns the
    copy itself)."""

    class Counted(base):
        def pack(self, tensor):
            live.paused = True
            try:
                return super().pack(tensor)
            finally:
                live.paused = False

        def unpack(self, packed):
            back = base.unpack(packed)
            return back.clone() if isinstance(packed, tuple) else back

    return Counted()


def saved_bytes_hooks(counter: dict):
    """Saved-tensor hooks that count the bytes autograd keeps for the backward, once per storage."""
    import torch

    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter) and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter["saved"] += storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from finetune import sequence_parallel as SP
    from finetune.loss import loss_sum
    from finetune.model import load_config, load_model
    from finetune.offload import ActivationOffload
    from finetune.recipe import Recipe

    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("BENCH_HANG_S", "1800")), exit=True)  # a hung collective shows where, then ends the launch
    if args.device == "cuda":
        return gpu_worker(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpointing, offload = MODES[args.mode]
    recipe = Recipe(model=args.model, attn_implementation="sdpa", mixed_precision="no", micro_batch_size=1,
                    max_seq_len=args.seq_len, sequence_parallel=world, activation_checkpointing=checkpointing,
                    activation_offload=offload)
    model_path, config = load_config(recipe)
    model = load_model(recipe, model_path, config).train()
    SP.start(recipe, model)
    for p in model.parameters():  # as in every micro-step after the first: the planner's grads column
        p.grad = torch.zeros_like(p)
    ids = torch.randint(3, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = SP.Layout.of(recipe, rank, world).shard(
        {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    counter = {"saved": 0}
    t0 = time.perf_counter()
    with live_bytes_mode() as live:
        hooks = offload_counted_as_on_a_gpu(ActivationOffload, live) if offload else saved_bytes_hooks(counter)
        with hooks:
            loss = loss_sum(model, batch)
        loss.backward()
        del loss
    seconds = time.perf_counter() - t0
    saved = hooks.packed if offload else counter["saved"]
    result = {"rank": rank, "peak": live.peak, "saved": saved, "ops": sorted(live.ops), "seconds": seconds,
              "peak_at": live.at}
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results) + "\n")
    dist.barrier()
    # measured and written: leave without the gloo and DeepSpeed teardown, which now and then aborts a rank
    # at exit ("terminate called without an active exception") after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gpu_worker(args) -> None:
    """One process on a GPU, bf16 weights and compute (as DeepSpeed's bf16 engine and FSDP2's
    param_dtype compute), the model built from its spec with random weights: the step's
    torch.cuda.max_memory_allocated above what was allocated before it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.loss import loss_sum
    from finetune.offload import ActivationOffload

    spec = MODELS[args.spec]
    checkpointing, offload = MODES[args.mode]
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                         num_attention_heads=spec.num_attention_heads,
                         num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
                         max_position_embeddings=max(args.seq_len, 4096), tie_word_embeddings=False,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    if checkpointing:  # as finetune/model.py load_model
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(3, spec.vocab_size, (1, args.seq_len), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    counter = {"saved": 0}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    hooks = ActivationOffload() if offload else saved_bytes_hooks(counter)
    with hooks:
        loss = loss_sum(model, batch)
    loss.backward()
    del loss
    torch.cuda.synchronize()
    result = {"rank": 0, "peak": torch.cuda.max_memory_allocated() - before,
              "saved": hooks.packed if offload else counter["saved"], "ops": [],
              "seconds": time.perf_counter() - t0, "device": torch.cuda.get_device_name()}
    Path(args.out).write_text(json.dumps([result]) + "\n")


# ---------------------------------------------------------------- the planner's figure and the table


def planner_bytes(arch, seq_len: int, sp: int, mode: str, mixed_precision: str = "no") -> int:
    from finetune.memory import activation_bytes

    checkpointing, offload = MODES[mode]
    return activation_bytes(arch, 1, seq_len, mixed_precision, checkpointing, "chunked", 0, sequence_parallel=sp,
                            attn_implementation="sdpa", activation_offload=offload)


def measure(work: Path, model: Path | None, seq_len: int, sp: int, mode: str, spec: str | None = None,
            reuse: bool = False) -> dict:
    out = work / f"sp{sp}-{mode}-{seq_len}{'-' + spec if spec else ''}.json"
    if reuse and out.is_file():
        ranks = json.loads(out.read_text())
        return {"seq_len": seq_len, "sp": sp, "mode": mode, "peak": max(r["peak"] for r in ranks),
                "saved": max(r["saved"] for r in ranks), "ops": sorted({o for r in ranks for o in r["ops"]}),
                "seconds": max(r["seconds"] for r in ranks), "device": ranks[0].get("device", "cpu"),
                "command": (work / f"{out.stem}.log").read_text().splitlines()[0].removeprefix("$ ")}
    where = ["--device", "cuda", "--spec", spec] if spec else ["--model", str(model)]
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", *where, "--seq-len", str(seq_len),
           "--mode", mode, "--out", str(out)]
    launch = run(cmd, work / f"{out.stem}.log", timeout=3600, env=launch_env(DS_ACCELERATOR="cpu"))
    if not launch.ok or not out.is_file():
        raise SystemExit(f"{shown(cmd)} failed: {launch.error()} (log: {work / (out.stem + '.log')})")
    ranks = json.loads(out.read_text())
    return {"seq_len": seq_len, "sp": sp, "mode": mode, "peak": max(r["peak"] for r in ranks),
            "saved": max(r["saved"] for r in ranks), "ops": sorted({o for r in ranks for o in r["ops"]}),
            "seconds": max(r["seconds"] for r in ranks), "device": ranks[0].get("device", "cpu"), "command": shown(cmd)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="off", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU, SP 1 only, bf16, torch.cuda's allocator count (no DeepSpeed needed)")
    parser.add_argument("--spec", default=MODEL.name, choices=sorted(MODELS), help="the model (cuda: any spec)")
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--work", default=f"/tmp/bench-act-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--doc", help="also write the result into docs/benchmarks.md's section 11")
    parser.add_argument("--reuse", action="store_true", help="keep the measurements already in --work (a run cut off)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from finetune.arch import load_architecture

    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    model = None if gpu else build_model(MODEL)
    arch = MODELS[args.spec].architecture() if gpu else load_architecture(str(model))
    results = []
    for mode in modes:
        for seq_len in lengths:
            for sp in (1,) if gpu else (1, 2):
                r = measure(work, model, seq_len, sp, mode, args.spec if gpu else None, args.reuse)
                r["planner"] = planner_bytes(arch, seq_len, sp, mode, "bf16" if gpu else "no")
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "command"}), flush=True)
    (work / "activation_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, args, lengths, modes)
    print(text)
    if args.doc:
        from bench.parts.report import SP_BEGIN, SP_END, SP_TITLE, write_marked_section

        write_marked_section(Path(args.doc), SP_TITLE, SP_BEGIN, SP_END, text)
    worst = max(abs(r["planner"] / r["peak"] - 1) for r in results)
    return 0 if worst <= 0.15 else 1


def report(results: list[dict], args, lengths: list[int], modes: list[str]) -> str:
    names = {"off": "checkpointing off", "ckpt": "checkpointing on", "offload": "checkpointing + offload"}
    rows = []
    for r in results:
        rows.append([names[r["mode"]], f"{r['seq_len']:,}", str(r["sp"]), f"{r['saved'] / MIB:,.0f}",
                     f"{r['peak'] / MIB:,.0f}", f"{r['planner'] / MIB:,.0f}", f"{r['planner'] / r['peak']:.2f}",
                     f"{r['seconds']:.0f}"])
    header = ["activations", "tokens per row", "SP", "saved for backward, MiB (offloaded)", "peak, MiB",
              "planner, MiB", "planner / peak", "step s"]
    worst = max(abs(r["planner"] / r["peak"] - 1) for r in results)
    ops = sorted({o for r in results if r["sp"] == 2 for o in r["ops"]})
    v = versions()
    command = "python bench/studies/activation_memory.py" + (f" --lengths {args.lengths}" if lengths != [2048, 4096, 8192, 16384]
                                                     else "") + (f" --modes {args.modes}" if modes != list(MODES) else "") \
        + (f" --doc {args.doc}" if args.doc else "")
    device = results[0].get("device", "cpu")
    if device != "cpu":
        command += f" --device cuda --spec {args.spec}"
        return "\n".join([
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` at git {git_state()}; "
            f"{device}; torch {v['torch']}, transformers {v['transformers']}.",
            "",
            f"Model {MODELS[args.spec].name} ({MODELS[args.spec].describe()}, random weights), one process, one row, "
            "bf16 weights and compute, attn sdpa, the chunked loss. Peak: torch.cuda.max_memory_allocated during "
            "the step above what was allocated before it, the parameters' gradients allocated beforehand.",
            "",
            table(header, rows),
            "",
            f"Worst planner / peak: {1 + worst:.2f} or {1 - worst:.2f}."])
    return "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` at git {git_state()}; "
        f"{machine()['cpu']}, {machine()['cores']} cores; torch {v['torch']}, transformers {v['transformers']}, "
        f"deepspeed {v.get('deepspeed', '?')}.",
        "",
        f"Model {MODEL.name} ({MODEL.describe()}, random weights), one row per micro-batch, fp32, attn sdpa, the "
        "chunked loss; SP 1: one process, the whole row; SP 2: two processes over gloo, half the row each "
        "(Ulysses). Peak: the most bytes the step's tensors held at once on a rank (torch's dispatcher sees "
        "every allocation: exact, unlike RSS), with the parameters' gradients allocated beforehand (the planner "
        "counts them as grads). Saved: what autograd kept for the backward (with offload: what was copied to "
        "CPU memory). Planner: finetune.memory.activation_bytes for the same recipe.",
        "",
        table(header, rows),
        "",
        f"Planner / peak from {min(r['planner'] / r['peak'] for r in results):.2f} to "
        f"{max(r['planner'] / r['peak'] for r in results):.2f} (15%: 0.85 to 1.15). "
        f"Attention operators the SP 2 steps called: {', '.join(ops)}.",
        "",
        f"Each row: `{results[0]['command']}` with its own --nproc_per_node (the SP), --seq-len and --mode.",
        "",
        anomaly_note(results),
    ])


def anomaly_note(results: list[dict]) -> str:
    """What the earlier RSS table of this section (bench/studies/sp_memory.py, 1K-4K tokens) could not explain."""
    from finetune.memory import loss_rows

    peak = {(r["mode"], r["seq_len"], r["sp"]): r["peak"] for r in results}
    growth = ""
    if all(("off", t, n) in peak for t in (2048, 4096, 8192) for n in (1, 2)):
        def grown(a, b, n):
            return (peak[("off", b, n)] - peak[("off", a, n)]) / MIB
        growth = (f" Counted exactly (checkpointing off, above), the peak grows from 2K to 4K tokens by "
                  f"{grown(2048, 4096, 1):.0f} MiB under SP 1 and {grown(2048, 4096, 2):.0f} MiB under SP 2 "
                  f"({grown(2048, 4096, 2) / grown(2048, 4096, 1):.2f}), from 4K to 8K by {grown(4096, 8192, 1):.0f} and "
                  f"{grown(4096, 8192, 2):.0f} MiB ({grown(4096, 8192, 2) / grown(4096, 8192, 1):.2f}).")

    v = MODEL.vocab_size

    def chunk(tokens):
        return loss_rows(v, tokens, "chunked") * v * 4 / MIB

    one = chunk(4096) - chunk(2048)
    two = chunk(2048) - chunk(1024)
    return (
        "The 4K anomaly of the earlier RSS measurement (bench/studies/sp_memory.py, ddp, 1K-4K tokens: from 2K to 4K the "
        "growth of the peak under SP 2 was 0.97 of SP 1's instead of a half) is the chunked loss: it holds one "
        f"chunk of fp32 logits, min(tokens per rank, {loss_rows(v, 10**9, 'chunked'):,}) rows for this "
        f"{v:,}-token vocabulary (256 MiB). Under SP 1 a rank reaches that cap between 2K and 4K tokens "
        f"(+{one:.0f} MiB from 2K to 4K); under SP 2 a rank holds half the tokens and its chunk doubles over the same "
        f"step (+{two:.0f} MiB), so the term that SP 1 stops growing SP 2 still grows. Every other term halves "
        "(saved for backward, SP 2 / SP 1, in the table). It is no kernel fallback: the Ulysses-gathered heads take "
        "SDPA's flash kernel (the operators above; no mask is passed, no score matrix is allocated), and on GPUs "
        "transformers' sdpa path passes is_causal the same way. On a GPU the cap is 523 rows for a 128K vocabulary, "
        "so the same bend appears at 523 x N tokens per row, 0.25 GiB at most; the planner counts the chunk "
        "(finetune/memory.py loss_rows)." + growth)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    raise SystemExit(main(sys.argv[1:]))
