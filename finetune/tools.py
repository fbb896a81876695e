"""Tools for GRPO's multi-turn rollouts, as TRL's GRPOTrainer takes them (trl 1.16: `tools=`,
`environment_factory`, `max_tool_calling_iterations`); the loop that calls them between turns is
finetune/training/agent.py.

A tool is a plain Python function with type hints and a Google-style docstring: its JSON schema (what
the chat template shows the model) comes from transformers' get_json_schema, and a function it cannot
describe is refused in one line before any model loads. A recipe names tools as it names reward
functions: callables in the recipe file, or "module:function" strings on the command line.

An environment (environment_factory: a class, or any callable returning an object) is made once per
completion: `reset(**row)` gets the prompt row's columns (and `seed`, the completion's sampling seed,
where reset takes a parameter of that name), its public methods are that completion's tools besides
the standalone ones, and a `get_reward()` method, where it has one, is one more reward function, named
after the class (TRL's).

What the model writes is read per turn by a tool-call format (FORMATS: the text between the markers
a family's chat template renders around a call), or by the tokenizer's own response parsing where it
has a response_template (transformers' parse_response). A call is run with its JSON arguments as
keyword arguments; what it returns becomes the tool message's content as TRL renders it (str(result));
a call that raises, names no tool, returns something that is not text, a number or JSON data, or runs
past tool_timeout seconds answers {'error': '...'} instead, which the model reads, and is counted.
Tools must be deterministic functions of their arguments (and an environment of its row and seed): a
resumed run calls them again and must get the same answers to repeat the uninterrupted run."""

from __future__ import annotations

import inspect
import json
import re
import threading
from dataclasses import dataclass, field

from finetune.errors import RecipeError


class ToolSpecError(ValueError):
    """A tool or environment that cannot be found or described as the recipe names it."""


# ---------------------------------------------------------------- naming, schemas, environments


def resolve_tools(specs) -> list:
    """The recipe's tools as callables ("module:function" strings imported), each with a JSON schema,
    their names distinct."""
    from finetune.rewards import RewardSpecError, resolve_name

    funcs = []
    for spec in specs:
        try:
            func = spec if callable(spec) else resolve_name(spec, "tools", "mymodule:multiply")
        except RewardSpecError as e:
            raise ToolSpecError(str(e)) from None
        if isinstance(func, type):
            raise ToolSpecError(f"tools={func.__module__}:{func.__qualname__} is a class; a tool is a function (an "
                                "environment's methods are tools through environment_factory)")
        funcs.append(func)
    names = [f.__name__ for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolSpecError(f"tools: two tools are named {twice[0]} (the model calls a tool by its name); give each "
                            "its own name")
    for func in funcs:
        schema(func)
    return funcs


def schema(func) -> dict:
    """The tool's JSON schema, as apply_chat_template renders tools=[func] (transformers' get_json_schema), or
    one line naming the function and what its signature or docstring lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException, and their kin
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        raise ToolSpecError(f"tool {getattr(func, '__module__', '')}:{name} cannot be described to the model "
                            f"({str(e).splitlines()[0]}); a tool needs a type hint on every argument and a Google-style "
                            "docstring: a summary line, then 'Args:' with one line per argument") from None


def resolve_environment(spec):
    """environment_factory as a callable ("module:Class" imported; a class is its own factory), or None."""
    if spec in (None, ""):
        return None
    if isinstance(spec, str):
        from finetune.rewards import RewardSpecError, resolve_name

        try:
            return resolve_name(spec, "environment_factory", "mymodule:Calculator")
        except RewardSpecError as e:
            raise ToolSpecError(str(e)) from None
    if not callable(spec):
        raise ToolSpecError(f"environment_factory={spec!r:.80}: give a class (or a function returning an environment), "
                            "or its module:Class name")
    return spec


ENVIRONMENT_HOOKS = ("reset", "get_reward")


def environment_class(factory) -> type:
    """The class of the environments a factory makes: the factory itself when it is a class, else the class
    of one object it makes (a function is called once for this, as TRL does)."""
    return factory if isinstance(factory, type) else type(factory())


def environment_method_names(cls) -> list[str]:
    """An environment's tools: the public functions of its class but reset and get_reward (TRL's)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ENVIRONMENT_HOOKS and not name.startswith("_")]


