"""GRPO with tools, ours against TRL 1.16's GRPOTrainer: the same conversations replayed through both, with the
same tools, on a real family's template (Qwen2.5's, tests/templates/qwen2_5.jinja, which TRL recognises and
parses with its own response template) and a small random Qwen2 (fp32).

What is replayed: 8 completions (2 prompts x 4) whose assistant turns are fixed in advance (PLANS): a call of
multiply answered, two calls in one turn, a call of a tool that does not exist, a call of a tool that
raises, a call that does not parse, a second round of calls, a plain answer, a conversation that runs into
max_completion_len. Ours: finetune's decode loop (finetune/generation.py generate, greedy) on a scripted
model that proposes each planned token at its position, with the conversations of finetune/training/agent.py
between turns (parse, run the tools, feed their answers as the chat template renders them); ours' tokens
must be the plan's. TRL: a real GRPOTrainer(tools=[...]) whose one-turn generation (_generate_single_turn)
returns the planned turn for the prefix it is given (which must be ours: prompt, the turns so far and
TRL's own rendering of the tool answers), its own _tool_call_loop, reward call and advantages
(_generate_and_score_completions), and its _compute_loss in 2 micro-batches.

Compared: the completion tokens and the tool mask (TRL's tool_mask), the messages the reward functions get,
the rewards and advantages, TRL's tool metrics (tools/call_frequency, tools/failure_frequency); then, from
the same weights, STEPS AdamW steps on those completions: the loss at each step, the reference's log-probs
(beta > 0), the first step's gradients and the weights after the last, for dapo (beta 0) and grpo with beta
0.04 (a frozen reference), at temperature 0.7. Where the weights differ most, the study prints that element's
first gradient on each side and the difference of AdamW's first updates they imply: a gradient of fp32
roundoff's size (a zero, up to it) near AdamW's eps makes lr * g / (|g| + eps) follow the roundoff.

    python bench/studies/grpo_tools_vs_trl.py                 # needs trl importable (pip install -e .[bench])
    python bench/studies/grpo_tools_vs_trl.py --doc docs/benchmarks.md    # also writes its section
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

TEMPERATURE, STEPS, LR, MAX_LEN, G = 0.7, 3, 1e-3, 192, 4
POSITIONS = 4096  # the model's context: beyond every conversation (TRL drops a tool answer that reaches it)
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-4


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def call(name, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


E = "<|im_end|>"
PROMPTS = [("3*4", "12"), ("5*6", "30")]  # prompts of one length: TRL left-pads them, finetune right-pads the rows
# each completion's assistant turns, in order (a turn that does not end with <|im_end|> runs into the budget)
PLANS = [
    [call("multiply", a=3, b=4) + E, "12" + E],
    [call("multiply", a=3, b=4) + "\n" + call("multiply", a=4, b=3) + E, "It is 12." + E],
    [call("add", a=3, b=4) + E, "7" + E],                           # a tool that does not exist
    ["12" + E],                                                     # no call
    [call("divide", a=5, b=0) + E, "I cannot." + E],                # a tool that raises
    ["<tool_call>\n{\"name\": \"multiply\", \"arguments\": " + E],  # a call that does not parse
    [call("multiply", a=5, b=6) + E, call("divide", a=30, b=6) + E, "30" + E],  # two rounds of calls
    [call("multiply", a=5, b=6) + E, "thirty " * 120],              # cut at max_completion_len
]


def family():
    """The small Qwen tokenizer of tests/family_assets.py with Qwen2.5's real template, and a random Qwen2."""
    import family_assets as F
    import transformers

    root = Path(tempfile.mkdtemp(prefix="tools-vs-trl-"))
    corpus = [t for plan in PLANS for t in plan] + [p for p, _ in PROMPTS] + ["multiply divide the dividend"] * 4
    tok = F.make_tokenizer(F.Family("qwen", "", {}, "", "qwen", []), corpus, root / "tokenizer")
    tok.chat_template = (REPO / "tests" / "templates" / "qwen2_5.jinja").read_text()
    config = F.family_config("qwen2", -(-len(tok) // 64) * 64, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.max_position_embeddings = POSITIONS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model", tok


class Scripted(torch.nn.Module):
    """A causal LM for finetune's decode loop whose logits put the plan's token of each completion at each
    position: the prefill is position 0, every later call the next."""

    def __init__(self, plans: list[list[int]], vocab: int):
        super().__init__()
        self.plans, self.vocab, self.t = plans, vocab, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(output_router_logits=False)

    def forward(self, input_ids, past_key_values=None, **kwargs):
        self.t = 0 if past_key_values is None else self.t + 1
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for i, plan in enumerate(self.plans):
            logits[i, 0, plan[self.t] if self.t < len(plan) else 0] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values=object())


def ours_rollout(tok, template, toolbox, prompt_ids, rows):
    """finetune's decode loop and conversations on the scripted model: the completions, their tool masks and
    records, and the messages the reward functions get."""
    from finetune.generation import Sampling, generate
    from finetune.training.agent import Conversations

    # the full completions the plan makes: each turn, then what finetune feeds after it (its own rendering)
    planned = []
    for i, plan in enumerate(PLANS):
        convs = Conversations(template, toolbox, [rows[i]], [0], [prompt_ids[i]], max_rounds=0, timeout=10)
        tokens = []
        for turn in plan:
            tokens += tok(turn, add_special_tokens=False).input_ids
            tokens = tokens[:MAX_LEN]
            if len(tokens) == MAX_LEN or tokens[-1] != tok.eos_token_id:
                break
            fed = convs.turn_ended(0, tokens, MAX_LEN - len(tokens))
            if not fed:
                break
            tokens += fed
        planned.append(tokens)
    convs = Conversations(template, toolbox, rows, [0] * len(rows), prompt_ids, max_rounds=0, timeout=10)
    outs = generate(Scripted(planned, len(tok)), prompt_ids, Sampling(MAX_LEN), stop_ids={tok.eos_token_id},
                    pad_id=tok.pad_token_id, context=None, turns=convs)
    assert [o.tokens for o in outs] == planned, "the decode loop feeds and draws what the plan says"
    records = convs.finish(outs)
    return outs, records, convs.messages


def trl_trainer(model_dir, tok, reward, loss_type, beta, dataset):
    import trl

    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=G, max_completion_length=MAX_LEN, temperature=TEMPERATURE, loss_type=loss_type,
                          beta=beta, learning_rate=LR, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                          disable_dropout=True, seed=0, max_steps=STEPS, save_strategy="no", epsilon=0.2,
                          model_init_kwargs={"dtype": torch.float32})
    return trl.GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=args, train_dataset=dataset,
                           processing_class=tok, tools=[multiply, divide])


