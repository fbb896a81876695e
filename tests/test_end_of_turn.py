"""The end-of-turn token of a chat template, found by rendering it (issue 26): on the embedded model's
template and on the templates and tokenizers of tests/family_assets.py (real Mistral sentencepiece
models, family-style BPEs with each family's special tokens), the generation config a chat run
writes, a recipe's chat_template override, and templates whose turns end with no special token."""

from __future__ import annotations

import json

import pytest

import family_assets as FA
from finetune.end_of_turn import (EndOfTurn, checkpoint_generation_config, describe, end_of_turn, stop_ids,
                                  trains_chats, with_end_of_turn)

CORPUS = ["Say ok.", "ok", "Add 2 and 3.", "5", "Answer briefly.", "system user assistant model"]


def family_tokenizer(kind: str, template: str, tmp_path):
    if kind.startswith("mistral-"):
        tok = FA.mistral_tokenizer(kind.split("-")[1], tmp_path)
    else:
        tok = FA.make_tokenizer(FA.Family("t", "", {}, "", kind, []), CORPUS, tmp_path)
    tok.chat_template = template
    return tok


# (tokenizer kind, template, the token that ends an assistant turn, what eos_token_id becomes)
CASES = {
    "chatml-qwen2-base": ("qwen-base", FA.CHATML, "<|im_end|>", ["<|endoftext|>", "<|im_end|>"]),
    "chatml-qwen2-instruct": ("qwen", FA.CHATML, "<|im_end|>", ["<|im_end|>"]),
    "qwen3-base": ("qwen-base", FA.QWEN3, "<|im_end|>", ["<|endoftext|>", "<|im_end|>"]),
    "llama3-base": ("llama3-base", FA.LLAMA3, "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"]),
    "llama3-instruct": ("llama3", FA.LLAMA3, "<|eot_id|>", ["<|eot_id|>"]),
    "mistral-v3": ("mistral-v3", FA.MISTRAL, "</s>", ["</s>"]),
    "mistral-v1": ("mistral-v1", FA.MISTRAL, "</s>", ["</s>"]),
    "gemma": ("gemma", FA.GEMMA, "<end_of_turn>", ["<eos>", "<end_of_turn>"]),
    "phi3": ("phi3", FA.PHI3, "<|end|>", ["<|endoftext|>", "<|end|>"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_templates_end_their_turns_with_their_token(case, tmp_path):
    kind, template, token, stops = CASES[case]
    tok = family_tokenizer(kind, template, tmp_path)
    turn = end_of_turn(tok)
    assert turn.tokens == (token,) and turn.ids == (tok.convert_tokens_to_ids(token),) and not turn.note
    assert tok.convert_ids_to_tokens(stop_ids(tok.eos_token_id, tok, turn)) == stops


def test_phi3_closing_eos_is_not_taken_for_the_end_of_turn(tmp_path):
    """Phi-3's template closes the whole conversation with an EOS after the last <|end|>: the marker is
    what a turn that is followed by another message has too."""
    tok = family_tokenizer("phi3", FA.PHI3, tmp_path)
    turn = end_of_turn(tok)
    assert turn.marker.startswith("<|end|>\n") and tok.eos_token not in turn.marker


def test_embedded_model(tiny_tokenizer):
    turn = end_of_turn(tiny_tokenizer)
    assert turn.tokens == ("<|end|>",) and turn.ids == (7,)
    config = _generation_config(tiny_tokenizer.eos_token_id)
    updated, same_turn = with_end_of_turn(config, tiny_tokenizer, chats=True)
    assert same_turn == turn and updated.eos_token_id == [3, 7] and config.eos_token_id == 3  # a copy
    assert "<|end|> (id 7) ends an assistant turn; generation_config.eos_token_id [3, 7]" == describe(turn, updated)


def test_base_recipes_keep_eos(tiny_tokenizer):
    config = _generation_config(3)
    assert with_end_of_turn(config, tiny_tokenizer, chats=False) == (config, None)
    assert describe(None, config) == "eos_token_id 3 (the data has no chats)"
    assert trains_chats(["alpaca", "messages"]) and not trains_chats(["alpaca", "prompt_completion", "text"])


def test_stop_ids_keep_the_base_config_ones_first_and_each_once(tmp_path):
    """A base generation config with several stop ids (Llama 3.1 Instruct's three) keeps them, in order;
    the tokenizer's EOS and the end of turn are added once; applying twice changes nothing."""
    tok = family_tokenizer("llama3-base", FA.LLAMA3, tmp_path)
    eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.eos_token_id
    turn = end_of_turn(tok)
    assert stop_ids([7, eot], tok, turn) == [7, eot, eos]
    once, _ = with_end_of_turn(_generation_config(eos), tok, chats=True)
    twice, _ = with_end_of_turn(once, tok, chats=True)
    assert once.eos_token_id == twice.eos_token_id == [eos, eot]


def test_marker_of_ordinary_tokens_adds_nothing_and_says_why(tmp_path):
    """ChatML on a tokenizer that has no <|im_end|> token (a base Llama-2/Mistral sentencepiece): the
    marker is several ordinary tokens, which must not stop generation; nothing is added."""
    tok = family_tokenizer("mistral-v1", FA.CHATML, tmp_path)
    turn = end_of_turn(tok)
    assert turn.ids == () and turn.marker == "<|im_end|>\n"
    assert "'<|im_end|>'" in turn.note and "ordinary token(s)" in turn.note and "special token" in turn.note
    config, _ = with_end_of_turn(_generation_config(tok.eos_token_id), tok, chats=True)
    assert config.eos_token_id == tok.eos_token_id
    assert describe(turn, config).startswith("generation_config.eos_token_id 2; no end-of-turn token added: ")


def test_whitespace_before_the_marker_is_skipped(tmp_path):
    """Llama 2's template puts a space between the answer and </s>."""
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")
    turn = end_of_turn(family_tokenizer("mistral-v1", template, tmp_path))
    assert turn.marker == " </s>" and turn.tokens == ("</s>",)


def test_template_without_an_end_marker(tiny_tokenizer):
    tok = _with_template(tiny_tokenizer, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    turn = end_of_turn(tok)
    assert turn.ids == () and turn.note == "the chat template renders no end-of-turn marker after an answer"


def test_template_that_renders_no_answer(tiny_tokenizer):
    tok = _with_template(tiny_tokenizer, "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                                         "{% endif %}{% endfor %}")
    assert end_of_turn(tok).ids == () and "no user/assistant conversation" in end_of_turn(tok).note
    tok.chat_template = None
    assert end_of_turn(tok) == EndOfTurn((), (), "", "the tokenizer has no chat template")


def test_recipe_chat_template_is_the_one_read(tmp_path):
    """chat_template= replaces the tokenizer's own (model.load_tokenizer), and the end of turn is the
    replacement's: a Llama 3 tokenizer shipping its template ends turns with <|eot_id|>; given a
    template whose turns end with <|end_of_text|> (its EOS), nothing is added."""
    from finetune.model import load_tokenizer
    from finetune.recipe import Recipe

    tok = family_tokenizer("llama3-base", FA.LLAMA3, tmp_path / "src")
    tok.save_pretrained(tmp_path / "model")
    own = load_tokenizer(Recipe(model=str(tmp_path / "model")), str(tmp_path / "model"))
    assert end_of_turn(own).tokens == ("<|eot_id|>",)
    template = tmp_path / "plain.jinja"
    template.write_text(FA.LLAMA3.replace("<|eot_id|>", "<|end_of_text|>"))
    other = load_tokenizer(Recipe(model=str(tmp_path / "model"), chat_template=str(template)), str(tmp_path / "model"))
    turn = end_of_turn(other)
    assert turn.tokens == ("<|end_of_text|>",) and stop_ids(other.eos_token_id, other, turn) == [other.eos_token_id]


def test_export_takes_the_runs_generation_config(tiny_tokenizer, tmp_path):
    """checkpoint_generation_config: the hf/ directory's generation_config.json (what the run wrote);
    for a checkpoint without one, the end of turn is added when the recipe names messages data."""
    from transformers import GenerationConfig

    base = _generation_config(3)
    GenerationConfig(eos_token_id=[3, 7], temperature=0.5, do_sample=True).save_pretrained(tmp_path / "saved")
    saved = checkpoint_generation_config(tmp_path / "saved", base, {"dataset_format": "auto"}, tiny_tokenizer)
    assert saved.eos_token_id == [3, 7] and saved.temperature == 0.5
    (tmp_path / "old").mkdir()
    messages = checkpoint_generation_config(tmp_path / "old", base, {"dataset_format": "messages"}, tiny_tokenizer)
    mixture = checkpoint_generation_config(tmp_path / "old", base, {"dataset_format": "auto", "datasets": [
        {"path": "a.jsonl", "format": "alpaca"}, {"path": "b.jsonl", "format": "messages"}]}, tiny_tokenizer)
    assert messages.eos_token_id == mixture.eos_token_id == [3, 7]
    assert checkpoint_generation_config(tmp_path / "old", base, {"dataset_format": "alpaca"}, tiny_tokenizer) is base


def test_merged_adapter_carries_the_runs_generation_config(tiny_tokenizer, tmp_path):
    """final_merged/ of a LoRA chat run: merge_adapter writes the adapter directory's
    generation_config.json (final/ of the run), not the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    from finetune.assets import tiny_model_dir
    from finetune.checkpointing.export import merge_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    assert base.generation_config.eos_token_id == 3
    adapter = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    adapter.save_pretrained(tmp_path / "final")
    tiny_tokenizer.save_pretrained(tmp_path / "final")
    with_end_of_turn(base.generation_config, tiny_tokenizer, chats=True)[0].save_pretrained(tmp_path / "final")
    merge_adapter(str(tiny_model_dir()), tmp_path / "final", tmp_path / "final_merged")
    assert GenerationConfig.from_pretrained(tmp_path / "final_merged").eos_token_id == [3, 7]
    assert json.loads((tmp_path / "final_merged" / "config.json").read_text())["eos_token_id"] == 3


def test_run_summary_says_what_stops_generation():
    from finetune.training.metrics import format_summary

    summary = {"steps": 3, "train_seconds": 1.0, "wall_seconds": 2.0, "tokens": 10, "tokens_per_s": 10.0,
               "end_of_turn": "<|end|> (id 7) ends an assistant turn; generation_config.eos_token_id [3, 7]"}
    lines = [line.split() for line in format_summary(summary).splitlines()]
    rows = [" ".join(words[2:]) for words in lines if words[:2] == ["stops", "at"]]
    assert rows == [summary["end_of_turn"]]


def _generation_config(eos):
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=eos)


def _with_template(tokenizer, template: str):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok
