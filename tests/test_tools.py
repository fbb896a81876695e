"""Tools for GRPO's multi-turn rollouts (finetune/tools.py) and the chat template's side of them
(finetune/training/agent.py Template): the recipe's refusals before any model loads, a call's outcome
whatever the tool does, the tool-call formats read back from real tokenizers' encodings and real chat
templates (tests/templates: Llama 3.1/3.2, Qwen2.5, Qwen3, Gemma 3, Phi-3.5; Mistral's own encoder,
mistral_common), and the prefix check on every family the suite has."""

import copy
import functools
import json
import time
from pathlib import Path

import pytest

from finetune import tools as T
from finetune.end_of_turn import end_of_turn
from finetune.recipe import Recipe, RecipeError, apply_overrides, validate
from finetune.rewards import exact_match
from finetune.training.agent import Template, render, template_for
from tests import family_assets as F
from tests.agent_tools import Calculator, NoReset, multiply, no_docstring, no_hints

TEMPLATES = Path(__file__).parent / "templates"


def grpo(**changes) -> Recipe:
    return Recipe(objective="grpo", reward_funcs=(exact_match,), global_batch_size=2, num_generations=2,
                  micro_batch_size=2, **changes)


# ---------------------------------------------------------------- the recipe's refusals


def test_tools_resolve_by_name_and_callable_with_schemas():
    assert T.resolve_tools(["tests.agent_tools:multiply"]) == [multiply]
    box = T.Toolbox.from_recipe(grpo(tools=(multiply,), environment_factory=Calculator))
    assert box.names == ["multiply", "calc"] and box.environment is Calculator
    assert box.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                         "description": "the first factor"}
    validate(apply_overrides(Recipe(), ["objective=grpo", "reward_funcs=finetune.rewards:exact_match",
                                        "tools=tests.agent_tools:multiply", "max_tool_calling_iterations=2",
                                        "global_batch_size=2", "num_generations=2", "micro_batch_size=2"]))
    assert grpo(tools=(multiply,)).to_dict()["tools"] == ("tests.agent_tools:multiply",)


@pytest.mark.parametrize("changes, message", [
    ({"tools": (no_docstring,)}, "tool tests.agent_tools:no_docstring cannot be described to the model.*no docstring"),
    ({"tools": (no_hints,)}, "tool tests.agent_tools:no_hints cannot be described.*missing a type hint"),
    ({"tools": ("tests.agent_tools:nothing",)}, "tools=tests.agent_tools:nothing: module tests.agent_tools has no nothing"),
    ({"tools": ("multiply",)}, "tools='multiply': name it as module:function"),
    ({"tools": (Calculator,)}, "is a class; a tool is a function"),
    ({"tools": (multiply, multiply)}, "two tools are named multiply"),
    ({"environment_factory": NoReset}, "an environment needs a reset"),
    ({"tools": (multiply,), "sequence_parallel": 2}, "tools with sequence_parallel=2"),
    ({"max_tool_calling_iterations": 2}, "max_tool_calling_iterations=2 applies to a rollout with tools only"),
    ({"tool_timeout": 5.0}, "tool_timeout=5.0 applies to a rollout with tools only"),
])
def test_refused_in_one_line(changes, message):
    with pytest.raises(RecipeError, match=message) as e:
        validate(grpo(**changes))
    assert "\n" not in str(e.value)


def test_tools_belong_to_grpo_and_the_environment_may_be_the_only_reward():
    with pytest.raises(RecipeError, match="applies to objective=grpo only"):
        validate(Recipe(tools=(multiply,)))
    validate(Recipe(objective="grpo", environment_factory=Calculator, global_batch_size=2, num_generations=2,
                    micro_batch_size=2))
    with pytest.raises(RecipeError, match="needs reward functions"):
        validate(Recipe(objective="grpo", tools=(multiply,), global_batch_size=2, num_generations=2,
                        micro_batch_size=2))


