"""GRPO's multi-turn rollout with tools, as TRL's GRPOTrainer runs its tool loop (trl 1.16
_tool_call_loop), on finetune's own decode loop (finetune/generation.py, `turns`). The tools themselves
(schemas, environments, the call formats, running a call) are finetune/tools.py.

A completion is a conversation: the model writes a turn; when it ends the turn (draws a stop token) the
turn is parsed (Template.parse); each call it makes is run (tools.call_tool: errors, timeouts and
answers that are not JSON data come back as {'error': ...} contents the model reads, and are counted);
their answers, as `tool` messages, are rendered by the chat template into the tokens that follow the
turn (Template.suffix: TRL's _get_tool_suffix_ids, the text a dummy conversation gains when the tool
messages and the generation prompt are added); those tokens are fed into the same sequence, whose KV
cache goes on (no token is computed twice), and the model writes its next turn. A conversation ends on
a turn without a call, once max_tool_calling_iterations rounds of calls were answered, when the tool
answers would not fit in what is left of max_completion_len (they are dropped, as TRL drops them), or
when the budget is spent. The fed tokens are in the sequence but marked 0 in the completion's mask:
they are out of the loss, the KL, the entropy and the importance ratios (TRL's tool_mask); the tokens
the model drew keep their positions, so a completion's seed fixes its whole conversation.

The chat template must render a conversation so that what the model generated stays a prefix of the
re-rendered conversation once a tool answered, and the end of each turn stays a token the model drew
(in the loss): Template.check renders such a conversation before the first rollout and refuses a
template that breaks either, in one line naming the model and what breaks.

The reward functions are called as TRL calls them with tools: `prompts` the prompts, `completions`
each conversation as its list of messages (assistant turns with their `tool_calls`, tool answers),
`completion_ids` every token of it (the tool answers' too), every dataset column, and `environments`
(each completion's environment) with environment_factory."""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune import data as D
from finetune.errors import RecipeError
from finetune.generation import Turns
from finetune.tools import FORMATS, Parsed, TokenizerParsing, call_tool, has_response_parsing

# contents no template rewrites (no spaces to trim, no tags), found again in the rendered text
USER, ANSWER, FINAL = "Zq7xk", "Zq8yl", "Zq9zm"

# loss.png's panels of a run with tools (metrics: finetune/tools.py tool_metrics)
PANELS = (("tool calls", "calls per completion", "tools/call_frequency"),
          ("tool errors", "failed calls per completion", "tools/errors"),
          ("turns", "assistant turns per completion", "tools/turns"))


def chat_stops(model_path: str, config, tokenizer) -> set[int]:
    """The ids a conversation's turns end at: the model's own stop ids and its chat template's end-of-turn
    token (the generation config a run with tools saves: the loop's stop_tokens with chats)."""
    from finetune.end_of_turn import base_generation_config, with_end_of_turn
    from finetune.generation import stop_ids

    return stop_ids(tokenizer, None, with_end_of_turn(base_generation_config(model_path, config), tokenizer, True)[0])


def render(tokenizer, messages: list[dict], generation_prompt: bool, tools=None) -> str:
    return D.render_chat(tokenizer, messages, generation_prompt, tools=tools)


def token_ids(tokenizer, text: str) -> list[int]:
    """A rendered text's tokens, as apply_chat_template(tokenize=True) makes them (no added specials)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def probe_arguments(schema: dict) -> dict:
    """Arguments of the types a tool's schema names, for a call the template renders."""
    values = {"integer": 7, "number": 2.5, "boolean": True, "string": "q", "array": [], "object": {}}
    properties = schema.get("function", {}).get("parameters", {}).get("properties", {}) or {}
    return {k: values.get(v.get("type") if isinstance(v.get("type"), str) else "string", "q")
            for k, v in properties.items()}


