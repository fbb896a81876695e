"""The multi-turn rollout (finetune/training/agent.py) on finetune's decode loop (finetune/generation.py
`turns`): a sequence fed a tool's answer goes on in the same KV cache, drawing what a generation that
re-read the whole conversation would draw, in the eager and the compiled loop alike, in a batch as alone;
the fed tokens are marked out of the loss. And the conversations' bookkeeping between turns, as TRL's tool
loop keeps it: calls run, answers fed, the budget, max_tool_calling_iterations, broken calls counted."""

import pytest
import torch

from finetune.assets import build_tokenizer, tiny_model_dir
from finetune.generation import Sampling, Turns, generate
from finetune.tools import Toolbox, schema
from finetune.training.agent import Conversations, Template
from finetune.training.rollouts import rollout_batch
from tests.agent_tools import Calculator, multiply
from finetune.data import IGNORE
from finetune.recipe import Recipe
from finetune.rewards import exact_match


@pytest.fixture(scope="module")
def model(finetune_cache):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("tiny-llama")).eval()


class Feed(Turns):
    """Feeds `fed` at each of the first `rounds` turn ends, records what it was asked."""

    def __init__(self, fed, rounds=1):
        self.fed, self.rounds, self.asked = fed, rounds, []

    def turn_ended(self, row, tokens, room):
        self.asked.append((row, list(tokens), room))
        if sum(r == row for r, _, _ in self.asked) > self.rounds or len(self.fed) > room:
            return None
        return list(self.fed)


def run(model, prompts, stop, turns=None, temperature=0.0, seeds=None, new=16):
    return generate(model, prompts, Sampling(new, temperature), stop_ids={stop}, pad_id=0, context=None,
                    seeds=seeds, turns=turns)


PROMPTS = [[2, 30, 31, 32, 33], [2, 40, 41, 42, 43, 44, 45, 46]]
FED = [11, 12, 13]


def test_a_fed_sequence_goes_on_as_if_it_had_read_the_whole_conversation(model):
    """Greedy: the first turn ends at a token the model draws; after the fed tokens, what it draws equals a fresh
    generation from the prompt, the turn and the fed tokens (the KV cache went on, nothing re-read), and the
    mask marks the fed tokens 0. (The compiled loop: tests/test_generation.py, beside its other compiled runs.)"""
    prompt = PROMPTS[0]
    plain = run(model, [prompt], stop=-1)[0].tokens
    stop = plain[3]
    assert stop not in plain[:3]
    feed = Feed(FED)
    [done] = run(model, [prompt], stop, turns=feed)
    assert done.tokens[:4] == plain[:4] and done.tokens[4:7] == FED
    fresh = run(model, [prompt + done.tokens[:7]], stop, new=16 - 7)[0]
    assert done.tokens[7:] == fresh.tokens and done.stopped == fresh.stopped
    assert done.mask == [1] * 4 + [0] * 3 + [1] * (len(done.tokens) - 7)
    assert feed.asked[0] == (0, plain[:4], 16 - 4)


def test_a_batch_with_turns_draws_what_each_sequence_draws_alone(model):
    """Sampled, left-padded prompts of two lengths, each fed at its own turn ends: each sequence's tokens and mask
    are what it gets alone (its seed keys its noise, the fed tokens take their positions)."""
    seeds = [5, 9]
    first = [run(model, [p], stop=-1, temperature=1.0, seeds=[s])[0].tokens for p, s in zip(PROMPTS, seeds)]
    stop = first[0][2]
    together = run(model, PROMPTS, stop, turns=Feed(FED, rounds=2), temperature=1.0, seeds=seeds)
    alone = [run(model, [p], stop, turns=Feed(FED, rounds=2), temperature=1.0, seeds=[s])[0]
             for p, s in zip(PROMPTS, seeds)]
    assert [(c.tokens, c.mask, c.stopped) for c in together] == [(c.tokens, c.mask, c.stopped) for c in alone]
    assert 0 in together[0].mask