def check_environment(factory) -> type:
    """The environment class, refused in one line without a reset method, or with a tool method that cannot
    be described (schema)."""
    cls = environment_class(factory)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not callable(getattr(cls, "reset", None)):
        raise ToolSpecError(f"environment_factory={name}: an environment needs a reset(**row) method (called with the "
                            "prompt row's columns before each completion)")
    probe = object.__new__(cls)  # bound methods for their signatures without self; __init__ is not run
    for method in environment_method_names(cls):
        schema(getattr(probe, method))
    return cls


def environment_reward(cls):
    """The reward function an environment's get_reward() gives (TRL's): named after the class, it scores each
    completion by its own environment."""

    def reward(environments=None, **kwargs):
        return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    reward.__module__ = cls.__module__
    return reward


@dataclass
class Toolbox:
    """The recipe's standalone tools and environment factory, with every schema the prompts render (the
    standalone tools', then the environment's methods')."""
    funcs: list
    factory: object = None
    environment: type | None = None
    schemas: list = field(default_factory=list)

    @classmethod
    def from_recipe(cls, recipe) -> Toolbox | None:
        """None for a recipe without tools; a ToolSpecError names what cannot be used."""
        funcs = resolve_tools(recipe.tools)
        factory = resolve_environment(recipe.environment_factory)
        if not funcs and factory is None:
            return None
        environment = check_environment(factory) if factory is not None else None
        schemas = [schema(f) for f in funcs]
        if environment is not None:
            probe = object.__new__(environment)
            schemas += [schema(getattr(probe, m)) for m in environment_method_names(environment)]
        names = [s["function"]["name"] for s in schemas]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ToolSpecError(f"tools: {twice[0]} is both a tool and a method of environment_factory; rename one")
        return cls(funcs, factory, environment, schemas)

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    def for_completion(self, row: dict, seed: int) -> tuple[dict, object]:
        """One completion's tools by name, and its environment (None without one): made and reset here."""
        tools = {f.__name__: f for f in self.funcs}
        if self.factory is None:
            return tools, None
        env = self.factory()
        kwargs = dict(row)
        if "seed" in inspect.signature(env.reset).parameters and "seed" not in kwargs:
            kwargs["seed"] = seed
        observation = env.reset(**kwargs)
        if observation is not None:
            raise RecipeError(f"environment_factory: {type(env).__name__}.reset returned an observation "
                              f"({str(observation)!r:.60}); appending it to the prompt is not supported here: put it in "
                              "the data's prompt column and return None")
        return tools | {m: getattr(env, m) for m in environment_method_names(type(env))}, env


# ---------------------------------------------------------------- running a call


@dataclass
class Answer:
    """A tool call's outcome: the tool message's content, and what went wrong (None: nothing)."""
    name: str
    content: str
    error: str | None = None  # "raised", "unknown", "arguments", "not_json", "timeout"


def error_content(message: str) -> str:
    return str({"error": message})  # what TRL renders for a failed call


JSON_SCALARS = (str, int, float, bool, type(None))


def is_json_data(value, depth: int = 0) -> bool:
    """Text, a number, a bool, None, or lists and string-keyed dicts of them: what renders the same in every
    process and every run (an object's str() may hold its memory address)."""
    if isinstance(value, JSON_SCALARS):
        return not isinstance(value, float) or value == value and abs(value) != float("inf")
    if depth > 32:
        return False
    if isinstance(value, (list, tuple)):
        return all(is_json_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_data(v, depth + 1) for k, v in value.items())
    return False