def assistant_call(call: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class Template:
    """The chat template's side of a run's tools: how a turn's calls are read (format), and the tokens a
    round of tool answers becomes (suffix). stops: the ids generation stops at (a turn's end)."""

    def __init__(self, tokenizer, schemas: list[dict], stops):
        self.tokenizer, self.schemas, self.stops = tokenizer, schemas, set(stops)
        self.format = None
        self.dummy_prefix: dict = {}

    def suffix(self, tool_messages: list[dict]) -> list[int]:
        """TRL's _get_tool_suffix_ids: the tokens a dummy conversation (a user message, an assistant turn
        calling the first answer's tool) gains when the tool messages and the generation prompt are added,
        from the end of the assistant's turn: its last stop token (TRL cuts at the EOS; a template whose turns
        end with an end-of-turn token that is not the EOS would otherwise lose what follows it)."""
        name = tool_messages[0]["name"]
        if name not in self.dummy_prefix:
            dummy = [{"role": "user", "content": "dummy"},
                     assistant_call({"type": "function", "function": {"name": name, "arguments": {}}})]
            prefix = token_ids(self.tokenizer, render(self.tokenizer, dummy, False))
            ends = [i for i, t in enumerate(prefix) if t in self.stops]
            self.dummy_prefix[name] = (dummy, prefix[:ends[-1] + 1] if ends else prefix)
        dummy, prefix = self.dummy_prefix[name]
        full = token_ids(self.tokenizer, render(self.tokenizer, dummy + tool_messages, True))
        if full[:len(prefix)] != prefix:
            raise ValueError("renders an assistant turn otherwise once a tool's answer follows it, so the tokens the "
                             "model generated are not a prefix of the conversation (Qwen3's drops its <think> block)")
        return full[len(prefix):]

    def parse(self, ids: list[int], prefix: list[int] | None = None) -> Parsed:
        """An assistant turn's content and calls (ids: the turn's tokens, its stop token last where it has one;
        prefix: every token before it, for the tokenizer's own parsing)."""
        if isinstance(self.format, TokenizerParsing):
            return self.format.parse_ids(ids, prefix)
        body = ids[:-1] if ids and ids[-1] in self.stops else ids
        parsed = self.format.parse(self.tokenizer.decode(body, skip_special_tokens=False))
        if not parsed.calls:  # TRL's content: the text parsed (stripped), or, where a call did not parse, decoded as is
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            parsed.content = text if parsed.broken else text.strip()
        return parsed

    def detect(self, turn: list[int], prefix: list[int], call: dict):
        """The format that reads `call` back from the template's rendering of it (turn: its tokens): the
        tokenizer's own response parsing where it has one, else one of tools.FORMATS; None: none does."""
        candidates = [TokenizerParsing(self.tokenizer, self.schemas)] if has_response_parsing(self.tokenizer) else []
        candidates += list(FORMATS.values())
        for fmt in candidates:
            self.format = fmt
            try:
                if self.parse(turn, prefix).calls == [call]:
                    return fmt
            except Exception:  # noqa: BLE001 - a parser that cannot read this template's text is not the one
                continue
        self.format = None
        return None

    def check(self) -> str | None:
        """Why this template cannot serve a multi-turn rollout (None: it can), found by rendering a conversation
        with a call to the first tool, its answer and a final answer (module docstring); sets the format."""
        tok, schemas = self.tokenizer, self.schemas
        call = {"type": "function", "function": {"name": schemas[0]["function"]["name"],
                                                 "arguments": probe_arguments(schemas[0])}}
        user = [{"role": "user", "content": USER}]
        tool = {"role": "tool", "name": call["function"]["name"], "content": ANSWER}
        try:
            prompt = render(tok, user, True, schemas)
            first = render(tok, user + [assistant_call(call)], False, schemas)
            full = token_ids(tok, render(tok, user + [assistant_call(call), tool], True, schemas))
            final = token_ids(tok, render(tok, user + [assistant_call(call), tool,
                                                       {"role": "assistant", "content": FINAL}], False, schemas))
        except D.DataError as e:
            return f"cannot render a conversation with a tool call and a tool message ({str(e).split('(', 1)[-1]}"
        if not first.startswith(prompt) or call["function"]["name"] not in first[len(prompt):]:
            return "renders no tool call in an assistant turn after its generation prompt"
        turn = token_ids(tok, first[len(prompt):])
        ends = [i for i, t in enumerate(turn) if t in self.stops]
        if not ends:
            return (f"ends an assistant turn that calls a tool ({first[len(prompt):]!r:.80}) with none of the stop "
                    f"tokens {sorted(self.stops)}: generation would not stop for the tool to answer")
        turn = turn[:ends[0] + 1]
        prompt_ids = token_ids(tok, prompt)
        if self.detect(turn, prompt_ids, call) is None:
            return (f"writes a tool call as {tok.decode(turn, skip_special_tokens=False)!r:.100}, which no tool-call "
                    f"format here reads ({', '.join(FORMATS)}) and the tokenizer has no response_template to parse")
        try:
            suffix = self.suffix([tool])
        except ValueError as e:
            return str(e)
        if ANSWER not in tok.decode(suffix, skip_special_tokens=False):
            return "renders no tool message (the tool's answer would be dropped)"
        sequence = prompt_ids + turn + suffix
        if sequence != full:
            at = next((i for i, (a, b) in enumerate(zip(sequence, full)) if a != b), min(len(sequence), len(full)))
            return ("re-renders the conversation once a tool answered: what the model generated and was fed is not a "
                    f"prefix of it (from token {at}: the rollout holds {tok.decode(sequence[at:at + 12])!r}, the "
                    f"template {tok.decode(full[at:at + 12])!r})")
        if final[:len(full)] != full or not any(t in self.stops for t in final[len(full):]):
            return ("renders the answer after a tool's otherwise than as a turn the model generates and ends with a "
                    "stop token")
        return None


# Training templates: a family's own chat template that fails the check, and the edit of it that passes (TRL's
# get_training_chat_template swaps in copies of its own): Qwen3's renders an assistant turn's <think> block only
# after the last user message and drops it from earlier turns, so a turn before a tool's answer is rendered
# otherwise once the answer follows; its training form keeps every turn's block.
QWEN3_TURN = """        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
"""
TRAINING_TEMPLATES = (("Qwen3", QWEN3_TURN, """        {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
"""),)


def training_template(template: str) -> tuple[str, str] | None:
    """(the family, its training form) of a chat template TRAINING_TEMPLATES knows, else None."""
    for family, original, replacement in TRAINING_TEMPLATES:
        if isinstance(template, str) and original in template:
            return family, template.replace(original, replacement)
    return None


def template_for(tokenizer, schemas: list[dict], stops, model: str) -> Template:
    """The run's Template, its check passed; a family's own template that fails it is replaced by its training
    form where TRAINING_TEMPLATES has one (the tokenizer's chat_template is set to it, said in one line, and
    saved with the model); else one line naming the model and what breaks."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(f"tools with model={model}: its tokenizer has no chat template to render tool calls with; set "
                          "chat_template=... to one that renders tools, tool_calls and tool messages")
    template = Template(tokenizer, schemas, stops)
    problem = template.check()
    known = training_template(tokenizer.chat_template) if problem else None
    if known is not None:
        original, tokenizer.chat_template = tokenizer.chat_template, known[1]
        template = Template(tokenizer, schemas, stops)
        if template.check() is None:
            from finetune.training.metrics import log

            log.warning(f"tools with model={model}: its chat template (the {known[0]} family's) {problem}; the run "
                        f"renders conversations with its training form instead, which keeps every turn as the model "
                        "wrote it (docs/agents.md, training templates), and saves it with the model")
            return template
        tokenizer.chat_template = original
    if problem:
        raise RecipeError(f"tools with model={model}: its chat template {problem}; set chat_template=... to a template "
                          "that renders each turn as the model writes it (docs/agents.md, the prefix check)")
    return template


# ---------------------------------------------------------------- the conversations of one generation


@dataclass
class Conversation:
    """One completion's conversation as it is generated: its tools and environment, the messages so far
    (what the reward functions get), a record of every turn (rollouts.jsonl), the counts."""
    tools: dict
    environment: object
    prompt: list[int]
    start: int = 0  # where the assistant's current turn starts in the completion's tokens
    closed: bool = False  # the last turn was read
    messages: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    rounds: int = 0
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    unparsed: int = 0

    def read(self, template: Template, tokens: list[int]) -> Parsed:
        """The turn from self.start to the end of `tokens`, parsed, recorded and kept as a message."""
        turn = tokens[self.start:]
        parsed = template.parse(turn, self.prompt + tokens[:self.start])
        self.unparsed += parsed.broken
        self.messages.append(parsed.message())
        self.turns.append({"role": "assistant", "text": template.tokenizer.decode(turn, skip_special_tokens=False),
                           "content": parsed.content, "tool_calls": parsed.calls, "unparsed": parsed.broken})
        return parsed

    def record(self, mask: list[int] | None) -> dict:
        return {"turns": self.turns, "tool_mask": mask, "calls": self.calls, "failures": self.failures,
                "timeouts": self.timeouts, "unparsed": self.unparsed,
                "assistant_turns": sum(t["role"] == "assistant" for t in self.turns)}


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a conversation's turn `turn` (0: the completion's own seed) for a generator that
    samples each turn as a request of its own (the vLLM engine): a stable 63-bit hash, so that the completion's
    seed fixes every turn."""
    import hashlib

    if turn == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"turn:{seed}:{turn}".encode(), digest_size=8).digest(), "little") >> 1