def test_environment_per_completion_reset_with_its_row_and_seed():
    class Seeded(Calculator):
        def reset(self, a, b, seed, **row):
            super().reset(a, b)
            self.seed = seed

    box = T.Toolbox.from_recipe(grpo(environment_factory=Seeded))
    tools_1, env_1 = box.for_completion({"prompt": "x", "a": 3, "b": 4}, seed=11)
    tools_2, env_2 = box.for_completion({"prompt": "x", "a": 5, "b": 6}, seed=12)
    assert env_1 is not env_2 and (env_1.seed, env_2.seed) == (11, 12)
    assert tools_1["calc"]() == "12"
    reward = T.environment_reward(Seeded)
    assert reward.__name__ == "Seeded" and reward(environments=[env_1, env_2]) == [1.0, 0.0]
    assert tools_2["calc"]() == "30"


# ---------------------------------------------------------------- a call's outcome


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_call_never_raises_and_says_what_went_wrong():
    def boom(x: int) -> int:
        """Fails.

        Args:
            x: anything
        """
        raise RuntimeError("boom")

    def hang() -> str:
        """Hangs."""
        time.sleep(30)
        return "late"

    def garbage() -> object:
        """Returns an object whose text is its memory address."""
        return object()

    tools = {"multiply": multiply, "boom": boom, "hang": hang, "garbage": garbage}
    assert T.call_tool(tools, call("multiply", a=3, b=4), 5) == T.Answer("multiply", "12")
    assert T.call_tool(tools, call("boom", x=1), 5) == T.Answer("boom", "{'error': 'boom'}", "raised")
    assert T.call_tool(tools, call("nope"), 5) == T.Answer("nope", "{'error': 'Tool nope not found.'}", "unknown")
    wrong = T.call_tool(tools, call("multiply", a=1), 5)
    assert wrong.error == "arguments" and "missing 1 required positional argument" in wrong.content
    assert T.call_tool(tools, {"type": "function", "function": {"name": "multiply", "arguments": [1]}}, 5).error == \
        "arguments"
    assert T.call_tool(tools, call("garbage"), 5).error == "not_json"
    t0 = time.perf_counter()
    late = T.call_tool(tools, call("hang"), 0.2)
    assert late == T.Answer("hang", "{'error': 'hang ran past tool_timeout=0.2 s'}", "timeout")
    assert time.perf_counter() - t0 < 5
    assert T.call_tool({"d": lambda: {"k": [1, 2.5, None]}}, call("d"), 0).content == "{'k': [1, 2.5, None]}"


def test_tool_metrics_as_trl_counts_them():
    records = [{"calls": 2, "failures": 1, "timeouts": 1, "unparsed": 0, "assistant_turns": 3},
               {"calls": 0, "failures": 0, "timeouts": 0, "unparsed": 1, "assistant_turns": 1}]
    assert T.tool_metrics(records) == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.5,
                                       "tools/calling_share": 0.5, "tools/errors": 0.5, "tools/timeouts": 1.0,
                                       "tools/unparsed": 1.0, "tools/turns": 2.0}


# ---------------------------------------------------------------- formats


def test_formats_read_calls_and_count_broken_ones():
    hermes, llama, mistral, phi4 = (T.FORMATS[k] for k in ("hermes", "llama3_json", "mistral", "phi4"))
    mul = call("multiply", a=3, b=4)
    assert hermes.parse('Let me see.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
                        ) == T.Parsed("Let me see.", [mul])
    two = hermes.parse('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>\n'
                       '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert two.calls == [mul, mul]
    assert hermes.parse("<tool_call>{\"name\": \"multiply\", ").broken
    assert hermes.parse("<tool_call>{not json}</tool_call>") == T.Parsed("<tool_call>{not json}</tool_call>", [], True)
    assert hermes.parse("12") == T.Parsed("12")
    assert llama.parse('{"name": "multiply", "parameters": {"a": 3, "b": 4}}').calls == [mul]
    assert llama.parse('<|python_tag|>{"name": "multiply", "parameters": {"a": 3, "b": 4}}').calls == [mul]
    assert llama.parse('{"answer": 12}') == T.Parsed('{"answer": 12}')
    assert llama.parse('{"name": "multiply", "parameters": {"a": 3').broken
    assert mistral.parse('[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 4}'
                         ).calls == [mul, mul]
    assert mistral.parse("[TOOL_CALLS]calc[ARGS]{}").calls == [call("calc")]
    assert mistral.parse("[TOOL_CALLS]calc[ARGS]{").broken and mistral.parse("[TOOL_CALLS]").broken
    assert phi4.parse('<|tool_call|>[{"name": "multiply", "arguments": {"a": 3, "b": 4}}]<|/tool_call|>').calls == [mul]
    assert phi4.parse('<|tool_call|>[{"name": "multiply"').broken


@pytest.mark.parametrize("version", ["v3", "v7"])  # (tekken writes the same, converted in 20 s: left out)
def test_mistral_calls_as_mistral_common_encodes_them(version, tmp_path):
    """Mistral's own encoder (mistral_common, the real tokenizers) writes an assistant turn's calls; decoded by the
    transformers tokenizer of the same file, the mistral format reads them back."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    encoder = MistralTokenizer.from_file(str(F.mistral_file(F.MISTRAL_MODELS[version])))
    tools = [Tool(function=Function(name="multiply", description="Multiply.", parameters=T.schema(multiply)["function"]
                                    ["parameters"]))]
    messages = [UserMessage(content="What is 3 times 4?"),
                AssistantMessage(content=None, tool_calls=[ToolCall(id="abcdefghi", function=FunctionCall(
                    name="multiply", arguments='{"a": 3, "b": 4}'))]),
                ToolMessage(content="12", tool_call_id="abcdefghi", name="multiply")]
    whole = encoder.encode_chat_completion(ChatCompletionRequest(tools=tools, messages=messages)).tokens
    asked = encoder.encode_chat_completion(ChatCompletionRequest(tools=tools, messages=messages[:1])).tokens
    tok = F.mistral_tokenizer(version, tmp_path / "tok")
    turn = whole[len(asked):]
    turn = turn[:turn.index(tok.eos_token_id)]  # the turn as the model writes it, to its </s>
    assert T.FORMATS["mistral"].parse(tok.decode(turn, skip_special_tokens=False)).calls == [call("multiply", a=3, b=4)]


# ---------------------------------------------------------------- the prefix check on real templates


@functools.cache
def trained_tokenizer(kind: str):
    """The family's small tokenizer (tests/family_assets.py), trained once per kind."""
    import tempfile

    family = F.Family(kind, "", {}, "", kind, [])
    corpus = ["What is 3 times 4? It is 12.", "multiply the first factor"] * 3
    return F.make_tokenizer(family, corpus, Path(tempfile.mkdtemp(prefix="tools-tok-")) / kind)


def family_tokenizer(kind: str, template: str, tmp_path=None):
    """A copy of the family's tokenizer with a real template (tests/templates) or one of family_assets'."""
    tok = copy.deepcopy(trained_tokenizer(kind))
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text() if template in TEMPLATES_ON_DISK else template
    return tok


TEMPLATES_ON_DISK = {p.stem for p in TEMPLATES.glob("*.jinja")}


def stops_of(tok) -> set[int]:
    return {tok.eos_token_id, *end_of_turn(tok).ids}


@pytest.mark.parametrize("kind, template, expected", [
    ("llama3", "llama3_1", "llama3_json"),
    ("llama3", "llama3_2", "llama3_json"),
    ("qwen", "qwen2_5", "hermes"),
    ("qwen-base", "qwen2_5", "hermes"),  # its EOS is not the template's end of turn: cut at <|im_end|> all the same
    ("qwen", "qwen3", "hermes"),  # through its training form (below)
    ("gemma", "gemma3", "cannot render a conversation with a tool call.*roles must alternate"),
    ("phi3", "phi3_5", "renders no tool call"),
    ("mistral-v3", F.MISTRAL, "renders no tool call"),
    ("llama3", F.LLAMA3, "renders no tool call"),
    ("qwen", F.CHATML, "renders no tool call"),
])
def test_prefix_check_on_real_templates(kind, template, expected, tmp_path):
    """Each family's template renders a conversation with a call, its answer and a final answer: where the turns
    the model writes stay a prefix of the re-rendered conversation and end with a stop token, the format that reads
    the template's calls is found; else the run is refused in one line naming the model and what breaks."""
    tok = family_tokenizer(kind, template, tmp_path)
    schemas = [T.schema(multiply)]
    if expected in T.FORMATS:
        made = template_for(tok, schemas, stops_of(tok), "some/model")
        assert made.format.name == expected
        return
    with pytest.raises(RecipeError, match=f"tools with model=some/model: its chat template ({expected})") as e:
        template_for(tok, schemas, stops_of(tok), "some/model")
    assert "\n" not in str(e.value)


def test_qwen3_is_trained_with_its_training_template(tmp_path, caplog):
    """Qwen3's own template drops an earlier turn's <think> block once a tool answers (the prefix check finds it);
    its training form, which keeps every turn's block, is put on the tokenizer in its place, said in one line;
    a template that is not Qwen3's own is refused instead."""
    from finetune.training.agent import Template, training_template

    tok = family_tokenizer("qwen", "qwen3", tmp_path)
    original = tok.chat_template
    problem = Template(tok, [T.schema(multiply)], stops_of(tok)).check()
    assert "renders an assistant turn otherwise once a tool's answer follows it" in problem
    template_for(tok, [T.schema(multiply)], stops_of(tok), "Qwen/Qwen3-8B")
    assert tok.chat_template == training_template(original)[1] != original
    assert "(the Qwen3 family's)" in caplog.text and "training form" in caplog.text
    tok.chat_template = original.replace("ns.last_query_index %}", "ns.last_query_index  %}")  # not Qwen3's own
    with pytest.raises(RecipeError, match="renders an assistant turn otherwise once a tool's answer follows it"):
        template_for(tok, [T.schema(multiply)], stops_of(tok), "Qwen/Qwen3-8B")


def test_tool_answers_render_as_the_template_goes_on(tmp_path):
    """The tokens fed after a turn are what the re-rendered conversation holds there (TRL's suffix, cut at the
    turn's end-of-turn token), on Qwen2.5's and Llama 3.1's real templates."""
    qwen = family_tokenizer("qwen", "qwen2_5", tmp_path)
    answer = [{"role": "tool", "name": "multiply", "content": "12"}]
    assert qwen.decode(Template(qwen, [], stops_of(qwen)).suffix(answer)) == \
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    llama = family_tokenizer("llama3", "llama3_1", tmp_path)
    assert llama.decode(Template(llama, [], stops_of(llama)).suffix(answer)) == \
        '<|start_header_id|>ipython<|end_header_id|>\n\n"12"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'


def test_the_tokenizers_own_response_parsing_comes_first(tmp_path):
    """A tokenizer with a response_template (transformers' parse_response) is read by it, as TRL reads it."""
    tok = family_tokenizer("qwen", "qwen2_5", tmp_path)
    tok.response_template = {
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                  "content": "json", "transform": {"type": "function", "function": "{content}"}},
                   "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    template = template_for(tok, [T.schema(multiply)], stops_of(tok), "qwen")
    assert isinstance(template.format, T.TokenizerParsing)
    prompt = tok(render(tok, [{"role": "user", "content": "3*4"}], True, [T.schema(multiply)]),
                 add_special_tokens=False).input_ids
    turn = tok('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
               add_special_tokens=False).input_ids
    assert template.parse(turn, prompt).calls == [call("multiply", a=3, b=4)]
    broken = template.parse(tok("<tool_call>\n{\"name\": <|im_end|>", add_special_tokens=False).input_ids, prompt)
    assert broken.broken and not broken.calls


def test_the_tiny_tools_model_renders_and_reads_its_calls():
    from finetune.assets import build_tokenizer

    tok = build_tokenizer(tools=True)
    schemas = [T.schema(Calculator().calc), T.schema(multiply)]
    template = template_for(tok, schemas, stops_of(tok), "builtin:tiny-llama-tools")
    assert template.format.name == "mistral"
    text = render(tok, [{"role": "user", "content": "3*4"}], True, schemas)
    assert text == ("<s>[AVAILABLE_TOOLS]calc(): The product of the question's numbers.\nmultiply(a,b): Multiply two "
                    "integers.\n[/AVAILABLE_TOOLS]<|user|>3*4<|end|><|assistant|>")
    turn = tok('[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 4}<|end|>', add_special_tokens=False).input_ids
    assert template.parse(turn).calls == [call("multiply", a=3, b=4)]
    assert tok.decode(template.suffix([{"role": "tool", "name": "multiply", "content": "12"}]),
                      skip_special_tokens=False) == "<|tool|>12<|end|><|assistant|>"


def test_the_caller_warm_up_is_deterministic_and_sees_the_recipes_prompt():
    """builtin:tiny-llama-caller's warm-up (finetune/assets.py): its conversations list the tool as
    recipes/tiny_grpo_tools.py's calculator does, so they render the recipe's prompts; and a warm-up from the same
    weights gives the same weights (a few steps here; the build runs CALLER_STEPS)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune import assets
    from recipes.tiny_grpo_tools import Calculator as RecipeCalculator

    assert T.schema(RecipeCalculator().mul) == assets.CALLER_TOOL
    tok = assets.build_tokenizer(tools=True)
    config = LlamaConfig(vocab_size=128, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        runs.append((assets.warm_up_caller(model, tok, steps=3), model.state_dict()))
    assert runs[0][0] == runs[1][0] and runs[0][0][-1] < runs[0][0][0]
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())


def test_the_caller_model_sometimes_calls_the_calculator_and_copies_its_answer():
    """builtin:tiny-llama-caller, as built: asked a product, it begins the calculator's call with some probability,
    neither never nor always (what GRPO raises), a call once begun runs to its end, and once the calculator
    answered, the answer's digits are the likeliest tokens (it copies them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune import assets

    tok = assets.build_tokenizer(tools=True)
    model = AutoModelForCausalLM.from_pretrained(assets.tiny_model_dir("tiny-llama-caller"), dtype=torch.float32)
    for a, b in ((37, 59), (12, 88), (91, 23)):
        prompt = render(tok, [{"role": "user", "content": f"{a}*{b}"}], True, [assets.CALLER_TOOL])
        call = "[TOOL_CALLS]mul[ARGS]{}<|end|>"
        answer = f"<|tool|>{a * b}<|end|><|assistant|>{a * b}<|end|>"
        ids = tok(prompt + call + answer, add_special_tokens=False).input_ids
        n, m = len(tok(prompt, add_special_tokens=False).input_ids), len(tok(call, add_special_tokens=False).input_ids)
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, :-1].softmax(-1)
        drawn = [probs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        called, copied = drawn[n - 1:n - 1 + m], drawn[-len(str(a * b)) - 1:]
        assert 0.03 < called[0] < 0.6 and min(called[1:]) > 0.5, (a, b, called)
        assert all(p == probs[i].max().item() for p, i in zip(copied, range(len(ids) - len(copied) - 1, len(ids) - 1))), \
            (a, b, copied)


def test_the_builtin_calculator_computes_arithmetic_and_nothing_else():
    assert [T.calculator(e) for e in ("(12.5 + 3) * 4 ** 2", "7/2", "2**10", "-3 % 5", "10 // 4")] == \
        ["248", "3.5", "1024", "2", "2"]
    tools = {"calculator": T.calculator}
    for expression, error in (("__import__('os')", "not arithmetic"), ("9**9**9", "a power too large"),
                              ("1/0", "division by zero"), ("x" * 201, "longer than 200 characters")):
        answer = T.call_tool(tools, call("calculator", expression=expression), 5)
        assert answer.error == "raised" and error in answer.content
    assert T.schema(T.calculator)["function"]["parameters"]["required"] == ["expression"]
