"""Data the way users have it (issue 13), in-process and without training: mixtures of DataSource(...)
with weights or row counts, column mapping (ShareGPT's conversations of from/value), splits and
eval_split of local folders and save_to_disk datasets, batched tokenization equal to the per-row
encoder on real tokenizers, the `python -m finetune.data --show` view, and the one-line errors that
stop a run before any model is loaded. The 2-process mixture run and its exact resume are in
tests/distributed/test_mixture_run.py."""

from __future__ import annotations

import json
import signal
from dataclasses import replace

import numpy as np
import pytest

import family_assets as FA
from finetune import data as D
from finetune.commands import data as data_command
from finetune.data import IGNORE, DataError
from finetune.recipe import DataSource, Recipe, RecipeError, apply_overrides, validate

SHAREGPT = {"messages": "conversations", "role": "from", "content": "value"}


def chats(n: int, start: int = 0) -> list[dict]:
    """ShareGPT rows: conversations of {from, value}, human and gpt."""
    return [{"id": i, "conversations": [{"from": "system", "value": "Answer briefly."},
                                        {"from": "human", "value": f"What is {i} plus {i}?"},
                                        {"from": "gpt", "value": f"{2 * i}."},
                                        {"from": "human", "value": "And doubled?"},
                                        {"from": "gpt", "value": f"It is {4 * i}."}]}
            for i in range(start, start + n)]


def alpaca(n: int) -> list[dict]:
    return [{"instruction": "Reverse the word.", "input": w, "output": w[::-1]}
            for w in (f"word{i}" for i in range(n))]


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


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Mistral-7B-Instruct v0.3's real sentencepiece tokenizer (mistral_common) with the [INST] template,
    saved so that a recipe can name it with tokenizer=DIR."""
    out = tmp_path_factory.mktemp("mistral")
    tok = FA.mistral_tokenizer("v3", out / "src")
    tok.chat_template = FA.MISTRAL
    tok.save_pretrained(out / "tok")
    return tok, out / "tok"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A Llama-3-style byte-level BPE (adds <|begin_of_text|>) with Llama 3's template."""
    corpus = [m["value"] for row in chats(40) for m in row["conversations"]] + [r["output"] for r in alpaca(40)]
    tok = FA.make_tokenizer(FA.FAMILIES["llama3"], corpus, tmp_path_factory.mktemp("llama3"))
    tok.chat_template = FA.LLAMA3
    return tok


# ---------------------------------------------------------------- mixing arithmetic


def test_weights_take_shares_of_each_source():
    sources = [DataSource(path="a", weight=0.5), DataSource(path="b", weight=2.0), DataSource(path="c", weight=1.5),
               DataSource(path="d", rows=7), DataSource(path="e", rows=25)]
    available = [10, 10, 10, 10, 10]
    counts = D.mixture_counts(available, sources)
    assert counts == [5, 20, 15, 7, 25]
    picks = D.mixture_indices(available, counts, seed=42)
    assert [len(p) for p in picks] == counts
    assert len(set(picks[0].tolist())) == 5  # a half: distinct rows
    assert sorted(picks[1].tolist()) == sorted(list(range(10)) * 2)  # twice: every row twice
    assert np.bincount(picks[2], minlength=10).min() == 1 and np.bincount(picks[2]).max() == 2
    assert len(set(picks[3].tolist())) == 7
    assert np.bincount(picks[4], minlength=10).tolist().count(3) == 5  # 25 of 10: each twice, half of them thrice


