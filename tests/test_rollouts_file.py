"""rollouts.jsonl (finetune/training/objectives/grpo.py write_rollouts): each completion with the row's
columns its reward functions received, and a count of the ids the tokenizer cannot decode (a model's
output layer padded past the tokenizer's vocabulary samples ids that decode to nothing: a reward read
off the text is then earned by an empty or shorter completion), which a log line and the run summary
also give."""

import json
import logging

import torch
from datasets import Dataset

from finetune.training.metrics import format_summary
from finetune.training.rollouts import rollouts_summary, undecodable, warn_undecodable, write_rollouts

VOCAB = 10


def write(path, tokens):
    ds = Dataset.from_dict({"prompt": ["Copy: ab\nAnswer: ", "Capitals: cd\nAnswer: "],
                            "prompt_input_ids": [[1, 2], [1, 3]], "n_tokens": [2, 2],
                            "answer": ["ab", "CD"], "level": [1, 2]})
    n = len(tokens)
    write_rollouts(path, 3, 2, [1, 0], ds, n // 2, tokens, ["x"] * n, [True] * n, ["exact_match"],
                   torch.zeros(n, 1), torch.zeros(n), torch.zeros(n), VOCAB)
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_completion_carries_the_columns_its_rewards_received(tmp_path):
    lines = write(tmp_path / "rollouts.jsonl", [[4, 5], [6], [7, 2], [3]])
    assert [line["row"] for line in lines] == [1, 1, 0, 0]
    assert [line["columns"] for line in lines] == [{"answer": "CD", "level": 2}] * 2 + [{"answer": "ab", "level": 1}] * 2
    assert lines[0]["prompt"] == "Capitals: cd\nAnswer: "
    assert all(line["undecodable_ids"] == 0 for line in lines)
    assert rollouts_summary(tmp_path / "rollouts.jsonl") == {}


def test_ids_the_tokenizer_cannot_decode_are_counted_logged_once_and_summed(tmp_path):
    tokens = [[4, 12, 13], [6], [VOCAB, 2], [3]]  # ids 10..13: rows of the output layer past the tokenizer's
    lines = write(tmp_path / "rollouts.jsonl", tokens)
    assert [line["undecodable_ids"] for line in lines] == [2, 0, 1, 0]
    assert undecodable(tokens, VOCAB) == (2, 3)
    summary = rollouts_summary(tmp_path / "rollouts.jsonl")
    assert summary == {"undecodable_completions": 2, "undecodable_ids": 3, "completions": 4}
    assert "2 of 4 completions hold 3 ids the tokenizer cannot decode" in format_summary(
        {"steps": 3, "train_seconds": 1.0, "wall_seconds": 1.0, "tokens": 10, "tokens_per_s": 1.0, **summary})

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("finetune")
    logger.addHandler(handler)
    try:
        warned = warn_undecodable(3, tokens, VOCAB, False)
        warned = warn_undecodable(4, tokens, VOCAB, warned)  # not again
    finally:
        logger.removeHandler(handler)
    assert warned and len(records) == 1
    assert records[0].getMessage().startswith("step 3: 2 of 4 completions hold 3 token ids past the tokenizer's 10 tokens")
    assert not warn_undecodable(3, [[1], [2]], VOCAB, False)
