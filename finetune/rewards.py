"""Reward functions for GRPO (finetune/training/objectives/grpo.py), as TRL's GRPOTrainer calls them: each is
called once per step with keyword arguments

    prompts       the step's prompts, one per completion (a prompt's value as the data has it: text, or
                  a list of messages)
    completions   the completions' text
    completion_ids  their token ids
    <column>      every other column of the rows (answer, ...), one value per completion

and returns one number per completion, or None where it does not score that completion. A recipe names
them in reward_funcs: callables in the recipe file, or "module:function" strings (on the command line);
reward_weights weighs them (1 each by default); a completion's reward is the weighted sum of the rewards
it got (NaN-sum: a None counts as nothing), and a completion no function scored gets no learning signal.

Built in: exact_match (the completion equals the `answer` column; exact_match_on(column) for another),
think_format (the completion is <think>...</think> then an answer; regex_reward(pattern) for another
format), math_answer (the math-verify package, optional: pip install math-verify), and RewardModel (a
sequence-classification model directory scoring prompt + completion)."""

from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass

import torch


class RewardSpecError(ValueError):
    """A reward function that cannot be found or used as named in the recipe."""


class RewardError(RuntimeError):
    """A reward function failed during the run: which step, which function, which prompt, what."""

    def __init__(self, step: int, function: str, prompt, message: str):
        self.step, self.function, self.prompt = step, function, prompt
        super().__init__(f"step {step}: reward function {function} {message} (prompt: {str(prompt)!r:.120})")


# ---------------------------------------------------------------- naming and resolving


def spec_name(func) -> str:
    """A reward function's name as recipes, logs and metrics show it: "module:function" for a function,
    its own `name` for an object that has one (RewardModel), else its class's."""
    if isinstance(func, str):
        return func
    name = getattr(func, "name", None)
    if isinstance(name, str):
        return name
    qualname = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{getattr(func, '__module__', type(func).__module__)}:{qualname}"


def short_name(func) -> str:
    """The name in metrics (rewards/NAME/mean): the function's own name, as TRL's __name__."""
    return spec_name(func).rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def resolve(spec):
    """A callable from a callable or a "module:function" string."""
    if callable(spec):
        return not_a_class(spec, f"{spec.__module__}:{spec.__qualname__}" if isinstance(spec, type) else "")
    return not_a_class(resolve_name(spec, "reward_funcs", "finetune.rewards:exact_match"), spec)


def resolve_name(spec, key: str, example: str):
    """The callable a "module:name" string names (a dotted name reaches inside the module), or one line
    naming the recipe key `key` and what is wrong (the reward functions', the tools', the environment's)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardSpecError(f"{key}={spec!r}: name it as module:function (for example {example}), or give a callable in "
                              "the recipe file")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure to import is the same mistake for the user
        raise RewardSpecError(f"{key}={spec}: module {module_name} cannot be imported ({type(e).__name__}: "
                              f"{e}); check the name and that it is on PYTHONPATH") from None
    func = module
    for part in attr.split("."):
        func = getattr(func, part, None)
        if func is None:
            raise RewardSpecError(f"{key}={spec}: module {module_name} has no {attr}; check the name")
    if not callable(func):
        raise RewardSpecError(f"{key}={spec}: {attr} is a {type(func).__name__}, not a function")
    return func


def not_a_class(func, spec: str):
    """func, unless it is a class: called with a step's completions it would make an object, not rewards."""
    if not isinstance(func, type):
        return func
    if issubclass(func, RewardModel):
        raise RewardSpecError(f"reward_funcs={spec} is the class, not a reward function: give one with its model "
                              "directory, RewardModel(\"path/to/reward_run/final\"), in the recipe file's reward_funcs "
                              "(or as a module:name bound to one)")
    raise RewardSpecError(f"reward_funcs={spec} is a class, not a reward function: give an instance of it (one "
                          "whose call returns the rewards), or a function")


def has_get_reward(cls) -> bool:
    """Whether an environment class gives a reward of its own (get_reward, TRL's environment_factory)."""
    return callable(getattr(cls, "get_reward", None))