def test_mix_is_a_pure_function_of_the_seed():
    available, counts = [100, 50], [30, 80]
    a, b = D.mixture_indices(available, counts, 1), D.mixture_indices(available, counts, 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    other = D.mixture_indices(available, counts, 2)
    assert not np.array_equal(a[0], other[0])
    assert (np.diff(a[0]) >= 0).all()  # a subset in the source's order: the BatchSchedule shuffles the mix


def test_a_weight_that_takes_no_row_is_an_error():
    msg = one_line(D.mixture_counts, [10], [DataSource(path="a", weight=0.01)], error=DataError)
    assert msg.startswith("datasets[0]: weight=0.01 of its 10 rows rounds to no row")


# ---------------------------------------------------------------- the recipe


def test_recipe_source_errors_name_the_key_and_value(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", alpaca(4))

    def check(**source):
        return one_line(validate, Recipe(datasets=(DataSource(path=str(good)), DataSource(**source))))

    assert check(path=str(good), weight=0).startswith("datasets[1].weight=0: must be a positive number")
    assert check(path=str(good), weight=-1.0).startswith("datasets[1].weight=-1.0: must be a positive number")
    assert check(path=str(good), weight=float("nan")).startswith("datasets[1].weight=nan")
    assert "set one of them" in check(path=str(good), weight=0.5, rows=10)
    assert check(path=str(tmp_path / "nope.jsonl")) == f"datasets[1].path={tmp_path / 'nope.jsonl'}: no such file or directory"
    assert check(path="builtin:nope").startswith("datasets[1].path=builtin:nope: unknown builtin")
    assert check(path=str(good), format="chatml").startswith("datasets[1].format=chatml: must be one of auto,")
    assert "maps 'question', which no format has" in check(path=str(good), columns={"question": "q"})
    assert "'gpt' to 'bot'" in check(path=str(good), roles={"gpt": "bot"})
    assert check(path=str(good), rows="10").startswith("datasets[1].rows='10': expected an integer")


def test_command_line_overrides_of_a_mixture(tmp_path):
    good = str(write_jsonl(tmp_path / "a.jsonl", alpaca(4)))
    mix = Recipe(datasets=[DataSource(path=good), DataSource(path=good, columns=SHAREGPT)])
    assert isinstance(mix.datasets, tuple)  # a list in the recipe file is kept as a tuple
    changed = apply_overrides(mix, ["datasets.1.weight=0.25", "datasets.0.columns=prompt:instruction,completion:output"])
    assert changed.datasets[1].weight == 0.25 and changed.datasets[0].columns == {"prompt": "instruction",
                                                                                  "completion": "output"}
    assert apply_overrides(mix, [f"dataset={good}"]).datasets == ()  # one source instead of the mixture
    assert "override one with datasets.N.split" in one_line(apply_overrides, mix, ["dataset_split=test"])
    assert one_line(apply_overrides, mix, ["datasets.2.weight=1"]).startswith(
        "datasets.2.weight=1: the recipe has 2 source(s)")
    assert "unknown DataSource field 'wieght'" in one_line(apply_overrides, mix, ["datasets.0.wieght=1"])
    assert "a list of DataSource" in one_line(apply_overrides, mix, ["datasets=a,b"])
    assert "eval_dataset" in one_line(validate, apply_overrides(mix, ["eval_split=test"]))
    # the single-source keys keep working as before
    single = apply_overrides(Recipe(), [f"dataset={good}", "dataset_split=train", "dataset_format=alpaca"])
    assert single.dataset == good and single.datasets == ()


def test_fingerprint_of_a_single_dataset_is_unchanged_and_a_mixture_is_data():
    from finetune.checkpointing.manifest import DATA_KEYS, HARD_KEYS, OPTIONAL_DATA_KEYS, fingerprint

    before = set(HARD_KEYS + DATA_KEYS) - set(OPTIONAL_DATA_KEYS)  # the keys earlier versions wrote
    assert set(fingerprint(Recipe())) == before
    mix = Recipe(datasets=(DataSource(path="builtin:tiny-tasks", weight=0.5),))
    assert fingerprint(mix)["datasets"] == [json.loads(json.dumps(DataSource(path="builtin:tiny-tasks",
                                                                             weight=0.5).__dict__))]


def test_a_resume_that_changes_the_mixture_is_refused(tmp_path):
    import dataclasses

    from finetune.checkpointing.manifest import fingerprint
    from finetune.checkpointing.resume import ResumePoint, check_fits

    mix = Recipe(datasets=(DataSource(path="builtin:tiny-tasks", weight=0.5),))
    # the fingerprint as resume.find reads it from a checkpoint's manifest
    point = ResumePoint(tmp_path / "step_000000003", 3, 2, 16, "zero3", {},
                        manifest={"fingerprint": json.loads(json.dumps(fingerprint(mix)))})
    check_fits(point, mix, allow_data_change=False)
    changed = dataclasses.replace(mix, datasets=(DataSource(path="builtin:tiny-tasks", weight=0.6),))
    assert "datasets" in one_line(check_fits, point, changed, allow_data_change=False)
    check_fits(point, changed, allow_data_change=True)
    assert "datasets" in one_line(check_fits, point, Recipe(), allow_data_change=False)  # mixture -> single


# ---------------------------------------------------------------- column mapping


def test_sharegpt_rows_map_onto_messages():
    spec = DataSource(path="x", columns=SHAREGPT)
    row = D.map_row(chats(1, start=3)[0], spec, "x line 1")
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert row["messages"][2] == {"role": "assistant", "content": "6."}
    custom = DataSource(path="x", columns=SHAREGPT, roles={"bot": "assistant"})
    bot = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}
    assert D.map_row(bot, custom, "x")["messages"][1]["role"] == "assistant"


def test_a_mapping_that_does_not_fit_names_the_field():
    spec = DataSource(path="x", columns=SHAREGPT)
    msg = one_line(D.map_row, {"messages": []}, spec, "x line 4", error=DataError)
    assert msg == ("x line 4: columns maps messages to 'conversations', but the row has no field 'conversations' "
                   "(its fields: messages)")
    msg = one_line(D.map_row, {"id": 3, "conversations": None}, spec, "hub/x row 3", error=DataError)
    assert msg.endswith("the row has no field 'conversations' (its fields: id)")  # null in Arrow: missing
    turns = {"conversations": [{"role": "user", "content": "hi"}]}
    msg = one_line(D.map_row, turns, spec, "x line 2", error=DataError)
    assert msg.startswith("x line 2: message 0 has no field 'from' (the role; columns maps role to 'from')")
    odd = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "yo"}]}
    msg = one_line(D.map_row, odd, spec, "x line 9", error=DataError)
    assert "message 1 has role 'bing'" in msg and "roles={'bing': 'assistant'}" in msg
    msg = one_line(D.check_columns, ["text", "id"], DataSource(path="x", columns={"prompt": "question"}), "hub/x",
                   error=DataError)
    assert msg == "hub/x: columns maps prompt to 'question', but the rows have no field 'question' (their fields: id, text)"