def replay_trl(trainer, tok, ours_tokens, prompt_ids, inputs):
    """TRL's rollout of `inputs` with its one-turn generation answering each prefix with the plan's next turn:
    the first call is every completion's prompt, in order; each later one the prompt, turns and TRL's rendering
    of the tool answers of the completions still calling, in order (two that share a prefix taken in turn)."""
    full = [p + t for p, t in zip(prompt_ids, ours_tokens)]
    first = [True]

    def single_turn(self, prefixes, images, multimodal_fields, num_generations, has_tool_images=False):
        out, taken = [], set()
        for k, prefix in enumerate(prefixes):
            if first[0]:
                i = k
                assert prefix == prompt_ids[i], "TRL renders the prompt (with the tools' schemas) as finetune does"
            else:
                owners = [i for i, f in enumerate(full) if f[:len(prefix)] == prefix and i not in taken]
                assert owners, ("TRL's prefix (the prompt, the turns, its rendering of the tool answers) is not "
                                "finetune's: " + repr(tok.decode(prefix[len(prompt_ids[0]):])))
                i = owners[0]
            taken.add(i)
            rest = full[i][len(prefix):]
            out.append(rest[:next((j + 1 for j, t in enumerate(rest) if t == tok.eos_token_id), len(rest))])
        first[0] = False
        return out, None

    trainer._generate_single_turn = types.MethodType(single_turn, trainer)
    trainer.model.train()
    return trainer._generate_and_score_completions(inputs)


