"""Tokenization with the tokenizers and chat templates users bring (issue 11): Mistral's own
sentencepiece and tekken tokenizers from the mistral_common wheel, family-style BPEs, and chat
templates reproducing Llama 3, Mistral, ChatML, Qwen3, Gemma and Phi-3. One BOS where the model
expects one, one EOS, every assistant turn (with its end-of-turn marker) trained as it appears in the
full rendering, and labels equal to transformers' own return_assistant_tokens_mask where a template
marks its turns with {% generation %}. Rows decode to exactly their text (prompt + completion, as
TRL's SFTTrainer tokenizes it) and chat rows start as apply_chat_template(tokenize=True) starts them
(issue 20)."""

from __future__ import annotations

import contextlib
import json

import pytest

import family_assets as FA
from finetune import data as D
from finetune.data import IGNORE
from finetune.recipe import Recipe, RecipeError, chat_template_text

ALPACA = {"instruction": "Name the capital of France.", "input": "", "output": "Paris"}
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]
ROWS = {
    "alpaca": ALPACA,
    "prompt_completion": {"prompt": "The capital of France is", "completion": " Paris"},
    "text": {"text": "Paris is the capital of France."},
    "messages": {"messages": CHAT},
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Mistral-7B v0.1's sentencepiece tokenizer (32,000 tokens, adds <s>), a [INST] template of ours."""
    tok = FA.mistral_tokenizer("v1", tmp_path_factory.mktemp("v1"))
    tok.chat_template = FA.MISTRAL
    return tok


@pytest.fixture(scope="module")
def mistral_v3(tmp_path_factory):
    """Mistral-7B-Instruct v0.3's: [INST] and [/INST] are control tokens."""
    tok = FA.mistral_tokenizer("v3", tmp_path_factory.mktemp("v3"))
    tok.chat_template = FA.MISTRAL
    return tok


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    """Mistral's tekken: a 131k byte-level BPE that, converted by transformers, adds no BOS."""
    tok = FA.tekken_tokenizer(tmp_path_factory.mktemp("tekken") / "tok")
    tok.chat_template = FA.CHATML.replace("<|im_start|>", "[INST]").replace("<|im_end|>", "</s>")
    return tok


@pytest.fixture(scope="module")
def llama3_bpe(tmp_path_factory):
    """A Llama-3-style byte-level BPE (Llama 3's pre-tokenizer; adds <|begin_of_text|> itself)."""
    corpus = [m["content"] for m in CHAT] + ["Question: What is the capital of France? Answer: Paris",
                                             "The capital of France is Paris."]
    return FA.make_tokenizer(FA.FAMILIES["llama3"], corpus, tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def qwen_bpe(tmp_path_factory):
    """A Qwen2-style byte-level BPE: no BOS at all, ChatML's tokens special."""
    return FA.make_tokenizer(FA.FAMILIES["qwen2"], [m["content"] for m in CHAT], tmp_path_factory.mktemp("qwen"))


@contextlib.contextmanager
def templated(tok, template: str):
    """The module's tokenizer with another chat template for the length of a test."""
    kept = tok.chat_template
    tok.chat_template = template
    try:
        yield tok
    finally:
        tok.chat_template = kept


def runs(ids, labels):
    """The labelled stretches of a row, as lists of ids."""
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


def trained_texts(tok, ids, labels):
    return [tok.decode(r) for r in runs(ids, labels)]


# ---------------------------------------------------------------- BOS and EOS, all four formats


@pytest.mark.parametrize("fmt", list(ROWS))
@pytest.mark.parametrize("name", ["mistral", "mistral_v3"])
def test_sentencepiece_rows_start_with_one_bos(name, fmt, request):
    """The bug this issue reports: the tokenizer adds <s> itself, so the old code added none and then
    asked for no special tokens: rows had no BOS at all."""
    tok = request.getfixturevalue(name)
    ids, labels = D.encode_row(ROWS[fmt], fmt, tok, train_on_prompt=False, max_len=512)
    assert tok("x").input_ids[0] == tok.bos_token_id == 1
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, tok.convert_ids_to_tokens(ids[:4])
    assert labels[0] == (IGNORE if fmt != "text" else ids[0])
    if fmt != "messages":  # chats end with the template's own end-of-turn (here </s>, once per answer)
        assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
    else:
        assert ids.count(tok.eos_token_id) == 2 and ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("fmt", list(ROWS))
def test_tokenizer_without_bos_gets_none(tekken, fmt):
    ids, _ = D.encode_row(ROWS[fmt], fmt, tekken, train_on_prompt=False, max_len=512)
    assert tekken("x").input_ids == tekken("x", add_special_tokens=False).input_ids  # adds nothing
    assert tekken.bos_token_id not in ids
    ends = len(CHAT) if fmt == "messages" else 1  # this ChatML-like template closes every turn with </s>
    assert ids.count(tekken.eos_token_id) == ends and (fmt == "messages" or ids[-1] == tekken.eos_token_id)


def test_template_bos_and_tokenizer_bos_are_not_doubled(mistral):
    """The [INST] template renders {{ bos_token }}; the tokenizer would add another: one stays."""
    ids, _ = D.encode_messages(mistral, CHAT, False, 512)
    assert ids[:2].count(mistral.bos_token_id) == 1


@pytest.mark.parametrize("name,template", [
    (name, template) for name in ("mistral", "mistral_v3", "tekken", "llama3_bpe") for template in ("llama3", "mistral",
                                                                                                  "chatml")
] + [("qwen_bpe", "chatml")])  # Qwen has no BOS token for a template to render
def test_chat_rows_start_as_apply_chat_template_tokenizes_them(name, template, request):
    """Issue 20 item 8: a chat row is apply_chat_template(messages, tokenize=True)'s tokens (what
    serving feeds the model): the template's BOS where it renders one (Llama 3's and our [INST]
    template render {{ bos_token }}), none where it renders none (ChatML), whatever the tokenizer
    adds to plain text (the sentencepiece models and the Llama-3 BPE add one; tekken and Qwen none)."""
    tok = request.getfixturevalue(name)
    with templated(tok, FA.TEMPLATES[template]):
        for train_on_prompt in (False, True):
            ids, labels = D.encode_messages(tok, CHAT, train_on_prompt, 512)
            served = list(tok.apply_chat_template(CHAT, tokenize=True)["input_ids"])
            assert ids == served, (tok.convert_ids_to_tokens(ids[:3]), tok.convert_ids_to_tokens(served[:3]))
            assert D.encode_batch([{"messages": CHAT}], "messages", tok, train_on_prompt, 512) == [(ids, labels)]
        renders_bos = template != "chatml"
        assert (ids[0] == tok.bos_token_id) == renders_bos and ids.count(tok.bos_token_id) == int(renders_bos)
        if not renders_bos and D.bos_ids(tok):  # the case the issue reports: the tokenizer's BOS is not put in front
            assert D.bos_ids(tok) == [tok.bos_token_id] and tok("x").input_ids[0] == tok.bos_token_id


@pytest.mark.parametrize("name", ["mistral", "tekken"])
def test_response_that_already_ends_with_eos_gets_one(name, request):
    tok = request.getfixturevalue(name)
    for fmt, row in (("prompt_completion", {"prompt": "Q:", "completion": " yes</s>"}),
                     ("alpaca", dict(ALPACA, output="Paris</s>")), ("text", {"text": "done.</s>"})):
        ids, labels = D.encode_row(row, fmt, tok, False, 512)
        assert ids.count(tok.eos_token_id) == 1 and ids[-1] == labels[-1] == tok.eos_token_id, (fmt, ids)
        plain = {k: v.replace("</s>", "") for k, v in row.items()}
        assert D.encode_row(plain, fmt, tok, False, 512) == (ids, labels)


def test_completion_is_tokenized_as_it_continues_the_prompt(mistral):
    """Sentencepiece puts a word-start marker on a text's first word; a completion that follows a
    newline must not get one (inference continues the tokenized prompt)."""
    ids, labels = D.encode_row(ALPACA, "alpaca", mistral, False, 512)
    prompt = D.ALPACA_PROMPT.format(instruction=ALPACA["instruction"])
    alone = mistral(prompt + "Paris").input_ids
    assert ids == alone + [mistral.eos_token_id]
    assert trained_texts(mistral, ids, labels) == ["Paris</s>"]
    assert not mistral.convert_ids_to_tokens(runs(ids, labels)[0])[0].startswith("▁")


# ---------------------------------------------------------------- the seam between prompt and completion

SEAMS = [  # (prompt, completion): a prompt ending in a space; the space in the completion; a newline; a word cut
    ("Question: What is the capital of France? Answer: ", "Paris"),
    ("Question: What is the capital of France? Answer:", " Paris"),
    ("Question: What is the capital of France?\n", "Paris"),
    ("The capital of France is Par", "is."),
]


def trl_row(tok, prompt: str, completion: str):
    """TRL 1.16 SFTTrainer's row for a prompt-completion example (trl/trainer/sft_trainer.py,
    tokenize_fn): EOS appended to the completion's text, prompt and prompt + completion tokenized
    with the tokenizer's special tokens, the completion from their common prefix's length on
    (trl/data_utils.py, common_prefix_length)."""
    prompt_ids = tok(prompt).input_ids
    ids = tok(prompt + completion + tok.eos_token).input_ids
    n = next((k for k, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return ids, [IGNORE] * n + ids[n:]


@pytest.mark.parametrize("name", ["mistral", "mistral_v3", "tekken", "llama3_bpe"])
def test_prompt_completion_rows_decode_to_their_text_as_trl_tokenizes_them(name, request):
    """Issue 20 item 6: "Answer: " + "Paris" trained as "Answer:  Paris" (':', '▁', '▁Paris') with
    Mistral's sentencepiece models: the completion tokenized alone got sentencepiece's word-start ▁.
    Now the row is prompt + completion tokenized as one text, so it decodes to exactly that text, for
    sentencepiece and byte-level tokenizers alike, and its tokens and labels are TRL's: the completion
    starts where the prompt's own tokens stop matching, so a token merged across the seam (▁Paris,
    ' Paris', ▁Paris from ▁Par + is) is trained, as the completion's first characters are in it."""
    tok = request.getfixturevalue(name)
    bos = D.bos_ids(tok)
    for prompt, completion in SEAMS:
        row = {"prompt": prompt, "completion": completion}
        ids, labels = D.encode_row(row, "prompt_completion", tok, False, 512)
        assert ids[:len(bos)] == bos and ids[-1] == tok.eos_token_id
        assert tok.decode(ids[len(bos):-1]) == prompt + completion, (name, prompt, tok.convert_ids_to_tokens(ids[-5:]))
        assert (ids, labels) == trl_row(tok, prompt, completion), (prompt, tok.convert_ids_to_tokens(ids[-5:]))
        assert D.encode_batch([row], "prompt_completion", tok, False, 512) == [(ids, labels)]
        trained = runs(ids, labels)
        assert len(trained) == 1 and trained[0][-1] == tok.eos_token_id
        text = tok.decode(trained[0][:-1])
        assert completion.strip() in text and (prompt + completion).endswith(text.lstrip()), (prompt, text)
        assert D.encode_row(row, "prompt_completion", tok, True, 512) == (ids, ids)


@pytest.mark.parametrize("name", ["mistral", "mistral_v3"])
def test_a_prompt_ending_in_a_space_trains_one_answer_token(name, request):
    """The issue's case in tokens: '▁' + '▁Paris' (two spaces) is now '▁Paris', trained."""
    tok = request.getfixturevalue(name)
    ids, labels = D.encode_row({"prompt": "Answer: ", "completion": "Paris"}, "prompt_completion", tok, False, 64)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁Answer", ":", "▁Paris", "</s>"]
    assert labels == [IGNORE, IGNORE, IGNORE, ids[3], ids[4]]
    assert tok.decode(ids, skip_special_tokens=True) == "Answer: Paris"


# ---------------------------------------------------------------- chat templates of each family


def _family_tokenizer(template_name, tmp_path):
    """A tokenizer carrying the special tokens the template uses."""
    kind = {"llama3": "llama3", "chatml": "qwen", "qwen3": "qwen", "gemma": "gemma"}[template_name]
    corpus = [m["content"] for m in CHAT] + ["<think>\nadd\n</think>"]
    tok = FA.make_tokenizer(FA.Family("t", "", {}, "", kind, []), corpus, tmp_path)
    tok.chat_template = FA.TEMPLATES[template_name]
    return tok


EXPECTED = {  # what each template trains for CHAT: each answer (as the template renders it) and its end of turn
    "llama3": ["4<|eot_id|>", "6, of course.<|eot_id|>"],
    "chatml": ["4<|im_end|>\n", "6, of course.<|im_end|>\n"],
    "gemma": ["4<end_of_turn>\n", "6, of course.<end_of_turn>\n"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_assistant_turn_and_its_end_of_turn_are_trained(name, tmp_path):
    tok = _family_tokenizer(name, tmp_path)
    ids, labels = D.encode_messages(tok, CHAT, False, 512)
    assert trained_texts(tok, ids, labels) == EXPECTED[name]
    starts_with_bos = tok.bos_token_id is not None
    assert (ids[0] == tok.bos_token_id) == starts_with_bos and (tok.bos_token_id is None or
                                                               ids.count(tok.bos_token_id) == 1)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_generation_marks_give_transformers_assistant_mask(name, tmp_path):
    """With {% generation %} blocks, labels are transformers' own mask; and the same template without
    them is located to the same tokens by rendering it prefix by prefix."""
    tok = _family_tokenizer(name, tmp_path)
    plain_ids, plain_labels = D.encode_messages(tok, CHAT, False, 512)
    tok.chat_template = FA.with_generation_marks(FA.TEMPLATES[name])
    ids, labels = D.encode_messages(tok, CHAT, False, 512)
    want = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(want["input_ids"]) == plain_ids
    assert [lab != IGNORE for lab in labels] == [bool(m) for m in want["assistant_masks"]]
    assert labels == plain_labels and any(m for m in want["assistant_masks"])


@pytest.mark.parametrize("template", ["llama3", "chatml"])
@pytest.mark.parametrize("name", ["mistral", "mistral_v3", "tekken", "llama3_bpe"])
def test_generation_labels_are_transformers_mask_where_a_token_straddles_a_turn(name, template, request):
    """Issue 20 item 7: a tokenizer that does not know a template's markers as tokens (Mistral's
    sentencepiece models and tekken under Llama 3's or ChatML's template) has tokens that span the end
    of an assistant turn, `><` finishing `<|eot_id|>` and opening `<|start_header_id|>`. transformers'
    return_assistant_tokens_mask marks every token that holds a character of a {% generation %} block;
    the labels are that mask, and the same template without the marks trains the same tokens."""
    tok = request.getfixturevalue(name)
    with templated(tok, FA.TEMPLATES[template]):
        plain = D.encode_messages(tok, CHAT, False, 512)
    with templated(tok, FA.with_generation_marks(FA.TEMPLATES[template])):
        ids, labels = D.encode_messages(tok, CHAT, False, 512)
        want = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert D.encode_batch([{"messages": CHAT}], "messages", tok, False, 512) == [(ids, labels)]
    assert ids == list(want["input_ids"])
    assert [lab != IGNORE for lab in labels] == [bool(m) for m in want["assistant_masks"]]
    assert (ids, labels) == plain
    end = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    assert len(trained_texts(tok, ids, labels)) == 2
    for text in trained_texts(tok, ids, labels):
        assert end in text, text  # every trained turn holds its whole end-of-turn marker


def test_the_straddling_token_of_the_issue_is_trained(mistral):
    """Mistral v1 under a Llama-3 template with {% generation %}: `><` spans the first answer's
    `<|eot_id|>` and the next header; transformers trains it, and so do we."""
    with templated(mistral, FA.with_generation_marks(FA.LLAMA3)):
        ids, labels = D.encode_messages(mistral, CHAT, False, 512)
        want = mistral.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        text, spans = D.assistant_spans(mistral, CHAT)
    enc = mistral(text, add_special_tokens=False, return_offsets_mapping=True)
    straddling = [k for k, (a, b) in enumerate(enc.offset_mapping) if any(a < hi < b for _, hi in spans)]
    assert straddling and all(mistral.convert_ids_to_tokens(ids[k]) == "><" for k in straddling)
    assert all(labels[k] == ids[k] and want["assistant_masks"][k] == 1 for k in straddling)


def test_qwen3_trains_each_answer_as_the_full_rendering_shows_it(tmp_path):
    """Qwen3 drops an answer's <think> block once a later user message follows: the first answer is
    trained without it (as the full conversation renders it), the last with it."""
    tok = _family_tokenizer("qwen3", tmp_path)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}]
    ids, labels = D.encode_messages(tok, chat, False, 512)
    full = tok.decode(ids)
    assert "<think>\nadd\n</think>" not in full and "<think>\nadd again\n</think>" in full
    assert trained_texts(tok, ids, labels) == ["4<|im_end|>\n", "<think>\nadd again\n</think>\n\n6<|im_end|>\n"]


def test_mistral_trains_every_answer_though_the_system_prompt_moves(mistral_v3):
    """The system prompt goes into the last user message, so the conversation's earlier renderings
    are not prefixes of the full one (the old code stopped the run here)."""
    ids, labels = D.encode_messages(mistral_v3, CHAT, False, 512)
    text = mistral_v3.decode(ids)
    assert text.index("Answer briefly.") > text.index("What is 2+2?")
    assert [t.strip() for t in trained_texts(mistral_v3, ids, labels)] == ["4</s>", "6, of course.</s>"]
    assert mistral_v3.convert_ids_to_tokens(ids[:2]) == ["<s>", "[INST]"]


def test_phi3_closing_eos_is_trained_with_the_last_answer_only(tmp_path):
    """Phi-3 ends the conversation, not each turn, with EOS."""
    tok = FA.make_tokenizer(FA.FAMILIES["phi3"], [m["content"] for m in CHAT], tmp_path)
    tok.chat_template = FA.PHI3
    ids, labels = D.encode_messages(tok, CHAT, False, 512)
    assert trained_texts(tok, ids, labels) == ["4<|end|>\n", "6, of course.<|end|>\n<|endoftext|>"]
    assert tok.bos_token_id not in ids  # Phi-3's tokenizer adds none and its template renders none


def test_template_that_hides_an_answer_is_a_clear_error(tmp_path):
    tok = _family_tokenizer("chatml", tmp_path)
    hidden = FA.QWEN3.replace("'<|im_start|>assistant\n' + content + '<|im_end|>\n'",
                              "'<|im_start|>assistant\n(earlier answer)<|im_end|>\n'")
    assert hidden != FA.QWEN3
    tok.chat_template = hidden
    with pytest.raises(D.DataError, match="generation"):
        D.encode_messages(tok, CHAT, False, 512)
    ids, labels = D.encode_messages(tok, CHAT, True, 512)  # train_on_prompt needs no location
    assert labels == ids


def test_template_that_raises_is_a_data_error(tmp_path):
    tok = _family_tokenizer("chatml", tmp_path)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(D.DataError, match="roles must alternate"):
        D.encode_messages(tok, CHAT, False, 512)


# Templates whose expressions fail in Python, not in Jinja: what a template bug looks like at run time
PYTHON_ERRORS = {
    "TypeError": "{% for m in messages %}{{ m['content'] + loop.index }}{% endfor %}",
    "ZeroDivisionError": "{{ bos_token }}{{ messages | length // 0 }}",
    "ValueError": "{% for m in messages %}{{ '{:d}'.format(m['content']) }}{% endfor %}",
    "UndefinedError": "{{ messages[99]['content'] }}",  # an index past the end is Undefined; its item raises
}


@pytest.mark.parametrize("error", list(PYTHON_ERRORS))
@pytest.mark.parametrize("tokenizer", ["mistral-v1", "chatml-bpe"])
def test_template_that_fails_in_python_is_one_data_error_line(error, tokenizer, tmp_path):
    """A Python error inside the template (not a Jinja syntax error, not raise_exception) is a DataError,
    one line naming the template's source and the error, with Mistral's sentencepiece tokenizer and a
    byte-level BPE, and in both renderings (one conversation, a batch)."""
    from finetune.model import load_tokenizer

    if tokenizer == "mistral-v1":
        FA.mistral_tokenizer("v1", tmp_path / "tok").save_pretrained(tmp_path / "tok")
    else:
        _family_tokenizer("chatml", tmp_path / "bpe").save_pretrained(tmp_path / "tok")
    (tmp_path / "broken.jinja").write_text(PYTHON_ERRORS[error])
    recipe = Recipe(tokenizer=str(tmp_path / "tok"), chat_template=str(tmp_path / "broken.jinja"))
    tok = load_tokenizer(recipe, str(tmp_path / "tok"))
    for encode in (lambda: D.encode_messages(tok, CHAT, False, 512),
                   lambda: D.render_chats(tok, [CHAT, CHAT])):
        with pytest.raises(D.DataError) as e:
            encode()
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"the chat template (chat_template={tmp_path / 'broken.jinja'}) failed on a "
                                  f"conversation ({error}: "), message
        assert message.endswith("fix the template (or set the recipe's chat_template to one that renders this "
                                "data), or the data")


# ---------------------------------------------------------------- recipe fields tokenizer and chat_template


def test_chat_template_inline_file_and_json(tmp_path):
    assert chat_template_text(Recipe()) is None
    assert chat_template_text(Recipe(chat_template=FA.CHATML)) == FA.CHATML
    (tmp_path / "t.jinja").write_text(FA.GEMMA)
    assert chat_template_text(Recipe(chat_template=str(tmp_path / "t.jinja"))) == FA.GEMMA
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": FA.LLAMA3}))
    assert chat_template_text(Recipe(chat_template=str(tmp_path / "tokenizer_config.json"))) == FA.LLAMA3
    for bad, says in ((str(tmp_path / "missing.jinja"), "no such file"), (str(tmp_path / "t.jinja") + "x", "no such"),
                      (str(tmp_path / "tokenizer_config.json").replace("tokenizer_config", "x"), "no such")):
        with pytest.raises(RecipeError, match=says):
            chat_template_text(Recipe(chat_template=bad))
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(RecipeError, match="no Jinja tags"):
        chat_template_text(Recipe(chat_template=str(tmp_path / "plain.txt")))


def test_chat_template_replaces_the_models_and_changes_the_data_fingerprint(finetune_cache, tmp_path, tiny_tokenizer):
    from finetune.checkpointing.manifest import DATA_KEYS, fingerprint
    from finetune.model import load_tokenizer

    (tmp_path / "chatml.jinja").write_text(FA.CHATML)
    recipe = Recipe(chat_template=str(tmp_path / "chatml.jinja"))
    tok = load_tokenizer(recipe, tiny_tokenizer.name_or_path)
    assert tok.chat_template == FA.CHATML != tiny_tokenizer.chat_template
    assert D.tokenizer_fingerprint(tok) != D.tokenizer_fingerprint(tiny_tokenizer)  # the data cache key
    assert {"tokenizer", "chat_template"} <= set(DATA_KEYS)
    assert fingerprint(recipe) != fingerprint(Recipe())
    other = load_tokenizer(Recipe(tokenizer=tiny_tokenizer.name_or_path), "/nonexistent")  # tokenizer= wins
    assert other.chat_template == tiny_tokenizer.chat_template


def test_bad_chat_template_stops_the_run_before_anything_loads(tmp_path):
    import subprocess
    import sys

    from family_assets import REPO

    proc = subprocess.run([sys.executable, "finetune/run.py", "--recipe", "tiny", f"output_dir={tmp_path / 'o'}",
                           f"chat_template={tmp_path / 'nope.jinja'}", "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: chat_template=") and "no such file" in proc.stderr