def call_tool(tools: dict, call: dict, timeout: float) -> Answer:
    """Run one parsed call ({"type": "function", "function": {"name", "arguments"}}) as TRL does, never
    raising: the function's result as str(result), or an {'error': ...} content (TRL's, for an unknown
    tool and an exception; ours besides for arguments that are not a JSON object, a result that is not
    JSON data and a call past `timeout` seconds (0: none), which is left running on its thread)."""
    function = call.get("function") or {}
    name = str(function.get("name"))
    if call.get("type", "function") != "function":
        return Answer(name, error_content(f"Unsupported tool call type: {call.get('type')}"), "unknown")
    if name not in tools:
        return Answer(name, error_content(f"Tool {name} not found."), "unknown")
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        return Answer(name, error_content(f"the arguments of {name} are not a JSON object"), "arguments")
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = tools[name](**arguments)
        except BaseException as e:  # noqa: BLE001 - the user's tool: whatever it raises is the model's answer
            outcome["raised"] = e

    if timeout:
        worker = threading.Thread(target=run, daemon=True, name=f"tool {name}")
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            return Answer(name, error_content(f"{name} ran past tool_timeout={timeout:g} s"), "timeout")
    else:
        run()
    if "raised" in outcome:
        error = outcome["raised"]
        return Answer(name, error_content(str(error)), "arguments" if isinstance(error, TypeError) else "raised")
    value = outcome.get("value")
    if not is_json_data(value):
        return Answer(name, error_content(f"{name} returned a {type(value).__name__}; a tool returns text, a number or "
                                          "JSON data"), "not_json")
    return Answer(name, str(value))


# ---------------------------------------------------------------- reading calls out of a turn


@dataclass
class Parsed:
    """An assistant turn as TRL's parse_response gives it: its content and the calls it makes; broken: it
    opened a call that does not parse (then, as TRL falls back, no call is made)."""
    content: str
    calls: list = field(default_factory=list)
    broken: bool = False

    def message(self) -> dict:
        out = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def function_call(name, arguments) -> dict | None:
    """{"type": "function", "function": {"name", "arguments"}}, or None where it is not one (arguments
    given as a JSON string are read: some models write them so)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def json_calls(value) -> list | None:
    """Calls from a JSON object ({"name", "arguments" or "parameters"}) or a list of them; None where any is
    not a call."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or "name" not in item:
            return None
        call = function_call(item["name"], item.get("arguments", item.get("parameters", {})))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def leading_json(text: str):
    """The JSON value text starts with (after spaces) and what follows it, or (None, text)."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return None, text
    return value, stripped[end:]


class Format:
    """A tool-call format: how a family's chat template writes calls in an assistant turn, read back from
    the turn's text (special tokens kept, its end-of-turn token cut off)."""
    name = ""
    opener = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def broken(self, text: str) -> Parsed:
        return Parsed(text.strip(), [], True)


