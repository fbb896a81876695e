"""Reward functions (finetune/rewards.py): resolving names, weights, the built-in rewards, a reward model
directory, scoring a step with TRL's None semantics, and the errors naming the step, function and prompt;
and the recipe's GRPO rules (finetune/recipe.py)."""

import importlib.util
import math

import pytest
import torch

from finetune import rewards as R
from finetune.rl_losses import group_advantages
from finetune.recipe import Recipe, RecipeError, apply_overrides, validate

PROMPTS = ["2+2=", "3*3="]


def test_resolve_by_name_and_callable():
    assert R.resolve("finetune.rewards:exact_match") is R.exact_match
    assert R.resolve(len) is len
    assert R.spec_name(R.exact_match) == "finetune.rewards:exact_match"
    assert R.short_name(R.think_format) == "think_format"
    with pytest.raises(R.RewardSpecError, match="module no_such_module cannot be imported"):
        R.resolve("no_such_module:f")
    with pytest.raises(R.RewardSpecError, match="has no nothing"):
        R.resolve("finetune.rewards:nothing")
    with pytest.raises(R.RewardSpecError, match="module:function"):
        R.resolve("exact_match")
    with pytest.raises(R.RewardSpecError, match="two functions are named exact_match"):
        R.resolve_all(["finetune.rewards:exact_match", R.exact_match])


def test_weights():
    assert R.weights((), 2).tolist() == [1.0, 1.0]
    assert R.weights(("0.5", 2), 2).tolist() == [0.5, 2.0]
    with pytest.raises(R.RewardSpecError, match="1 weights for 2 reward functions"):
        R.weights((1.0,), 2)
    with pytest.raises(R.RewardSpecError, match="'x' is not a finite number"):
        R.weights(("x", 1), 2)


def test_builtins():
    assert R.exact_match(completions=[" 4 ", "8"], answer=[4, "9"], prompts=PROMPTS) == [1.0, 0.0]
    assert R.exact_match_on("solution")(completions=["4"], solution=["4"]) == [1.0]
    with pytest.raises(KeyError, match="needs a column 'solution'"):
        R.exact_match_on("solution")(completions=["4"], answer=["4"])
    messages = [[{"role": "assistant", "content": "4"}]]
    assert R.exact_match(completions=messages, answer=["4"]) == [1.0]
    think = ["<think>two and two</think> 4", "4", "<think>a</think><think>b</think> 4", "<think>\nmulti\nline</think>5"]
    assert R.think_format(completions=think) == [1.0, 0.0, 0.0, 1.0]
    digits = R.regex_reward(r"\d+", name="digits", reward=0.5)
    assert digits(completions=["42", "42 apples"]) == [0.5, 0.0] and R.short_name(digits) == "digits"


def test_math_answer_or_its_clear_error():
    """math-verify is optional: where it is installed the answers are checked, else the error says how to
    install it (this machine's venv has no math-verify: the error is what runs here)."""
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ImportError, match="pip install math-verify"):
            R.math_answer(completions=["4"], answer=["4"])
        return
    out = R.math_answer(completions=["The answer is $\\frac{1}{2}$", "it is 3", "x"], answer=["$0.5$", "$4$", ""])
    assert out == [1.0, 0.0, None]


def step_rewards(*funcs, weights=()):
    return R.Rewards(funcs, weights)


def test_score_with_none_and_weights_as_trl():
    def half(completions, **kw):
        return [0.5 if c == "4" else None for c in completions]

    def length(completions, answer, completion_ids, **kw):
        assert answer == ["4", "4", "9", "9"] and len(completion_ids) == 4
        return [None, float(len(completions[1])), None, 3]

    rewards = step_rewards(half, length, weights=(2.0, 1.0))
    assert rewards.names == ["half", "length"]
    per_func = rewards.score(0, PROMPTS[:1] * 2 + PROMPTS[1:] * 2, ["4", "44", "9", "x"], [[1], [1, 1], [2], [3]],
                             {"answer": ["4", "4", "9", "9"]})
    assert torch.equal(torch.isnan(per_func), torch.tensor([[False, True], [True, False], [True, True], [True, False]]))
    combined = R.weighted_rewards(per_func, rewards.weights)
    assert combined[:2].tolist() == [1.0, 2.0] and math.isnan(combined[2]) and combined[3] == 3.0
    advantages, _ = group_advantages(per_func, rewards.weights, 2, "none")
    assert advantages.tolist() == [-0.5, 0.5, 0.0, 0.0]  # the unscored completion: advantage 0, its group's mean 3


def test_errors_name_step_function_and_prompt():
    def boom(completions, **kw):
        raise ZeroDivisionError("division by zero")

    def short(completions, **kw):
        return [1.0]

    def words(completions, **kw):
        return ["good", 1.0]

    def infinite(completions, **kw):
        return [1.0, float("inf")]

    args = (PROMPTS, ["4", "9"], [[1], [2]], {})
    with pytest.raises(R.RewardError, match=r"step 7: reward function boom raised ZeroDivisionError: division by zero "
                                            r"\(prompt: '2\+2='\)") as e:
        step_rewards(boom).score(7, *args)
    assert (e.value.step, e.value.function, e.value.prompt) == (7, "boom", "2+2=")
    with pytest.raises(R.RewardError, match="step 3: reward function short returned 1 rewards for 2 completions"):
        step_rewards(short).score(3, *args)
    with pytest.raises(R.RewardError, match=r"words returned 'good' \(str\) for completion 0.*prompt: '2\+2='"):
        step_rewards(words).score(3, *args)
    with pytest.raises(R.RewardError, match=r"infinite returned inf \(float\) for completion 1.*prompt: '3\*3='"):
        step_rewards(infinite).score(3, *args)


def test_reward_model_directory_scores_prompt_and_completion(tmp_path):
    """A real sequence-classification model written by save_pretrained, with a real tokenizer (Mistral's
    sentencepiece model from the mistral_common wheel): its first logit per text, batched as one by one."""
    import family_assets as FA
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = FA.mistral_tokenizer("v3", tmp_path / "rm")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    model = R.RewardModel(str(tmp_path / "rm"), batch_size=2)
    completions = ["4", "four, I think", "9"]
    scores = model(prompts=PROMPTS + ["1+1="], completions=completions)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores) and len(set(scores)) == 3
    one = R.RewardModel(str(tmp_path / "rm"), batch_size=1)(prompts=PROMPTS + ["1+1="], completions=completions)
    assert scores == pytest.approx(one, abs=1e-5)  # right padding: a text's score does not depend on its batch
    assert R.short_name(model).startswith("reward_model(")
    per_func = R.Rewards([model, R.exact_match]).score(0, PROMPTS + ["1+1="], completions, [[1]] * 3,
                                                       {"answer": ["4", "9", "2"]})
    assert per_func[:, 0].tolist() == pytest.approx(scores) and per_func[:, 1].tolist() == [1.0, 0.0, 0.0]


def test_reward_model_directory_is_checked_before_the_policy_loads(tmp_path, tiny_tokenizer):
    """GRPO's check_reward_models (its before_model, which the loop calls before the policy loads) refuses, in one line, a reward
    model directory that is missing, whose weights are cut short, or that has no score head (a causal LM's
    final/ given by mistake: transformers would add a random head, and the run train on random rewards), or
    whose model type has no sequence-classification class (Mamba); it passes a real sequence-classification
    directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, MambaConfig, MambaForCausalLM

    from finetune.training.objectives.grpo import GRPO

    config = dict(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=tiny_tokenizer.pad_token_id)
    good, causal, cut, mamba = tmp_path / "rm", tmp_path / "lm", tmp_path / "cut", tmp_path / "mamba"
    LlamaForSequenceClassification(LlamaConfig(**config, num_labels=1)).save_pretrained(good)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(causal)
    LlamaForSequenceClassification(LlamaConfig(**config, num_labels=1)).save_pretrained(cut)
    MambaForCausalLM(MambaConfig(vocab_size=len(tiny_tokenizer), hidden_size=16, state_size=4,
                                 num_hidden_layers=1)).save_pretrained(mamba)
    for folder in (good, causal, cut, mamba):
        tiny_tokenizer.save_pretrained(folder)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])

    def before_model(path):
        objective = GRPO(Recipe(objective="grpo", reward_funcs=(R.RewardModel(str(path)),), num_generations=4,
                                micro_batch_size=4))
        objective.check_reward_models()

    before_model(good)
    for path, words in ((tmp_path / "missing", "no such directory"),
                        (causal, "its weights have no score head (score.weight: a LlamaForCausalLM directory"),
                        (cut, "model.safetensors is not a whole safetensors file"),
                        (mamba, "model type mamba has no sequence-classification class in transformers")):
        with pytest.raises(RecipeError) as e:
            before_model(path)
        assert str(e.value).startswith(f"reward_funcs: reward model {path}: {words}"), str(e.value)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the recipe's GRPO rules
GRPO = {"objective": "grpo", "reward_funcs": ("finetune.rewards:exact_match",), "num_generations": 4,
        "micro_batch_size": 4}


def test_recipe_grpo_accepts_names_callables_and_command_line_lists():
    validate(Recipe(**GRPO))
    r = validate(Recipe(**(GRPO | {"reward_funcs": [R.exact_match, R.think_format], "reward_weights": [1, 0.5]})))
    assert r.reward_funcs == (R.exact_match, R.think_format)
    assert r.to_dict()["reward_funcs"] == ("finetune.rewards:exact_match", "finetune.rewards:think_format")
    r = validate(apply_overrides(Recipe(**GRPO), ["reward_funcs=finetune.rewards:exact_match,finetune.rewards:"
                                                  "think_format", "reward_weights=1,0.5", "loss_type=dr_grpo"]))
    assert r.reward_funcs == ("finetune.rewards:exact_match", "finetune.rewards:think_format")
    assert R.Rewards.from_recipe(r).weights.tolist() == [1.0, 0.5]


@pytest.mark.parametrize("changes, message", [
    ({"reward_funcs": ()}, "objective=grpo needs reward functions: reward_funcs=module:function"),
    ({"reward_funcs": ("no_such_rewards_module:correct",)},  # not my_rewards, which a user may well have
     "reward_funcs=no_such_rewards_module:correct: module no_such_rewards_module cannot be imported"),
    ({"reward_weights": (1.0, 2.0)}, "reward_weights=1.0,2.0: 2 weights for 1 reward functions"),
    ({"num_generations": 1}, "num_generations=1: a group needs at least 2 completions"),
    ({"micro_batch_size": 3}, "micro_batch_size=3 x grad_accum=1 completions per process do not split into whole "
                              "groups of num_generations=4"),
    ({"global_batch_size": 3, "micro_batch_size": 8}, "global_batch_size=3 prompts x num_generations=4 = 12 "
                                                      "completions do not split into micro-batches of micro_batch_size=8"),
    ({"dpo_beta": 0.2}, "dpo_beta=0.2 applies to objective=dpo only"),
    ({"packing": True}, "packing=true with objective=grpo"),
    ({"max_prompt_len": 2000, "max_completion_len": 100}, "max_prompt_len=2000 + max_completion_len=100 exceed"),
])
def test_recipe_grpo_errors(changes, message):
    with pytest.raises(RecipeError) as e:
        validate(Recipe(**(GRPO | changes)))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key, value", [("num_generations", 4), ("beta", 0.04), ("loss_type", "grpo"),
                                        ("reward_funcs", ("finetune.rewards:exact_match",))])
def test_recipe_grpo_fields_with_another_objective(key, value):
    for objective in ("sft", "dpo"):
        with pytest.raises(RecipeError, match=f"{key}=.* applies to objective=grpo only; set objective=grpo"):
            validate(Recipe(objective=objective, **{key: value}))


def test_the_reward_model_class_is_refused_with_how_to_configure_it():
    """reward_funcs=finetune.rewards:RewardModel (the class) passed validation and failed at step 1 with
    an empty function name: it is one line at validation now, for a name and for the class itself."""
    for spec, shown in (("finetune.rewards:RewardModel", "finetune.rewards:RewardModel"),
                        (R.RewardModel, "finetune.rewards:RewardModel")):
        with pytest.raises(RecipeError) as e:
            validate(Recipe(**(GRPO | {"reward_funcs": (spec,)})))
        assert str(e.value) == (f"reward_funcs={shown} is the class, not a reward function: give one with its model "
                                "directory, RewardModel(\"path/to/reward_run/final\"), in the recipe file's reward_funcs "
                                "(or as a module:name bound to one)")
    with pytest.raises(RecipeError, match=r"reward_funcs=collections:Counter is a class, not a reward function"):
        validate(Recipe(**(GRPO | {"reward_funcs": ("collections:Counter",)})))
    validate(Recipe(**(GRPO | {"reward_funcs": (R.RewardModel("any/dir"),)})))  # an instance is a function


def test_bools_count_alike_from_python_torch_and_numpy():
    """A numpy bool array was refused ("not a finite number") where Python and torch bools pass."""
    import numpy as np

    def python(completions, **kw):
        return [c == "4" for c in completions]

    def torch_bools(completions, **kw):
        return torch.tensor([c == "4" for c in completions])

    def numpy_bools(completions, **kw):
        return np.array([c == "4" for c in completions])

    def numpy_numbers(completions, **kw):
        return np.array([1.5, 2.0], dtype=np.float32)

    per_func = step_rewards(python, torch_bools, numpy_bools, numpy_numbers).score(1, PROMPTS, ["4", "9"], [[1], [2]], {})
    assert per_func.tolist() == [[1.0, 1.0, 1.0, 1.5], [0.0, 0.0, 0.0, 2.0]]


def test_huge_rewards_keep_their_advantages():
    """Rewards near 1e30 overflowed the std's float32 squares to inf and made every advantage 0 without a
    word; beyond float32's range a reward cannot be kept and is refused in one line."""
    from finetune.training.rollouts import rollout_metrics

    per_func = torch.tensor([[1e30], [3e30], [-1e30], [1e30]])
    advantages, zero_std = group_advantages(per_func, torch.ones(1), 2)
    small, _ = group_advantages(per_func / 1e30, torch.ones(1), 2)
    assert torch.allclose(advantages, small, rtol=1e-4) and advantages.abs().min() > 0.7 and not zero_std.any()
    metrics = rollout_metrics(per_func, torch.ones(1), ["r"], zero_std, torch.tensor([1, 2, 3, 4]),
                              torch.zeros(4, dtype=torch.bool))
    assert math.isfinite(metrics["reward_std"]) and math.isfinite(metrics["rewards/r/std"])

    def beyond(completions, **kw):
        return [1.0, 1e39]

    with pytest.raises(R.RewardError, match=r"step 2: reward function beyond returned 1e\+39 for completion 1, beyond "
                                            r"the float32 range rewards are kept in"):
        step_rewards(beyond).score(2, PROMPTS, ["4", "9"], [[1], [2]], {})


