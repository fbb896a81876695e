"""objective=reward (finetune/training/objectives/reward.py): the Bradley-Terry loss and accuracy against a hand
computation and against TRL's RewardTrainer.compute_loss formula, on a real sequence-classification
model; the global batch's mean whatever its split; the recipe's rules; the sequence-classification
config; RewardModel tokenizing as the run's pair sides."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from finetune import data as D
from finetune.model import init_score_head, is_reward_config, model_class, reward_config
from finetune.training.objectives import objective_for
from finetune.training.objectives.reward import METRICS, Reward, pair_losses, rewards
from finetune.recipe import Recipe, RecipeError, validate


def trl_loss(logits: torch.Tensor, center_rewards_coefficient: float | None) -> torch.Tensor:
    """TRL 1.16's RewardTrainer.compute_loss (trl/trainer/reward_trainer.py, lines 786-795), as written there."""
    rewards_chosen, rewards_rejected = torch.chunk(logits.squeeze(-1), chunks=2)
    loss = -torch.nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center_rewards_coefficient is not None:
        loss += center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss


def test_pair_losses_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, -1.0])
    want = [math.log(1 + math.exp(-1)), math.log(1 + math.exp(1)), math.log(2)]
    assert pair_losses(chosen, rejected).tolist() == pytest.approx(want, abs=1e-7)
    centred = [w + 0.01 * (c + r) ** 2 for w, c, r in zip(want, [2.0, 0.5, -1.0], [1.0, 1.5, -1.0])]
    assert pair_losses(chosen, rejected, 0.01).tolist() == pytest.approx(centred, abs=1e-7)


def tiny_reward_model(pad_id: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=pad_id)
    model = LlamaForSequenceClassification(config).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # rewards of order 1: every pair's loss term matters
    return model


PAIRS = [  # prepared pairs as the preference pipeline gives them: ids, labels on the response
    {"chosen_input_ids": [1, 5, 6, 7, 2], "chosen_labels": [-100, -100, 6, 7, 2],
     "rejected_input_ids": [1, 5, 9, 2], "rejected_labels": [-100, -100, 9, 2]},
    {"chosen_input_ids": [1, 8, 8, 3, 4, 2], "chosen_labels": [-100, -100, -100, 3, 4, 2],
     "rejected_input_ids": [1, 8, 8, 11, 12, 13, 2], "rejected_labels": [-100, -100, -100, 11, 12, 13, 2]},
    {"chosen_input_ids": [1, 10, 2], "chosen_labels": [-100, 10, 2],
     "rejected_input_ids": [1, 14, 15, 2], "rejected_labels": [-100, 14, 15, 2]},
]


@pytest.mark.parametrize("center", [0.0, 0.01])
def test_loss_and_accuracy_as_trl_on_a_real_model(center):
    """One micro-batch of all pairs: our summed loss / pairs is TRL's loss, its metrics TRL's accuracy and
    margin; each row scored at its last non-pad token (right padding changes nothing)."""
    model = tiny_reward_model()
    batch = D.collate_pairs(PAIRS, pad_id=0)
    objective = Reward(Recipe(objective="reward", center_rewards_coefficient=center))
    with torch.no_grad():
        loss = objective.loss(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert float(loss) / 3 == pytest.approx(float(trl_loss(logits, center if center else None)), abs=1e-6)
    metrics = dict(zip(METRICS, (objective.take_metrics() / 3).tolist()))
    chosen, rejected = torch.chunk(logits.squeeze(-1), 2)
    assert metrics["accuracy"] == pytest.approx(float((chosen > rejected).float().mean()))  # TRL's accuracy
    assert metrics["margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-6)  # TRL's margin
    assert metrics["mean_reward"] == pytest.approx(float(logits.mean()), abs=1e-6)  # TRL's mean_reward
    assert 0 < metrics["accuracy"] < 1  # the pairs disagree: the check above can tell a wrong side from a right one
    for k, pair in enumerate(PAIRS):  # each sequence alone, unpadded: the same reward
        for side, value in (("chosen", chosen[k]), ("rejected", rejected[k])):
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([pair[f"{side}_input_ids"]])).logits[0, 0]
            assert float(alone) == pytest.approx(float(value), abs=1e-5)


def test_global_batch_mean_whatever_the_split_and_placeholders_count_nothing():
    """Micro-batches of 2 and 1 pairs (plus a placeholder pair keeping ranks in lock-step): their summed losses
    over the counted pairs are the one-batch mean."""
    model = tiny_reward_model()
    objective = Reward(Recipe(objective="reward"))
    whole = D.collate_pairs(PAIRS, 0)
    placeholder = {k: (list(v) if "ids" in k else [-100] * len(v)) for k, v in PAIRS[0].items()}
    parts = [D.collate_pairs(PAIRS[:2], 0), D.collate_pairs([PAIRS[2], placeholder], 0)]
    assert objective.counts(parts)[0] == 3 and objective.eval_count(parts[1]) == 1
    assert objective.counts(parts)[1] == sum(len(p[f"{s}_input_ids"]) for p in PAIRS for s in ("chosen", "rejected")) \
        + len(PAIRS[0]["chosen_input_ids"]) + len(PAIRS[0]["rejected_input_ids"])  # every real token, placeholder's too
    with torch.no_grad():
        split = sum(float(objective.loss(model, b)) for b in parts)
        objective.take_metrics()
        one = float(objective.loss(model, whole))
    assert split == pytest.approx(one, abs=1e-6)


def test_gradient_reaches_the_score_head_and_the_body():
    model = tiny_reward_model().train()
    loss = Reward(Recipe(objective="reward")).loss(model, D.collate_pairs(PAIRS, 0))
    loss.backward()
    assert model.score.weight.grad.abs().sum() > 0 and model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_objective_for_reward():
    assert isinstance(objective_for(Recipe(objective="reward")), Reward)


def test_reward_config_and_seeded_head():
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    base = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, architectures=["LlamaForCausalLM"])
    config = reward_config(base, pad_token_id=3)
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id == 3 and base.architectures == ["LlamaForCausalLM"]  # a copy
    assert is_reward_config(config) and not is_reward_config(base)
    assert model_class(config) is AutoModelForSequenceClassification
    heads = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed * 100)  # the global generator does not decide the head
        model = AutoModelForSequenceClassification.from_config(config)
        init_score_head(model, seed)
        heads.append(model.score.weight.detach().clone())
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert heads[0].std().item() == pytest.approx(config.initializer_range, rel=0.5)


