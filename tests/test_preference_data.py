"""Preference data for objective=dpo (issue 22), in-process and without training: the three row shapes
(explicit prompt, conversational, implicit prompt) on real tokenizers (Mistral v1 and v3 sentencepiece
from mistral_common, a byte-level BPE with ChatML), each side tokenized as the SFT row of the same
data (one BOS, one EOS or the template's end-of-turn, labels exactly on the side's answer), TRL's
implicit-prompt cut, the prompt and total budgets and the pairs they drop, column mapping, mixtures
of preference sources, the one-line refusals before any model loads, `finetune data --show` of a
pair, the samples' prompts of a preference eval set, and builtin:tiny-preferences."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

import family_assets as FA
from finetune import data as D
from finetune.commands import data as data_command
from finetune.data import IGNORE, DataError
from finetune.recipe import DataSource, Recipe, RecipeError

SYSTEM = {"role": "system", "content": "Answer briefly."}
PROMPT = [SYSTEM, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
          {"role": "user", "content": "And 3+3?"}]
CHOSEN = [{"role": "assistant", "content": "6, of course."}]
REJECTED = [{"role": "assistant", "content": "It is 7."}]
TEXT = {"prompt": "Question: What is the capital of France? Answer: ", "chosen": "Paris", "rejected": "Lyon, I think"}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Mistral-7B v0.1's sentencepiece tokenizer (adds <s>), the [INST] template (ends an answer with </s>)."""
    tok = FA.mistral_tokenizer("v1", tmp_path_factory.mktemp("v1"))
    tok.chat_template = FA.MISTRAL
    return tok


@pytest.fixture(scope="module")
def mistral_v3(tmp_path_factory):
    """Mistral-7B-Instruct v0.3's, saved with its template so that a recipe can name it (tokenizer=DIR)."""
    out = tmp_path_factory.mktemp("v3")
    tok = FA.mistral_tokenizer("v3", out / "src")
    tok.chat_template = FA.MISTRAL
    tok.save_pretrained(out / "tok")
    tok.saved_to = str(out / "tok")
    return tok


@pytest.fixture(scope="module")
def chatml_bpe(tmp_path_factory):
    """A Qwen-style byte-level BPE (no BOS; EOS <|endoftext|>) with ChatML (ends a turn with <|im_end|>)."""
    corpus = [m["content"] for m in PROMPT + CHOSEN + REJECTED] + list(TEXT.values())
    tok = FA.make_tokenizer(FA.FAMILIES["qwen2"], corpus, tmp_path_factory.mktemp("chatml"))
    tok.chat_template = FA.CHATML
    return tok


@pytest.fixture(scope="module")
def llama3_bpe(tmp_path_factory):
    """A Llama-3-style byte-level BPE that adds <|begin_of_text|> itself, with Llama 3's template."""
    corpus = [m["content"] for m in PROMPT + CHOSEN + REJECTED] + list(TEXT.values())
    tok = FA.make_tokenizer(FA.FAMILIES["llama3"], corpus, tmp_path_factory.mktemp("llama3"))
    tok.chat_template = FA.LLAMA3
    return tok


TOKENIZERS = ["mistral", "mistral_v3", "chatml_bpe"]


def runs(ids, labels):
    """The labelled stretches of a side, as lists of ids (labels equal to the ids where set)."""
    out, current = [], []
    for t, lab in zip(ids, labels):
        if lab == IGNORE:
            if current:
                out.append(current)
            current = []
        else:
            assert lab == t
            current.append(t)
    return out + ([current] if current else [])


def sides(pair: dict):
    return [(pair[f"{s}_input_ids"], pair[f"{s}_labels"]) for s in ("chosen", "rejected")]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line(fn, *args, error=RecipeError, **kwargs) -> str:
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- format detection


def test_preference_is_detected_before_messages():
    """UltraFeedback-binarized rows carry prompt, chosen, rejected and messages: they are pairs."""
    assert D.detect_format(["prompt", "chosen", "rejected", "messages", "prompt_id"], "x") == "preference"
    assert D.detect_format(["chosen", "rejected"], "x") == "preference"
    assert D.detect_format(["messages", "chosen"], "x") == "messages"
    assert D.FORMAT_FIELDS["preference"] == ("chosen", "rejected")


# ---------------------------------------------------------------- (a) explicit prompt, strings