def unpadded(ids, mask):
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def compare(loss_type: str, beta: float) -> dict:
    from datasets import Dataset

    from finetune.data import IGNORE
    from finetune.recipe import Recipe
    from finetune.rewards import Rewards
    from finetune.rl_losses import TOKEN_COUNTED, group_advantages
    from finetune.tools import Toolbox, tool_metrics
    from finetune.training.agent import render, template_for
    from finetune.training.objectives.grpo import GRPO
    from finetune.training.reference import Frozen
    from finetune.training.rollouts import rollout_batch

    model_dir, tok = family()
    seen = {"trl": [], "ours": []}

    def make_reward(side):
        def answer_and_calls(prompts, completions, answer, **kwargs):
            seen[side].append([list(c) for c in completions])
            out = []
            for c, a in zip(completions, answer):
                said = [m["content"] for m in c if m["role"] == "assistant"]
                ok = [m for m in c if m["role"] == "tool" and "error" not in m["content"]]
                out.append(float(bool(said) and said[-1].strip() == a) + 0.25 * len(ok))
            return out
        return answer_and_calls

    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in PROMPTS for _ in range(G)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in PROMPTS])
    trainer = trl_trainer(model_dir, tok, make_reward("trl"), loss_type, beta, dataset)
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    recipe = Recipe(objective="grpo", loss_type=loss_type, beta=beta, temperature=TEMPERATURE, max_completion_len=MAX_LEN,
                    num_generations=G, micro_batch_size=4, reward_funcs=(make_reward("ours"),), tools=(multiply, divide),
                    loss_chunk_tokens=16, epsilon=0.2)
    toolbox = Toolbox.from_recipe(recipe)
    template = template_for(tok, toolbox.schemas, {tok.eos_token_id}, "qwen2.5")
    prompt_ids = [tok(render(tok, r["prompt"], True, toolbox.schemas), add_special_tokens=False).input_ids for r in rows]
    outs, records, messages = ours_rollout(tok, template, toolbox, prompt_ids, rows)
    tokens, masks = [o.tokens for o in outs], [r["tool_mask"] for r in records]

    objective = GRPO(recipe)
    objective.rewards = Rewards([make_reward("ours")])
    per_func = objective.rewards.score(1, [r["prompt"] for r in rows], messages, tokens, {"answer": [r["answer"] for r in rows]})
    advantages, _ = group_advantages(per_func, objective.rewards.weights, G, recipe.scale_rewards)

    ours_model = type(trainer.model).from_pretrained(model_dir, dtype=torch.float32)  # the weights TRL starts from
    ours_model.train()
    trainer.current_gradient_accumulation_steps = 2  # what TRL's training loop sets: its 2 micro-batches a step
    if beta:
        reference = type(trainer.model).from_pretrained(model_dir, dtype=torch.float32).requires_grad_(False).eval()
        objective.reference = Frozen(reference, types.SimpleNamespace(autocast=contextlib.nullcontext), recipe)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=LR)
    trl_opt = torch.optim.AdamW(trainer.model.parameters(), lr=LR)
    inputs = [dict(r) for r in rows]

    result = {"loss_type": loss_type, "beta": beta, "d_loss": 0.0, "losses": [], "d_ref": None}
    first_grads = {}  # each side's gradients of the first step, from the same weights
    for step in range(STEPS):
        out = replay_trl(trainer, tok, tokens, prompt_ids, inputs)
        trl_tokens = unpadded(out["completion_ids"], out["completion_mask"])
        trl_masks = unpadded(out["tool_mask"], out["completion_mask"])
        if step == 0:
            result["same_tokens"] = trl_tokens == tokens
            result["same_masks"] = trl_masks == masks
            result["same_messages"] = seen["trl"][-1] == messages
            result["advantages"] = (out["advantages"] - advantages).abs().max().item()
            metrics = trainer._metrics["train"]
            ours_tools = tool_metrics(records)
            result["tool_metrics"] = max(abs(metrics["tools/call_frequency"][-1] - ours_tools["tools/call_frequency"]),
                                         abs(metrics["tools/failure_frequency"][-1] -
                                             ours_tools["tools/failure_frequency"]))
            result["calls"], result["fed_tokens"] = sum(r["calls"] for r in records), sum(m.count(0) for m in masks)
        # TRL: its loss in 2 micro-batches of 4
        trl_opt.zero_grad()
        trl_loss = 0.0
        for part in (slice(0, 4), slice(4, 8)):
            piece = {k: (v[part] if torch.is_tensor(v) and v.dim() and v.shape[0] == 8 else v) for k, v in out.items()}
            loss = trainer._compute_loss(trainer.model, piece)
            loss.backward()
            trl_loss += loss.item()
        # ours: the rows with the tool mask's 0s out of the labels, 2 micro-batches over the global count
        micro = []
        for a in (0, 4):
            b = rollout_batch(prompt_ids[a:a + 4], tokens[a:a + 4], [o.stopped for o in outs[a:a + 4]],
                              advantages[a:a + 4], tok.pad_token_id, masks=masks[a:a + 4])
            if beta:
                b["ref_logps"] = objective.reference.token_logps(ours_model, b, objective.temperature)
            micro.append(b)
        if beta:  # the reference's log-probs of the drawn tokens, TRL's against ours
            trl_ref = [row[m] for row, m in zip(out["ref_per_token_logps"], (out["completion_mask"] * out["tool_mask"]).bool())]
            ours_ref = [row[m] for b in micro for row, m in zip(b["ref_logps"], b["labels"] != IGNORE)]
            result["d_ref"] = max(result["d_ref"] or 0.0, max((x - y).abs().max().item() for x, y in zip(trl_ref, ours_ref)))
        count = sum(int((b["labels"] != IGNORE).sum()) for b in micro) if loss_type in TOKEN_COUNTED else len(tokens)
        ours_opt.zero_grad()
        ours_loss = sum(objective.loss(ours_model, b) / count for b in micro)
        ours_loss.backward()
        objective.take_metrics()
        if step == 0:
            trl_grads = dict(trainer.model.named_parameters())
            first_grads = {n: (trl_grads[n].grad.clone(), q.grad.clone()) for n, q in ours_model.named_parameters()}
            result["d_grad"] = max((a - b).abs().max().item() for a, b in first_grads.values())
        result["losses"].append((trl_loss, ours_loss.item()))
        result["d_loss"] = max(result["d_loss"], abs(trl_loss - ours_loss.item()))
        trl_opt.step()
        ours_opt.step()
    trl_weights = dict(trainer.model.named_parameters())
    diffs = {n: (trl_weights[n] - p).abs().flatten() for n, p in ours_model.named_parameters()}
    result["d_weights"] = max(d.max().item() for d in diffs.values())
    # the largest difference, and the first step's gradient of that element on each side: where it is of fp32
    # roundoff's size, near AdamW's eps, the first update lr * g / (|g| + eps) follows the roundoff, not the loss
    name = max(diffs, key=lambda n: diffs[n].max().item())
    i = diffs[name].argmax().item()
    g_trl, g_ours = (g.flatten()[i].item() for g in first_grads[name])
    first_update = lambda g: LR * g / (abs(g) + 1e-8)  # noqa: E731  AdamW's first step (bias-corrected), eps 1e-8
    result["worst"] = (name, i, g_trl, g_ours, abs(first_update(g_trl) - first_update(g_ours)))
    result["moved"] = max((trl_weights[n].detach() - start[n]).abs().max().item() for n in start if n in trl_weights)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--doc", type=Path, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    import trl
    import transformers

    results = [compare("dapo", 0.0), compare("grpo", 0.04)]
    lines = [f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
             f"Qwen2.5's template, a random 2-layer Qwen2 (fp32), {len(PLANS)} completions (2 prompts x {G}), "
             f"max_completion_len {MAX_LEN}, temperature {TEMPERATURE}, {STEPS} AdamW steps (lr {LR:g}), 2 micro-batches",
             "", "| loss_type | beta | tokens as TRL | tool mask as TRL | reward messages as TRL | advantages: max abs diff "
             "| tool metrics: max abs diff | reference log-probs: max abs diff | loss per step (TRL / ours) | loss: max abs "
             "diff | first step's gradients: max abs diff | weights after the last step: max abs diff | how far the "
             "weights moved |", "|" + " --- |" * 13]
    ok = True
    for r in results:
        losses = ", ".join(f"{a:.6f} / {b:.6f}" for a, b in r["losses"])
        lines.append(f"| {r['loss_type']} | {r['beta']:g} | {r['same_tokens']} | {r['same_masks']} | "
                     f"{r['same_messages']} | {r['advantages']:.1e} | {r['tool_metrics']:.1e} | "
                     f"{'-' if r['d_ref'] is None else format(r['d_ref'], '.1e')} | {losses} | {r['d_loss']:.1e} | "
                     f"{r['d_grad']:.1e} | {r['d_weights']:.1e} | {r['moved']:.1e} |")
        ok &= (r["same_tokens"] and r["same_masks"] and r["same_messages"] and r["advantages"] < LOSS_TOLERANCE
               and r["tool_metrics"] < 1e-9 and r["d_loss"] <= LOSS_TOLERANCE and r["d_weights"] <= WEIGHT_TOLERANCE)
    lines += ["", f"{results[0]['calls']} tool calls and {results[0]['fed_tokens']} fed (masked) tokens in the "
              f"{len(PLANS)} conversations; within the bounds (loss {LOSS_TOLERANCE:g}, weights {WEIGHT_TOLERANCE:g}): "
              f"{'yes' if ok else 'NO'}"]
    for r in results:
        name, i, g_trl, g_ours, update = r["worst"]
        lines.append(f"{r['loss_type']}: the weights differ most at {name}[{i}], whose first gradient was {g_trl:.2e} "
                     f"(TRL) / {g_ours:.2e} (ours), fp32 roundoff of a gradient that is 0 up to it, near AdamW's eps "
                     f"1e-8, so the first updates lr*g/(|g|+eps) differ by {update:.1e}")
    print("\n".join(lines))
    if args.doc:
        from bench.parts.report import TOOLS_BEGIN, TOOLS_END, TOOLS_TITLE, write_marked_section

        command = "python bench/studies/grpo_tools_vs_trl.py --doc docs/benchmarks.md"
        write_marked_section(args.doc, TOOLS_TITLE, TOOLS_BEGIN, TOOLS_END, f"`{command}`\n\n" + "\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
