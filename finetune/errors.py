"""The errors every layer may raise, on the ground floor: this module imports nothing of finetune, so
the recipe, the strategies and the loop can all import it without an arrow pointing back up."""


class RecipeError(ValueError):
    """A mistake the user can fix by editing the recipe or the command line; printed as one line."""