@pytest.mark.parametrize("name", TOKENIZERS + ["llama3_bpe"])
def test_explicit_pairs_are_prompt_completion_rows(name, request):
    """Each side is exactly the SFT prompt_completion row (prompt, side): the tokenizer's BOS once
    (none for the BPE without one), prompt + side tokenized as one text, one EOS, labels on the side."""
    tok = request.getfixturevalue(name)
    pair = D.encode_pair(TEXT, tok, 512)
    bos = D.bos_ids(tok)
    assert (name != "chatml_bpe") == bool(bos)
    for (ids, labels), side in zip(sides(pair), (TEXT["chosen"], TEXT["rejected"])):
        assert (ids, labels) == D.encode_prompt_completion(tok, TEXT["prompt"], side, False, 512)
        assert ids[:len(bos)] == bos and ids.count(tok.bos_token_id) == len(bos)
        assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
        trained = runs(ids, labels)
        assert len(trained) == 1 and trained[0][-1] == tok.eos_token_id  # one stretch: the answer and its EOS
        assert tok.decode(trained[0][:-1]).strip() == side
        assert tok.decode(ids[len(bos):-1]) == TEXT["prompt"] + side  # decodes to exactly prompt + side
        start = D.prompt_length(ids, labels)
        assert labels[:start] == [IGNORE] * start and all(x != IGNORE for x in labels[start:])


# ---------------------------------------------------------------- (b) conversational


@pytest.mark.parametrize("name", TOKENIZERS)
def test_conversational_pairs_train_only_their_own_answer(name, request):
    """Each side is apply_chat_template(prompt + side)'s tokens; of its assistant turns only the side's
    own is trained (the prompt's earlier answer "4" is context), with its end-of-turn marker."""
    tok = request.getfixturevalue(name)
    pair = D.encode_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, tok, 512)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>") if name == "chatml_bpe" else tok.eos_token_id
    for (ids, labels), side in zip(sides(pair), (CHOSEN, REJECTED)):
        conversation = PROMPT + side
        assert ids == list(tok.apply_chat_template(conversation, tokenize=True)["input_ids"])
        sft_ids, sft_labels = D.encode_messages(tok, conversation, False, 512)
        assert ids == sft_ids
        assert runs(ids, labels) == runs(sft_ids, sft_labels)[1:]  # the SFT row trains both answers; a side its own
        trained = runs(ids, labels)
        assert len(trained) == 1 and side[0]["content"] in tok.decode(trained[0])
        assert end_of_turn in trained[0] and "4" not in tok.decode(trained[0]).replace(side[0]["content"], "")
        renders_bos = name != "chatml_bpe"
        assert ids.count(tok.bos_token_id) == int(renders_bos) and (ids[0] == tok.bos_token_id) == renders_bos


# ChatML whose {% generation %} block opens after `<|im_start|>assistant`, before the newline that ends the
# generation prompt, as TRL's qwen2_5_training.jinja marks it (SFT's assistant-only loss then trains that newline).
CHATML_MARKED_BEFORE_NEWLINE = FA.CHATML.replace(
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}",
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- generation %}{{- '\n' + m['content'] + '<|im_end|>\n' }}{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}")


@pytest.mark.parametrize("name", ["chatml_bpe", "llama3_bpe"])
def test_conversational_sides_train_nothing_of_the_generation_prompt(name, request):
    """A side is scored as log p(side | prompt), the prompt as generation is given it: its generation
    prompt `<|im_start|>assistant\n` is context even where the template's {% generation %} block
    covers the newline (issue 34: 0 of 16 pairs equal to TRL's, IPO's loss 0.33 off). The pair is
    the same under that template, under one marking the block after the newline, and under the
    unmarked template; its first trained token follows apply_chat_template(prompt,
    add_generation_prompt=True)'s tokens, TRL's prompt_ids. On the Qwen-style BPE (<|im_end|>
    special) and on the Llama-3-style one (<|im_end|> plain text)."""
    assert CHATML_MARKED_BEFORE_NEWLINE.count("{%- generation %}") == 1
    tok = request.getfixturevalue(name)
    row, own = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, tok.chat_template
    try:
        pairs = []
        for template in (CHATML_MARKED_BEFORE_NEWLINE, FA.with_generation_marks(FA.CHATML), FA.CHATML):
            tok.chat_template = template
            pairs.append(D.encode_pair(row, tok, 512))
        served = list(tok.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True)["input_ids"])
        tok.chat_template = CHATML_MARKED_BEFORE_NEWLINE
        sft_ids, sft_labels = D.encode_messages(tok, PROMPT + CHOSEN, False, 512)
    finally:
        tok.chat_template = own
    assert pairs[0] == pairs[1] == pairs[2]
    for (ids, labels), side in zip(sides(pairs[0]), (CHOSEN, REJECTED)):
        assert D.prompt_length(ids, labels) == len(served) and ids[:len(served)] == served
        assert tok.decode(ids[len(served):]) == side[0]["content"] + "<|im_end|>\n"
        assert all(x != IGNORE for x in labels[len(served):])
    newline = len(served) - 1  # the generation prompt's last token: trained in the SFT row, as the marks say
    assert tok.decode([sft_ids[newline]]) == "\n" and sft_labels[newline] == sft_ids[newline]


# ---------------------------------------------------------------- (c) implicit prompt


