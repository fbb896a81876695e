"""GRPO with a tool on CPU in a few minutes: the 2-layer tiny Llama learns from rewards to call a calculator and
answer with what it says. Each prompt asks the product of two numbers of two digits (builtin:tiny-products:
"37*59"), which a tiny model cannot compute; the calculator can: an environment made per completion
(environment_factory=Calculator, reset with the row's numbers) whose one method, mul(), is the tool. A call is
written [TOOL_CALLS]mul[ARGS]{} and ends its turn with <|end|>; the calculator's answer comes back as a tool turn,
masked out of the loss, and the model answers in a second turn. Rewards: tool_call (the share of the right
call's tokens the completion starts with: 1.0 for the call), char_match and exact_match of the last answer with
the product (3.0 at most).

The model, builtin:tiny-llama-caller, starts where agent RL starts, from a model that knows its tool-call format
and calls now and then: the tiny Llama after a 150-step supervised warm-up made when it is first built (about
10 s of one CPU core, seeded: finetune/assets.py warm_up_caller) on conversations of which a quarter call the
calculator and copy its answer and the rest guess a number, with short copy drills besides. It calls in about a
quarter of its completions and, having called, copies the answer about two times in three; it cannot compute a
product, so a guess is almost never right. GRPO raises the call share and the copying. (From the untrained
builtin:tiny-llama-tools, 100 GRPO steps at lr 1e-2 taught only the call's first tokens: no eval completion
wrote a whole call.)

MEASURED (2026-11-29, the first command below from an empty FINETUNE_CACHE on 2 CPU cores shared with other
jobs: 224 s in all, the model's build and warm-up included; 137 s of training), on the 32 eval prompts x 8:
                                     step 0   step 20   step 40   step 60
    eval reward (3.0 at most)        0.719    2.448     2.727     2.830
    completions calling right        25.8%    93.4%     96.1%     98.0%   (tools/calling_share)
    exact_match (the product)        0.168    0.711     0.844     0.895
tools/call_frequency equals the calling share at steps 0 and 60 (0.258, 0.980): one call a completion, none
failed; the rest of the eval completions guess. Bit for bit the same in a second run.

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
    model="builtin:tiny-llama-caller",
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
    lr=1e-3,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=60,
    seed=42,
    output_dir="runs/tiny_grpo_tools",
    log_every=5,
    sample_prompts=0,
)