def converse(generate_turns, prompts: list[list[int]], budgets: list[int], turns: "Conversations", seeds) -> list:
    """Multi-turn completions from a generator of single turns (the vLLM engine: each turn a request of its own,
    the conversation so far its prompt, its prefix cache reusing what is cached): generate_turns(prompts,
    budgets, seeds) -> completions with .tokens, .stopped and .logprobs; between turns `turns` as the decode
    loop asks it; budgets: each completion's most tokens (max_completion_len, within the context). Each
    completion's tokens, whether it ended on a stop token, its mask (0: fed) and its
    log-probs (0.0 for a fed token, which no term reads)."""
    n = len(prompts)
    tokens, masks, logps, stopped = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [False] * n
    going, turn = list(range(n)), 0
    while going:
        outs = generate_turns([prompts[i] + tokens[i] for i in going], [budgets[i] - len(tokens[i]) for i in going],
                              None if seeds is None else [turn_seed(seeds[i], turn) for i in going])
        more = []
        for i, out in zip(going, outs):
            tokens[i] += out.tokens
            masks[i] += [1] * len(out.tokens)
            logps[i] += list(getattr(out, "logprobs", []) or [0.0] * len(out.tokens))
            fed = turns.turn_ended(i, list(tokens[i]), budgets[i] - len(tokens[i])) if out.stopped else None
            if fed:
                tokens[i] += fed
                masks[i] += [0] * len(fed)
                logps[i] += [0.0] * len(fed)
                if len(tokens[i]) < budgets[i]:
                    more.append(i)
            else:
                stopped[i] = out.stopped
        going, turn = more, turn + 1
    return [(t, s, m, lp) for t, s, m, lp in zip(tokens, stopped, masks, logps)]


class Conversations(Turns):
    """The conversations of one generation call (generation.Turns): between turns, run the calls and answer
    the tokens to feed."""

    def __init__(self, template: Template, toolbox, rows: list[dict], seeds: list[int], prompts: list[list[int]],
                 max_rounds: int, timeout: float, between=None, context: int | None = None):
        """between: called once a round of calls was answered, before the answer is fed (the crash tests' fault
        point between turns). context: the generator's positions; answers that would reach them are dropped
        (TRL's check: prompt, completion and answers at least the model's length)."""
        self.template, self.max_rounds, self.timeout, self.between = template, max_rounds, timeout, between
        self.context = context
        self.items = []
        for row, seed, prompt in zip(rows, seeds, prompts):
            try:
                tools, env = toolbox.for_completion(row, seed)
            except RecipeError:
                raise
            except Exception as e:  # noqa: BLE001 - the user's environment: its failure is one line
                raise RecipeError(f"environment_factory: making or resetting an environment raised {type(e).__name__}: "
                                  f"{e} (row {str(row.get('prompt'))!r:.80}); fix the environment") from None
            self.items.append(Conversation(tools, env, list(prompt)))

    def turn_ended(self, row: int, tokens: list[int], room: int) -> list[int] | None:
        conv = self.items[row]
        parsed = conv.read(self.template, tokens)
        if not parsed.calls or (self.max_rounds and conv.rounds >= self.max_rounds):
            conv.closed = True
            return None
        conv.rounds += 1
        answers = [call_tool(conv.tools, call, self.timeout) for call in parsed.calls]
        conv.calls += len(answers)
        conv.failures += sum(a.error is not None for a in answers)
        conv.timeouts += sum(a.error == "timeout" for a in answers)
        messages = [{"role": "tool", "name": a.name, "content": a.content} for a in answers]
        suffix = self.template.suffix(messages)
        fits = len(suffix) <= room and (self.context is None or len(conv.prompt) + len(tokens) + len(suffix) < self.context)
        conv.turns += [m | {"error": a.error} | ({} if fits else {"dropped": "past max_completion_len"})
                       for m, a in zip(messages, answers)]
        if not fits:  # TRL drops the answers that would not fit, and the conversation ends with the call
            conv.closed = True
            return None
        conv.messages += messages
        conv.start = len(tokens) + len(suffix)
        if self.between is not None:
            self.between()
        return suffix

    def finish(self, completions: list) -> list[dict]:
        """Each conversation's last turn read where the budget cut it (TRL parses a cut turn too), then every
        completion's record (rollouts.jsonl, metrics), its tool mask in it."""
        for conv, completion in zip(self.items, completions):
            if not conv.closed and len(completion.tokens) > conv.start:
                conv.read(self.template, completion.tokens)
        return [conv.record(c.mask) for conv, c in zip(self.items, completions)]

    @property
    def messages(self) -> list[list[dict]]:
        return [conv.messages for conv in self.items]

    @property
    def environments(self) -> list:
        return [conv.environment for conv in self.items]