class Hermes(Format):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated: Qwen2, Qwen2.5, Qwen3, Hermes."""
    name, opener, closer = "hermes", "<tool_call>", "</tool_call>"
    block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.opener)
        if at < 0:
            return Parsed(text.strip())
        blocks = self.block.findall(text)
        calls = []
        for body in blocks:
            value, rest = leading_json(body)
            found = json_calls(value) if value is not None and not rest.strip() and isinstance(value, dict) else None
            if found is None:
                return self.broken(text)
            calls += found
        if len(blocks) != text.count(self.opener):
            return self.broken(text)
        return Parsed(text[:at].strip(), calls)


class Llama3Json(Format):
    """Llama 3.1 / 3.2: the whole turn one JSON object {"name": ..., "parameters": {...}} (after <|python_tag|>
    where the model writes one); at most one call a turn."""
    name, opener = "llama3_json", "{"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed(text.strip())
        value, rest = leading_json(body)
        calls = json_calls(value) if isinstance(value, dict) and not rest.strip() else None
        if calls is None:
            # a turn that opens with { but is no call: plain content if it names no function (a JSON answer)
            return self.broken(text) if '"name"' in body else Parsed(text.strip())
        return Parsed("", calls)


class MistralCalls(Format):
    """[TOOL_CALLS] then a JSON list of {"name", "arguments"} (Mistral v3 tokenizers), or [TOOL_CALLS]name[ARGS]{...}
    repeated (v11 and later; the embedded tiny-llama-tools model)."""
    name, opener = "mistral", "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        at = text.find(self.opener)
        if at < 0:
            return Parsed(text.strip())
        content, pieces = text[:at].strip(), text[at:].split(self.opener)[1:]
        calls = []
        for piece in pieces:
            if "[ARGS]" in piece:
                name, _, args = piece.partition("[ARGS]")
                value, rest = leading_json(args)
                call = function_call(name.strip(), value) if isinstance(value, dict) and not rest.strip() else None
                found = [call] if call is not None else None
            else:
                value, rest = leading_json(piece)
                found = json_calls(value) if value is not None and not rest.strip() else None
            if found is None:
                return self.broken(text)
            calls += found
        return Parsed(content, calls)


class Phi4Calls(Format):
    """<|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|> (Phi-4-mini)."""
    name, opener, closer = "phi4", "<|tool_call|>", "<|/tool_call|>"

    def parse(self, text: str) -> Parsed:
        at = text.find(self.opener)
        if at < 0:
            return Parsed(text.strip())
        body, closed, rest = text[at + len(self.opener):].partition(self.closer)
        value, after = leading_json(body)
        calls = json_calls(value) if closed and value is not None and not after.strip() and not rest.strip() else None
        if calls is None:
            return self.broken(text)
        return Parsed(text[:at].strip(), calls)


FORMATS = {f.name: f for f in (Hermes(), Llama3Json(), MistralCalls(), Phi4Calls())}


class TokenizerParsing(Format):
    """The tokenizer's own response parsing (a response_template or response_schema: transformers'
    parse_response), read as TRL's parse_response reads it: the EOS string cut from the content, a call
    without arguments given {}, and a response that does not parse taken as plain text (broken)."""
    name = "tokenizer"

    def __init__(self, tokenizer, schemas):
        self.tokenizer, self.schemas = tokenizer, schemas

    def parse_ids(self, ids: list[int], prefix: list[int] | None) -> Parsed:
        tok = self.tokenizer
        try:
            kwargs = {"prefix": prefix, "tools": self.schemas} if getattr(tok, "response_template", None) else {}
            parsed = tok.parse_response(ids, **kwargs)
            if parsed is None:
                raise ValueError("nothing parsed")
            content = parsed.get("content") or ""
            if isinstance(content, str) and tok.eos_token:
                content = content.removesuffix(tok.eos_token)
            calls = []
            for item in parsed.get("tool_calls") or []:
                function = item.get("function", item) if isinstance(item, dict) else None
                call = function_call(function.get("name"), function.get("arguments")) if isinstance(function, dict) \
                    else None
                if call is None:
                    raise ValueError("a call without a name")
                calls.append(call)
            return Parsed(content if isinstance(content, str) else str(content), calls)
        except (ValueError, TypeError, AttributeError):
            return Parsed(tok.decode(ids, skip_special_tokens=True), [], True)


def has_response_parsing(tokenizer) -> bool:
    """Whether the tokenizer parses responses itself (transformers' response_template / response_schema)."""
    return any(getattr(tokenizer, a, None) is not None for a in ("response_template", "response_schema"))


# ---------------------------------------------------------------- counting


TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency", "tools/calling_share", "tools/errors",
                "tools/timeouts", "tools/unparsed", "tools/turns")


def tool_metrics(records: list[dict]) -> dict:
    """A batch's tool metrics from its completions' records (agent.Conversation.record): TRL's call_frequency
    (calls per completion) and failure_frequency (failed calls per call, 0 without calls); the share of
    completions with a call that answered without error, failed calls per completion, timeouts and
    turns whose call did not parse (counts over the batch), and assistant turns per completion."""
    n = max(len(records), 1)
    calls = sum(r["calls"] for r in records)
    failed = sum(r["failures"] for r in records)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failed / calls if calls else 0.0,
            "tools/calling_share": sum(r["calls"] > r["failures"] for r in records) / n,
            "tools/errors": failed / n, "tools/timeouts": float(sum(r["timeouts"] for r in records)),
            "tools/unparsed": float(sum(r["unparsed"] for r in records)),
            "tools/turns": sum(r["assistant_turns"] for r in records) / n}


# ---------------------------------------------------------------- built in


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, for example "(12.5 + 3) * 4 ** 2"
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
           ast.UAdd: operator.pos}

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
                raise ValueError("a power too large to compute")
            return ops[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]}")

    if len(expression) > 200:
        raise ValueError("an expression longer than 200 characters")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() and abs(result) < 2**53 else result)