@pytest.mark.parametrize("name", TOKENIZERS)
def test_implicit_prompt_of_conversations_is_their_common_prefix(name, request):
    """HH-RLHF's shape as messages: the shared turns are the prompt; the pair is the conversational
    pair with that prompt, token for token."""
    tok = request.getfixturevalue(name)
    implicit = {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    assert D.split_pair(implicit) == (PROMPT, CHOSEN, REJECTED, True)
    explicit = D.encode_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, tok, 512)
    assert D.encode_pair(implicit, tok, 512) == explicit
    # HuggingFaceH4/ultrafeedback_binarized: a string prompt beside whole conversations is ignored, as TRL does
    h4 = {"prompt": "What is 2+2?", "chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    assert D.encode_pair(h4, tok, 512) == explicit


def test_implicit_prompt_cut_is_trls():
    """trl/data_utils.py extract_prompt: the common prefix, a space before the first difference going
    to the sides; where one side is the other's start, the shorter keeps its last item (message or
    character). TRL's cut at a difference in the first character would move a trailing space of
    chosen into the prompt (its chosen[idx - 1] is chosen[-1] there); here the prompt is empty."""
    hh = "\n\nHuman: What is 2+2?\n\nAssistant:"
    assert D.extract_prompt(hh + " 4", hh + " 5") == (hh, " 4", " 5")
    assert D.extract_prompt(hh + " four", hh + " 4") == (hh, " four", " 4")
    assert D.extract_prompt("abc", "abcdef") == ("ab", "c", "cdef")
    assert D.extract_prompt("x y ", "z") == ("", "x y ", "z")
    first, second = [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "yes"}]
    more = [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "no"}]
    assert D.extract_prompt(first + second, first + second + more) == (first, second, second + more)


@pytest.mark.parametrize("name", ["mistral", "chatml_bpe"])
def test_implicit_prompt_of_texts_is_the_explicit_pair(name, request):
    tok = request.getfixturevalue(name)
    hh = "\n\nHuman: What is the capital of France?\n\nAssistant:"
    implicit = D.encode_pair({"chosen": hh + " Paris", "rejected": hh + " Lyon"}, tok, 512)
    assert implicit == D.encode_pair({"prompt": hh, "chosen": " Paris", "rejected": " Lyon"}, tok, 512)
    for ids, labels in sides(implicit):
        assert "Human" not in tok.decode([t for t in labels if t != IGNORE])


# ---------------------------------------------------------------- batches of mixed shapes


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_batch_of_mixed_shapes_equals_each_row_alone(name, request):
    tok = request.getfixturevalue(name)
    rows = [TEXT, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
            {"chosen": PROMPT + REJECTED, "rejected": PROMPT + CHOSEN}, {"chosen": "A: yes", "rejected": "A: no"}]
    batch = D.encode_pairs(rows, tok, 512)
    for k, row in enumerate(rows):
        one = D.encode_pair(row, tok, 512)
        assert {c: batch[c][k] for c in D.PAIR_COLUMNS} == one
        counts = [sum(1 for x in one[f"{s}_labels"][1:] if x != IGNORE) for s in ("chosen", "rejected")]
        assert batch["n_targets"][k] == sum(counts) > 0
        assert batch["n_tokens"][k] == len(one["chosen_input_ids"]) + len(one["rejected_input_ids"])


# ---------------------------------------------------------------- truncation


@pytest.mark.parametrize("name", ["mistral", "llama3_bpe", "chatml_bpe"])
def test_prompt_budget_keeps_the_prompts_end_and_its_bos(name, request):
    tok = request.getfixturevalue(name)
    row = {"prompt": "Question: " + "What is the capital of France? " * 10 + "Answer: ", "chosen": "Paris",
           "rejected": "Lyon, I think"}
    full = D.encode_pair(row, tok, 512)
    cut = D.encode_pair(row, tok, 512, max_prompt_len=8)
    bos = D.bos_ids(tok)
    for (ids, labels), (fids, flabels) in zip(sides(cut), sides(full)):
        start, fstart = D.prompt_length(ids, labels), D.prompt_length(fids, flabels)
        assert start == 8 < fstart
        assert ids[:len(bos)] == bos  # the BOS stays first and counts in the budget
        assert ids[len(bos):] == fids[fstart - (8 - len(bos)):] and labels[start:] == flabels[fstart:]
    # the total budget then cuts each side's end
    short = D.encode_pair(row, tok, 10, max_prompt_len=8)
    for (ids, labels), (cids, clabels) in zip(sides(short), sides(cut)):
        assert ids == cids[:10] and labels == clabels[:10]
    # a conversation's prompt is the tokens before the side's answer: its header included
    conv = D.encode_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, tok, 512, max_prompt_len=6)
    fconv = D.encode_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, tok, 512)
    for (ids, labels), (fids, flabels) in zip(sides(conv), sides(fconv)):
        assert D.prompt_length(ids, labels) == 6 and ids[-3:] == fids[-3:]
        assert runs(ids, labels) == runs(fids, flabels)