@pytest.mark.parametrize("overrides, message", [
    ({"dpo_beta": 0.5}, "dpo_beta=0.5 applies to objective=dpo only"),
    ({"dpo_loss": "ipo"}, "dpo_loss=ipo applies to objective=dpo only"),
    ({"packing": True}, "packing=true with objective=reward"),
    ({"train_on_prompt": True}, "train_on_prompt=true with objective=reward"),
    ({"max_prompt_len": 512, "max_seq_len": 512}, "max_prompt_len=512 leaves no room"),
])
def test_recipe_reward_rules(overrides, message):
    with pytest.raises(RecipeError, match=message):
        validate(Recipe(objective="reward", dataset="builtin:tiny-preferences", **overrides))


def test_center_rewards_coefficient_only_with_reward():
    with pytest.raises(RecipeError, match="center_rewards_coefficient=0.01 applies to objective=reward only"):
        validate(Recipe(dataset="builtin:tiny-preferences", objective="dpo", center_rewards_coefficient=0.01))
    validate(Recipe(objective="reward", dataset="builtin:tiny-preferences", center_rewards_coefficient=0.01,
                    max_prompt_len=64))


def test_preference_rows_train_a_reward_model(tmp_path):
    import json

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q", "chosen": "A", "rejected": "B"}) + "\n")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    D.prevalidate_recipe(Recipe(dataset=str(pairs), objective="reward"))
    with pytest.raises(D.DataError, match="objective=reward needs preference rows"):
        D.prevalidate_recipe(Recipe(dataset=str(sft), objective="reward"))


def test_reward_model_encodes_as_the_run(tmp_path, tiny_tokenizer):
    """RewardModel's tokens for prompt + completion are the run's tokens of that pair side (text prompts, a
    completion ending in the EOS string, conversations through the chat template)."""
    from finetune.rewards import RewardModel

    eos = tiny_tokenizer.eos_token
    rows = [{"prompt": "Copy: abc\nAnswer: ", "chosen": "abc", "rejected": "ABC" + eos},
            {"prompt": "Reverse: ich\nAnswer: ", "chosen": "hci", "rejected": "xrw"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Copy: abc"}],
             "chosen": [{"role": "assistant", "content": "abc"}], "rejected": [{"role": "assistant", "content": "cba"}]}]
    assert tiny_tokenizer.chat_template
    prepared = D.encode_pairs(rows, tiny_tokenizer, 128)
    model = RewardModel(str(tmp_path))
    model._tokenizer, model._model = tiny_tokenizer, object()  # loaded: only its tokenizer is used here
    prompts = [r["prompt"] for r in rows] * 2
    ids = model.encode(prompts, [r["chosen"] for r in rows] + [r["rejected"][0]["content"] if isinstance(
        r["rejected"], list) else r["rejected"] for r in rows])
    assert ids == prepared["chosen_input_ids"] + prepared["rejected_input_ids"]
    assert ids[0][0] == tiny_tokenizer.bos_token_id and ids[0][-1] == tiny_tokenizer.eos_token_id
    assert ids[3].count(tiny_tokenizer.eos_token_id) == 1