def test_prevalidate_applies_the_mapping_and_names_the_line(tmp_path):
    rows = chats(3)
    rows[1] = {"id": 1, "conversation": rows[1]["conversations"]}
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    spec = DataSource(path=str(path), columns=SHAREGPT)
    msg = one_line(D.prevalidate, str(path), "auto", "datasets[0].path", spec=spec, error=DataError)
    assert msg.startswith(f"{path} line 2: columns maps messages to 'conversations', but the row has no field")
    good = write_jsonl(tmp_path / "good.jsonl", chats(3))
    assert D.prevalidate(str(good), "auto", spec=DataSource(path=str(good), columns=SHAREGPT)) == "messages"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), tmp_path / "qa.parquet")
    qa = DataSource(path=str(tmp_path / "qa.parquet"), columns={"prompt": "question", "completion": "response"})
    msg = one_line(D.prevalidate, qa.path, "auto", spec=qa, error=DataError)
    assert "columns maps completion to 'response', but the rows have no field 'response'" in msg
    ok = DataSource(path=qa.path, columns={"prompt": "question", "completion": "answer"})
    assert D.prevalidate(qa.path, "auto", spec=ok) == "prompt_completion"


def test_sharegpt_without_a_mapping_is_read_as_messages(tmp_path, mistral):
    """Issue 20 item 5: a ShareGPT file (conversations of {from, value}) needs no columns=: with
    format auto or messages its rows are read as the explicit mapping reads them; JSONL, parquet and
    save_to_disk alike, and conversations of {role, content} too."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    tok, _ = mistral
    path = write_jsonl(tmp_path / "share.jsonl", chats(6))
    assert D.prevalidate(str(path), "auto") == "messages" == D.prevalidate(str(path), "messages")
    pq.write_table(pa.Table.from_pylist(chats(3)), tmp_path / "share.parquet")
    assert D.prevalidate(str(tmp_path / "share.parquet"), "auto") == "messages"
    Dataset.from_list(chats(3)).save_to_disk(str(tmp_path / "saved"))
    assert D.prevalidate(str(tmp_path / "saved"), "auto") == "messages"
    recipe = Recipe(max_seq_len=256, eval_fraction=0)
    mapped = D.build_datasets(replace(recipe, datasets=(DataSource(path=str(path), columns=SHAREGPT),)), tok)
    for plain in (replace(recipe, dataset=str(path)), replace(recipe, dataset=str(path), dataset_format="messages")):
        data = D.build_datasets(plain, tok)
        assert data.format == "messages" and data.train["input_ids"] == mapped.train["input_ids"]
        assert data.train["labels"] == mapped.train["labels"]
    trained = [t for t, lab in zip(data.train[0]["input_ids"], data.train[0]["labels"]) if lab != IGNORE]
    assert tok.decode(trained).replace(" ", "") == "0.</s>Itis0.</s>"  # both gpt turns, nothing else
    turns = [{"id": r["id"], "conversations": [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
                                                "content": m["value"]} for m in r["conversations"]]} for r in chats(6)]
    role_content = write_jsonl(tmp_path / "turns.jsonl", turns)
    assert D.prevalidate(str(role_content), "auto") == "messages"
    data = D.build_datasets(replace(recipe, dataset=str(role_content)), tok)
    assert data.train["input_ids"] == mapped.train["input_ids"] and data.train["labels"] == mapped.train["labels"]


def test_sharegpt_read_as_another_format_says_what_to_set(tmp_path):
    """A recipe whose dataset_format is alpaca (as recipes/tiny.py's) given a ShareGPT file: one line
    naming the file, the line and the setting that reads it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write_jsonl(tmp_path / "share.jsonl", chats(2))
    msg = one_line(D.prevalidate, str(path), "alpaca", error=DataError)
    assert msg.startswith(f"{path} line 1: missing field 'instruction' (dataset_format=alpaca needs instruction, "
                          "output); these rows hold ShareGPT conversations: set dataset_format=messages"), msg
    pq.write_table(pa.Table.from_pylist(chats(2)), tmp_path / "share.parquet")
    msg = one_line(D.prevalidate, str(tmp_path / "share.parquet"), "alpaca", error=DataError)
    assert "missing column(s) ['instruction', 'output']" in msg and "set dataset_format=messages" in msg


def test_an_unknown_role_is_named_with_file_line_and_the_roles_allowed(tmp_path, mistral):
    """Issue 20 item 5: a `bot` turn (a messages row, or a ShareGPT row without a mapping) is named:
    file, line, message, role, the roles there are and the mapping that fixes it; also in data that is
    only seen while tokenizing (a hub dataset)."""
    from datasets import Dataset

    allowed = "which is none of system, user, assistant, tool; map it with roles={'bot': 'assistant'}"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]})
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    msg = one_line(D.prevalidate, str(path), "auto", error=DataError)
    assert msg.startswith(f"{path} line 3: message 1 has role 'bot', {allowed}"), msg
    share = chats(3)
    share[1]["conversations"][4]["from"] = "bot"
    path = write_jsonl(tmp_path / "share.jsonl", share)
    msg = one_line(D.prevalidate, str(path), "auto", error=DataError)
    assert msg.startswith(f"{path} line 2: message 4 has role 'bot', {allowed}"), msg
    fixed = DataSource(path=str(path), roles={"bot": "assistant"})
    assert D.prevalidate(str(path), "auto", spec=fixed) == "messages"
    tok, _ = mistral
    msg = one_line(D.tokenize_dataset, Dataset.from_list(rows), "auto", tok, Recipe(max_seq_len=256), "hub/chat",
                   error=DataError)
    assert msg.startswith(f"hub/chat row 2: message 1 has role 'bot', {allowed}"), msg


