"""loss.png by objective (finetune/training/metrics.py plot_losses with the objective's panels,
Objective.panels), from metrics.jsonl as runs write it:
SFT the loss; GRPO the reward, the completion length, the entropy, the clipped share (clipped loss
types) and the KL when beta > 0 (not the policy loss, about 0 whatever the policy); DPO the loss, accuracy and margin; a reward model the loss and accuracy; KTO the loss, the rewards of the
desirable and of the undesirable completions and the KL;
train and eval each; the learning rate in a panel of its own only when it changes. The PNG records how
many points each curve has (its Description), which is what these tests read."""

import json

import pytest
from PIL import Image

from finetune.recipe import apply_overrides, load_recipe_module
from finetune.training.metrics import plot_losses
from finetune.training.objectives import objective_for

RECIPES = {"sft": "tiny", "grpo": "tiny_grpo", "dpo": "tiny_dpo", "reward": "tiny_reward", "kto": "tiny_kto"}


def panels(objective: str, *overrides: str):
    return objective_for(apply_overrides(load_recipe_module(RECIPES[objective]), list(overrides))).panels


def records(objective: str, lr_constant: bool, beta: float = 0.0) -> list[dict]:
    out = []
    for step in range(1, 11):
        r = {"step": step, "loss": 1.0 / step, "lr": 1e-3 if lr_constant else 1e-3 * step / 10, "grad_norm": 0.1}
        if objective == "grpo":
            r |= {"loss": 0.0, "reward": step / 10, "completions/mean_length": 8 - step / 5, "entropy": 3 - step / 10,
                  "clip_ratio/region_mean": step / 100}
            r |= {"kl": step / 100} if beta else {}
        if objective == "dpo":
            r |= {"rewards/accuracies": step / 10, "rewards/margins": step / 5}
        if objective == "reward":
            r |= {"accuracy": step / 10, "margin": step / 5}
        if objective == "kto":
            r |= {"rewards/chosen": step / 10, "rewards/rejected": -step / 10, "kl": step / 100}
        out.append(r)
        if step % 5 == 0:
            e = {"step": step}
            if objective == "grpo":
                e |= {"eval_reward": step / 10, "eval_completions/mean_length": 7.0}
            else:
                e |= {"eval_loss": 1.0 / step}
            e |= {"eval_rewards/accuracies": 0.5, "eval_rewards/margins": 0.2} if objective == "dpo" else {}
            e |= {"eval_accuracy": 0.5} if objective == "reward" else {}
            e |= {"eval_rewards/chosen": 0.2, "eval_rewards/rejected": -0.2, "eval_kl": 0.1} if objective == "kto" else {}
            out.append(e)
    return out


EXPECTED = {
    "sft": {"train_loss": 10, "eval_loss": 2},
    "grpo": {"train_reward": 10, "eval_reward": 2, "train_completions/mean_length": 10,
             "eval_completions/mean_length": 2, "train_entropy": 10, "train_clip_ratio/region_mean": 10},
    "dpo": {"train_loss": 10, "eval_loss": 2, "train_rewards/accuracies": 10, "eval_rewards/accuracies": 2,
            "train_rewards/margins": 10, "eval_rewards/margins": 2},
    "reward": {"train_loss": 10, "eval_loss": 2, "train_accuracy": 10, "eval_accuracy": 2},
    "kto": {"train_loss": 10, "eval_loss": 2, "train_rewards/chosen": 10, "eval_rewards/chosen": 2,
            "train_rewards/rejected": 10, "eval_rewards/rejected": 2, "train_kl": 10, "eval_kl": 2},
}


@pytest.mark.parametrize("objective", sorted(EXPECTED))
@pytest.mark.parametrize("lr_constant", [True, False], ids=["constant-lr", "cosine-lr"])
def test_each_objective_plots_what_it_optimizes(tmp_path, objective, lr_constant):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records(objective, lr_constant)))
    png = plot_losses(metrics, tmp_path / "run" / "loss.png", panels(objective))
    drawn = json.loads(Image.open(png).text["Description"])
    assert drawn == EXPECTED[objective] | {"learning_rate": 0 if lr_constant else 10, "last_step": 10}
    if objective == "grpo":
        assert "train_loss" not in drawn  # the policy loss of fresh samples says nothing


def test_grpo_plots_the_kl_when_beta_is_set(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records("grpo", True, beta=0.04)))
    drawn = json.loads(Image.open(plot_losses(metrics, tmp_path / "loss.png", panels("grpo", "beta=0.04")))
                       .text["Description"])
    assert drawn["train_kl"] == 10 and drawn["train_reward"] == 10
    drawn = json.loads(Image.open(plot_losses(metrics, tmp_path / "loss.png", panels("grpo"))).text["Description"])
    assert "train_kl" not in drawn  # beta 0: no reference, no KL panel
    drawn = json.loads(Image.open(plot_losses(metrics, tmp_path / "loss.png", panels("grpo", "loss_type=sapo")))
                       .text["Description"])
    assert "train_clip_ratio/region_mean" not in drawn and drawn["train_entropy"] == 10  # sapo does not clip
