"""The errors every layer may raise, on the ground floor: this module imports nothing of finetune, so
the recipe, the strategies and the loop can all import it without an arrow pointing back up."""


class RecipeError(ValueError):
    """A mistake the user can fix by editing the recipe or the command line; printed as one line."""


def refuse_switched_on(recipe, keys, setting: str, why: str, after: str = "") -> None:
    """The first of these boolean keys that is true in the recipe, refused with `setting`: one line,
    "KEY=true with SETTING: WHY; set KEY=false" plus `after`."""
    for key in keys:
        if getattr(recipe, key):
            raise RecipeError(f"{key}=true with {setting}: {why}; set {key}=false{after}")
