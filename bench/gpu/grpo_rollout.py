"""GRPO's rollout on one GPU (issue 40): 64 completions x 512 new tokens from a 1B-class model in bf16,
our generator before (finetune at ba2306b: one completion at a time, a host copy and a CPU draw per
row per token) and after (one batched Gumbel-max draw per token on the device; eager, and the compiled
static-cache loop that generation_compile=auto runs on a GPU), against the generation TRL's
GRPOTrainer runs without vLLM: `model.generate` with the GenerationConfig trl 1.16's
GRPOTrainer.__init__ builds (do_sample, temperature, top_p, top_k, max_new_tokens, disable_compile=True),
as GRPOTrainer._generate calls it. Rollout seconds (torch.cuda.synchronize around each call), generated
tokens per second, peak memory; then, with --steps N, whole GRPO steps: finetune/run.py (recipes/
tiny_grpo.py on this model, after and before) and TRL's GRPOTrainer (bench/studies/grpo_vs_trl.py's TRL
side, one process) where trl imports.

Before the call, here (the device has no git history):

    git show ba2306b:finetune/generation.py > bench/gpu/before_generation.py     # git-ignored

On the device (run(carry=["bench/gpu/before_generation.py"], timeout_s=...)):

    python bench/gpu/grpo_rollout.py --out /tmp/gr/rollout.json --deadline 400; cp /tmp/gr/rollout.json $OUT/
    # call 2, the same warm machine (its /tmp kept; $OUT is new each call), with the wheels of
    # bench/README.md installed (finetune/run.py needs datasets and deepspeed; TRL's row needs trl):
    python bench/gpu/grpo_rollout.py --out /tmp/gr/rollout.json --no-generation --steps 4 --deadline 400; \
        cp /tmp/gr/rollout.json $OUT/
    python bench/gpu/grpo_rollout.py --render $OUT/rollout.json --doc docs/benchmarks.md   # here, afterwards
    python bench/gpu/grpo_rollout.py --smoke       # CPU, a tiny model, 8 x 16 tokens: checks the pipeline only

What it also records (not asserted, reported): the counter-based noise on the GPU against the CPU's
(bit for bit), and whether the compiled loop's tokens equal the eager loop's (greedy and sampled).
The model is a random-weight Llama of bench/parts/common.py's llama-1b shape (0.95B; real weights need
the hub); the prompts are 8 rows of random ids, 64 to 128 tokens (left-padded), each 8 times; no stop
id, so every variant generates all 64 x 512 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

BEFORE_FILE = REPO / "bench" / "gpu" / "before_generation.py"
VARIANTS = ("before", "after, eager", "after, compiled", "TRL generate")
TARGET = 3.0  # issue 40: our rollout at least 3x TRL's generation on the same GPU


def before_module():
    """finetune/generation.py as it was at ba2306b (bench/gpu/before_generation.py), or None."""
    if not BEFORE_FILE.is_file():
        return None
    spec = importlib.util.spec_from_file_location("before_generation", BEFORE_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["before_generation"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def prompts_for(prompts: int, generations: int, vocab: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    base = [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(prompts)]
    return [p for p in base for _ in range(generations)]


def summarize(seconds: list[float], tokens: int) -> dict:
    """A variant's rounds: the first (compile, graph capture, allocator), the median of the rest (or the
    first when only one ran), generated tokens per second at that median."""
    steady = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {"rounds": seconds, "first": seconds[0], "seconds": steady, "tokens": tokens,
            "tokens_per_s": tokens / steady if steady > 0 else None}


def time_call(fn, cuda: bool) -> tuple[float, object]:
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def trl_generate(model, prompts: list[list[int]], pad_id: int, new_tokens: int, temperature: float, top_p: float,
                 top_k: int):
    """GRPOTrainer._generate's transformers path (trl 1.16): left-padded input ids and mask, one
    model.generate with the trainer's GenerationConfig; eos_token_id None here (no stop, as ours)."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                              pad_token_id=pad_id, bos_token_id=None, eos_token_id=None, temperature=temperature,
                              top_p=top_p, top_k=top_k, min_p=None, repetition_penalty=1.0, cache_implementation=None,
                              disable_compile=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, width:]


