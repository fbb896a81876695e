"""Data: format detection, pre-validation of dataset files, tokenization and label masks, packing
(checked against the real tiny model), the batch schedule, loss normalization and eval sharding."""

import csv
import json
import random
from itertools import chain

import pytest
import torch

from finetune import data as D
from finetune.data import IGNORE, DataError
from finetune.model import loss_sum
from finetune.recipe import Recipe, RecipeError

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_model():
    """The builtin tiny Llama through from_pretrained, fp32, eval mode, no KV cache (as in training)."""
    from transformers import AutoModelForCausalLM

    from finetune.assets import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, RecipeError)  # reported by run.py like any recipe error
    message = str(info.value)
    assert "\n" not in message
    return message


ALPACA = {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}


# ---------------------------------------------------------------- detect_format


@pytest.mark.parametrize("columns,expected", [
    (["messages"], "messages"),
    (["messages", "text", "instruction", "output"], "messages"),
    (["instruction", "input", "output"], "alpaca"),
    (["instruction", "output", "prompt", "completion", "text"], "alpaca"),
    (["prompt", "completion"], "prompt_completion"),
    (["prompt", "completion", "text"], "prompt_completion"),
    (["text", "id"], "text"),
])
def test_detect_format(columns, expected):
    assert D.detect_format(columns, "somewhere") == expected


@pytest.mark.parametrize("columns", [[], ["instruction"], ["question", "answer"], ["question", "output"]])
def test_detect_format_unknown(columns):
    msg = error(D.detect_format, columns, "data.jsonl line 1")
    assert msg.startswith("data.jsonl line 1: cannot tell the dataset format")
    assert str(sorted(columns)) in msg
    assert "dataset_format=" in msg


# ---------------------------------------------------------------- prevalidate


def test_prevalidate_good_jsonl_detects_format(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", [ALPACA, "", ALPACA])
    assert D.prevalidate(str(path), "auto") == "alpaca"
    assert D.prevalidate(str(path), "alpaca") == "alpaca"


def test_prevalidate_malformed_json_line(tmp_path):
    path = write_jsonl(tmp_path / "broken.jsonl", [ALPACA, ALPACA, '{"instruction": "x", "output": ', ALPACA])
    msg = error(D.prevalidate, str(path), "auto")
    assert f"{path} line 3" in msg
    assert "not valid JSON" in msg


def test_prevalidate_missing_field_names_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / "missing.jsonl", [ALPACA, {"instruction": "x", "input": ""}])
    msg = error(D.prevalidate, str(path), "auto")
    assert f"{path} line 2" in msg
    assert "missing field 'output'" in msg
    assert "dataset_format=alpaca" in msg


def test_prevalidate_null_field_is_missing(tmp_path):
    path = write_jsonl(tmp_path / "null.jsonl", [{"prompt": "p", "completion": None}])
    msg = error(D.prevalidate, str(path), "prompt_completion")
    assert "line 1" in msg and "missing field 'completion'" in msg


def test_prevalidate_explicit_format_checks_fields(tmp_path):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    msg = error(D.prevalidate, str(path), "prompt_completion")
    assert "line 1" in msg and "missing field 'prompt'" in msg


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_prevalidate_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    msg = error(D.prevalidate, str(path), "auto")
    assert "empty" in msg and str(path) in msg


def test_prevalidate_empty_file_names_eval_key(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("")
    assert error(D.prevalidate, str(path), "alpaca", key="eval_dataset").startswith("eval_dataset=")


def test_prevalidate_wrong_type_field(tmp_path):
    path = write_jsonl(tmp_path / "typed.jsonl", [ALPACA, ALPACA, {"instruction": "Add.", "output": 5}])
    msg = error(D.prevalidate, str(path), "auto")
    assert f"{path} line 3" in msg
    assert "field 'output' must be a string, got int" in msg


def test_prevalidate_row_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", [ALPACA, '["a", "b"]'])
    msg = error(D.prevalidate, str(path), "auto")
    assert "line 2" in msg and "expected a JSON object, got list" in msg


def test_prevalidate_messages_without_assistant(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, bad])
    msg = error(D.prevalidate, str(path), "auto")
    assert f"{path} line 2" in msg and "no assistant message" in msg


