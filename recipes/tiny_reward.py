"""A reward model on CPU in about a minute: the 2-layer tiny Llama with a score head (transformers'
AutoModelForSequenceClassification, one label) learns to score the right answer of builtin:tiny-preferences'
pairs above the wrong one (Bradley-Terry, TRL's RewardTrainer loss); the eval's accuracy climbs well
above 0.5. final/ loads with AutoModelForSequenceClassification.from_pretrained and scores through
finetune.rewards.RewardModel (a GRPO reward function).

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_reward
    python finetune/run.py --recipe tiny_reward strategy=ddp          # one process

tiny_dpo's data and settings with objective=reward and lr=1e-2 (no reference, no samples: a reward model does not generate).
"""

from dataclasses import replace

from finetune.recipe import Recipe
from recipes.tiny_dpo import recipe as tiny_dpo

recipe = replace(tiny_dpo, objective="reward", dpo_beta=Recipe().dpo_beta, lr=1e-2, output_dir="runs/tiny_reward")