def test_both_sides_are_scored_from_the_same_position_and_a_budget_there_drops_the_pair(mistral):
    """'Answer: ' + 'Paris' merges into ▁Paris, so chosen's tokens leave the prompt's a token earlier
    than rejected's ('\nno'): both sides are scored from that earlier position (TRL's one prompt length
    for a pair), rejected's last prompt token included, so both are conditioned on the same tokens; a
    total budget that ends there leaves neither side an answer, and the pair is dropped."""
    pair = D.encode_pairs([{"prompt": "Answer: ", "chosen": "Paris", "rejected": "\nno"}], mistral, 64)
    starts = [D.prompt_length(pair[f"{side}_input_ids"][0], pair[f"{side}_labels"][0]) for side in ("chosen", "rejected")]
    assert starts[0] == starts[1]
    assert pair["chosen_input_ids"][0][:starts[0]] == pair["rejected_input_ids"][0][:starts[0]]
    alone = D.encode_pairs([{"prompt": "Answer: ", "completion": "x", "chosen": "\nyes", "rejected": "\nno"}],
                           mistral, 64)
    assert D.prompt_length(alone["rejected_input_ids"][0], alone["rejected_labels"][0]) > starts[0], \
        "without a merging side, rejected's answer starts later: the earlier start came from chosen"
    cut = D.encode_pairs([{"prompt": "Answer: ", "chosen": "Paris", "rejected": "\nno"}], mistral, starts[0])
    assert cut["n_targets"] == [0]


def test_dropped_pairs_are_counted_in_the_summary(tmp_path, mistral):
    rows = [{"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(20)]
    rows.append({"prompt": "word " * 80, "chosen": "end", "rejected": "stop"})
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    recipe = Recipe(dataset=str(path), objective="dpo", max_seq_len=64, eval_fraction=0.0)
    data = D.build_datasets(recipe, mistral)
    assert data.sources[0]["dropped_no_target"] == 1 and len(data.train) == 20
    assert data.sources[0]["at_max_seq_len"] == 0
    line = D.summary_lines(data, recipe)[0]
    assert f"data dataset {path} (preference, split train): 21 rows, 1 dropped (chosen or rejected has no response " \
           "token within max_seq_len=64)" in line
    kept = D.build_datasets(Recipe(dataset=str(path), objective="dpo", max_seq_len=64, max_prompt_len=32,
                                   eval_fraction=0.0), mistral)
    assert kept.sources[0]["dropped_no_target"] == 0 and len(kept.train) == 21
    assert kept.sources[0]["at_max_seq_len"] == 0  # the prompt budget made room: nothing cut at max_seq_len
    everything = Recipe(dataset=str(path), objective="dpo", max_seq_len=9, eval_fraction=0.0)
    cut = D.build_datasets(everything, mistral)
    assert cut.sources[0]["at_max_seq_len"] == cut.sources[0]["kept"] == 5
    assert cut.sources[0]["dropped_identical"] == 5  # " 10" against " 11" cut after "▁1"
    hopeless = write_jsonl(tmp_path / "long.jsonl", rows[-1:])
    message = one_line(D.build_datasets, Recipe(dataset=str(hopeless), objective="dpo", max_seq_len=64,
                                                eval_fraction=0.0), mistral, error=DataError)
    assert message == (f"{hopeless}: no pair has a response token left on both sides within max_seq_len=64; raise "
                       "max_seq_len, or set max_prompt_len below it (a long prompt then loses its start)")


def test_pairs_identical_once_cut_at_max_seq_len_are_dropped_and_counted(tmp_path, mistral):
    """Sides that differ only past max_seq_len are the same tokens once cut: the pair's DPO margin is 0
    whatever the weights (no gradient, a log 2 diluting the mean), so it is dropped as identical rows
    are refused, and counted on the summary line apart from the pairs without a response token."""
    same = "The answer, after a long and careful thought about every part of the question, is "
    rows = [{"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(20)]
    rows += [{"prompt": f"Question {i}: ", "chosen": same + "yes.", "rejected": same + "no."} for i in range(3)]
    rows.append({"prompt": "word " * 80, "chosen": "end", "rejected": "stop"})
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs = D.encode_pairs(rows[20:23], mistral, 20)
    assert pairs["chosen_input_ids"] == pairs["rejected_input_ids"] and pairs["n_targets"] == [-1] * 3
    assert D.encode_pairs(rows[20:23], mistral, 64)["n_targets"][0] > 0  # they differ within 64 tokens
    recipe = Recipe(dataset=str(path), objective="dpo", max_seq_len=20, eval_fraction=0.0)
    data = D.build_datasets(recipe, mistral)
    assert len(data.train) == 20 and all(r["chosen_input_ids"] != r["rejected_input_ids"] for r in data.train)
    assert data.sources[0]["dropped_identical"] == 3 and data.sources[0]["dropped_no_target"] == 1
    assert D.summary_lines(data, recipe)[0].startswith(
        f"data dataset {path} (preference, split train): 24 rows, 1 dropped (chosen or rejected has no response "
        "token within max_seq_len=20), 3 dropped (chosen and rejected identical within max_seq_len=20: they "
        "differ only after it)")
    wide = D.build_datasets(Recipe(dataset=str(path), objective="dpo", max_seq_len=64, eval_fraction=0.0), mistral)
    assert wide.sources[0]["dropped_identical"] == 0 and len(wide.train) == 23
    alone = write_jsonl(tmp_path / "same.jsonl", rows[20:23])
    message = one_line(D.build_datasets, Recipe(dataset=str(alone), objective="dpo", max_seq_len=20,
                                                eval_fraction=0.0), mistral, error=DataError)
    assert message == (f"{alone}: no pair left: 3 of 3 have chosen and rejected identical within max_seq_len=20 "
                       "(they differ only after it), the others no response token on both sides; raise max_seq_len")


# ---------------------------------------------------------------- mapping and mixtures


def test_mapped_columns_and_message_fields_give_the_same_pairs(tmp_path, mistral):
    def sharegpt(msgs):
        return [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                for m in msgs]

    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}] * 4)
    mapped = write_jsonl(tmp_path / "mapped.jsonl", [{"question": sharegpt(PROMPT), "good": sharegpt(CHOSEN),
                                                      "bad": sharegpt(REJECTED)}] * 4)
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad", "role": "from", "content": "value"}
    recipe = Recipe(dataset=str(plain), objective="dpo", max_seq_len=256, eval_fraction=0.0)
    assert D.prevalidate(str(mapped), "auto", spec=DataSource(path=str(mapped), columns=columns)) == "preference"
    a = D.tokenize_dataset(D.load_source(DataSource(path=str(plain))), "auto", mistral, recipe, "plain")
    spec = DataSource(path=str(mapped), columns=columns)
    b = D.tokenize_dataset(D.load_source(spec), "auto", mistral, recipe, "mapped", spec=spec)
    assert a.column_names == b.column_names == D.PAIR_COLUMNS
    assert a[:] == b[:]
    bad = DataSource(path=str(mapped), columns={"chosen": "good", "rejected": "worse"})
    assert "columns maps rejected to 'worse'" in one_line(D.prevalidate, str(mapped), "auto", spec=bad)


def test_pairs_beside_a_conversations_column_are_not_read_as_sharegpt(tmp_path, mistral):
    """ShareGPT's layout (a conversations column, no messages) is read as messages only for chat rows:
    rows with chosen and rejected are pairs, their other columns left alone."""
    row = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}],
           "prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    path = write_jsonl(tmp_path / "pairs.jsonl", [row] * 3)
    assert D.prevalidate(str(path), "auto") == "preference"
    recipe = Recipe(dataset=str(path), objective="dpo", max_seq_len=256, eval_fraction=0.0)
    data = D.build_datasets(recipe, mistral)
    assert data.train[0] == D.encode_pair(row, mistral, 256)