@pytest.mark.parametrize("messages,fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "assistant"}], "string 'role' and 'content'"),
    ([{"role": "assistant", "content": 3}], "string 'role' and 'content'"),
])
def test_prevalidate_bad_messages(tmp_path, messages, fragment):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    msg = error(D.prevalidate, str(path), "messages")
    assert "line 1" in msg and fragment in msg


def test_prevalidate_json_array(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}], indent=2))
    assert D.prevalidate(str(path), "auto") == "prompt_completion"


def test_prevalidate_json_array_bad_item(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], indent=2))
    msg = error(D.prevalidate, str(path), "auto")
    assert f"{path} item 1" in msg and "missing field 'completion'" in msg


def test_prevalidate_json_array_invalid(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n{"prompt": "a", "completion": "b"},\n{"prompt": \n')
    msg = error(D.prevalidate, str(path), "auto")
    assert str(path) in msg and "not valid JSON" in msg and "line" in msg


def test_prevalidate_empty_json_array(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[]")
    assert "empty" in error(D.prevalidate, str(path), "auto")


def _write_parquet(path, columns: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _write_csv(path, header, rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_prevalidate_parquet(tmp_path):
    good = _write_parquet(tmp_path / "good.parquet", {"prompt": ["a", "b"], "completion": ["c", "d"]})
    assert D.prevalidate(str(good), "auto") == "prompt_completion"
    bad = _write_parquet(tmp_path / "bad.parquet", {"instruction": ["a"], "input": ["b"]})
    msg = error(D.prevalidate, str(bad), "alpaca")
    assert str(bad) in msg and "missing column(s) ['output']" in msg
    msg = error(D.prevalidate, str(bad), "auto")
    assert "cannot tell the dataset format" in msg and "'input'" in msg


def test_prevalidate_parquet_empty(tmp_path):
    path = _write_parquet(tmp_path / "empty.parquet", {"text": []})
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    assert "empty" in error(D.prevalidate, str(path), "auto")


def test_prevalidate_csv(tmp_path):
    good = _write_csv(tmp_path / "good.csv", ["instruction", "output"], [["a", "b"], ["c", "d"]])
    assert D.prevalidate(str(good), "auto") == "alpaca"
    bad = _write_csv(tmp_path / "bad.csv", ["prompt", "answer"], [["a", "b"]])
    msg = error(D.prevalidate, str(bad), "prompt_completion")
    assert str(bad) in msg and "missing column(s) ['completion']" in msg
    header_only = _write_csv(tmp_path / "header.csv", ["text"], [])
    assert "empty" in error(D.prevalidate, str(header_only), "auto")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_prevalidate_latin1_file_names_line_and_byte(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    good = json.dumps(ALPACA) + "\n" if suffix != ".csv" else "instruction,output\n"
    bad = '{"instruction": "caf\xe9", "output": "x"}\n' if suffix != ".csv" else "caf\xe9,x\n"
    path.write_bytes(good.encode() + bad.encode("latin-1"))
    msg = error(D.prevalidate, str(path), "auto")
    offset = len(good.encode()) + bad.index("\xe9")
    assert msg.startswith(f"{path} line 2 (byte offset {offset}, byte 0xe9): not UTF-8 text"), msg
    assert "save it as UTF-8" in msg


def test_prevalidate_binary_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"PAR1\x00\x15\x04\xff\xfe" + bytes(range(256)))
    msg = error(D.prevalidate, str(path), "auto")
    assert msg.startswith(f"{path} line 1 (byte offset 7, byte 0xff): binary data, not text"), msg


def test_prevalidate_csv_missing_cells_name_file_row_and_column(tmp_path):
    rows = [["Say hi", "", "hi"], ["Say it", "x", ""]]
    path = _write_csv(tmp_path / "gaps.csv", ["instruction", "input", "output"], rows)
    msg = error(D.prevalidate, str(path), "auto")  # the empty optional 'input' in row 1 is fine
    assert msg == (f"{path} line 3 (row 2): column 'output' is empty (dataset_format=alpaca needs instruction, "
                   "output); fill it in or drop the row")
    path = _write_csv(tmp_path / "na.csv", ["prompt", "completion"], [["a", "b"], ["c", "NA"]])
    assert "line 3 (row 2): column 'completion' is 'NA', which the CSV reader reads as missing" in \
        error(D.prevalidate, str(path), "auto")
    path = tmp_path / "ragged.csv"
    path.write_text("text,id\none,1\ntwo, with a comma,2\n")
    assert f"{path} line 3 (row 2): 3 cells, the header has 2" in error(D.prevalidate, str(path), "auto")
    path = tmp_path / "multiline.csv"
    path.write_text('text,id\n"one\nspans lines",1\n,2\n')
    assert f"{path} line 4 (row 2): column 'text' is empty" in error(D.prevalidate, str(path), "auto")


def test_prevalidate_parquet_nulls_name_the_row(tmp_path):
    path = _write_parquet(tmp_path / "nulls.parquet", {"instruction": ["a", "b", "c"], "input": [None, None, "x"],
                                                       "output": ["d", None, "f"]})
    assert error(D.prevalidate, str(path), "auto") == (f"{path} row 1: 'output' is null (dataset_format=alpaca "
                                                        "needs instruction, output)")


def test_prevalidate_directory(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "one"}])
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "two"}, {"txt": "three"}])
    msg = error(D.prevalidate, str(tmp_path / "d"), "auto")
    assert "b.jsonl line 2" in msg and "missing field 'text'" in msg
    (tmp_path / "none").mkdir()
    assert "holds no" in error(D.prevalidate, str(tmp_path / "none"), "auto")