# ---------------------------------------------------------------- splits


@pytest.fixture
def split_folders(tmp_path):
    """A folder of train/test files, and a save_to_disk DatasetDict with train and validation."""
    from datasets import Dataset, DatasetDict

    files = tmp_path / "files"
    write_jsonl(files / "train.jsonl", alpaca(30))
    write_jsonl(files / "test.jsonl", alpaca(6))
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(chats(20)), "validation": Dataset.from_list(chats(4, start=50))}
                ).save_to_disk(str(saved))
    return files, saved


def test_splits_of_local_folders(split_folders):
    files, saved = split_folders
    assert {k: [p.name for p in v] for k, v in D.local_splits(files).items()} == {"train": ["train.jsonl"],
                                                                                 "test": ["test.jsonl"]}
    assert len(D.load_source(DataSource(path=str(files), split="test"))) == 6
    assert len(D.load_source(DataSource(path=str(saved), split="validation"))) == 4
    assert D.saved_splits(saved) == ["train", "validation"]
    msg = one_line(D.load_source, DataSource(path=str(saved), split="test"), "dataset", "dataset_split",
                   error=DataError)
    assert msg == f"dataset_split=test: {saved} has no split 'test'; its splits: train, validation"
    msg = one_line(D.prevalidate, str(files), "auto", split="validation", split_key="eval_split", error=DataError)
    assert msg == f"eval_split=validation: {files} has no split 'validation'; its splits: train, test"


