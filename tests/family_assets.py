"""The model families users bring, made small and offline for tests: real tokenizers where a package
ships one (Mistral's sentencepiece models in the `mistral_common` wheel), small tokenizers of the
family's kind trained here otherwise (byte-level BPE with Llama-3's or Qwen's pre-tokenizer, a
sentencepiece-style BPE for Gemma), chat templates written here after each family's documented
behaviour, and random-weight configs of each architecture, written with `save_pretrained` so that a
run loads them through the normal `model=<dir>` path.
"""

from __future__ import annotations

import json
import random
import shutil
import string
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------- chat templates
# Each reproduces its family's documented behaviour in a few lines; none is copied from a model repo.

# Llama 3: header tokens around the role, <|eot_id|> ends every turn, BOS rendered by the template.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# Mistral (v3 / Nemo style): [INST] ... [/INST], the answer then </s>; the system prompt has no turn
# of its own but is put into the LAST user message, so it moves as the conversation grows.
MISTRAL = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for m in loop_messages %}"
    "{%- if m['role'] == 'user' %}"
    "{%- if system_message is defined and m == user_messages[-1] %}"
    "{{- '[INST] ' + system_message + '\n\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m['content'] | trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# ChatML as Qwen2/2.5 ship it: a default system turn when there is none, no BOS.
CHATML = (
    "{%- for m in messages %}"
    "{%- if loop.first and m['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen3: ChatML, and an answer's <think> reasoning block is kept only after the last user message:
# earlier answers are rendered without it once the conversation goes on.
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Gemma: no system role (its text opens the first user turn), the assistant is "model", BOS rendered.
GEMMA = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for m in loop_messages %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)

# Phi-3: <|role|> headers, <|end|> after each turn, and one EOS closing the whole conversation (not
# each turn): a turn's own rendering ends with an EOS that the full conversation has only at its end.
PHI3 = (
    "{%- for m in messages %}"
    "{{- '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)

TEMPLATES = {"llama3": LLAMA3, "mistral": MISTRAL, "chatml": CHATML, "qwen3": QWEN3, "gemma": GEMMA, "phi3": PHI3}


def with_generation_marks(template: str) -> str:
    """The same template with each assistant turn's produced part in {% generation %} blocks, for
    comparison with transformers' return_assistant_tokens_mask."""
    marked = {
        LLAMA3: LLAMA3.replace(
            "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}",
            "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
            "{%- if m['role'] == 'assistant' %}{%- generation %}{{- m['content'] | trim + '<|eot_id|>' }}"
            "{%- endgeneration %}{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}"),
        CHATML: CHATML.replace(
            "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}",
            "{{- '<|im_start|>' + m['role'] + '\n' }}"
            "{%- if m['role'] == 'assistant' %}{%- generation %}{{- m['content'] + '<|im_end|>\n' }}"
            "{%- endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>\n' }}{%- endif %}"),
        GEMMA: GEMMA.replace(
            "{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + m['content'] | trim"
            " + '<end_of_turn>\n' }}",
            "{{- '<start_of_turn>' + role + '\n' }}"
            "{%- if m['role'] == 'assistant' %}{%- generation %}{{- m['content'] | trim + '<end_of_turn>\n' }}"
            "{%- endgeneration %}{%- else %}{{- (first_user_prefix if loop.first else '') + m['content'] | trim"
            " + '<end_of_turn>\n' }}{%- endif %}"),
    }[template]
    assert marked != template
    return marked


# ---------------------------------------------------------------- tokenizers

REPO = Path(__file__).resolve().parents[1]
MISTRAL_MODELS = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3",
                  "v7": "mistral_instruct_tokenizer_241114.model.v7"}
# Llama 3's pre-tokenizer pattern (digits in groups of up to 3); Qwen2's splits every digit.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def mistral_file(name: str) -> Path:
    """A tokenizer file from the installed mistral_common wheel (a dev dependency)."""
    import importlib.util

    spec = importlib.util.find_spec("mistral_common")
    assert spec is not None and spec.submodule_search_locations, "pip install -e .[dev] (mistral_common)"
    return Path(list(spec.submodule_search_locations)[0]) / "data" / name