def test_a_reward_function_needing_a_missing_column_is_found_before_the_model():
    """Called once on the first row with an empty completion: a column looked up (KeyError) or a keyword
    argument missing (TypeError) is one line naming the function and the rows' columns; any other
    failure on an empty completion is left to the run."""
    row = {"prompt": "2+2=", "level": 1}
    problem = R.missing_column_problem(step_rewards(R.exact_match), row, ["level"])
    assert problem.startswith("reward function exact_match, called on the first training row with an empty "
                              "completion before the model loads, raised KeyError: ")
    assert "the prompt rows have the columns prompt, level: map the one it reads with columns=" in problem
    assert "raised TypeError: char_match() missing 1 required positional argument: 'answer'" in \
        R.missing_column_problem(step_rewards(R.char_match), row, ["level"])

    def picky(completions, **kw):
        return [float(completions[0])]  # ValueError on an empty completion: not a column

    assert R.missing_column_problem(step_rewards(picky, R.RewardModel("not/loaded")), row, ["level"]) is None
    assert R.missing_column_problem(step_rewards(R.exact_match), row | {"answer": "4"}, ["level", "answer"]) is None


@pytest.mark.parametrize("changes, message", [
    ({"temperature": 1e-40}, "temperature=1e-40: a temperature this small divides the logits beyond float range"),
    ({"top_p": 0.0}, "top_p=0 keeps no token to sample from; use a value in (0, 1]"),
])
def test_sampling_that_cannot_run_is_refused_at_validation(changes, message):
    """Both passed validation and raised tracebacks after the model loaded."""
    with pytest.raises(RecipeError) as e:
        validate(Recipe(**(GRPO | changes)))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    validate(Recipe(**(GRPO | {"temperature": 0.0})))  # greedy: allowed, with a warning (below)


@pytest.mark.parametrize("changes, why", [
    ({"temperature": 0.0}, "temperature=0 samples greedily"),
    ({"top_k": 1}, "top_k=1 keeps only the likeliest token"),
    ({"top_p": 1e-9}, "top_p=1e-09 (not above 1/32000, one over the vocabulary) keeps only the likeliest token"),
])
def test_sampling_without_a_learning_signal_is_said(changes, why):
    from finetune.objective_rules import grpo as grpo_rules

    line = grpo_rules.no_signal(validate(Recipe(**(GRPO | changes))), 32000)
    assert line.startswith(why + ": the num_generations=4 completions of a prompt are all the same") and \
        "every advantage is 0: no learning signal" in line
    assert grpo_rules.no_signal(validate(Recipe(**(GRPO | {"top_p": 0.5, "top_k": 2}))), 32000) is None