def measure_generation(a, deadline: float | None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.parts.common import MODELS
    from finetune import generation as G

    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.smoke:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        shape = "tiny smoke model"
    else:
        spec = MODELS[a.model]
        config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                             intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                             num_attention_heads=spec.num_attention_heads,
                             num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        shape = spec.describe()
    config.bos_token_id = config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    params = sum(p.numel() for p in model.parameters())
    rows = prompts_for(a.completions // a.generations, a.generations, config.vocab_size, a.prompt_low, a.prompt_high)
    seeds = list(range(1000, 1000 + len(rows)))
    sampling = G.Sampling(a.new_tokens, temperature=1.0)
    kw = dict(stop_ids=(), pad_id=0, context=None)
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "model": shape, "parameters": params,
           "dtype": str(dtype).replace("torch.", ""), "completions": len(rows), "new_tokens": a.new_tokens,
           "prompt_tokens": [a.prompt_low, a.prompt_high], "variants": {}, "checks": {}}
    before = before_module()
    calls = {
        "before": (lambda: before.generate(model, rows, sampling, seeds=seeds, **kw)) if before else None,
        "after, eager": lambda: G.generate(model, rows, sampling, seeds=seeds, **kw),
        "after, compiled": lambda: G.generate(model, rows, sampling, seeds=seeds, compiled=True, **kw),
        "TRL generate": lambda: trl_generate(model, rows, 0, a.new_tokens, 1.0, 1.0, 0),
    }
    outputs = {}
    for name in VARIANTS:
        if calls[name] is None:
            res["variants"][name] = {"skipped": f"{BEFORE_FILE.relative_to(REPO)} missing (git show ba2306b:...)"}
            continue
        rounds = 1 if name == "before" else a.rounds
        seconds, tokens = [], 0
        try:
            for _ in range(rounds):
                if deadline is not None and time.time() > deadline:
                    break
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                s, out = time_call(calls[name], cuda)
                seconds.append(s)
                outputs[name] = out
                tokens = int(out.numel()) if isinstance(out, torch.Tensor) else sum(len(c.tokens) for c in out)
        except Exception as e:  # a variant that fails is a row with its error; the others still run
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        if not seconds:
            res["variants"][name] = {"skipped": "deadline"}
            continue
        res["variants"][name] = summarize(seconds, tokens)
        if cuda:
            res["variants"][name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"{name}: {res['variants'][name]}", flush=True)
    # the noise on this device against the CPU's; the compiled loop's tokens against the eager loop's
    bits = G.noise_bits(torch.tensor(seeds[:8]), 5, 4096)
    res["checks"]["noise_bits_equal_cpu"] = bool(torch.equal(G.noise_bits(torch.tensor(seeds[:8], device=device), 5,
                                                                          4096).cpu(), bits))
    # sampled: the timed runs' own completions; greedy: one more run of each at the same shapes (the
    # compiled graph is reused: no new trace)
    eager, compiled = outputs.get("after, eager"), outputs.get("after, compiled")
    if eager is not None and compiled is not None:
        res["checks"]["compiled_equals_eager_sampled"] = sum(x.tokens == y.tokens for x, y in zip(eager, compiled))
        greedy = G.Sampling(a.new_tokens)
        e = G.generate(model, rows, greedy, **kw)
        c = G.generate(model, rows, greedy, compiled=True, **kw)
        res["checks"]["compiled_equals_eager_greedy"] = sum(x.tokens == y.tokens for x, y in zip(e, c))
        res["checks"]["rows_compared"] = len(rows)
    return res


def measure_steps(a, work: Path, deadline: float | None) -> list[dict]:
    """Whole GRPO steps, one process: finetune/run.py after and before (its generate swapped for
    ba2306b's), TRL's GRPOTrainer where trl imports."""
    from bench.parts.common import MODELS, PY, build_model, fresh_dir, launch_env, read_jsonl, run, shown
    from bench.studies.rollout_speed import rollout_and_step_seconds

    model_dir = build_model(MODELS[a.model], device="cuda")
    g = a.generations
    over = [f"model={model_dir}", "strategy=ddp", "mixed_precision=bf16", f"max_steps={a.steps}",
            f"global_batch_size={a.completions // g}", f"num_generations={g}", f"micro_batch_size={g}",
            f"max_completion_len={a.new_tokens}", f"max_seq_len={a.new_tokens + 64}", "log_every=1", "save_every=0",
            "eval_every=0", "eval_fraction=0", "sample_prompts=0", "plot_loss=false", "activation_checkpointing=true"]
    rows = []
    for name, cmd_head in (("after", [PY, "finetune/run.py"]),
                           ("before", [PY, "bench/gpu/grpo_rollout.py", "before-run", "finetune/run.py"]),
                           ("TRL GRPOTrainer", None)):
        left = None if deadline is None else deadline - time.time()
        if left is not None and left < 60:
            rows.append({"variant": name, "skipped": "deadline"})
            continue
        if name == "before" and before_module() is None:
            rows.append({"variant": name, "skipped": f"no {BEFORE_FILE.relative_to(REPO)} (module docstring)"})
            continue
        out = fresh_dir(work / f"steps-{name.split()[0].lower()}")
        if cmd_head is None:
            if importlib.util.find_spec("trl") is None:
                rows.append({"variant": name, "skipped": "trl not importable"})
                continue
            cmd = [PY, "bench/studies/grpo_vs_trl.py", "phases", str(out / "phases.json"), "trl", str(out),
                   "--recipe", "tiny_grpo", *over, f"output_dir={out}"]
            done = (out / "phases.json").exists
        else:
            cmd = [*cmd_head, "--recipe", "tiny_grpo", *over, f"output_dir={out}"]
            done = (out / "summary.json").exists
        launch = run(cmd, work / f"steps-{name.split()[0].lower()}.log", env=launch_env(OMP_NUM_THREADS="8"),
                     done=done, timeout=left or 900)
        row = {"variant": name, "command": shown(cmd), "ok": launch.ok}
        if cmd_head is not None and launch.ok:
            row.update(rollout_and_step_seconds(read_jsonl(out / "metrics.jsonl")))
        elif cmd_head is None and (out / "phases.json").exists():
            ph = json.loads((out / "phases.json").read_text())
            row.update({"ok": True, "rollout": ph["phases"].get("GRPOTrainer._generate", [None])[0],
                        "step": ph.get("step_seconds")})
        else:
            row["error"] = launch.error(4)
        rows.append(row)
    return rows


def before_run(argv: list[str]) -> None:
    """`grpo_rollout.py before-run finetune/run.py ARGS`: finetune/run.py with generation.generate as it was
    at ba2306b (the new keyword arguments dropped): the sampler's and decode loop's part of a step."""
    import runpy

    from finetune import generation
    from finetune.training import rollouts

    old = before_module()

    def generate(*args, vocab_size=None, compiled=False, **kwargs):
        return old.generate(*args, **kwargs)

    generation.generate = rollouts.generate = generate
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def section(res: dict) -> str:
    """The docs section from a result file: the generation table (TRL's generate = 1.00x), the checks,
    and the whole-step table when steps ran."""
    from bench.parts.common import table

    def num(x, digits=2):
        return f"{x:.{digits}f}" if isinstance(x, (int, float)) and x == x else "-"

    gen = res["generation"]
    trl = gen["variants"].get("TRL generate", {})
    body = []
    for name in VARIANTS:
        v = gen["variants"].get(name, {})
        if "seconds" not in v:
            body.append([name, "-", "-", "-", "-", "-", v.get("error") or v.get("skipped") or "not run"])
            continue
        speed = f"{trl['seconds'] / v['seconds']:.2f}x" if trl.get("seconds") else "-"
        body.append([name, num(v["first"]), num(v["seconds"]), f"{v['tokens_per_s']:,.0f}", speed,
                     num(v.get("peak_gib")), f"{len(v['rounds'])} round(s)"])
    checks = gen["checks"]
    ours = gen["variants"].get("after, compiled", {}).get("seconds")
    ratio = trl["seconds"] / ours if ours and trl.get("seconds") else None
    lines = [
        f"Measured by `{res['command']}` at git {res['git']} on {res['started']}; {gen['device']}, "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".", "",
        f"One process, {gen['model']} ({gen['parameters'] / 1e9:.2f}B parameters, random weights), {gen['dtype']}; "
        f"{gen['completions']} completions x {gen['new_tokens']} new tokens (no stop id: every variant generates "
        f"them all), prompts of {gen['prompt_tokens'][0]}-{gen['prompt_tokens'][1]} tokens left-padded, temperature 1. "
        "seconds: one rollout, torch.cuda.synchronize around it; first: the first call (compile and CUDA graph "
        "capture for the compiled loop); vs TRL: TRL's generate seconds / the variant's.", "",
        table(["generator", "first s", "s", "tokens/s", "vs TRL", "peak GiB", "note"], body), "",
        f"Target (issue 40): our rollout at least {TARGET:.0f}x TRL's generation: "
        + ("not measured" if ratio is None else f"{'met' if ratio >= TARGET else 'not met'} ({ratio:.2f}x)") + ". "
        f"Checks: the counter-based noise on the GPU equals the CPU's bit for bit: {checks.get('noise_bits_equal_cpu')}; "
        f"the compiled loop's tokens equal the eager loop's in {checks.get('compiled_equals_eager_greedy')} of "
        f"{checks.get('rows_compared')} rows greedy, {checks.get('compiled_equals_eager_sampled')} sampled (bf16: "
        "the compiled kernels round differently, a near tie can go the other way)."]
    if res.get("steps"):
        rows = []
        for r in res["steps"]:
            if not r.get("ok"):
                rows.append([r["variant"], "-", "-", r.get("error") or r.get("skipped") or "failed"])
                continue
            rows.append([r["variant"], num(r.get("rollout")), num(r.get("step")), ""])
        lines += ["", f"Whole GRPO steps (`{res.get('steps_command', res['command'])}`), one process, strategy ddp, "
                  "bf16, the same model (recipes/tiny_grpo.py's prompts and rewards, the character tokenizer), the "
                  "same completions a step; medians after the first step. before: finetune/run.py with ba2306b's "
                  "generate (`grpo_rollout.py before-run`); TRL: its rollout is GRPOTrainer._generate:", "",
                  table(["trainer", "rollout s", "step s", "note"], rows)]
    return "\n".join(lines)


TITLE = "## GRPO rollout on one GPU: our generator before and after, TRL's generation"
BEGIN, END = "<!-- grpo-rollout-gpu:begin -->", "<!-- grpo-rollout-gpu:end -->"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/grpo_rollout.json")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--completions", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-low", type=int, default=64)
    p.add_argument("--prompt-high", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="N whole GRPO steps per trainer (0: none)")
    p.add_argument("--no-generation", action="store_true", help="steps only, the generation rows kept from --out")
    p.add_argument("--deadline", type=float, default=0, help="seconds from now: no new round or run after it")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--render", default="")
    p.add_argument("--doc", default="")
    a = p.parse_args(argv)
    if a.smoke:
        a.completions, a.generations, a.new_tokens, a.prompt_low, a.prompt_high, a.rounds = 8, 4, 16, 4, 9, 2
    if a.render:
        res = json.loads(Path(a.render).read_text())
    else:
        from bench.parts.common import git_state, versions

        deadline = time.time() + a.deadline if a.deadline else None
        shown = [x for i, x in enumerate(argv) if x != "--out" and (i == 0 or argv[i - 1] != "--out")]
        res = json.loads(Path(a.out).read_text()) if a.no_generation else {}
        res.update({"git": git_state(), "versions": versions()})
        if not a.no_generation:
            res.update({"command": "python bench/gpu/grpo_rollout.py " + " ".join(shown),
                        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            res["generation"] = measure_generation(a, deadline)
        else:
            res["steps_command"] = "python bench/gpu/grpo_rollout.py " + " ".join(shown)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
        if a.steps:
            res["steps"] = measure_steps(a, Path(a.out).parent / "grpo_rollout_work", deadline)
            Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    text = section(res)
    print(text)
    if a.doc:
        from bench.studies.rollout_speed import write_doc_section

        write_doc_section(Path(a.doc), TITLE, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "before-run":
        before_run(sys.argv[2:])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