def test_eval_split_is_the_eval_set(split_folders, mistral):
    tok, _ = mistral
    files, saved = split_folders
    data = D.build_datasets(Recipe(dataset=str(files), eval_split="test", max_seq_len=256), tok)
    assert len(data.train) == 30 and len(data.eval) == 6  # nothing held out of train
    recipe = Recipe(datasets=(DataSource(path=str(saved), columns=SHAREGPT),), max_seq_len=256,
                    eval_dataset=DataSource(path=str(saved), split="validation", columns=SHAREGPT))
    validate(recipe)
    data = D.build_datasets(recipe, tok)
    assert len(data.train) == 20 and len(data.eval) == 4 and data.format == "messages"
    assert data.summary["eval"]["rows"] == 4


# ---------------------------------------------------------------- tokenization


@pytest.mark.parametrize("fmt", ["alpaca", "prompt_completion", "text", "messages"])
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_batched_encoding_equals_the_row_encoder(fmt, train_on_prompt, mistral, llama3):
    rows = {"alpaca": alpaca(5) + [{"instruction": "Say hi.", "input": "", "output": "hi</s>"}],
            "prompt_completion": [{"prompt": f"{i} plus {i} is", "completion": f" {2 * i}"} for i in range(6)]
            + [{"prompt": "Paris is", "completion": "n't small"}],  # a seam a BPE merge can cross
            "text": [{"text": f"Line {i}."} for i in range(5)],
            "messages": [D.map_row(r, DataSource(path="x", columns=SHAREGPT), "x") for r in chats(5)]}[fmt]
    for tok in (mistral[0], llama3):
        for max_len in (12, 512):
            batch = D.encode_batch(rows, fmt, tok, train_on_prompt, max_len)
            assert batch == [D.encode_row(r, fmt, tok, train_on_prompt, max_len) for r in rows]