def test_prevalidate_leaves_hub_and_builtin_sources_alone():
    assert D.prevalidate("org/name", "auto") == "auto"
    assert D.prevalidate("builtin:tiny-tasks", "alpaca") == "alpaca"


# ---------------------------------------------------------------- encode_row


def split_at_labels(ids, labels):
    """(prompt ids, response ids): the prompt is the leading run of IGNORE labels, which must be
    followed only by labels equal to their ids."""
    assert len(ids) == len(labels)
    n = next(i for i, lab in enumerate(labels) if lab != IGNORE)
    assert all(lab == IGNORE for lab in labels[:n])
    assert labels[n:] == ids[n:]
    return ids[:n], ids[n:]


@pytest.mark.parametrize("row,prompt", [
    (ALPACA, "### Instruction:\nReverse the word.\n\n### Input:\nabc\n\n### Response:\n"),
    ({"instruction": "Say hi.", "input": "", "output": "cba"}, "### Instruction:\nSay hi.\n\n### Response:\n"),
    ({"instruction": "Say hi.", "output": "cba"}, "### Instruction:\nSay hi.\n\n### Response:\n"),
])
def test_encode_alpaca(tiny_tokenizer, row, prompt):
    tok = tiny_tokenizer
    ids, labels = D.encode_row(row, "alpaca", tok, train_on_prompt=False, max_len=512)
    assert tok.decode(ids) == "<s>" + prompt + "cba</s>"
    p, r = split_at_labels(ids, labels)
    assert tok.decode(p) == "<s>" + prompt
    assert tok.decode(r) == "cba</s>"


