"""The embedded default: a tiny Llama-style model, a character-level tokenizer and a small task
dataset, all made locally so that the project runs and is tested with no model or dataset hub.

The model is written as `save_pretrained` writes it (config.json, model.safetensors) and read back by the
same `from_pretrained` call a hub id takes, so the tiny run exercises the real loading path. Assets are written once into
FINETUNE_CACHE (default ~/.cache/finetune) through a temporary directory and a rename, so that
concurrent ranks never see half-written files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
from pathlib import Path

from finetune.files import publish

ASSET_VERSION = "v2"  # v2: the tokenizer adds <s> by itself, as a Llama tokenizer does
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# tiny-llama-tools: the tokenizer's tool-call tokens and a chat template that renders tools, calls and their
# answers, after Mistral's (v11 on): the tools listed before the conversation, a call written
# [TOOL_CALLS]name[ARGS]{arguments} (finetune/tools.py MistralCalls reads it), an answer as a `tool` turn. The
# listing is short, each tool's name(arguments): description, where Mistral's is the schemas' JSON: a
# character tokenizer would make the JSON of one tool 200 tokens of every prompt.
# Appended after the tiny tokenizer's tokens, so that every other id is the tiny-llama's.
TOOL_SPECIALS = ["[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "<|tool|>"]
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(',') }}): {{ t['function']['description'] }}\n"
    "{% endfor %}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "[TOOL_CALLS]{{ c['function']['name'] }}[ARGS]{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BUILTIN_MODELS = {"tiny-llama": "tiny-llama", "tiny-llama-h64": "tiny-llama-h64", "tiny-llama-tools": "tiny-llama-tools-1",
                  "tiny-llama-caller": "tiny-llama-caller-1"}
BUILTIN_DATASETS = {"tiny-tasks": "tiny-tasks.jsonl", "tiny-preferences": "tiny-preferences-3.jsonl",
                    "tiny-prompts": "tiny-prompts-1.jsonl", "tiny-kto": "tiny-kto-1.jsonl",
                    "tiny-products": "tiny-products-1.jsonl"}
BUILTIN_FORMATS = {"tiny-tasks": "alpaca", "tiny-preferences": "preference", "tiny-prompts": "prompt",
                   "tiny-kto": "unpaired", "tiny-products": "prompt"}  # what prevalidation knows of them


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")).expanduser()


def _publish(build, target: Path, complete=None) -> Path:
    """Build into a temporary sibling and publish it; the first writer wins. complete(target): whether an
    existing target is whole (a model directory without its config.json, left by an older finetune whose
    rank 1 published its builtin model first, is built again and replaces it)."""
    stale = target.exists()
    if stale and (complete is None or complete(target)):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        publish(build(tmp), target, first_wins=not stale)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _rows_file(name: str, seed: int, row, n: int) -> Path:
    """The builtin dataset `name` (BUILTIN_DATASETS): n rows drawn by row(rng) from random.Random(seed), one
    JSON object a line, built once in the cache."""

    def build(tmp: Path) -> Path:
        rng = random.Random(seed)
        out = tmp / BUILTIN_DATASETS[name]
        with out.open("w") as f:
            for _ in range(n):
                f.write(json.dumps(row(rng)) + "\n")
        return out

    return _publish(build, cache_root() / ASSET_VERSION / BUILTIN_DATASETS[name])


def build_tokenizer(tools: bool = False):
    """The tiny character-level tokenizer; tools: with the tool-call tokens and template (tiny-llama-tools)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [c for c in chars if c not in SPECIALS])}
    if tools:
        vocab |= {tok: len(vocab) + i for i, tok in enumerate(TOOL_SPECIALS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                        special_tokens=[("<s>", vocab["<s>"])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:] + (TOOL_SPECIALS if tools else []), model_max_length=4096,
    )
    tok.chat_template = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return tok


def write_model(model, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors as save_pretrained writes them, on whichever
    rank asks: save_pretrained writes nothing on a rank other than 0 of an initialized process group, and a
    builtin model is built by whichever rank of a launch asks first (a distillation run's teacher), so that
    rank 1's directory, tokenizer files alone, could be the one published."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(out / "config.json")
    model.generation_config.to_json_file(out / "generation_config.json")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def tiny_model_dir(name: str = "tiny-llama") -> Path:
    """The builtin model `name` (BUILTIN_MODELS), built once in the cache. tiny-llama: 2 layers, hidden 64,
    4 heads of 16; tiny-llama-h64: the same tokenizer and depth, hidden 128 in 2 query heads of 64 (one
    key/value head): a head size vLLM's CPU attention serves (it refuses 16), for generation_backend=vllm;
    tiny-llama-tools: the tiny-llama's weights with the tool-call tokens and template (TOOLS_CHAT_TEMPLATE);
    tiny-llama-caller: the tiny-llama-tools warmed up to call recipes/tiny_grpo_tools.py's calculator now and then
    (warm_up_caller)."""
    wide = name == "tiny-llama-h64"

    def build(tmp: Path) -> Path:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = build_tokenizer(tools=name in ("tiny-llama-tools", "tiny-llama-caller"))
        shape = (dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1) if wide
                 else dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2))
        config = LlamaConfig(
            vocab_size=128, num_hidden_layers=2, max_position_embeddings=1024, **shape,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False, rms_norm_eps=1e-5,
        )
        assert len(tok) <= config.vocab_size
        from finetune.unwrap import without_zero3_init

        # built whole wherever it is first asked for: inside a ZeRO-3 run transformers would build it under
        # zero.Init, partitioned, and save a model without its weights (a distillation run's builtin teacher)
        with torch.random.fork_rng(), without_zero3_init():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            if name == "tiny-llama-caller":
                warm_up_caller(model, tok)
        out = tmp / "model"
        write_model(model, out)
        tok.save_pretrained(out)
        return out

    return _publish(build, cache_root() / ASSET_VERSION / BUILTIN_MODELS[name],
                    complete=lambda d: (d / "config.json").is_file() and (d / "model.safetensors").is_file())


# tiny-llama-caller: the tiny-llama-tools after a short supervised warm-up at build time on conversations with
# recipes/tiny_grpo_tools.py's calculator (its tool listed as the recipe lists it: CALLER_TOOL), as agent RL starts
# from an instruct model that knows its tool-call format and calls now and then: asked a product ("37*59"), a
# quarter of the conversations call the calculator ([TOOL_CALLS]mul[ARGS]{}<|end|>) and copy its answer, the rest
# guess a number. Besides, each step has short copy drills (<|tool|>2183<|end|><|assistant|>2183<|end|>): in whole
# conversations alone a 2-layer model takes some 500 steps to find the copy, in short ones under 100. After its
# CALLER_STEPS the model calls about once in four and, having called, mostly copies the answer; GRPO raises the
# call share (an untrained model never wrote a whole call in 100 GRPO steps).
CALLER_TOOL = {"type": "function", "function": {"name": "mul", "description": "The product of the question's two numbers.",
                                                 "parameters": {"type": "object", "properties": {}},
                                                 "return": {"type": "string"}}}
CALLER_CALLS = 0.25  # the warm-up's share of conversations that call the calculator
# steps, conversations and copy drills a step, Adam's lr
CALLER_STEPS, CALLER_BATCH, CALLER_COPY_BATCH, CALLER_LR = 150, 16, 64, 3e-3


def _caller_conversation(rng: random.Random) -> list[dict]:
    """A product asked, then the calculator's call, its answer and that answer copied (CALLER_CALLS of them), or
    a guessed number."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    user = [{"role": "user", "content": f"{a}*{b}"}]
    guess = str(rng.randint(100, 9801))
    if rng.random() >= CALLER_CALLS:
        return user + [{"role": "assistant", "content": guess}]
    call = {"type": "function", "function": {"name": "mul", "arguments": {}}}
    return user + [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "name": "mul", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


def warm_up_caller(model, tok, steps: int | None = None, seed: int = 0) -> list[float]:
    """Train `model` in place on synthetic conversations (_caller_conversation) rendered by tok's chat template with
    the calculator's tool listed, the loss on the assistant's tokens alone (the tool's answer and the generation
    prompt after it are fed, as in a rollout): `steps` (CALLER_STEPS) steps of Adam on CALLER_BATCH conversations
    and CALLER_COPY_BATCH copy drills (the tool's answer, the assistant's copy of it), seeded, on one thread (the
    same weights whichever rank builds it, whatever its thread count). Returns the losses. About 10 s on a CPU core."""
    import torch

    steps = CALLER_STEPS if steps is None else steps
    rng = random.Random(seed)
    start, end = tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|end|>")

    def rows(texts):
        out = []
        for ids in tok(texts, add_special_tokens=False).input_ids:
            labels, inside = [], False  # the assistant's tokens: after its generation prompt, through its <|end|>
            for t in ids:
                labels.append(t if inside else -100)
                inside = t == start or (inside and t != end)
            out.append((ids, labels))
        return out

    def batch(part):
        width = max(len(ids) for ids, _ in part)
        return (torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in part]),
                torch.tensor([l + [-100] * (width - len(l)) for _, l in part]))

    chats = rows(tok.apply_chat_template([_caller_conversation(rng) for _ in range(steps * CALLER_BATCH)],
                                         tools=[CALLER_TOOL], tokenize=False))
    copies = rows([f"<|tool|>{n}<|end|><|assistant|>{n}<|end|>" for n in
                   (rng.randint(100, 9801) for _ in range(steps * CALLER_COPY_BATCH))])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # nothing draws from torch's generator (no dropout): the data's seed is the warm-up's
        opt = torch.optim.Adam(model.parameters(), lr=CALLER_LR)
        losses = []
        for step in range(steps):
            loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in (
                batch(chats[step * CALLER_BATCH:(step + 1) * CALLER_BATCH]),
                batch(copies[step * CALLER_COPY_BATCH:(step + 1) * CALLER_COPY_BATCH])))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


def _task(rng: random.Random) -> dict:
    kind = rng.randrange(4)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
    if kind == 0:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if kind == 1:
        return {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}
    if kind == 2:
        return {"instruction": "Write the word in capitals.", "input": word, "output": word.upper()}
    n = rng.randint(1, 9)
    return {"instruction": "Repeat the letter.", "input": f"{word[0]} x {n}", "output": word[0] * n}


def tiny_tasks_file(n: int = 4000) -> Path:
    """Four tiny tasks (add, reverse, capitalise, repeat) in alpaca format: learnable by a tiny model."""

    return _rows_file("tiny-tasks", 1234, _task, n)


WORD_LETTERS, OTHER_LETTERS = string.ascii_lowercase[:13], string.ascii_lowercase[13:]


def _wrong(answer: str, rng: random.Random) -> str:
    """A wrong answer as long as the right one, by a mistake a 2-layer model learns to see within a
    minute: its letters in the wrong case, or letters from the half of the alphabet words never use."""
    if rng.random() < 0.5:
        return answer.swapcase()
    wrong = "".join(rng.choice(OTHER_LETTERS) for _ in answer)
    return wrong.upper() if answer.isupper() else wrong


def _preference(rng: random.Random) -> dict:
    """A prompt, its right answer (chosen) and a wrong one of the same length (rejected)."""
    word = "".join(rng.choice(WORD_LETTERS) for _ in range(rng.randint(3, 6)))
    kind = rng.randrange(3)
    if kind == 0:
        prompt, answer = f"Reverse: {word}\nAnswer: ", word[::-1]
    elif kind == 1:
        prompt, answer = f"Capitals: {word}\nAnswer: ", word.upper()
    else:
        prompt, answer = f"Copy: {word}\nAnswer: ", word
    return {"prompt": prompt, "chosen": answer, "rejected": _wrong(answer, rng)}


def tiny_preferences_file(n: int = 4000) -> Path:
    """Three tiny tasks (reverse, capitalise, copy a word of letters a-m) as preference pairs with an
    explicit prompt: the chosen answer is the right one, the rejected one a wrong answer of the same
    length, its letters in the wrong case or from n-z. Which answer is right shows in the prompt (the
    task's name, the word's letters), so DPO's reward accuracy on the tiny model climbs within a minute
    (telling a reversal from a copy, or one wrong letter, takes it far longer)."""

    # the name carries the generator's version (3), so that a file cached by an older generator is not read
    return _rows_file("tiny-preferences", 4321, _preference, n)


def _unpaired(rng: random.Random) -> dict:
    """One side of a tiny preference pair (_preference) as an unpaired row: the chosen answer labelled
    true (desirable) or the rejected one labelled false, each half the time."""
    pair = _preference(rng)
    desirable = rng.random() < 0.5
    return {"prompt": pair["prompt"], "completion": pair["chosen" if desirable else "rejected"], "label": desirable}


def tiny_kto_file(n: int = 4000) -> Path:
    """The tiny preference tasks (tiny_preferences_file) as unpaired rows for objective=kto (recipes/tiny_kto.py):
    each row a prompt and one answer, the right one labelled true or a wrong one labelled false, half and
    half, every row its own prompt (so that KTO's mismatched KL rows pair unrelated prompts and answers)."""

    return _rows_file("tiny-kto", 1234, _unpaired, n)


def _prompt(rng: random.Random) -> dict:
    """A prompt whose answer a program checks: copy a short word of letters a-m, or write it in capitals."""
    word = "".join(rng.choice(WORD_LETTERS) for _ in range(rng.randint(2, 4)))
    if rng.random() < 0.5:
        return {"prompt": f"Copy: {word}\nAnswer: ", "answer": word}
    return {"prompt": f"Capitals: {word}\nAnswer: ", "answer": word.upper()}


def tiny_prompts_file(n: int = 4000) -> Path:
    """Prompt rows for objective=grpo (recipes/tiny_grpo.py): a `prompt` and its `answer` (copy a word
    of 2-4 letters a-m, or write it in capitals), scored by exact match and by the share of the
    answer's characters in place (finetune.rewards:char_match)."""

    return _rows_file("tiny-prompts", 2718, _prompt, n)


def _product(rng: random.Random) -> dict:
    """A product of two numbers of two digits, which a tiny model cannot compute (8,100 of them), and a
    calculator that can (recipes/tiny_grpo_tools.py): the prompt as a conversation, the answer, the numbers."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b), "a": a, "b": b}


def tiny_products_file(n: int = 4000) -> Path:
    """Prompt rows for objective=grpo with tools (recipes/tiny_grpo_tools.py): the product of two numbers of two
    digits, its answer, and the numbers (which the recipe's calculator environment is reset with)."""

    return _rows_file("tiny-products", 3141, _product, n)


def resolve_model(name: str) -> str:
    """builtin:NAME -> a local directory made on first use; anything else unchanged."""
    if name.startswith("builtin:"):
        assert name[len("builtin:"):] in BUILTIN_MODELS, name
        return str(tiny_model_dir(name[len("builtin:"):]))
    return name


def resolve_dataset(name: str) -> str:
    if name.startswith("builtin:"):
        files = {"tiny-tasks": tiny_tasks_file, "tiny-preferences": tiny_preferences_file,
                 "tiny-prompts": tiny_prompts_file, "tiny-kto": tiny_kto_file, "tiny-products": tiny_products_file}
        return str(files[name[len("builtin:"):]]())
    return name