def test_mixture_build_counts_and_determinism(tmp_path, mistral):
    tok, _ = mistral
    a = write_jsonl(tmp_path / "a.jsonl", alpaca(40))
    c = write_jsonl(tmp_path / "c.jsonl", chats(20))
    recipe = Recipe(max_seq_len=256, eval_fraction=0.1, seed=3,
                    datasets=(DataSource(path=str(a), weight=0.5), DataSource(path=str(c), columns=SHAREGPT, rows=30)))
    first, again = D.build_datasets(recipe, tok), D.build_datasets(recipe, tok)
    assert first.train["input_ids"] == again.train["input_ids"]
    assert [s["rows"] for s in first.sources] == [36, 18]  # 10% of each held out for eval
    assert [s["rows_in_mix"] for s in first.sources] == [18, 30]
    assert len(first.train) == 48 and len(first.eval) == 4 + 2 and first.format == "mixed"
    assert np.bincount(first.row_sources).tolist() == [18, 30]
    for i, s in enumerate(first.sources):  # the per-source counts are the rows' own
        rows = [first.train[int(k)] for k in np.flatnonzero(first.row_sources == i)]
        assert s["tokens"] == sum(len(r["input_ids"]) for r in rows)
        assert s["target_tokens"] == sum(sum(1 for x in r["labels"][1:] if x != IGNORE) for r in rows)
    assert first.summary["target_tokens"] == sum(s["target_tokens"] for s in first.sources)
    lines = D.summary_lines(first, recipe)
    assert lines[0].startswith(f"data datasets[0] {a} (alpaca, split train): 36 rows, none dropped; weight 0.5: "
                               "18 rows in the mix")
    assert lines[1].startswith(f"data datasets[1] {c} (messages, split train): 18 rows, none dropped; rows=30: "
                               "30 rows in the mix")
    reseeded = D.build_datasets(recipe.__class__(**{**recipe.__dict__, "seed": 4}), tok)
    assert reseeded.train["input_ids"] != first.train["input_ids"]


def test_dropped_rows_and_packing_in_the_summary(tmp_path, mistral):
    tok, _ = mistral
    long = {"prompt": "word " * 80, "completion": "end"}
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"{i} plus {i} is", "completion": f" {2 * i}"}
                                               for i in range(20)] + [long])
    recipe = Recipe(dataset=str(path), max_seq_len=64, packing=True, eval_fraction=0.0)
    data = D.build_datasets(recipe, tok)
    assert data.sources[0]["dropped_no_target"] == 1
    assert data.summary["packed_rows"] == len(data.train) < 20
    assert 0 < data.summary["packing_efficiency"] <= 1
    lines = D.summary_lines(data, recipe)
    assert "1 dropped (no target token within max_seq_len=64)" in lines[0]
    assert f"packed into {len(data.train)} rows of 64" in lines[-1]


def test_several_processes_prepare_the_same_rows(tmp_path, mistral):
    tok, _ = mistral
    path = write_jsonl(tmp_path / "c.jsonl", chats(40))
    spec = DataSource(path=str(path), columns=SHAREGPT)
    raw = D.load_source(spec)
    one = D.tokenize_dataset(raw, "auto", tok, Recipe(max_seq_len=256, num_proc=1), "c", spec=spec)
    two = D.tokenize_dataset(raw, "auto", tok, Recipe(max_seq_len=256, num_proc=2), "c2", spec=spec)
    assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"]


# ---------------------------------------------------------------- python -m finetune.data --show, and run.py