def test_encode_prompt_completion(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, labels = D.encode_row({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, "prompt_completion", tok, False, 512)
    assert tok.decode(ids) == "<s>Q: 2+2?\nA: 4</s>"
    p, r = split_at_labels(ids, labels)
    assert tok.decode(p) == "<s>Q: 2+2?\nA:"
    assert tok.decode(r) == " 4</s>"
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


def test_encode_text_labels_everything(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, labels = D.encode_row({"text": "plain text."}, "text", tok, False, 512)
    assert tok.decode(ids) == "<s>plain text.</s>"
    assert labels == ids


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_encode_messages_labels_assistant_turns(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, labels = D.encode_row({"messages": MESSAGES}, "messages", tok, False, 512)
    assert tok.decode(ids) == ("<s><|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>hello<|end|>"
                               "<|user|>2+2?<|end|><|assistant|>4<|end|>")
    assert len(labels) == len(ids)
    # labelled tokens are those of each assistant content plus its <|end|>, nothing else
    assert all(lab in (IGNORE, t) for t, lab in zip(ids, labels))
    runs, current = [], []
    for t, lab in zip(ids, labels):
        if lab == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(t)
    if current:
        runs.append(current)
    assert [tok.decode(r) for r in runs] == ["hello<|end|>", "4<|end|>"]
    # and the token before each run is the <|assistant|> header, unlabelled
    header = tok.convert_tokens_to_ids("<|assistant|>")
    starts = [i for i in range(1, len(ids)) if labels[i] != IGNORE and labels[i - 1] == IGNORE]
    assert [ids[i - 1] for i in starts] == [header, header]


@pytest.mark.parametrize("fmt,row", [
    ("alpaca", ALPACA),
    ("prompt_completion", {"prompt": "p", "completion": "c"}),
    ("messages", {"messages": MESSAGES}),
])
def test_train_on_prompt_labels_everything(tiny_tokenizer, fmt, row):
    ids, labels = D.encode_row(row, fmt, tiny_tokenizer, train_on_prompt=True, max_len=512)
    assert labels == ids
    masked_ids, _ = D.encode_row(row, fmt, tiny_tokenizer, train_on_prompt=False, max_len=512)
    assert masked_ids == ids


@pytest.mark.parametrize("fmt,row", [
    ("alpaca", ALPACA), ("messages", {"messages": MESSAGES}), ("text", {"text": "x" * 100}),
])
def test_encode_truncates_to_max_len(tiny_tokenizer, fmt, row):
    full, _ = D.encode_row(row, fmt, tiny_tokenizer, False, 4096)
    ids, labels = D.encode_row(row, fmt, tiny_tokenizer, False, 20)
    assert len(ids) == len(labels) == 20
    assert ids == full[:20]


# ---------------------------------------------------------------- pack_rows


def random_examples(n, seed=0, low=1, high=20):
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = rng.randint(low, high)
        ids = [rng.randrange(8, 100) for _ in range(length)]
        prompt = rng.randint(0, length)
        out.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return out


PAD = 0


@pytest.mark.parametrize("max_len,seed", [(20, 0), (32, 1), (64, 2)])
def test_pack_rows_layout(max_len, seed):
    examples = random_examples(40, seed=seed, high=max_len)
    plan = D.plan_packing([len(e[0]) for e in examples], max_len)
    assert sorted(i for row in plan for i in row) == list(range(len(examples)))  # each example exactly once
    packed = D.pack_rows([e[0] for e in examples], [e[1] for e in examples], max_len, PAD)
    assert len(packed["input_ids"]) == len(plan) >= 2
    for row, row_ids, row_labels, row_pos in zip(plan, packed["input_ids"], packed["labels"], packed["position_ids"]):
        assert len(row_ids) == len(row_labels) == len(row_pos) == max_len
        at = 0
        for k in row:
            ids, labels = examples[k]
            end = at + len(ids)
            assert row_ids[at:end] == ids  # whole, never split
            assert row_pos[at:end] == list(range(len(ids)))  # positions restart at each example
            assert row_labels[at] == IGNORE  # never a target of the previous example's last token
            assert row_labels[at + 1:end] == labels[1:]
            at = end
        pad = max_len - at
        assert row_ids[at:] == [PAD] * pad
        assert row_labels[at:] == [IGNORE] * pad
        assert row_pos[at:] == list(range(pad))


@pytest.mark.parametrize("max_len,seed", [(20, 0), (64, 2), (256, 5)])
def test_plan_packing_fills_rows(max_len, seed):
    """Best-fit decreasing: a row is opened only when its first example fits in no earlier row,
    and it never uses more rows than packing in arrival order."""
    lengths = [len(e[0]) for e in random_examples(300, seed=seed, high=max_len)]
    plan = D.plan_packing(lengths, max_len)
    used = [sum(lengths[i] for i in row) for row in plan]
    assert all(u <= max_len for u in used)
    for j, row in enumerate(plan):
        assert all(max_len - used[i] < lengths[row[0]] for i in range(j))
    arrival_rows, fill = 0, max_len
    for n in lengths:
        if fill + n > max_len:
            arrival_rows, fill = arrival_rows + 1, 0
        fill += n
    assert -(-sum(lengths) // max_len) <= len(plan) <= arrival_rows


def test_pack_rows_preserves_tokens_and_targets():
    examples = random_examples(50, seed=3, high=30)
    packed = D.pack_rows([e[0] for e in examples], [e[1] for e in examples], 64, PAD)
    non_pad = sorted(t for row in packed["input_ids"] for t in row if t != PAD)
    assert non_pad == sorted(chain.from_iterable(e[0] for e in examples))  # ids never include PAD here
    targets = sum(1 for row in packed["labels"] for lab in row if lab != IGNORE)
    assert targets == sum(sum(1 for lab in e[1][1:] if lab != IGNORE) for e in examples)


def test_pack_rows_exact_fit_has_no_pad():
    packed = D.pack_rows([[5] * 4, [6] * 4, [7] * 8], [[5] * 4, [6] * 4, [7] * 8], 8, PAD)
    assert packed["input_ids"] == [[7] * 8, [5] * 4 + [6] * 4]
    assert packed["position_ids"] == [list(range(8)), [0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed["labels"] == [[IGNORE] + [7] * 7, [IGNORE, 5, 5, 5, IGNORE, 6, 6, 6]]


# ---------------------------------------------------------------- packing isolation, real model


def _logits(model, batch):
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]


def test_packing_isolates_examples_in_the_real_model(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    a = D.encode_row({"instruction": "Reverse the word.", "input": "hello", "output": "olleh"}, "alpaca", tok, False, 128)
    b = D.encode_row({"prompt": "Add: 12 + 30 =", "completion": " 42"}, "prompt_completion", tok, False, 128)
    na, nb = len(a[0]), len(b[0])
    max_len = na + nb + 7
    packed = D.pack_rows([a[0], b[0]], [a[1], b[1]], max_len, tok.pad_token_id)
    assert len(packed["input_ids"]) == 1
    row = {k: v[0] for k, v in packed.items()}
    packed_batch = D.collate([row], tok.pad_token_id, packed=True)
    assert "attention_mask" not in packed_batch and packed_batch["position_ids"].shape == (1, max_len)

    alone_a = D.collate([{"input_ids": a[0], "labels": a[1]}], tok.pad_token_id, packed=False)
    alone_b = D.collate([{"input_ids": b[0], "labels": b[1]}], tok.pad_token_id, packed=False)
    in_pack = _logits(tiny_model, packed_batch)
    torch.testing.assert_close(in_pack[:na], _logits(tiny_model, alone_a)[0:na], atol=1e-5, rtol=0)
    torch.testing.assert_close(in_pack[na:na + nb], _logits(tiny_model, alone_b), atol=1e-5, rtol=0)

    # the loss of the packed row is exactly the two losses: no cross-example target at the seam
    with torch.no_grad():
        total = loss_sum(tiny_model, packed_batch)
        separate = loss_sum(tiny_model, alone_a) + loss_sum(tiny_model, alone_b)
    torch.testing.assert_close(total, separate, atol=1e-4, rtol=1e-6)
    assert D.target_tokens(packed_batch) == D.target_tokens(alone_a) + D.target_tokens(alone_b)

    # control: the same tokens concatenated under a plain causal mask let B attend to A
    plain = {"input_ids": packed_batch["input_ids"], "attention_mask": torch.ones_like(packed_batch["input_ids"])}
    leaked = _logits(tiny_model, plain)
    torch.testing.assert_close(leaked[:na], in_pack[:na], atol=1e-5, rtol=0)  # A comes first: unaffected
    assert (leaked[na:na + nb] - _logits(tiny_model, alone_b)).abs().max() > 1e-2


def test_packing_isolation_in_a_batch_of_packed_rows(tiny_model, tiny_tokenizer):
    """Several packed rows in one micro-batch, as the loop fetches them."""
    tok = tiny_tokenizer
    texts = ["one two three", "four", "five six seven eight", "nine ten", "eleven twelve thirteen"]
    enc = [D.encode_row({"text": t}, "text", tok, False, 64) for t in texts]
    packed = D.pack_rows([e[0] for e in enc], [e[1] for e in enc], 32, tok.pad_token_id)
    rows = [{k: packed[k][i] for k in packed} for i in range(len(packed["input_ids"]))]
    assert len(rows) >= 2 and all(len(r["input_ids"]) == 32 for r in rows)
    batch = D.collate(rows, tok.pad_token_id, packed=True)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    plan = D.plan_packing([len(e[0]) for e in enc], 32)
    for r, row in enumerate(plan):
        at = 0
        for k in row:
            n = len(enc[k][0])
            alone = _logits(tiny_model, D.collate([{"input_ids": enc[k][0], "labels": enc[k][1]}], 0, False))
            torch.testing.assert_close(logits[r, at:at + n], alone, atol=1e-5, rtol=0)
            at += n
    assert sorted(k for row in plan for k in row) == list(range(len(enc)))


# ---------------------------------------------------------------- BatchSchedule

SPLITS = [(16, 1, 1), (8, 2, 1), (4, 2, 2), (2, 2, 4), (1, 4, 4), (2, 1, 8), (1, 1, 16), (4, 4, 1)]


def global_rows(schedule, step):
    out = []
    for rank in range(schedule.world_size):
        micro = schedule.rows(step, rank)
        assert len(micro) == schedule.grad_accum
        assert all(len(m) == schedule.micro_batch_size for m in micro)
        out.extend(chain.from_iterable(micro))
    return out


def test_schedule_same_global_batch_for_every_split():
    n = 100
    reference = D.BatchSchedule(n, 16, 1, 1, seed=5)
    assert reference.steps_per_epoch == 6
    for micro, accum, world in SPLITS:
        s = D.BatchSchedule(n, micro, accum, world, seed=5)
        assert s.global_batch == 16 and s.steps_per_epoch == 6
        for step in range(13):  # two epochs and a bit
            rows = global_rows(s, step)
            assert len(rows) == len(set(rows)) == 16  # disjoint within a step
            assert set(rows) == set(global_rows(reference, step)), (micro, accum, world, step)


def test_schedule_epoch_covers_disjoint_rows_then_reshuffles():
    s = D.BatchSchedule(100, 2, 2, 4, seed=0)
    epoch0 = [global_rows(s, step) for step in range(6)]
    flat = list(chain.from_iterable(epoch0))
    assert len(flat) == len(set(flat)) == 96 and set(flat) <= set(range(100))
    epoch1 = [global_rows(s, step) for step in range(6, 12)]
    flat1 = list(chain.from_iterable(epoch1))
    assert len(set(flat1)) == 96
    assert [set(b) for b in epoch0] != [set(b) for b in epoch1]
    assert set(global_rows(s, 0)) != set(global_rows(s, 6))


def test_schedule_is_a_pure_function_of_its_fields():
    a = D.BatchSchedule(50, 2, 3, 2, seed=1)
    b = D.BatchSchedule(50, 2, 3, 2, seed=1)
    c = D.BatchSchedule(50, 2, 3, 2, seed=2)
    assert [a.rows(7, r) for r in range(2)] == [b.rows(7, r) for r in range(2)]
    assert set(global_rows(a, 0)) != set(global_rows(c, 0))
    # resume: step N alone, without steps before it, gives what a run that went through them saw
    for _ in range(5):
        a.rows(0, 0)
    assert a.rows(4, 1) == D.BatchSchedule(50, 2, 3, 2, seed=1).rows(4, 1)


@pytest.mark.parametrize("n,micro,accum,world,expected", [
    (100, 4, 2, 2, 6), (16, 4, 2, 2, 1), (15, 4, 2, 2, 0), (1000, 1, 1, 1, 1000), (33, 2, 4, 4, 1),
])
def test_steps_per_epoch(n, micro, accum, world, expected):
    assert D.BatchSchedule(n, micro, accum, world, seed=0).steps_per_epoch == expected


# ---------------------------------------------------------------- loss normalization


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _backward(model, batch, scale):
    (loss_sum(model, batch) * scale).backward()


def _encoded_rows(tok, count=8):
    rng = random.Random(7)
    rows = []
    for i in range(count):
        prompt = "Repeat: " + "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 30)))
        completion = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 40)))
        ids, labels = D.encode_row({"prompt": prompt, "completion": completion}, "prompt_completion", tok, False, 128)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def test_loss_normalization_is_split_invariant(tiny_model, tiny_tokenizer):
    from datasets import Dataset

    model, tok = tiny_model, tiny_tokenizer
    pad = tok.pad_token_id
    rows = _encoded_rows(tok)
    ds = Dataset.from_list(rows)
    counts = [sum(1 for lab in r["labels"][1:] if lab != IGNORE) for r in rows]
    assert len(set(counts)) > 4  # varying target tokens per row, or the test proves nothing

    world, accum, micro = 2, 2, 2
    schedule = D.BatchSchedule(len(ds), micro, accum, world, seed=3)
    assert schedule.steps_per_epoch == 1

    # (a) the whole global batch as one micro-batch on one process
    everything = D.fetch(ds, list(range(8)), pad, packed=False)
    with torch.no_grad():  # loss_sum / target tokens is the usual mean over target tokens
        hf_mean = model(**everything).loss
        ours = loss_sum(model, everything) / D.target_tokens(everything)
    torch.testing.assert_close(ours, hf_mean, atol=1e-5, rtol=1e-6)
    model.zero_grad(set_to_none=True)
    _backward(model, everything, 1.0 / D.target_tokens(everything))
    reference = _grads(model)

    # (b) 2 ranks x 2 accumulation steps, scaled as the loop does; Accelerate divides by accum,
    # the data-parallel all-reduce averages over ranks
    per_rank = {rank: [D.fetch(ds, ix, pad, packed=False) for ix in schedule.rows(0, rank)] for rank in range(world)}
    global_tokens = sum(D.target_tokens(b) for bs in per_rank.values() for b in bs)
    assert global_tokens == D.target_tokens(everything)
    scale = world * accum / global_tokens

    def simulate(scale_of):
        summed = None
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            for batch in per_rank[rank]:
                _backward(model, batch, scale_of(batch) / accum)
            g = _grads(model)
            summed = g if summed is None else [x + y for x, y in zip(summed, g)]
        return [x / world for x in summed]

    split = simulate(lambda batch: scale)
    for ref, got in zip(reference, split):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)

    # control: the mean per micro-batch (what a plain `loss.mean()` does) weights tokens unequally
    naive = simulate(lambda batch: 1.0 / D.target_tokens(batch))
    worst = max(float((n - r).abs().max()) for n, r in zip(naive, reference))
    assert worst > 1e-4


# ---------------------------------------------------------------- eval batches and fetch


@pytest.mark.parametrize("n", [1, 5, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 5])
def test_eval_batches_cover_every_row_once(n, world, micro):
    per_rank = [D.eval_batches(range(n), micro, rank, world) for rank in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    assert len({tuple(len(x) for x in b) for b in per_rank}) == 1  # and the same sizes
    real = [i for b in per_rank for batch in b for i in batch if i >= 0]
    assert sorted(real) == list(range(n))
    for batches in per_rank:
        flat = [i for batch in batches for i in batch]
        assert all(len(batch) <= micro for batch in batches)
        if -1 in flat:
            first = flat.index(-1)
            assert all(i == -1 for i in flat[first:])  # placeholders only at the end
        assert all(i == -1 or 0 <= i < n for i in flat)
    assert sum(1 for b in per_rank for batch in b for i in batch if i == -1) < world


@pytest.mark.parametrize("n,max_samples", [(40, 10), (40, 13), (5, 13), (40, 0)])
def test_eval_batches_max_samples(n, max_samples):
    expected = list(range(min(n, max_samples) if max_samples else n))
    for world in (1, 2, 3, 4):
        for micro in (1, 3):
            per_rank = [D.eval_batches(range(n), micro, rank, world, max_samples) for rank in range(world)]
            assert len({tuple(len(x) for x in b) for b in per_rank}) == 1
            real = [i for b in per_rank for batch in b for i in batch if i >= 0]
            assert sorted(real) == expected  # the same first rows whatever the world size


def test_fetch_placeholder_carries_no_targets():
    from datasets import Dataset

    ds = Dataset.from_list([
        {"input_ids": [2, 10, 11, 12, 3], "labels": [IGNORE, IGNORE, 11, 12, 3]},
        {"input_ids": [2, 20, 21], "labels": [2, 20, 21]},
    ])
    batch = D.fetch(ds, [1, -1], pad_id=0, packed=False)
    assert batch["input_ids"].tolist() == [[2, 20, 21, 0, 0], [2, 10, 11, 12, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[2, 20, 21, IGNORE, IGNORE], [IGNORE] * 5]
    assert D.target_tokens(batch) == 2
    only_placeholders = D.fetch(ds, [-1, -1], pad_id=0, packed=False)
    assert (only_placeholders["labels"] == IGNORE).all() and D.target_tokens(only_placeholders) == 0


# ---------------------------------------------------------------- tokenize_dataset


def test_tokenize_dataset_packs_and_drops_rows_without_targets(tiny_tokenizer):
    from datasets import Dataset

    rows = [{"prompt": "p" * 10, "completion": "c" * k} for k in (1, 5, 9)] + [{"prompt": "q" * 40, "completion": "x"}]
    ds = Dataset.from_list(rows)
    recipe = Recipe(max_seq_len=32, packing=False)
    out = D.tokenize_dataset(ds, "auto", tiny_tokenizer, recipe, "mem")
    assert len(out) == 3  # the last prompt fills max_seq_len: no response token left, dropped
    packed = D.tokenize_dataset(ds, "auto", tiny_tokenizer, Recipe(max_seq_len=32, packing=True), "mem")
    assert all(len(r) == 32 for r in packed["input_ids"])
    assert sum(1 for r in packed["labels"] for x in r if x != IGNORE) == sum(
        1 for r in out["labels"] for x in r[1:] if x != IGNORE)
    only_prompt = Dataset.from_list(rows[-1:])
    msg = error(D.tokenize_dataset, only_prompt, "auto", tiny_tokenizer, recipe, "mem")
    assert "no example has a response token" in msg and "max_seq_len=32" in msg