def test_mixture_of_two_preference_sources(tmp_path, mistral_v3):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"Reverse {w}: ", "chosen": w[::-1], "rejected": w}
                                           for w in (f"word{i}" for i in range(40))])
    b = write_jsonl(tmp_path / "b.jsonl", [{"chosen": [{"role": "user", "content": f"{i}+{i}?"},
                                                       {"role": "assistant", "content": str(2 * i)}],
                                            "rejected": [{"role": "user", "content": f"{i}+{i}?"},
                                                         {"role": "assistant", "content": str(2 * i + 1)}]}
                                           for i in range(20)])
    recipe = Recipe(objective="dpo", max_seq_len=128, eval_fraction=0.1, seed=3,
                    datasets=(DataSource(path=str(a), weight=0.5), DataSource(path=str(b), rows=30)))
    first, again = D.build_datasets(recipe, mistral_v3), D.build_datasets(recipe, mistral_v3)
    assert first.train.column_names == D.PAIR_COLUMNS and first.eval.column_names == D.PAIR_COLUMNS
    assert first.train[:] == again.train[:]
    assert first.format == "preference"
    assert [s["rows"] for s in first.sources] == [36, 18] and [s["rows_in_mix"] for s in first.sources] == [18, 30]
    assert len(first.train) == 48 and len(first.eval) == 4 + 2
    for i, s in enumerate(first.sources):  # a pair's tokens and targets: both sides', counted as SFT counts them
        rows = [first.train[int(k)] for k in np.flatnonzero(first.row_sources == i)]
        assert s["tokens"] == sum(len(r["chosen_input_ids"]) + len(r["rejected_input_ids"]) for r in rows)
        assert s["target_tokens"] == sum(sum(1 for x in r[f"{side}_labels"][1:] if x != IGNORE)
                                         for r in rows for side in ("chosen", "rejected"))
    lines = D.summary_lines(first, recipe)
    assert lines[0].startswith(f"data datasets[0] {a} (preference, split train): 36 rows, none dropped; weight 0.5: "
                               "18 rows in the mix")
    assert lines[1].startswith(f"data datasets[1] {b} (preference, split train): 18 rows, none dropped; rows=30")