def resolve_all(specs) -> list:
    funcs = [resolve(s) for s in specs]
    names = [short_name(f) for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RewardSpecError(f"reward_funcs: two functions are named {twice[0]} (metrics are kept per name); give "
                              "each its own name")
    return funcs


def weights(values, count: int) -> torch.Tensor:
    """The reward weights: one number per function (strings from the command line parsed), 1 each when
    none are given."""
    if not values:
        return torch.ones(count)
    if len(values) != count:
        raise RewardSpecError(f"reward_weights={','.join(map(str, values))}: {len(values)} weights for {count} reward "
                              "functions; give one weight per function, in order")
    out = []
    for v in values:
        try:
            number = float(v) if isinstance(v, str) or (isinstance(v, numbers.Real) and not isinstance(v, bool)) else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise RewardSpecError(f"reward_weights={','.join(map(str, values))}: {v!r} is not a finite number")
        out.append(number)
    return torch.tensor(out)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[completions, functions] rewards (NaN: not scored) to one reward each: the weighted nansum (TRL's),
    NaN where no function scored the completion."""
    rewards = (per_func * weights.to(per_func).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))


# ---------------------------------------------------------------- scoring a step


class Rewards:
    """The recipe's reward functions with their names and weights."""

    def __init__(self, specs, weight_values=(), extra=()):
        """extra: reward functions besides the recipe's (an environment's get_reward), weighed 1 unless
        weight_values gives them a weight too (one more than specs)."""
        self.funcs = resolve_all(specs) + list(extra)
        self.names = [short_name(f) for f in self.funcs]
        if weight_values and len(weight_values) == len(specs):
            self.weights = torch.cat([weights(weight_values, len(specs)), torch.ones(len(extra))])
        else:
            self.weights = weights(weight_values, len(self.funcs))

    @classmethod
    def from_recipe(cls, recipe, extra=()) -> Rewards:
        return cls(recipe.reward_funcs, recipe.reward_weights, extra)

    def score(self, step: int, prompts: list, completions: list[str], completion_ids: list[list[int]],
              columns: dict[str, list]) -> torch.Tensor:
        """[completions, functions] float32 rewards, NaN where a function returned None. A function that
        raises, returns another number of rewards, or a value that is not a number stops the run with a
        RewardError naming the step, the function and the prompt."""
        out = torch.full((len(completions), len(self.funcs)), float("nan"), dtype=torch.float32)
        for j, (func, name) in enumerate(zip(self.funcs, self.names)):
            try:
                values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported as theirs
                raise RewardError(step, name, prompts[0] if prompts else None,
                                  f"raised {type(e).__name__}: {e}") from e
            try:
                values = list(values)
            except TypeError:
                raise RewardError(step, name, prompts[0] if prompts else None,
                                  f"returned {type(values).__name__}, not a list of rewards") from None
            if len(values) != len(completions):
                raise RewardError(step, name, prompts[0] if prompts else None,
                                  f"returned {len(values)} rewards for {len(completions)} completions (one per "
                                  "completion, None where it does not score one)")
            for i, v in enumerate(values):
                if v is None:
                    continue
                number = as_number(v)
                if number is None:
                    raise RewardError(step, name, prompts[i], f"returned {v!r:.40} ({type(v).__name__}) for "
                                      f"completion {i}; a reward is a finite number, or None")
                if abs(number) > FLOAT32_MAX:
                    raise RewardError(step, name, prompts[i], f"returned {number:g} for completion {i}, beyond the "
                                      f"float32 range rewards are kept in (±{FLOAT32_MAX:.3g}); scale the rewards down")
                out[i, j] = number
        return out


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def missing_column_problem(rewards: Rewards, row: dict, columns: list[str], toolbox=None) -> str | None:
    """Whether a reward function needs a column the prompt rows lack, found before any model loads: each
    function (a RewardModel reads no column, and is not loaded for this) is called once on `row` (a
    prompt row's prompt and its columns) with an empty completion (with tools: an empty assistant
    message, and with an environment_factory the row's environment). A KeyError or TypeError there (a
    column looked up, a keyword argument missing) is the one line; any other failure is left to the
    run, since an empty completion may be what a function cannot take."""
    kwargs = {c: [row[c]] for c in columns}
    completion = "" if toolbox is None else [{"role": "assistant", "content": ""}]
    if toolbox is not None and toolbox.factory is not None:
        try:
            kwargs["environments"] = [toolbox.for_completion({c: row[c] for c in ["prompt", *columns]}, 0)[1]]
        except Exception as e:  # noqa: BLE001 - the user's environment
            return (f"environment_factory: making and resetting an environment on the first training row raised "
                    f"{type(e).__name__}: {e}; reset(**row) gets the columns {', '.join(['prompt', *columns])} (and "
                    "seed where it takes one): fix the environment or the data")
    for func, name in zip(rewards.funcs, rewards.names):
        if isinstance(func, RewardModel):
            continue
        try:
            func(prompts=[row["prompt"]], completions=[completion], completion_ids=[[]], **kwargs)
        except (KeyError, TypeError) as e:
            return (f"reward function {name}, called on the first training row with an empty completion before the "
                    f"model loads, raised {type(e).__name__}: {e}; the prompt rows have the columns "
                    f"{', '.join(['prompt', *columns])}: map the one it reads with columns={{...}} (or add it to the "
                    "data), or fix the function")
        except Exception:  # noqa: BLE001 - the user's code; anything else is for the run to report
            continue
    return None


def as_number(value) -> float | None:
    """A reward as a float, or None when it is not a finite number. A bool counts as 0 / 1, whether
    Python's, torch's or numpy's; a one-element tensor or numpy array as its element."""
    if (torch.is_tensor(value) or type(value).__module__ == "numpy") and getattr(value, "size", None) is not None:
        if (value.numel() if torch.is_tensor(value) else value.size) == 1:
            value = value.item()
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


# ---------------------------------------------------------------- built in


def completion_text(completion) -> str:
    """A completion's text: a string, or a conversational completion's answer: the content of its last
    assistant message (with tools, what the model wrote after the tools answered)."""
    if isinstance(completion, str):
        return completion
    answers = [m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant"]
    return answers[-1] if answers else ""


def exact_match_on(column: str):
    """1.0 where the completion, stripped, equals the row's `column` value (as text, stripped), else 0.0."""

    def exact_match(completions, **kwargs):
        if column not in kwargs:
            raise KeyError(f"exact_match needs a column {column!r} in the prompt data; the rows have "
                           f"{', '.join(sorted(k for k in kwargs if k not in ('prompts', 'completion_ids'))) or 'none'}")
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, kwargs[column])]

    exact_match.__qualname__ = f"exact_match_on({column!r})" if column != "answer" else "exact_match"
    exact_match.__module__ = __name__
    return exact_match


exact_match = exact_match_on("answer")


def char_match(completions, answer, **kwargs):
    """The share of positions where the completion (stripped) has the answer's character, over the longer
    of the two: 1.0 for the exact answer, partial credit on the way there (a dense signal a small model
    can climb before it gets whole answers right)."""
    out = []
    for c, a in zip(completions, answer):
        text, a = completion_text(c).strip(), str(a).strip()
        longest = max(len(text), len(a), 1)
        out.append(sum(x == y for x, y in zip(text, a)) / longest)
    return out


def answer_chars(completions, answer, **kwargs):
    """The share of the completion's characters (stripped) that occur in the answer, 0.0 for an empty
    one: the densest of the answer rewards, which an untrained model moves first (right letters, then
    in the right places: char_match, then the whole answer: exact_match)."""
    out = []
    for c, a in zip(completions, answer):
        text = completion_text(c).strip()
        out.append(sum(ch in str(a) for ch in text) / len(text) if text else 0.0)
    return out


def regex_reward(pattern: str, *, name: str = "regex_format", reward: float = 1.0):
    """`reward` where the whole completion matches the regular expression (re.DOTALL: . spans lines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def regex_format(completions, **kwargs):
        return [reward if compiled.fullmatch(completion_text(c)) else 0.0 for c in completions]

    regex_format.__qualname__ = name
    regex_format.__module__ = __name__
    return regex_format


# TRL's think_format_reward: a <think> block (no nested tag), then the answer
think_format = regex_reward(r"^<think>(?!.*<think>)(.*?)</think>.*$", name="think_format")


def math_answer(completions, answer, **kwargs):
    """1.0 where math-verify finds the completion's final answer equal to the row's `answer`, 0.0 where
    not, None where the reference answer cannot be parsed (TRL's accuracy_reward)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("math_answer needs the math-verify package: pip install math-verify") from None
    out = []
    for completion, solution in zip(completions, answer):
        gold = parse(str(solution))
        if len(gold) == 0:
            out.append(None)
            continue
        out.append(float(verify(gold, parse(completion_text(completion)))))
    return out


def side_ids(tokenizer, prompt, completion) -> list[int]:
    """prompt + completion tokenized as a preference pair's side is for training (finetune/data/preference.py
    encode_sides; not imported from there: finetune.data imports the recipe, which imports this module;
    tests/test_reward_objective.py holds the two equal). A text prompt: the tokenizer's own BOS (what it
    adds by itself, if anything), prompt + completion as one text (a completion ending in the EOS string
    loses it), the EOS id. A conversational prompt: prompt + the completion as the assistant's message,
    rendered by the chat template and tokenized without added special tokens."""
    text = completion_text(completion)
    if not isinstance(prompt, str):  # a conversation with tools: every message of it (TRL's)
        messages = list(prompt) + (list(completion) if isinstance(completion, list) else
                                   [{"role": "assistant", "content": text}])
        return list(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids)
    eos = tokenizer.eos_token
    if eos and text.endswith(eos):
        text = text[:-len(eos)]
    plain, full = tokenizer("a", add_special_tokens=False).input_ids, tokenizer("a").input_ids
    bos = next((full[:k] for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain),
               full[:1] if full and full[0] == tokenizer.bos_token_id else [])
    ids = list(bos) + list(tokenizer(prompt + text, add_special_tokens=False).input_ids)
    return ids + ([] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id])


def checkpoint_keys(folder, where: str) -> set[str] | None:
    """The tensor names a model directory's safetensors weights hold, read from their headers (whole files
    checked: safetensors refuses a file shorter than its header says); None where its weights are in
    another format. RewardSpecError where there are none, or a file is cut short or unreadable."""
    import json

    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as e:
            raise RewardSpecError(f"{where}: {index.name} is unreadable ({type(e).__name__}); copy the directory "
                                  "again") from None
        missing = sorted(wanted - {f.name for f in files})
        if missing:
            raise RewardSpecError(f"{where}: {missing[0]} is missing (named in {index.name}); copy the directory again")
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            return None
        raise RewardSpecError(f"{where}: holds no model weights (*.safetensors); give the final/ of an "
                              "objective=reward run")
    keys = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as weights:
                keys.update(weights.keys())
        except Exception as e:  # noqa: BLE001 - cut short, garbled: the same for the user
            raise RewardSpecError(f"{where}: {f.name} is not a whole safetensors file ({type(e).__name__}: "
                                  f"{str(e)[:160]}); copy the directory again") from None
    return keys


@dataclass
class RewardModel:
    """A sequence-classification model directory (AutoModelForSequenceClassification with one label, its
    tokenizer beside it: final/ of an objective=reward run, or any such model) as a reward function: the
    score of prompt + completion. Each is tokenized as that run tokenized a pair's side
    (side_ids): a text prompt and completion as one text between the
    tokenizer's BOS and EOS; a conversational prompt (a list of messages) with the completion as the
    assistant's answer, rendered by the tokenizer's chat template. Rows are right-padded with the
    model's pad id and scored at their last token that is not it (transformers' rule, and the run's).
    Loaded on first use, on the CPU unless `device` says otherwise, whole on every process whatever the
    run's strategy (outside ZeRO-3's partitioning: each process scores its own completions); scores
    batch_size texts at a time; max_length > 0 cuts each sequence to that many tokens (as the run cut a
    side at max_seq_len). `check` reads the directory's config, tokenizer and weight files' headers
    without loading the weights: GRPO calls it before the policy loads."""
    path: str
    device: str = "cpu"
    batch_size: int = 8
    name: str = ""
    max_length: int = 0

    def __post_init__(self):
        self.name = self.name or f"reward_model({self.path})"
        self._model = self._tokenizer = None

    def check(self) -> None:
        """RewardSpecError (one line) unless `path` is a sequence-classification model directory whose
        weight files are whole and hold its score head: not there, no config or tokenizer, a weight file
        cut short, or a causal LM's directory (no score head: transformers would give it a random one and
        the run would train on random rewards)."""
        from pathlib import Path

        where = f"reward model {self.path}"
        folder = Path(self.path).expanduser()
        if not folder.is_dir():
            raise RewardSpecError(f"{where}: no such directory; give the final/ of an objective=reward run (or any "
                                  "sequence-classification model directory)")
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - any unreadable config is the same mistake for the user
            raise RewardSpecError(f"{where}: no readable config.json ({type(e).__name__}: {str(e)[:200]})") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001
            raise RewardSpecError(f"{where}: no tokenizer beside the model ({type(e).__name__}: {str(e)[:200]}); "
                                  "save the tokenizer the reward model was trained with into the directory") from None
        keys = checkpoint_keys(folder, where)
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            raise RewardSpecError(f"{where}: model type {config.model_type} has no sequence-classification class in "
                                  "transformers (AutoModelForSequenceClassification); give the final/ of an "
                                  "objective=reward run")
        from finetune.unwrap import without_zero3_init

        # a skeleton on the meta device, to read its head's names; outside ZeRO-3's zero.Init, which
        # would partition it (and cannot copy out of a meta tensor)
        with without_zero3_init(), torch.device("meta"):
            try:
                skeleton = AutoModelForSequenceClassification.from_config(config)
            except Exception as e:  # noqa: BLE001 - the config's values do not build a model
                raise RewardSpecError(f"{where}: its config.json does not build a sequence-classification model "
                                      f"({type(e).__name__}: {str(e)[:200]})") from None
        prefix = skeleton.base_model_prefix
        head = [k for k in skeleton.state_dict() if not k.startswith(f"{prefix}.")]
        if keys is not None and head and not any(k == key or key.endswith(f".{k}") for k in head for key in keys):
            kind = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
            raise RewardSpecError(f"{where}: its weights have no score head ({', '.join(head)}: a {kind} directory, "
                                  "not a reward model); give the final/ of an objective=reward run")

    def load(self):
        if self._model is None:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            from finetune.unwrap import without_zero3_init

            self._tokenizer = self._tokenizer or AutoTokenizer.from_pretrained(self.path)
            # outside ZeRO-3's zero.Init: partitioned, its weights would be empty on this process
            with without_zero3_init():
                model = AutoModelForSequenceClassification.from_pretrained(self.path)
            self._model = model.to(self.device).eval()
            # the model scores each row at its last token that is not its pad id: both must pad with the same id
            if self._tokenizer.pad_token_id is None and self._model.config.pad_token_id is not None:
                self._tokenizer.pad_token_id = self._model.config.pad_token_id
            elif self._tokenizer.pad_token_id is None:
                self._tokenizer.pad_token = self._tokenizer.eos_token
            self._model.config.pad_token_id = self._tokenizer.pad_token_id
        return self._model, self._tokenizer

    def encode(self, prompts, completions) -> list[list[int]]:
        """Each prompt + completion's token ids, as an objective=reward run's pair side (side_ids)."""
        _, tokenizer = self.load()
        ids = [side_ids(tokenizer, p, c) for p, c in zip(prompts, completions)]
        return [x[:self.max_length] for x in ids] if self.max_length else ids

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        model, tokenizer = self.load()
        ids = self.encode(prompts, completions)
        pad = tokenizer.pad_token_id
        scores = []
        with torch.inference_mode():
            for start in range(0, len(ids), self.batch_size):
                rows = ids[start:start + self.batch_size]
                width = max(len(r) for r in rows)
                input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
                mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
                scores += model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores
