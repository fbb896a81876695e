"""Prompt rows for objective=grpo (finetune/data/prompts.py): detection, checks, tokens as a prompt
continues into generation (text: BOS + text; messages: the chat template with its generation prompt,
as apply_chat_template makes them), the budget (max_prompt_len cuts the start; else a too-long prompt is
refused, naming its row), and the prepared dataset keeping the columns the rewards read. Real
tokenizer: Mistral's sentencepiece model from the mistral_common wheel (tests/family_assets.py)."""

import json

import pytest

import family_assets as FA
from finetune import data as D
from finetune.recipe import DataSource, Recipe

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12 + 30?"}]
GRPO = {"objective": "grpo", "reward_funcs": ("finetune.rewards:exact_match",), "num_generations": 2,
        "micro_batch_size": 2, "num_proc": 1, "max_seq_len": 64, "max_completion_len": 16}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    tok = FA.mistral_tokenizer("v3", tmp_path_factory.mktemp("v3"))
    tok.chat_template = FA.CHATML  # a template with a generation prompt
    return tok


def test_prompt_rows_are_detected_and_checked():
    assert D.detect_format(["prompt", "answer", "level"], "d") == "prompt"
    assert D.detect_format(["prompt"], "d") == "prompt"
    assert D.detect_format(["prompt", "completion"], "d") == "prompt_completion"
    D.check_row({"prompt": "2+2=", "answer": "4"}, "prompt", "d row 0")
    D.check_row({"prompt": CHAT}, "prompt", "d row 0")
    with pytest.raises(D.DataError, match="d row 1: the prompt is empty"):
        D.check_row({"prompt": ""}, "prompt", "d row 1")
    with pytest.raises(D.DataError, match="must be a string or a list of .* got a int"):
        D.check_row({"prompt": 3}, "prompt", "d row 1")
    with pytest.raises(D.DataError, match="the prompt's last message is the assistant's"):
        D.check_row({"prompt": CHAT + [{"role": "assistant", "content": "42"}]}, "prompt", "d row 1")


def test_tokens_are_what_generation_continues_from(mistral):
    out = D.encode_prompts([{"prompt": "What is 12 + 30?"}, {"prompt": CHAT}], mistral)
    assert out["prompt_input_ids"][0] == mistral("What is 12 + 30?").input_ids  # its BOS, then the text
    assert out["prompt_input_ids"][0][0] == mistral.bos_token_id
    expected = mistral.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert out["prompt_input_ids"][1] == expected["input_ids"]
    assert mistral.decode(out["prompt_input_ids"][1]).endswith("<|im_start|>assistant\n")
    assert out["n_tokens"] == [len(x) for x in out["prompt_input_ids"]]


def test_long_prompts_lose_their_start_or_are_refused(mistral):
    long = "one two three four five six seven eight nine ten eleven twelve"
    whole = mistral(long).input_ids
    cut = D.encode_prompts([{"prompt": long}], mistral, max_prompt_len=5)["prompt_input_ids"][0]
    assert cut == whole[:1] + whole[-4:] and cut[0] == mistral.bos_token_id  # the BOS stays, counted
    assert D.encode_prompts([{"prompt": long}], mistral, max_prompt_len=50)["prompt_input_ids"][0] == whole
    with pytest.raises(D.DataError, match=f"d row 7: the prompt has {len(whole)} tokens, more than the 5 that "
                                          "max_seq_len - max_completion_len leaves; set max_prompt_len"):
        D.encode_prompts([{"prompt": long}], mistral, room=5, where=["d row 7"])


def test_prepared_prompts_keep_the_reward_columns(mistral, tmp_path):
    rows = [{"question": "What is 12 + 30?", "answer": "42", "level": 1},
            {"question": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4", "level": 2}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    spec = DataSource(path=str(path), columns={"prompt": "question"})
    ds = D.tokenize_dataset(D.load_source(spec), "auto", mistral, Recipe(**GRPO), "prompts", spec=spec)
    assert sorted(ds.column_names) == ["answer", "level", "n_tokens", "prompt", "prompt_input_ids"]
    assert ds[0]["prompt"] == "What is 12 + 30?" and ds[0]["answer"] == "42"
    assert ds[0]["prompt_input_ids"] == mistral("What is 12 + 30?").input_ids
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": rows[1]["question"], "answer": "4"}) + "\n")
    ds = D.tokenize_dataset(D.load_source(DataSource(path=str(chats))), "prompt", mistral,
                            Recipe(**GRPO, max_prompt_len=8), "chats")
    assert ds[0]["n_tokens"] == 8 and ds[0]["prompt"] == rows[1]["question"]


def test_objective_and_rows_must_agree():
    with pytest.raises(D.DataError, match="objective=grpo needs prompt rows"):
        D.sources.check_objective(Recipe(**GRPO), "messages", "dataset", "d.jsonl")
    with pytest.raises(D.DataError, match="has prompt rows .* which train with objective=grpo"):
        D.sources.check_objective(Recipe(), "prompt", "dataset", "d.jsonl")
    D.sources.check_objective(Recipe(**GRPO), "prompt", "dataset", "d.jsonl")


# ---------------------------------------------------------------- finetune data --show


def test_show_prompt_renders_the_prompt_and_lists_the_reward_columns(mistral):
    text = {"prompt": "What is 12 + 30?", "answer": "42", "level": 1, "tags": ["sum"],
            "prompt_input_ids": mistral("What is 12 + 30?").input_ids, "n_tokens": 9}
    assert D.prompt_columns(text) == ["answer", "level", "tags"]
    decoded = mistral.decode(text["prompt_input_ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded.startswith("<s>") and decoded.endswith("What is 12 + 30?")  # the BOS, then the text
    shown = D.show_prompt(mistral, text).splitlines()
    assert shown == ["prompt:   " + decoded, "answer:   42", "level:    1", 'tags:     ["sum"]']
    ids = D.encode_prompts([{"prompt": CHAT}], mistral)["prompt_input_ids"][0]
    chat = D.show_prompt(mistral, {"prompt": CHAT, "answer": "42", "prompt_input_ids": ids, "n_tokens": len(ids)})
    # the conversation as the chat template renders it (ChatML), its assistant turn opened, then the columns
    rendered = mistral.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert chat == "prompt:   " + rendered + "\nanswer:   42"
    assert rendered.rstrip().endswith("<|im_start|>assistant") and "What is 12 + 30?" in rendered
    assert "\x1b[" in D.show_prompt(mistral, text, colour=True) and "\x1b[" not in "\n".join(shown)


def test_data_command_shows_prompt_rows(mistral, tmp_path, capsys):
    """`finetune data --show` on a prompt set with a mapped column: each row's prompt and the columns the
    reward functions get; --json gives the rows' columns."""
    from finetune.commands import data as data_command

    tok_dir = tmp_path / "tok"
    mistral.save_pretrained(tok_dir)
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(6)]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "grpo.py"
    recipe.write_text(f'''from finetune.recipe import DataSource, Recipe

recipe = Recipe(
    tokenizer={str(tok_dir)!r},
    datasets=[DataSource(path={str(path)!r}, format="prompt", columns={{"prompt": "question"}})],
    objective="grpo",
    reward_funcs=("finetune.rewards:exact_match",),
    num_generations=2,
    micro_batch_size=2,
    max_seq_len=64,
    max_completion_len=16,
    mixed_precision="no",
    eval_fraction=0.0,
    num_proc=1,
    output_dir={str(tmp_path / "out")!r},
)
''')
    assert data_command.main(["--recipe", str(recipe), "--show", "3", "--color", "never"]) == 0
    out = capsys.readouterr().out
    blocks = out.split("--- row ")[1:]
    assert len(blocks) == 3
    for position, block in enumerate(blocks):
        header, body = block.split("\n", 1)
        assert f"(prompt {'first' if position == 0 else f'#{position + 1}'} of the run): " in header
        assert header.endswith("the reward functions get prompts, completions, completion_ids, answer, level")
        lines = body.splitlines()
        assert lines[0].startswith("prompt:   ") and "What is " in lines[0] and "[[" not in lines[0]
        i = int(lines[0].split("What is ")[1].split(" ")[0])
        assert lines[1] == f"answer:   {i + 1}" and lines[2] == f"level:    {i % 3}"
    assert "trained tokens in" not in out and "(prompt, split train)" in out
    # prompts have no target tokens: the data lines count prompt tokens, not "0 target tokens (0.0%)"
    assert "target tokens" not in out and "prompt tokens (the completions are sampled)" in out
    assert data_command.main(["--recipe", str(recipe), "--show", "2", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(shown) == 2
    for r in shown:
        assert r["prompt"].startswith("What is ") and {"answer", "level", "prompt_input_ids"} <= set(r)
        assert r["prompt_input_ids"] == mistral(r["prompt"]).input_ids


def test_a_too_long_prompt_is_named_by_its_file_line(mistral, tmp_path):
    """After the eval split a row's index is no one's ("row 139" before): the error names the prompt's
    line in its file, in the training part and in the held-out part alike."""
    long = " ".join(["word"] * 80)
    rows = [{"prompt": f"short {i}", "answer": "a"} for i in range(40)]
    rows[29]["prompt"] = long
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[10:]))
    for fraction in (0.05, 0.95):  # the long row in the training part, then in the eval part
        recipe = Recipe(**GRPO, dataset=str(path), eval_fraction=fraction)
        with pytest.raises(D.DataError) as e:
            D.build_datasets(recipe, mistral)
        assert str(e.value).startswith(f"{path} line 31: the prompt has "), str(e.value)


def test_a_lone_surrogate_in_a_prompt_is_named_with_its_cause(mistral, tmp_path):
    """A JSON escape of half a UTF-16 pair decodes to a lone surrogate, which the tokenizer cannot encode
    (before: a traceback from inside the tokenizer, no row, no cause)."""
    from finetune.data.sources import prevalidate

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine", "answer": "a"}\n{"prompt": "smile \\ud83d", "answer": "a"}\n'
                    '{"prompt": [{"role": "user", "content": "x\\udc00"}], "answer": "a"}\n')
    with pytest.raises(D.DataError, match=rf"{path} line 2: the prompt holds a lone surrogate \('\\ud83d' at "
                                          r"character 6: half of a UTF-16 pair"):
        prevalidate(str(path), "prompt", "dataset")  # before the model loads, from the file itself
    # rows that reach tokenizing without prevalidation (a hub dataset's) are checked there, row by row
    with pytest.raises(D.DataError, match=r"d row 1: the prompt holds a lone surrogate"):
        D.check_row({"prompt": "smile \ud83d"}, "prompt", "d row 1")
    with pytest.raises(D.DataError, match=r"d row 0: the prompt's message 0 holds a lone surrogate"):
        D.check_row({"prompt": [{"role": "user", "content": "x\udc00"}]}, "prompt", "d row 0")
