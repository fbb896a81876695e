"""Tools and environments the tool tests name as module:function (tests/test_tools.py, tests/test_agent.py, the
launch tests with tools): one module, so that a name and the object resolve to the same function."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def no_docstring(a: int) -> int:
    return a


def no_hints(a):
    """Return a.

    Args:
        a: anything
    """
    return a


class Calculator:
    """An environment: reset with a row's numbers, calc() its tool, get_reward() its reward."""

    def reset(self, a, b, **row):
        self.a, self.b, self.called = a, b, False

    def calc(self) -> str:
        """The product of the question's numbers."""
        self.called = True
        return str(self.a * self.b)

    def get_reward(self) -> float:
        return float(self.called)


def calc() -> str:
    """The product of 37 and 59 (a calculator that knows the one question `finetune chat` is asked in its test)."""
    return str(37 * 59)


class NoReset:
    def calc(self) -> str:
        """The answer."""
        return "1"


def next_table(tool: str) -> dict:
    """What the tool-happy model draws next after each token (a bigram table): after the generation prompt a call
    most of the time, else a number; a call is `tool`'s ([TOOL_CALLS]mul[ARGS]{}), or one of a name cut after its
    first letter, which names no tool, or one cut after [ARGS] (which does not parse), sometimes two in a turn;
    numbers run on or end the turn. A letter the name repeats (calc's c) keeps its first place's next tokens."""
    table = {"<|assistant|>": {"[TOOL_CALLS]": 0.6, **{d: 0.04 for d in "0123456789"}}, "[TOOL_CALLS]": {tool[0]: 1.0},
             tool[0]: {tool[1]: 0.6, "[ARGS]": 0.4}}
    for letter, after in zip(tool[1:], tool[2:] + "\0"):
        table.setdefault(letter, {after if after != "\0" else "[ARGS]": 1.0})
    return {**table, "[ARGS]": {"{": 0.9, "<|end|>": 0.1}, "{": {"}": 1.0}, "}": {"<|end|>": 0.9, "[TOOL_CALLS]": 0.1},
            **{d: {**{e: 0.075 for e in "0123456789"}, "<|end|>": 0.25} for d in "0123456789"}}


def tool_happy_model(out, base: str = "tiny-llama-tools", tool: str = "mul"):
    """builtin:tiny-llama-tools (base: another builtin of its vocabulary's size, tiny-llama-h64 for vLLM, which
    serves its head size) with weights set (not trained) so that it draws the tokens of next_table(tool): its
    attention and MLP outputs zero, each token's embedding a unit vector of its own, the output layer the
    log-probabilities of what follows it. Its rollouts call `tool` (by default mul, recipes/tiny_grpo_tools.py's
    calculator; calc for `finetune chat --tools tests.agent_tools:calc`), name a tool that does not exist,
    write calls that do not parse and answer with numbers, as no untrained model does; training moves it from
    there. Written with save_pretrained to `out`, loaded by a run as model=<out>."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.assets import build_tokenizer, tiny_model_dir

    tok = build_tokenizer(tools=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(base), dtype=torch.float32)
    hidden = model.config.hidden_size
    table = next_table(tool)
    slot = {token: k for k, token in enumerate(table)}  # every other token shares the last slot: the turn ends
    end = tok.convert_tokens_to_ids("<|end|>")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, hidden - 1] = 1.0
        head = model.lm_head.weight
        head.fill_(-30.0 / math.sqrt(hidden))
        head[end, hidden - 1] = 0.0
        for token, k in slot.items():
            embed[tok.convert_tokens_to_ids(token)] = torch.nn.functional.one_hot(torch.tensor(k), hidden).float()
            for after, p in table[token].items():
                head[tok.convert_tokens_to_ids(after), k] = math.log(p) / math.sqrt(hidden)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