def test_several_processes_prepare_the_same_pairs(tmp_path, mistral):
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED},
                                              TEXT] * 10)
    raw = D.load_source(DataSource(path=str(path)))
    one = D.tokenize_dataset(raw, "auto", mistral, Recipe(objective="dpo", max_seq_len=256, num_proc=1), "p1")
    two = D.tokenize_dataset(raw, "auto", mistral, Recipe(objective="dpo", max_seq_len=256, num_proc=2), "p2")
    assert one[:] == two[:]


# ---------------------------------------------------------------- refusals


BAD_ROWS = [
    ({"prompt": "Q", "chosen": "A"}, "line 2: missing field 'rejected' (dataset_format=preference needs chosen, "
     "rejected)"),
    ({"prompt": "Q", "chosen": "A", "rejected": None}, "line 2: missing field 'rejected'"),
    ({"prompt": "Q", "chosen": " A", "rejected": " A"}, "line 2: 'chosen' and 'rejected' are identical"),
    ({"prompt": "Q", "chosen": 3, "rejected": "B"}, "line 2: field 'chosen' must be a string or a list of {role, "
     "content} messages, got a int"),
    ({"prompt": "Q", "chosen": "A", "rejected": CHOSEN}, "line 2: 'chosen' is a string and 'rejected' a list of "
     "messages; both must be strings or both lists of messages"),
    ({"prompt": PROMPT, "chosen": "A", "rejected": "B"}, "line 2: 'prompt' is a list of messages but 'chosen' and "
     "'rejected' are strings"),
    ({"prompt": 5, "chosen": "A", "rejected": "B"}, "line 2: field 'prompt' must be a string or a list"),
    ({"prompt": PROMPT, "chosen": [{"role": "user", "content": "x"}], "rejected": REJECTED},
     "line 2: 'chosen' has no assistant message after the prompt"),
    ({"prompt": PROMPT, "chosen": [{"role": "assistant"}], "rejected": REJECTED},
     "line 2: each message needs string 'role' and 'content'"),
    ({"prompt": PROMPT, "chosen": [{"role": "bot", "content": "x"}], "rejected": REJECTED},
     "line 2: message 0 has role 'bot'"),
]


@pytest.mark.parametrize("row,expected", BAD_ROWS)
def test_bad_pairs_are_one_line_naming_file_and_line(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [TEXT, row])
    message = one_line(D.prevalidate, str(path), "auto", error=DataError)
    assert message.startswith(f"{path} line 2") and expected in message, message
    assert "line 2" in one_line(D.prevalidate, str(path), "preference", error=DataError)


def test_bad_pairs_in_parquet_csv_and_saved_datasets_name_the_row(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [TEXT, dict(TEXT, rejected=TEXT["chosen"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    assert one_line(D.prevalidate, str(tmp_path / "pairs.parquet"), "auto", error=DataError).startswith(
        f"{tmp_path / 'pairs.parquet'} row 1: 'chosen' and 'rejected' are identical")
    (tmp_path / "pairs.csv").write_text("prompt,chosen,rejected\nQ,A,B\nQ,C,C\n")
    assert one_line(D.prevalidate, str(tmp_path / "pairs.csv"), "auto", error=DataError).startswith(
        f"{tmp_path / 'pairs.csv'} row 1: 'chosen' and 'rejected' are identical")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert one_line(D.prevalidate, str(tmp_path / "saved"), "auto", error=DataError).startswith(
        f"{tmp_path / 'saved'} row 1: 'chosen' and 'rejected' are identical")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "good.parquet")
    assert D.prevalidate(str(tmp_path / "good.parquet"), "auto") == "preference"


def test_objective_and_rows_must_agree(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [TEXT])
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q", "completion": "A"}])
    message = one_line(D.prevalidate_recipe, Recipe(dataset=str(sft), objective="dpo"))
    assert message.startswith("objective=dpo needs preference rows (prompt, chosen, rejected); "
                              f"dataset={sft} has prompt_completion rows")
    message = one_line(D.prevalidate_recipe, Recipe(dataset=str(pairs)))
    assert message.startswith(f"dataset={pairs} has preference rows (chosen, rejected), which train with "
                              "objective=dpo; set objective=dpo")
    mixed = Recipe(objective="dpo", datasets=(DataSource(path=str(pairs)), DataSource(path=str(sft))))
    assert f"datasets[1]={sft} has prompt_completion rows" in one_line(D.prevalidate_recipe, mixed)
    with_eval = Recipe(dataset=str(pairs), objective="dpo", eval_dataset=str(sft))
    assert f"eval_dataset={sft} has prompt_completion rows" in one_line(D.prevalidate_recipe, with_eval)
    assert "objective=dpo needs preference rows" in one_line(
        D.prevalidate_recipe, Recipe(dataset="builtin:tiny-tasks", objective="dpo"))
    D.prevalidate_recipe(Recipe(dataset=str(pairs), objective="dpo"))
    D.prevalidate_recipe(Recipe(dataset="builtin:tiny-preferences", objective="dpo"))


def test_objective_is_checked_again_once_rows_are_seen(tmp_path, mistral):
    """A hub dataset is not seen before it is downloaded; its format is checked where it is read."""
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q", "completion": "A"}] * 4)
    message = one_line(D.build_datasets, Recipe(dataset=str(sft), objective="dpo", eval_fraction=0.0), mistral)
    assert message.startswith("objective=dpo needs preference rows")


@pytest.fixture
def dpo_recipe(tmp_path, mistral_v3):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [dict(TEXT, chosen=f"Paris {i}") for i in range(20)])
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}] * 10)
    path = tmp_path / "dpo.py"
    path.write_text(f'''from finetune.recipe import DataSource, Recipe

recipe = Recipe(
    tokenizer={mistral_v3.saved_to!r},
    objective="dpo",
    max_seq_len=256,
    mixed_precision="no",
    strategy="ddp",
    datasets=[DataSource(path={str(pairs)!r}), DataSource(path={str(chats)!r})],
    output_dir={str(tmp_path / "out")!r},
)
''')
    return path