def test_fed_tokens_count_against_the_budget(model):
    prompt = PROMPTS[0]
    stop = run(model, [prompt], stop=-1)[0].tokens[1]
    [done] = run(model, [prompt], stop, turns=Feed([11] * 14), new=16)  # 2 drawn + 14 fed: the budget
    assert len(done.tokens) == 16 and done.mask == [1, 1] + [0] * 14 and not done.stopped
    [over] = run(model, [prompt], stop, turns=Feed([11] * 15), new=16)  # no room: the turn ends the sequence
    assert over.tokens == done.tokens[:2] and over.stopped and over.mask == [1, 1]


# ---------------------------------------------------------------- the conversations between turns


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer(tools=True)
    return tok, (lambda text: tok(text, add_special_tokens=False).input_ids)


def conversations(tok, rounds=0, timeout=5.0, tools=(multiply,), env=Calculator):
    box = Toolbox.from_recipe(Recipe(objective="grpo", reward_funcs=(exact_match,), tools=tools,
                                     environment_factory=env))
    template = Template(tok, box.schemas, {tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")})
    assert template.check() is None
    return Conversations(template, box, [{"prompt": [{"role": "user", "content": "3*4"}], "a": 3, "b": 4}],
                         seeds=[1], prompts=[[2]], max_rounds=rounds, timeout=timeout)


def test_a_conversation_as_trl_keeps_it(tiny):
    tok, ids = tiny
    convs = conversations(tok)
    first = ids("[TOOL_CALLS]multiply[ARGS]{\"a\": 3, \"b\": 4}[TOOL_CALLS]calc[ARGS]{}<|end|>")
    fed = convs.turn_ended(0, first, room=100)
    assert tok.decode(fed, skip_special_tokens=False) == "<|tool|>12<|end|><|tool|>12<|end|><|assistant|>"
    second = first + fed + ids("12<|end|>")
    assert convs.turn_ended(0, second, room=50) is None

    class Done:
        tokens, mask = second, [1] * len(first) + [0] * len(fed) + [1] * 3

    [record] = convs.finish([Done])
    calls = [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}},
             {"type": "function", "function": {"name": "calc", "arguments": {}}}]
    assert convs.messages == [[{"role": "assistant", "content": "", "tool_calls": calls},
                               {"role": "tool", "name": "multiply", "content": "12"},
                               {"role": "tool", "name": "calc", "content": "12"},
                               {"role": "assistant", "content": "12"}]]
    assert (record["calls"], record["failures"], record["unparsed"], record["assistant_turns"]) == (2, 0, 0, 2)
    assert record["tool_mask"] == Done.mask and [t["role"] for t in record["turns"]] == \
        ["assistant", "tool", "tool", "assistant"]
    assert convs.environments[0].called


def test_errors_broken_calls_the_budget_and_the_rounds(tiny):
    tok, ids = tiny
    convs = conversations(tok)
    fed = convs.turn_ended(0, ids("[TOOL_CALLS]divide[ARGS]{}<|end|>"), room=100)
    assert tok.decode(fed, skip_special_tokens=False) == "<|tool|>{'error': 'Tool divide not found.'}<|end|><|assistant|>"
    assert convs.items[0].failures == 1
    convs = conversations(tok)
    assert convs.turn_ended(0, ids("[TOOL_CALLS]multiply[ARGS]{\"a\": <|end|>"), room=100) is None
    assert convs.items[0].unparsed == 1 and convs.items[0].calls == 0
    assert convs.messages[0] == [{"role": "assistant", "content": "multiply{\"a\": "}]  # decoded as is, as TRL's
    convs = conversations(tok)  # the answer does not fit: dropped, as TRL drops it; the call counted
    turn = ids("[TOOL_CALLS]calc[ARGS]{}<|end|>")
    assert convs.turn_ended(0, turn, room=3) is None
    assert convs.items[0].calls == 1 and convs.messages[0][-1]["role"] == "assistant"
    assert convs.items[0].turns[-1]["dropped"] == "past max_completion_len"
    convs = conversations(tok, rounds=1)  # max_tool_calling_iterations=1: the second round is not run
    fed = convs.turn_ended(0, turn, room=100)
    assert convs.turn_ended(0, turn + fed + turn, room=50) is None and convs.items[0].calls == 1


