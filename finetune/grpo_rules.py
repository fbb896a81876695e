"""GRPO's rules on how completions are sampled (temperature, top_p, top_k): the values that cannot
sample (refused by recipe.validate through `problem`, before anything loads) and those that sample
without a learning signal (said by the GRPO objective through `no_signal`, before the model loads).
Plain values in, a line or None out: no import from the rest of finetune (recipe.py, on the ground
floor, asks it)."""

from __future__ import annotations

# Below this the logits divided by the temperature leave float32's range (inf - inf: NaN probabilities)
# while sampling as greedy already would; 0 is greedy itself.
MIN_TEMPERATURE = 1e-3


def problem(recipe) -> str | None:
    """Why the recipe's sampling cannot run (one line), or None."""
    if 0 < recipe.temperature < MIN_TEMPERATURE:
        return (f"temperature={recipe.temperature:g}: a temperature this small divides the logits beyond float range "
                f"(NaN probabilities) and samples as greedy would; use temperature=0 (greedy) or at least "
                f"{MIN_TEMPERATURE:g}")
    if recipe.top_p <= 0:
        return f"top_p={recipe.top_p:g} keeps no token to sample from; use a value in (0, 1] (1: off)"
    return None


def no_signal(recipe, vocab_size: int | None = None) -> str | None:
    """Why every completion of a prompt would be the same (greedy sampling), which makes each group's
    rewards equal and every advantage 0: the run would train on nothing. None when it samples."""
    if recipe.temperature == 0:
        why = "temperature=0 samples greedily"
    elif recipe.top_k == 1:
        why = "top_k=1 keeps only the likeliest token"
    elif vocab_size and recipe.top_p <= 1 / vocab_size:  # the likeliest token alone always reaches it
        why = f"top_p={recipe.top_p:g} (not above 1/{vocab_size}, one over the vocabulary) keeps only the likeliest token"
    else:
        return None
    return (f"{why}: the num_generations={recipe.num_generations} completions of a prompt are all the same, so each "
            "group's rewards are equal and every advantage is 0: no learning signal; sample with temperature > 0 "
            "(TRL's default: 1), top_k=0 or above 1, top_p near 1")
