"""Our asynchronous GRPO replayed through TRL 1.16's AsyncGRPOTrainer loss: the same samples, advantages and
behaviour log-probs, step by step, from the same initial weights; the weights after every step compared.

    python bench/studies/async_grpo_vs_trl.py                            # ~2 min on 2 cores
    python bench/studies/async_grpo_vs_trl.py --doc docs/benchmarks.md   # also writes its section

Ours: recipes/tiny_grpo.py with 1 training and 1 generating process (rollout_processes=1, strategy=ddp, fp32),
max_staleness=1 (step s trains on a rollout generated from the weights step s - 1 started from), loss_type=bnpo
(the mean over each micro-batch's tokens, averaged over the step's micro-batches: TRL's async normalisation,
per micro-batch global_n_tokens over the accumulation steps) and vllm_importance_sampling_correction=false (the
behaviour log-probs are the old ones: TRL's async loss has no correction of its own); a checkpoint after every step
(its weights, and the rollout in flight with its behaviour log-probs: in_flight/rollouts_in_flight.*, read back
as a resume reads it), rollouts.jsonl (every completion's tokens and advantage).

TRL's side, in this process: the same initial model with TRL's fused log-prob head (trl.trainer.utils
add_fused_lm_head, at the recipe's temperature) and TRL's tree attention, each micro-batch (ours: the same
completions in the same order) packed by TRL's own TreeRow and DataCollatorForRollout and its loss computed by
AsyncGRPOTrainer.compute_loss itself (called on a stand-in for the trainer: one process, its accumulation steps),
backward, then the gradient clipped and AdamW stepped with the recipe's settings. TRL's tree attention calls the FA3
kernel, which needs a GPU: here a plain-torch function of the same arguments and meaning (each packed segment's
queries attending causally to the keys and values of its root-to-segment path) stands in for it. Rollout 0 (the
first, from the initial weights, which no checkpoint holds in flight) gets its behaviour log-probs from the initial
model's forward here; every later one's are the generating process's, read from the checkpoints.

Reported: per step, each side's loss (ours: metrics.jsonl; TRL's: the sum of compute_loss over the step's
micro-batches), the largest |difference| of any weight between our checkpoint and TRL's replay (and which weight),
and how many weights differ by more than 1e-5; the targets: the loss within 1e-5 at every step, the final weights
within 1e-4. --override key=value changes the recipe on both sides (adam_eps=1e-6: docs/async-rl.md says why)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from bench.parts.common import accelerate_launch, launch_env, machine, run, table, versions  # noqa: E402
from bench.parts.report import write_marked_section  # noqa: E402

RECIPE = "tiny_grpo"
TITLE = "## Asynchronous GRPO against TRL's AsyncGRPOTrainer loss (bench/studies/async_grpo_vs_trl.py)"
BEGIN, END = "<!-- async-grpo-vs-trl:begin -->", "<!-- async-grpo-vs-trl:end -->"
PER_STEP, FINAL = 1e-5, 1e-4


def ours(work: Path, steps: int, extra: list[str]) -> tuple[Path, list[str]]:
    """Our run (launched unless work/ours holds a finished one: the replay alone again), and its arguments."""
    out = work / "ours"
    args = ["--recipe", RECIPE, "strategy=ddp", "rollout_processes=1", "max_staleness=1", "loss_type=bnpo",
            "vllm_importance_sampling_correction=false", f"max_steps={steps}", "save_every=1", f"keep_last={steps}",
            "log_every=1", "eval_fraction=0", "plot_loss=false", *extra, f"output_dir={out}"]
    if (out / "metrics.jsonl").is_file() and (out / "final").is_dir():
        return out, args
    launch = run(accelerate_launch("finetune/run.py", args, 2), work / "ours.log", env=launch_env())
    if launch.returncode != 0:
        raise SystemExit(f"our run failed (rc {launch.returncode}): {work / 'ours.log'}")
    return out, args


def cpu_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                       tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling=None, **kwargs):
    """trl.experimental.async_grpo.packing.tree_attention's meaning in plain torch: segment s's queries (rows
    cu_q[s]..cu_q[s+1] of the packed row) attend to the keys and values at tree_kv_index[cu_k[s]..cu_k[s+1]] (its
    root-to-segment path, ending with the segment itself), causally aligned to the path's end (flash-attn's varlen
    causal)."""
    import torch

    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [tokens, heads, dim]
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        rows = slice(cq[s], cq[s + 1])
        path = tree_kv_index[ck[s]:ck[s + 1]]
        n, m = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        allowed = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[path].transpose(0, 1), v[path].transpose(0, 1), attn_mask=allowed,
            scale=scaling)
        out[rows] = attn.transpose(0, 1)
    return out.unsqueeze(0), None


class Stand:
    """What AsyncGRPOTrainer.compute_loss reads of the trainer: one process, no MoE loss, its metric sinks."""

    def __init__(self, recipe, accumulation: int):
        import torch

        self.epsilon_low = recipe.epsilon
        self.epsilon_high = recipe.epsilon_high or recipe.epsilon
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = accumulation
        self._metrics = {"train": defaultdict(list)}
        for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples",
                     "_step_forward_s"):
            setattr(self, name, 0.0)

        class One:
            num_processes = 1

            @staticmethod
            def reduce(t, reduction="sum"):
                return t

            @staticmethod
            def gather(t):
                return t.reshape(-1) if torch.is_tensor(t) else t

        self.accelerator = One()


def replay(out: Path, steps: int, extra: list[str]) -> dict:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
    from trl.trainer.utils import add_fused_lm_head
    from safetensors.torch import load_file

    from finetune import data as D
    from finetune.model import load_config, load_tokenizer
    from finetune.recipe import resolve

    torch.set_num_threads(1)
    recipe = resolve(RECIPE, ["strategy=ddp", "eval_fraction=0", *extra])
    model_path, _ = load_config(recipe)
    tokenizer = load_tokenizer(recipe, model_path)
    prompts = D.build_datasets(recipe, tokenizer).train["prompt_input_ids"]
    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=TREE_ATTENTION)
    model.train()
    temperature = recipe.temperature if recipe.temperature > 0 else 1.0
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(recipe.adam_beta1, recipe.adam_beta2),
                                  eps=recipe.adam_eps, weight_decay=recipe.weight_decay)
    lines = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    m = recipe.micro_batch_size
    collator = DataCollatorForRollout(pad_token_id=tokenizer.pad_token_id, num_processes=1)
    rows_out = []
    for step in range(steps):
        samples = [x for x in lines if x["step"] == step + 1]
        if step == 0:
            behaviour = initial_logps(model_path, samples, prompts, temperature)
        else:
            behaviour = held_logps(out / "checkpoints" / f"step_{step:09d}", step)
        built = []
        for i, (line, logps) in enumerate(zip(samples, behaviour, strict=True)):
            prompt, completion = list(prompts[line["row"]]), line["completion_ids"]
            built.append({"input_ids": torch.tensor(prompt + completion),
                          "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion)),
                          "old_log_probs": torch.tensor([0.0] * len(prompt) + list(logps), dtype=torch.float32),
                          "advantage": float(line["advantage"]), "group_id": i // recipe.num_generations,
                          "metrics": {}})
        stand = Stand(recipe, len(built) // m)
        total = 0.0
        for a in range(0, len(built), m):
            row = TreeRow()
            for sample in built[a:a + m]:
                row.add(sample)
            inputs = collator.torch_call([[row]])
            loss = AsyncGRPOTrainer.compute_loss(stand, model, inputs)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        saved = load_file(str(out / "checkpoints" / f"step_{step + 1:09d}" / "model.safetensors"))
        mine = dict(model.named_parameters())
        diffs = {name: (saved[name].float() - mine[name].detach().float()).abs() for name in saved}
        where = max(diffs, key=lambda name: diffs[name].max().item())
        rows_out.append({"step": step + 1, "weights_max_diff": diffs[where].max().item(), "worst_weight": where,
                         "weights_over_1e-5": sum(int((d > 1e-5).sum()) for d in diffs.values()),
                         "weights": sum(d.numel() for d in diffs.values()), "trl_loss": total,
                         "our_loss": metrics[step]["loss"], "completions": len(built),
                         "staleness": metrics[step].get("sample/staleness_max")})
    return {"steps": rows_out, "recipe": RECIPE}


def held_logps(checkpoint: Path, rollout: int) -> list[list[float]]:
    """The behaviour log-probs of the rollout a checkpoint holds in flight, read as a resume reads them."""
    from finetune.checkpointing.run_state import load_in_flight
    from finetune.training.rollout_group import IN_FLIGHT, rollouts_of_state

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    what = f"checkpoint {checkpoint}"
    held = rollouts_of_state(*load_in_flight(checkpoint, IN_FLIGHT, manifest, what), what=what)
    return next(x for x in held if x["rollout"] == rollout)["logps"]


def initial_logps(model_path, samples, prompts, temperature) -> list[list[float]]:
    """Rollout 0's behaviour log-probs: the initial weights' (its generating process's are in no checkpoint), every
    output row as the loss's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    with torch.no_grad():
        for line in samples:
            prompt, completion = list(prompts[line["row"]]), line["completion_ids"]
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float() / temperature
            logps = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(completion)[:, None])
            out.append(logps[:, 0].tolist())
    return out