def test_the_tool_mask_keeps_fed_tokens_out_of_the_loss():
    batch = rollout_batch([[1, 2]], [[5, 6, 7, 8]], [True], torch.zeros(1), 0, masks=[[1, 0, 0, 1]])
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 5, IGNORE, IGNORE, 8]]
    assert batch["input_ids"].tolist() == [[1, 2, 5, 6, 7, 8]]


def test_an_engine_converses_one_request_per_turn(tiny):
    """The vLLM engine's multi-turn rollout (agent.converse): each turn a request whose prompt is the conversation
    so far, its budget what the earlier turns left, its seed the turn's own (turn 0: the completion's); the
    answers fed between turns as the decode loop feeds them, masked 0 with log-prob 0.0."""
    import types

    from finetune.training.agent import converse, turn_seed

    tok, ids = tiny
    call, answer = ids("[TOOL_CALLS]calc[ARGS]{}<|end|>"), ids("12<|end|>")
    asked = []

    def engine(prompts, budgets, seeds):
        asked.append((prompts, budgets, seeds))
        return [types.SimpleNamespace(tokens=call if len(p) == 1 else answer, stopped=True,
                                      logprobs=[-0.5] * len(call if len(p) == 1 else answer)) for p in prompts]

    [(tokens, stopped, mask, logps)] = converse(engine, [[2]], [100], conversations(tok), [7])
    fed = tokens[len(call):len(tokens) - len(answer)]
    assert tok.decode(fed, skip_special_tokens=False) == "<|tool|>12<|end|><|assistant|>"
    assert tokens == call + fed + answer and stopped
    assert mask == [1] * len(call) + [0] * len(fed) + [1] * len(answer)
    assert logps == [-0.5] * len(call) + [0.0] * len(fed) + [-0.5] * len(answer)
    assert asked[0][1:] == ([100], [7]) and asked[1][0] == [[2] + call + fed]
    assert asked[1][1:] == ([100 - len(call) - len(fed)], [turn_seed(7, 1)]) and turn_seed(7, 1) != 7


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_fed_tokens_count_in_no_term(loss_type):
    """A micro-batch of conversations (finetune's GRPO loss on a model, beta > 0, num_iterations 2): the old and the
    reference log-probs at fed tokens (tool mask 0) changed to anything, the loss, its gradient and every metric
    (kl, entropy, clip ratios) stay the same: those tokens are in no loss term, no KL, no entropy and no
    importance ratio; changed at a drawn token, they move."""
    from finetune.training.objectives.grpo import GRPO
    from tests.test_grpo_objective import REWARD, tiny_model

    prompts = [[1, 5, 6], [1, 7, 8]]
    completions = [[10, 11, 30, 31, 32, 12, 13], [14, 33, 34, 15]]
    masks = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1]]
    batch = rollout_batch(prompts, completions, [True, True], torch.tensor([1.0, -0.7]), 0, masks=masks)
    fed = torch.zeros_like(batch["labels"], dtype=torch.bool)
    for i, (p, m) in enumerate(zip(prompts, masks)):
        fed[i, len(p):len(p) + len(m)] = torch.tensor(m) == 0
    g = torch.Generator().manual_seed(3)
    batch["old_logps"] = -torch.rand(batch["labels"].shape, generator=g)
    batch["ref_logps"] = -torch.rand(batch["labels"].shape, generator=g)
    recipe = Recipe(objective="grpo", loss_type=loss_type, beta=0.04, num_iterations=2, micro_batch_size=2, **REWARD)

    def outcome(b):
        objective, model = GRPO(recipe), tiny_model()
        loss = objective.loss(model, b)
        loss.backward()
        return loss.item(), model.lm_head.weight.grad.clone(), objective.take_metrics()

    base = outcome(batch)
    moved = dict(batch, old_logps=batch["old_logps"].masked_fill(fed, -9.0), ref_logps=batch["ref_logps"].masked_fill(fed, 0.0))
    same = outcome(moved)
    assert same[0] == base[0] and torch.equal(same[1], base[1]) and torch.equal(same[2], base[2])
    drawn = dict(batch, old_logps=batch["old_logps"].masked_fill(~fed & (batch["labels"] != IGNORE), -9.0))
    assert outcome(drawn)[0] != base[0]