def mistral_tokenizer(version: str, out: Path, **config):
    """Mistral's own sentencepiece model, loaded by AutoTokenizer as a LlamaTokenizer (adds <s>)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(mistral_file(MISTRAL_MODELS[version]), out / "tokenizer.model")
    settings = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "legacy": False} | config
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return AutoTokenizer.from_pretrained(out)


def tekken_tokenizer(out: Path):
    """Mistral's tekken (tiktoken-style byte-level BPE, 131k tokens), converted by transformers."""
    from transformers import AutoTokenizer

    if not (out / "tokenizer.json").is_file():
        raw = out.with_name(out.name + "-raw")
        raw.mkdir(parents=True, exist_ok=True)
        shutil.copy(mistral_file("tekken_240911.json"), raw / "tekken.json")
        tok = AutoTokenizer.from_pretrained(raw)
        tok.bos_token, tok.eos_token, tok.unk_token = "<s>", "</s>", "<unk>"
        tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def trained_bpe(corpus: list[str], kind: str, specials: list[str], bos: str | None, eos: str, add_bos: bool,
                vocab_size: int = 512, pad: str | None = None):
    """A small BPE of the family's kind, trained here on the test data: `bytelevel` (Llama 3, Qwen:
    byte-level BPE with their pre-tokenizer regex), `qwen`, `metaspace` (sentencepiece-style BPE, ▁
    for spaces, as Gemma's tokenizer.json) or `llama2` (the same with a ▁ before the first word, as
    Llama 2's and Phi-3's sentencepiece models). With add_bos the tokenizer adds BOS itself through
    its post-processor, as Llama 3's and Gemma's do."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind in ("bytelevel", "qwen"):
        core = Tokenizer(models.BPE())
        pattern = LLAMA3_PATTERN if kind == "bytelevel" else QWEN_PATTERN
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        post = [processors.ByteLevel(trim_offsets=False)]
    else:
        core = Tokenizer(models.BPE(unk_token="<unk>"))
        core.normalizer = normalizers.Replace(" ", "▁")
        prepend = "first" if kind == "llama2" else "never"
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
        core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend)
        alphabet = sorted({c for text in corpus + [string.printable] for c in text.replace(" ", "▁")} - set("\t\r\x0b\x0c"))
        post = []
    unk = None if kind in ("bytelevel", "qwen") else "<unk>"
    all_specials = [t for t in dict.fromkeys([pad, bos, eos, unk, *specials]) if t]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=all_specials, initial_alphabet=alphabet,
                                  show_progress=False)
    core.train_from_iterator(corpus, trainer)
    if add_bos:
        post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                  special_tokens=[(bos, core.token_to_id(bos))]))
    if post:
        core.post_processor = processors.Sequence(post) if len(post) > 1 else post[0]
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=unk,
                                   additional_special_tokens=[t for t in specials if t not in (bos, eos, pad)])


# ---------------------------------------------------------------- data


def _task(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 5)))
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"Add {a} and {b}.", str(a + b)
    if kind == 1:
        return f"Reverse {word}.", word[::-1]
    return f"Capitalise {word}.", word.upper()


# One exchange repeated through the training data (every other conversation), short enough for a
# tiny model to learn within a family run: a test can then generate from its question greedily and
# expect exactly its answer followed by the template's end-of-turn token.
LEARNED = [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok"}]


def conversations(n: int, seed: int, reasoning: bool = False) -> list[list[dict]]:
    """Short chats: a system prompt in some, one or two user/assistant exchanges; with reasoning, each
    answer starts with a <think> block (as Qwen3's data does)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2)):
            question, answer = _task(rng)
            if reasoning:
                answer = f"<think>\nThe task: {question.split()[0].lower()}.\n</think>\n\n{answer}"
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(msgs)
    return out


def write_chats(path: Path, chats: list[list[dict]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


# ---------------------------------------------------------------- families


@dataclass
class Family:
    name: str
    config: str           # transformers config class
    config_kwargs: dict
    template: str
    tokenizer: str        # how the tokenizer is made (see make_tokenizer)
    lora_targets: list[str]
    reasoning: bool = False
    recipe: list[str] = field(default_factory=list)  # recipe overrides a run of this family needs


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]
MLP = ["down_proj", "gate_proj", "up_proj"]

FAMILIES = {
    "llama3": Family("llama3", "LlamaConfig", dict(
        SMALL, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
        LLAMA3, "llama3-base", sorted(ATTENTION + MLP)),
    "mistral": Family("mistral", "MistralConfig", dict(SMALL, hidden_size=32, intermediate_size=64, sliding_window=16,
                                                        tie_word_embeddings=False),
                      MISTRAL, "mistral-v3", sorted(ATTENTION + MLP)),
    "qwen2": Family("qwen2", "Qwen2Config", dict(SMALL, tie_word_embeddings=True), CHATML, "qwen-base",
                    sorted(ATTENTION + MLP)),
    "gemma2": Family("gemma2", "Gemma2Config", dict(
        SMALL, head_dim=16, tie_word_embeddings=True, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=16, sliding_window=16), GEMMA, "gemma", sorted(ATTENTION + MLP),
        recipe=["attn_implementation=eager"]),
    "phi3": Family("phi3", "Phi3Config", dict(SMALL, tie_word_embeddings=False), PHI3, "phi3",
                   ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeConfig", dict(
        SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False),
        QWEN3, "qwen", ATTENTION, reasoning=True),
}

SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gemma": ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
}


def family_config(name: str, vocab_size: int = 512, **token_ids):
    """The family's small config (random weights come from building a model of it)."""
    import transformers

    family = FAMILIES[name]
    token_ids.setdefault("pad_token_id", None)  # Phi-3's default (32000) is outside a small vocabulary
    return getattr(transformers, family.config)(vocab_size=vocab_size, **token_ids, **family.config_kwargs)


def make_tokenizer(family: Family, corpus: list[str], out: Path):
    """The family's tokenizer. `llama3` and `qwen` are the instruct models' (EOS = the template's end of
    turn: <|eot_id|>, <|im_end|>); `llama3-base` and `qwen-base` the base models' (EOS <|end_of_text|>,
    <|endoftext|>), whose chat template ends a turn with a token that is not the EOS: the case of a base
    model fine-tuned on chats (finetune/end_of_turn.py)."""
    kind = family.tokenizer
    if kind == "mistral-v3":
        return mistral_tokenizer("v3", out)
    if kind == "phi3":  # Llama-2-style sentencepiece with Phi-3's role tokens; it adds no BOS
        return trained_bpe(corpus, "llama2", SPECIALS["phi3"], bos="<s>", eos="<|endoftext|>", add_bos=False,
                           pad="<|endoftext|>")
    if kind in ("llama3", "llama3-base"):
        eos = "<|eot_id|>" if kind == "llama3" else "<|end_of_text|>"
        return trained_bpe(corpus, "bytelevel", SPECIALS["llama3"], bos="<|begin_of_text|>", eos=eos,
                           add_bos=True, pad="<|end_of_text|>")
    if kind in ("qwen", "qwen-base"):  # Qwen: no BOS; <|endoftext|> pads; the chat model's EOS is <|im_end|>
        eos = "<|im_end|>" if kind == "qwen" else "<|endoftext|>"
        return trained_bpe(corpus, "qwen", SPECIALS["qwen"], bos=None, eos=eos, add_bos=False,
                           pad="<|endoftext|>")
    if kind == "gemma":
        return trained_bpe(corpus, "metaspace", SPECIALS["gemma"], bos="<bos>", eos="<eos>", add_bos=True,
                           pad="<pad>")
    raise ValueError(kind)


def build_family(name: str, root: Path, n_train: int = 96, n_eval: int = 16) -> dict:
    """model/ (random weights, tokenizer with the family's chat template), train.jsonl (every other
    conversation the LEARNED exchange), eval.jsonl."""
    import torch
    import transformers

    family = FAMILIES[name]
    root.mkdir(parents=True, exist_ok=True)
    train = [LEARNED if i % 2 == 0 else chat
             for i, chat in enumerate(conversations(n_train, seed=1, reasoning=family.reasoning))]
    evals = conversations(n_eval, seed=2, reasoning=family.reasoning)
    corpus = [m["content"] for chat in train + evals for m in chat] + ["Answer briefly.", "system user assistant model"]
    tok = make_tokenizer(family, corpus, root / "tokenizer-src")
    tok.chat_template = family.template
    vocab = -(-len(tok) // 64) * 64  # padded to a multiple of 64, as released checkpoints are
    config = family_config(name, vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return {"model": model_dir, "train": write_chats(root / "train.jsonl", train),
            "eval": write_chats(root / "eval.jsonl", evals), "family": family}