def section(results: dict) -> str:
    m, rows = results["machine"], results["steps"]
    worst = max(r["weights_max_diff"] for r in rows)
    final = rows[-1]["weights_max_diff"]
    body = [[r["step"], r["staleness"], r["completions"], f"{r['our_loss']:.6f}", f"{r['trl_loss']:.6f}",
             f"{abs(r['our_loss'] - r['trl_loss']):.1e}", f"{r['weights_max_diff']:.1e} ({r['worst_weight']})",
             f"{r['weights_over_1e-5']} of {r['weights']}"] for r in rows]
    loss_worst = max(abs(r["our_loss"] - r["trl_loss"]) for r in rows)
    verdict = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    return "\n".join([
        f"Measured {results['started']} on {m['cpu']}, {m['cores']} cores; "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + f", trl {results['trl']}.", "",
        f"`{results['command']}`, then each step replayed through TRL's loss in this process (the module docstring "
        "says how). weights: the largest |ours - TRL's| of any weight after the step.", "",
        table(["step", "staleness", "completions", "our loss", "TRL's loss", "|loss diff|", "weights max |diff| (where)",
               "weights off by > 1e-5"], body), "",
        f"Targets: every step's loss within {PER_STEP:g}: {verdict(loss_worst <= PER_STEP)} (largest {loss_worst:.1e}); "
        f"the final weights within {FINAL:g}: {verdict(final <= FINAL)} ({final:.1e}; every step's largest: "
        f"{worst:.1e})."])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--work", default=f"/tmp/async-grpo-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--doc", default="")
    p.add_argument("--override", action="append", default=[], help="a recipe key=value for both sides (repeatable)")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out, args = ours(work, a.steps, a.override)
    os.environ.update({k: v for k, v in launch_env().items() if k.startswith(("FINETUNE", "HF_"))})
    from importlib.metadata import version

    results = replay(out, a.steps, a.override) | {"machine": machine(), "versions": versions(), "trl": version("trl"),
                                      "started": started,
                                      "command": "accelerate launch --multi_gpu --num_processes 2 finetune/run.py "
                                                 + " ".join(x for x in args if not x.startswith("output_dir"))}
    (work / "results.json").write_text(json.dumps(results, indent=2))
    text = section(results)
    print(text)
    if a.doc:
        write_marked_section(Path(a.doc), TITLE, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
