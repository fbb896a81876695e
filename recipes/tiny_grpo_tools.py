"""GRPO with a tool on CPU in a few minutes: the 2-layer tiny Llama, untrained, learns from rewards alone to
call a calculator and copy its answer. Each prompt asks the product of two numbers of two digits
(builtin:tiny-products: "37*59"), which a tiny model cannot compute; the calculator can: an environment
made per completion (environment_factory=Calculator, reset with the row's numbers) whose one method,
mul(), is the tool. The builtin tiny-llama-tools writes a call as [TOOL_CALLS]mul[ARGS]{} and ends its
turn with <|end|>; the calculator's answer comes back as a tool turn, masked out of the loss, and the
model answers in a second turn. Rewards: tool_call (the share of the right call's tokens the completion
starts with: 1.0 for the call), char_match and exact_match of the last answer with the product.

MEASURED (2026-11-29, the first command below on 2 CPU cores shared with other jobs, 241 s): eval reward
0.004 at step 0, 0.071 at 20, 0.214 at 40, 0.232 at step 100 (tool_call 0.108, char_match 0.124,
exact_match 0); but no eval completion yet writes a whole call (tools/call_frequency 0, all 256 eval
completions unparsed at step 100): in 100 steps the untrained model learns the call's first tokens and some
digits, not the call. A recipe that learns the call is still to be tuned; the multi-turn machinery itself is
checked by tests/distributed/test_agents.py on a model that calls (tests/agent_tools.py).

    finetune train tiny_grpo_tools --num_processes 2
    python finetune/run.py --recipe tiny_grpo_tools strategy=ddp          # one process

rollouts.jsonl in output_dir has every conversation: each turn, the calls read from it, the calculator's
answers, the tool mask and the rewards.
"""

import functools

from finetune.recipe import Recipe
from finetune.rewards import char_match, exact_match


class Calculator:
    """A calculator that knows the question's two numbers (reset with the row's a and b)."""

    def reset(self, a, b, **row):
        self.a, self.b = a, b

    def mul(self) -> str:
        """The product of the question's two numbers."""
        return str(self.a * self.b)


@functools.cache
def right_call() -> list[int]:
    from finetune.assets import build_tokenizer

    tok = build_tokenizer(tools=True)
    return tok("[TOOL_CALLS]mul[ARGS]{}<|end|>", add_special_tokens=False).input_ids


def tool_call(completion_ids, **kwargs):
    """The share of the right call's tokens ([TOOL_CALLS]mul[ARGS]{}<|end|>) the completion starts with: 1.0 for the
    call, partial credit for its start (credit for a token in place after a wrong one would reward repeating one
    token in every place, where the tiny model collapses)."""
    call = right_call()
    out = []
    for ids in completion_ids:
        same = next((i for i, (a, b) in enumerate(zip(ids, call)) if a != b), min(len(ids), len(call)))
        out.append(same / len(call))
    return out


recipe = Recipe(
    model="builtin:tiny-llama-tools",
    dataset="builtin:tiny-products",
    dataset_format="prompt",
    objective="grpo",
    environment_factory=Calculator,
    reward_funcs=(tool_call, char_match, exact_match),
    num_generations=8,
    temperature=1.0,
    max_completion_len=24,
    max_tool_calling_iterations=1,
    loss_type="dapo",
    eval_fraction=0.02,
    eval_max_samples=32,
    eval_every=20,
    eval_at_start=True,
    max_seq_len=256,
    strategy="zero3",
    mixed_precision="no",
    micro_batch_size=16,
    global_batch_size=16,
    lr=1e-2,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=100,
    seed=42,
    output_dir="runs/tiny_grpo_tools",
    log_every=5,
    sample_prompts=0,
)