@pytest.mark.parametrize("row,expected", [
    ({"prompt": "Q", "chosen": "A"}, "line 3: missing field 'rejected'"),
    ({"prompt": "Q", "chosen": "A", "rejected": "A"}, "line 3: 'chosen' and 'rejected' are identical"),
    ({"prompt": "Q", "completion": "A"}, "objective=dpo needs preference rows (prompt, chosen, rejected)"),
])
def test_bad_pairs_stop_a_run_in_one_line_before_any_model(dpo_recipe, tmp_path, row, expected, capsys, monkeypatch):
    import finetune.model
    from finetune import run

    pairs = tmp_path / "pairs.jsonl"
    rows = pairs.read_text().splitlines()
    pairs.write_text("\n".join(rows[:2] + [json.dumps(row)] + rows[2:]) + "\n")
    if "completion" in row:
        write_jsonl(pairs, [row])

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(finetune.model, "load_model", no_model)
    monkeypatch.setattr(finetune.model, "load_config", no_model)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert run.main(["--recipe", str(dpo_recipe)]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_pairs_read_as_another_format_name_dataset_format_preference(tmp_path, mistral):
    """Preference rows given to a recipe whose dataset_format is alpaca (recipes/tiny.py's), or messages,
    get one line naming the setting that reads them, as ShareGPT rows read as alpaca do: from a jsonl
    file, a parquet file's columns, and rows first seen while tokenizing (a hub dataset)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    hint = ("these rows hold preference pairs (chosen, rejected), which train with objective=dpo: set "
            "dataset_format=preference (or auto; format='preference' on a DataSource)")
    rows = [TEXT, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    msg = one_line(D.prevalidate, str(path), "alpaca", error=DataError)
    assert msg == f"{path} line 1: missing field 'instruction' (dataset_format=alpaca needs instruction, output); {hint}"
    msg = one_line(D.prevalidate_recipe, Recipe(dataset=str(path), dataset_format="messages", objective="dpo"),
                   error=DataError)
    assert msg == f"{path} line 1: missing field 'messages' (dataset_format=messages needs messages); {hint}"
    pq.write_table(pa.Table.from_pylist([TEXT] * 2), tmp_path / "pairs.parquet")
    msg = one_line(D.prevalidate, str(tmp_path / "pairs.parquet"), "alpaca", error=DataError)
    assert "missing column(s) ['instruction', 'output'] for dataset_format=alpaca; " + hint in msg, msg
    msg = one_line(D.tokenize_dataset, Dataset.from_list([TEXT] * 2), "prompt_completion", mistral,
                   Recipe(max_seq_len=64), "hub/pairs", error=DataError)
    assert msg == f"hub/pairs: missing field(s) ['completion'] for dataset_format=prompt_completion; {hint}"
    assert D.format_hint(["instruction", "output"], "messages").endswith("set dataset_format=alpaca (or auto; "
                                                                          "format='alpaca' on a DataSource)")
    assert D.format_hint(["chosen", "rejected"], "preference") == D.format_hint(["other"], "text") == ""


# ---------------------------------------------------------------- finetune data --show


def test_show_gives_the_prompt_once_and_each_side_marked(dpo_recipe, capsys):
    assert data_command.main(["--recipe", str(dpo_recipe), "--show", "4", "--color", "never"]) == 0
    out = capsys.readouterr().out
    blocks = out.split("--- row ")[1:]
    assert len(blocks) == 4
    for block in blocks:
        header, body = block.split("\n", 1)
        assert "chosen " in header and "rejected " in header and " trained" in header
        lines = [line for line in body.split("\n") if line.startswith(("prompt:", "chosen:", "rejected:"))]
        assert [line.split(":")[0] for line in lines] == ["prompt", "chosen", "rejected"]
        assert "[[" not in lines[0]  # the prompt is not trained
        assert lines[1].split(None, 1)[1].startswith("[[") and lines[2].split(None, 1)[1].startswith("[[")
        assert lines[1].rstrip().endswith("</s>]]") and lines[2].rstrip().endswith("</s>]]")
    assert "(preference, split train)" in out and "rows in the mix" in out
    assert "[INST] And 3+3?[/INST]" in out or "Question: What is the capital" in out


def test_show_json_gives_the_pair_columns(dpo_recipe, mistral_v3, capsys):
    assert data_command.main(["--recipe", str(dpo_recipe), "--show", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert set(D.PAIR_COLUMNS) <= set(r) and "n_tokens" not in r
        assert r["chosen_input_ids"][0] == mistral_v3.bos_token_id


def test_show_pair_text(mistral):
    """The prompt is what both sides start with (rejected's untrained '▁', which chosen's ▁Paris holds,
    belongs to rejected's line; decoded alone it shows as nothing); a side's own turns after the shared
    prompt are shown on its line."""
    pair = D.encode_pair({"prompt": "Answer: ", "chosen": "Paris", "rejected": "\nno"}, mistral, 64)
    assert D.show_pair(mistral, pair) == "prompt:   <s> Answer:\nchosen:   [[Paris</s>]]\nrejected: [[\nno</s>]]"
    first = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    pair = D.encode_pair({"chosen": first + [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ok"}],
                          "rejected": first + [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "No"}]},
                         mistral, 64)
    assert D.show_pair(mistral, pair) == ("prompt:   <s>[INST] Hi[/INST] Hello</s>[INST]\nchosen:   Bye[/INST][[Ok</s>]]"
                                          "\nrejected: Go[/INST][[No</s>]]")


# ---------------------------------------------------------------- samples at eval


def test_eval_prompts_of_preference_rows(tmp_path, mistral):
    from finetune.training.samples import eval_prompts

    path = write_jsonl(tmp_path / "pairs.jsonl", [TEXT, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    recipe = Recipe(dataset=str(path), objective="dpo", max_seq_len=256, eval_fraction=0.0)
    ds = D.tokenize_dataset(D.load_source(DataSource(path=str(path))), "auto", mistral, recipe, "pairs")
    prompts = eval_prompts(ds, 2, mistral)
    text_ids, text_labels = D.encode_prompt_completion(mistral, TEXT["prompt"], TEXT["chosen"], False, 256)
    assert prompts[0].ids == text_ids[:D.prompt_length(text_ids, text_labels)]
    assert prompts[0].reference == "Paris"
    chat = list(mistral.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert prompts[1].ids == chat and prompts[1].reference == CHOSEN[0]["content"]


# ---------------------------------------------------------------- builtin:tiny-preferences


def test_builtin_tiny_preferences(tiny_tokenizer):
    from finetune.assets import resolve_dataset, tiny_preferences_file

    path = resolve_dataset("builtin:tiny-preferences")
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 4000 and path == str(tiny_preferences_file())
    assert D.prevalidate(path, "auto") == "preference"
    for r in rows:
        assert set(r) == {"prompt", "chosen", "rejected"} and r["chosen"] != r["rejected"]
        assert len(r["chosen"]) == len(r["rejected"])
        task, word = r["prompt"].split("\n")[0].split(": ")
        assert r["chosen"] == {"Reverse": word[::-1], "Capitals": word.upper(), "Copy": word}[task]
        # wrong in a way the prompt shows: the case, or letters from the half of the alphabet words never use
        assert set(word) <= set("abcdefghijklm")
        assert r["rejected"] == r["chosen"].swapcase() or set(r["rejected"].lower()) <= set("nopqrstuvwxyz")
    assert {r["prompt"].split(":")[0] for r in rows} == {"Reverse", "Capitals", "Copy"}
    recipe = Recipe(dataset="builtin:tiny-preferences", objective="dpo", max_seq_len=64, eval_fraction=0.05)
    data = D.build_datasets(recipe, tiny_tokenizer)
    assert data.sources[0]["dropped_no_target"] == 0 and len(data.train) + len(data.eval) == 4000
    first = data.train[0]
    assert first["chosen_input_ids"][0] == tiny_tokenizer.bos_token_id
    assert first["chosen_input_ids"][-1] == first["chosen_labels"][-1] == tiny_tokenizer.eos_token_id