@pytest.fixture
def mixture_recipe(tmp_path, mistral):
    _, tok_dir = mistral
    a = write_jsonl(tmp_path / "a.jsonl", alpaca(30))
    c = write_jsonl(tmp_path / "c.jsonl", chats(20))
    path = tmp_path / "mix.py"
    path.write_text(f'''from finetune.recipe import DataSource, Recipe

recipe = Recipe(
    tokenizer={str(tok_dir)!r},
    max_seq_len=256,
    mixed_precision="no",
    strategy="ddp",  # no DeepSpeed op checks: these tests are about the data
    datasets=[
        DataSource(path={str(a)!r}, format="alpaca", weight=0.5),
        DataSource(path={str(c)!r}, columns={{"messages": "conversations", "role": "from", "content": "value"}}),
    ],
    output_dir={str(tmp_path / "out")!r},
)
''')
    return path


def test_show_marks_the_trained_tokens(mixture_recipe, capsys):
    assert data_command.main(["--recipe", str(mixture_recipe), "--show", "4", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- row ") == 4
    assert "[[" in out and "]]" in out
    assert "[INST] What is" in out and "[[" not in out.split("[INST] What is")[1].split("[/INST]")[0]
    assert "datasets[0]" in out and "datasets[1]" in out and "rows in the mix" in out
    assert "train: 33 rows" in out  # 15 of 29 alpaca rows (one held out) + 18 of 19 chats (one held out)
    assert data_command.main(["--recipe", str(mixture_recipe), "--show", "1", "--color", "always"]) == 0
    assert D.GREEN in capsys.readouterr().out


def test_show_json_gives_ids_and_labels(mixture_recipe, mistral, capsys):
    tok, _ = mistral
    assert data_command.main(["--recipe", str(mixture_recipe), "--show", "5", "--json"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 5 and [r["position"] for r in rows] == list(range(5))
    for r in rows:
        assert len(r["input_ids"]) == len(r["labels"])
        assert all(lab in (IGNORE, tok_id) for lab, tok_id in zip(r["labels"], r["input_ids"]))
        assert r["source"] in ("datasets[0]", "datasets[1]")
    assert "train: 33 rows" in captured.err
    one = D.build_datasets(validate_recipe(mixture_recipe), tok)
    assert rows[0]["input_ids"] == one.train[rows[0]["row"]]["input_ids"]


def validate_recipe(path):
    from finetune.recipe import resolve

    return resolve(str(path), [])


def test_show_packed_rows_separates_examples(mistral):
    tok, _ = mistral
    a, b = D.encode_batch([{"prompt": "1 plus 1 is", "completion": " 2"}, {"prompt": "Say", "completion": " hi"}],
                          "prompt_completion", tok, False, 64)
    assert tok.pad_token_id is None  # Mistral's has none: the loader pads with EOS, as pack_dataset does
    packed = D.pack_rows([a[0], b[0]], [a[1], b[1]], 24, tok.eos_token_id)
    text = D.show_row(tok, packed["input_ids"][0], packed["labels"][0], packed["position_ids"][0])
    pad = 24 - len(a[0]) - len(b[0])
    assert text == f"<s> 1 plus 1 is[[2</s>]] || <s> Say[[hi</s>]] || <pad x {pad}>"


@pytest.mark.parametrize("overrides,expected", [
    (["datasets.1.weight=0"], "error: datasets[1].weight=0.0: must be a positive number"),
    (["datasets.0.path=/no/such.jsonl"], "error: datasets[0].path=/no/such.jsonl: no such file or directory"),
    (["datasets.1.columns=messages:turns"], "columns maps messages to 'turns', but the row has no field 'turns'"),
    (["datasets.0.split=test"], "error: datasets[0].split=test: "),
    (["eval_dataset=builtin:tiny-tasks", "eval_split=validation"], "error: eval_split=validation: "),
])
def test_bad_input_is_one_line_and_exit_2_before_any_model(mixture_recipe, overrides, expected, capsys, monkeypatch):
    import finetune.model
    from finetune import run

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(finetune.model, "load_model", no_model)
    monkeypatch.setattr(finetune.model, "load_config", no_model)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert run.main(["--recipe", str(mixture_recipe), *overrides]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


# ---------------------------------------------------------------- columns, the recipe key (one dataset)


def test_columns_maps_one_datasets_fields_and_the_advice_works_as_typed(tmp_path, tiny_tokenizer):
    """Thumbs-up/down rows whose label is a field `thumbs` (issue 52): the line that stops the run names the
    mapping, and that mapping typed on the command line (columns=label:thumbs) trains them, with the labels
    read from thumbs, as the same mapping in a recipe file (columns={...}) and on a DataSource do."""
    import re

    from finetune.checkpointing.manifest import fingerprint

    rows = [{"prompt": f"Copy: ab{i}\nAnswer: ", "completion": "AB" if i % 2 else "ab", "thumbs": i % 2 == 1}
            for i in range(20)]
    path = write_jsonl(tmp_path / "thumbs.jsonl", rows)
    for fmt in ("unpaired", "auto"):  # the format given, and detected (then the rows look like prompt_completion)
        recipe = validate(apply_overrides(Recipe(), ["objective=kto", f"dataset={path}", f"dataset_format={fmt}",
                                                     "micro_batch_size=2", "eval_fraction=0.1"]))
        message = one_line(D.prevalidate_recipe, recipe, error=DataError)
        assert re.findall(r"columns=\S+", message) == ["columns=label:thumbs"], message
        typed = validate(apply_overrides(recipe, ["columns=label:thumbs"]))
        assert typed.columns == {"label": "thumbs"}
        D.prevalidate_recipe(typed)
    data = D.build_datasets(typed, tiny_tokenizer)
    assert sorted(list(data.train["desirable"]) + list(data.eval["desirable"])) == [0] * 10 + [1] * 10
    in_file = validate(replace(recipe, columns={"label": "thumbs"}))
    assert D.build_datasets(in_file, tiny_tokenizer).train["input_ids"][:] == data.train["input_ids"][:]
    as_source = validate(replace(recipe, datasets=(DataSource(path=str(path), columns={"label": "thumbs"}),)))
    assert D.build_datasets(as_source, tiny_tokenizer).train["input_ids"][:] == data.train["input_ids"][:]
    assert fingerprint(typed)["columns"] == {"label": "thumbs"} and "columns" not in fingerprint(Recipe())


@pytest.mark.parametrize("overrides, message", [
    (["columns=thumbs:label"], "columns maps 'thumbs', which no format has: the wrong way round? the format's field "
                               "comes first (label:thumbs reads the dataset's field thumbs as label)"),
    (["columns=answer:response"], "columns maps 'answer', which no format has; map one of messages, role,"),
    (["columns=label"], "columns=label: expected field:field pairs, the format's field first"),
    (["columns=label:"], "columns maps 'label' to '': both sides need a field name"),
])
def test_a_bad_columns_mapping_is_named(overrides, message):
    assert one_line(lambda: validate(apply_overrides(Recipe(), overrides))).startswith(message)


def test_columns_with_a_mixture_names_the_sources_key(tmp_path):
    good = str(write_jsonl(tmp_path / "a.jsonl", alpaca(4)))
    mixture = Recipe(datasets=(DataSource(path=good), DataSource(path=good)))
    assert one_line(validate, replace(mixture, columns={"output": "answer"})) == (
        "columns=output:answer maps the fields of dataset=..., but this recipe mixes 2 sources (datasets=...), each "
        "with its own columns: set datasets.N.columns=output:answer for the source that needs it")
    assert one_line(validate, replace(mixture, columns={"output": 3})).startswith("columns={'output': 3}: expected a dict")
    validate(apply_overrides(mixture, [f"dataset={good}", "columns=output:output"]))  # one source again: taken
