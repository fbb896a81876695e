"""objective=reward as real launches (CPU, gloo, fp32) on the tiny model and builtin:tiny-preferences: a
2-process FSDP run's curve (loss, accuracy, margin, the eval's) equals the 1-process run's; its final/ is a
plain transformers AutoModelForSequenceClassification directory, the same weights as the export of its
last checkpoint, and finetune.rewards.RewardModel scores prompt + completion with it exactly as the run
scored the pair's sides."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import one_thread

REWARD = ["max_steps=4", "eval_every=2", "eval_max_samples=16", "warmup_steps=1", "save_every=4"]
KEYS = ("loss", "accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")  # the eval's: eval_<key>
TOLERANCE = 1e-5  # fp32 (measured: up to 7e-7 in loss and 9e-7 in margin, fsdp and zero3 against 1 process)


@pytest.fixture(scope="module")
def runs(launch):
    return {"fsdp": launch(2, *REWARD, "strategy=fsdp", recipe="tiny_reward"),
            "one": launch(1, *REWARD, "strategy=ddp", recipe="tiny_reward")}


def curve(run) -> list[dict]:
    keep = KEYS + tuple(f"eval_{k}" for k in KEYS)
    return [{"step": r["step"], **{k: r[k] for k in keep if k in r}} for r in run.train_records + run.eval_records]


def test_two_processes_equal_one(runs):
    two, one = curve(runs["fsdp"]), curve(runs["one"])
    assert [r["step"] for r in two] == [1, 2, 3, 4, 0, 2, 4] and len(two) == len(one)
    for x, y in zip(two, one):
        assert set(x) == set(y) and (set(KEYS) <= set(x) or {"eval_" + k for k in KEYS} <= set(x)), (x, y)
        for key in x:
            accuracy = key.endswith("accuracy")  # a pair whose sides tie within the tolerance may flip: exact elsewhere
            assert math.isclose(x[key], y[key], abs_tol=0.0 if accuracy else TOLERANCE) or accuracy and abs(
                x[key.replace("accuracy", "margin")]) < 1e-3, (key, x, y)
    evals = runs["fsdp"].eval_records
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < 0.75  # it learns; it starts near log 2
    summary = json.loads((runs["fsdp"].output_dir / "summary.json").read_text())
    assert summary["final_eval_accuracy"] == evals[-1]["eval_accuracy"]


def test_final_is_a_sequence_classification_model_and_scores_as_trained(runs, launch_env, monkeypatch, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune import assets
    from finetune import data as D
    from finetune.checkpointing.export import export_checkpoint
    from finetune.training.objectives.reward import rewards
    from finetune.rewards import RewardModel

    final = runs["fsdp"].output_dir / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert config["pad_token_id"] == tokenizer.pad_token_id is not None
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1

    monkeypatch.setenv("FINETUNE_CACHE", launch_env["FINETUNE_CACHE"])
    rows = [json.loads(line) for line in assets.tiny_preferences_file().read_text().splitlines()[:12]]
    with one_thread():
        scorer = RewardModel(str(final), batch_size=5)
        chosen = scorer(prompts=[r["prompt"] for r in rows], completions=[r["chosen"] for r in rows])
        rejected = scorer(prompts=[r["prompt"] for r in rows], completions=[r["rejected"] for r in rows])
        prepared = D.encode_pairs(rows, tokenizer, 128)  # the pairs as the run tokenized them
        batch = D.collate_pairs([{k: prepared[k][i] for k in D.PAIR_COLUMNS} for i in range(len(rows))],
                                tokenizer.pad_token_id)
        with torch.no_grad():
            trained = rewards(model, batch)
    assert chosen + rejected == pytest.approx(trained.tolist(), abs=1e-5)
    assert len(set(chosen)) == len(rows)  # real, distinct scores

    out = tmp_path / "exported"  # the last checkpoint (2 FSDP shards) exports to final/'s weights
    info = export_checkpoint(runs["fsdp"].output_dir / "checkpoints" / "step_000000004", out, log=lambda *_: None)
    assert info["step"] == 4
    from safetensors.torch import load_file

    want, got = load_file(final / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(want) == sorted(got) and "score.weight" in want and all(torch.equal(want[k], got[k]) for k in want)
