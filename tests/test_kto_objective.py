"""KTO's pure parts (finetune/training/objectives/kto.py, finetune/data/unpaired.py, finetune/objective_rules/kto.py):
the losses on hand-computed cases, the objective on a real tiny model against a direct computation, the
metrics' means, the unpaired rows' tokens on real tokenizers (each the side of a preference pair the row
would be), TRL's rotation of the completions for the KL rows, the micro-batch's layout, and the recipe's
and the data's refusals. No training here: tests/distributed/test_kto.py runs it; bench/studies/kto_vs_trl.py
compares it with TRL's KTOTrainer."""

import json
import math

import pytest
import torch

import family_assets as FA
from finetune import data as D
from finetune.data.preference import encode_pairs
from finetune.data.unpaired import encode_unpaired, kl_partners, kl_row, kl_rows, with_kl_rows
from finetune.loss import sequence_logps
from finetune.recipe import Recipe, RecipeError, validate
from finetune.training.objectives import KTO, objective_for
from finetune.training.objectives.dpo import real_pairs
from finetune.training.objectives.kto import half, kto_losses


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_kto_and_apo_zero_unpaired_on_hand_computed_rows():
    policy = torch.tensor([-10.0, -12.0, -9.0], dtype=torch.float64)
    reference = torch.tensor([-11.0, -11.0, -9.5], dtype=torch.float64)  # log-ratios 1, -1, 0.5
    desirable = torch.tensor([True, False, False])
    got = kto_losses("kto", 0.1, policy, reference, desirable, kl=0.5)
    want = [1 - sigmoid(0.1 * (1 - 0.5)), 1 - sigmoid(0.1 * (0.5 + 1)), 1 - sigmoid(0.1 * (0.5 - 0.5))]
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    got = kto_losses("kto", 0.1, policy, reference, desirable, kl=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    assert got.tolist() == pytest.approx([2 * want[0], 0.5 * want[1], 0.5 * want[2]], abs=1e-12)
    got = kto_losses("apo_zero_unpaired", 0.1, policy, reference, desirable, kl=0.5)  # no KL term
    assert got.tolist() == pytest.approx([1 - sigmoid(0.1), sigmoid(-0.1), sigmoid(0.05)], abs=1e-12)
    # at the start (policy = reference, KL 0) every row's loss is 1 - sigmoid(0) = 0.5
    assert kto_losses("kto", 0.1, policy, policy, desirable).tolist() == [0.5] * 3


def test_means_per_side_and_a_side_without_rows():
    objective = KTO(Recipe(objective="kto"))
    # rewards chosen, rejected, logps chosen, rejected, rows chosen, rejected, KL x rows
    sums = torch.tensor([0.6, -0.3, -60.0, -90.0, 2.0, 3.0, 0.25 * 5], dtype=torch.float64)
    rc, rr, margin, lc, lr, kl = objective.means(sums, torch.tensor(5.0))
    assert (rc, rr, lc, lr) == pytest.approx((0.3, -0.1, -30.0, -30.0)) and margin == pytest.approx(0.4)
    assert kl == pytest.approx(0.25)
    none = objective.means(torch.tensor([0.6, 0.0, -60.0, 0.0, 2.0, 0.0, 0.0], dtype=torch.float64),
                           torch.tensor(2.0))
    assert math.isnan(none[1]) and math.isnan(none[2]) and math.isnan(none[4]) and none[0] == pytest.approx(0.3)


def test_kl_partners_rotate_by_one_within_each_chunk():
    """TRL's add_kl_completion_ids: [y_n, y_1, ..., y_{n-1}] per chunk of per_device_train_batch_size rows."""
    assert kl_partners(7, 3) == [2, 0, 1, 5, 3, 4, 6]
    assert kl_partners(4, 2) == [1, 0, 3, 2]
    ids, labels = [1, 5, 6, 7, 2], [D.IGNORE] * 3 + [7, 2]
    other_ids, other_labels = [1, 9, 8, 4, 4, 2], [D.IGNORE] * 2 + [8, 4, 4, 2]
    assert kl_row(ids, labels, other_ids, other_labels, 64) == ([1, 5, 6, 8, 4, 4, 2], [D.IGNORE] * 3 + [8, 4, 4, 2])
    assert kl_row(ids, labels, other_ids, other_labels, 5) == ([1, 5, 6, 8, 4], [D.IGNORE] * 3 + [8, 4])


def tiny_rows():
    return [{"prompt": f"Copy: {w}\nAnswer: ", "completion": c, "label": ok}
            for w, c, ok in (("abc", "abc", True), ("dea", "DEA", False), ("mmk", "mmk", True),
                             ("bad", "xyz", False), ("kel", "kel", True))]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from finetune.assets import build_tokenizer

    return build_tokenizer()


def prepared(tokenizer, rows, chunk=2, max_len=64):
    import datasets

    ds = datasets.Dataset.from_dict(encode_unpaired(rows, tokenizer, max_len))
    return with_kl_rows(ds, chunk, max_len)


def test_batch_layout_rows_then_their_kl_rows_and_placeholders(tiny_tokenizer):
    ds = prepared(tiny_tokenizer, tiny_rows())
    assert ds["desirable"] == [1, 0, 1, 0, 1]
    batch = D.fetch(ds, [2, 3, -1], tiny_tokenizer.pad_token_id, False)
    n = 3
    assert batch["input_ids"].shape[0] == 2 * n and batch["desirable"].tolist() == [True, False, True]
    row2 = ds[2]
    width = len(row2["input_ids"])
    assert batch["input_ids"][0, :width].tolist() == row2["input_ids"]
    # row 2's KL row: its prompt with row 3's completion (chunk [2, 3]: 2 takes 3's, 3 takes 2's)
    prompt = D.prompt_length(row2["input_ids"], row2["labels"])
    other = ds[3]
    answer = other["input_ids"][D.prompt_length(other["input_ids"], other["labels"]):]
    kl = batch["input_ids"][n, :prompt + len(answer)].tolist()
    assert kl == row2["input_ids"][:prompt] + answer
    assert (batch["labels"][[2, n + 2]] == D.IGNORE).all()  # the placeholder trains nothing, nor its KL row
    assert real_pairs(batch).tolist() == [True, True, False]


def completion_of(row: dict) -> list[int]:
    return row["input_ids"][D.prompt_length(row["input_ids"], row["labels"]):]


def test_training_kl_rows_are_made_from_each_micro_batch_as_fetched(tiny_tokenizer):
    """The shuffled training split carries no KL rows: each micro-batch, in the order it is fetched, pairs
    each row's prompt with the completion of the row before it (the first row's with the last's), TRL's
    rotation within the batch its KTOTrainer reads; cut at kl_max_len."""
    import datasets

    ds = datasets.Dataset.from_dict(encode_unpaired(tiny_rows(), tiny_tokenizer, 64))
    order = [3, 0, 4]
    batch = D.fetch(ds, order, tiny_tokenizer.pad_token_id, False, kl_max_len=64)
    n = len(order)
    for j, (row, partner) in enumerate(zip(order, [4, 3, 0])):
        mine, other = ds[row], ds[partner]
        prompt = D.prompt_length(mine["input_ids"], mine["labels"])
        want = mine["input_ids"][:prompt] + completion_of(other)
        assert batch["input_ids"][n + j, :len(want)].tolist() == want
        trained = batch["labels"][n + j][batch["labels"][n + j] != D.IGNORE].tolist()
        assert trained == completion_of(other)
    assert kl_rows([ds[i] for i in order], 64) == [(batch["input_ids"][n + j][batch["attention_mask"][n + j] == 1]
                                                     .tolist(), batch["labels"][n + j][batch["attention_mask"][n + j]
                                                                                     == 1].tolist()) for j in range(n)]
    short = D.fetch(ds, order, tiny_tokenizer.pad_token_id, False, kl_max_len=12)
    assert short["attention_mask"][n:].sum(-1).max() <= 12 < batch["attention_mask"][n:].sum(-1).max()


def test_the_micro_batches_and_so_the_kl_rows_are_the_same_on_any_process_count():
    """A step's micro-batches are the same rows in the same order whether one process accumulates them or
    several processes take one each (BatchSchedule), so the KL rows made from them are too (2 processes =
    1), and as accelerate shards a sequential batch sampler (micro-batch a of rank p: batch a x world + p)."""
    one, two = D.BatchSchedule(100, 4, 2, 1, 42), D.BatchSchedule(100, 4, 1, 2, 42)
    for step in range(one.steps_per_epoch + 3):
        assert one.rows(step, 0) == two.rows(step, 0) + two.rows(step, 1)


def test_rollout_fetches_the_step_and_reads_the_precomputed_epoch(tiny_tokenizer):
    """kto's rollout makes the step's micro-batches from the schedule (the loop fetches none), their KL rows
    from each, and where the reference was precomputed, the rows' and KL rows' values of the step's epoch;
    the step's KL is the mean over its rows of the policy's minus those, clamped at 0."""
    import types

    import datasets
    from finetune.assets import tiny_model_dir
    from finetune import sequence_parallel as SP
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir()).float()
    ds = datasets.Dataset.from_dict(encode_unpaired(tiny_rows() * 2, tiny_tokenizer, 64))
    schedule = D.BatchSchedule(len(ds), 2, 2, 1, 7)
    recipe = Recipe(objective="kto", micro_batch_size=2, max_seq_len=64, loss_impl="full")
    objective = KTO(recipe)
    assert objective.makes_batches and not KTO(Recipe(objective="kto", kto_loss="apo_zero_unpaired")).makes_batches
    objective.to_device = lambda batch, device: batch
    objective.epoch_reference = [torch.arange(20, dtype=torch.float32).view(10, 2) - 50 - 100 * e for e in range(3)]
    run = types.SimpleNamespace(schedule=schedule, recipe=recipe, model=model, datasets=types.SimpleNamespace(train=ds),
                                tokenizer=tiny_tokenizer, accelerator=types.SimpleNamespace(device=torch.device("cpu")),
                                parallel=types.SimpleNamespace(sp=SP.Layout()), reduce_sum=lambda t: t)
    step = schedule.steps_per_epoch + 1  # epoch 1's second step
    batches = objective.rollout(run, step, [])
    rows = schedule.rows(step, 0)
    assert len(batches) == 2
    policy, reference = [], []
    for batch, part in zip(batches, rows):
        want = D.fetch(ds, part, tiny_tokenizer.pad_token_id, False, kl_max_len=64)
        assert torch.equal(batch["input_ids"], want["input_ids"])
        table = objective.epoch_reference[1]
        assert batch["ref_logps"].tolist() == [table[i, 0].item() for i in part] + [table[i, 1].item() for i in part]
        with torch.no_grad():
            policy += sequence_logps(model, half(batch, True), "full")[0].tolist()
        reference += [table[i, 1].item() for i in part]
    want = max(0.0, sum(p - r for p, r in zip(policy, reference)) / len(policy))
    assert objective.kl.item() == pytest.approx(want, rel=1e-6) and want > 0


def test_a_sequence_parallel_shard_keeps_both_halves_and_the_labels(tiny_tokenizer):
    """Under sequence parallelism each half (rows, KL rows) is padded to micro_batch_size rows, as a pair
    batch's sides are, and the shard carries which rows are real and which desirable, whole."""
    from finetune import sequence_parallel as SP

    ds = prepared(tiny_tokenizer, tiny_rows())
    batch = D.fetch(ds, [0, 1, 2], tiny_tokenizer.pad_token_id, False)
    out = SP.shard(batch, 2, 0, 4, tiny_tokenizer.pad_token_id, pairs=True)
    assert out["input_ids"].shape[0] == 8 and out["desirable"].tolist() == [True, False, True, False]
    assert out["real_pairs"].tolist() == [True, True, True, False]
    assert set(half(out, True)) == {"input_ids", "attention_mask", "position_ids", "shift_labels"}
    assert torch.equal(half(out, True)["input_ids"], out["input_ids"][4:])


def test_the_loss_on_a_real_model_is_the_direct_computation(tiny_tokenizer):
    from finetune.assets import tiny_model_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir()).float()
    ds = prepared(tiny_tokenizer, tiny_rows(), chunk=5)
    batch = D.fetch(ds, [0, 1, 2, 3, 4], tiny_tokenizer.pad_token_id, False)
    reference = torch.tensor([-30.0, -31.0, -29.0, -33.0, -28.0])
    batch["ref_logps"] = torch.cat([reference, reference - 1.0])  # rows, then their KL rows
    objective = KTO(Recipe(objective="kto", kto_beta=0.2, desirable_weight=1.5, loss_impl="full"))
    objective.kl = torch.tensor(0.3)
    loss = objective.loss(model, batch)
    with torch.no_grad():
        sums, _ = sequence_logps(model, half(batch, False), "full")
    desirable = batch["desirable"]
    want = sum((1.5 * (1 - sigmoid(0.2 * (s - r - 0.3))) if d else 1 - sigmoid(0.2 * (0.3 - (s - r))))
               for s, r, d in zip(sums.tolist(), reference.tolist(), desirable.tolist()))
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    metrics = objective.means(objective.take_metrics(), torch.tensor(5.0))
    chosen = [0.2 * (s - r) for s, r, d in zip(sums.tolist(), reference.tolist(), desirable.tolist()) if d]
    assert metrics[0] == pytest.approx(sum(chosen) / len(chosen), rel=1e-6) and metrics[5] == pytest.approx(0.3)


@pytest.mark.parametrize("name", ["mistral", "chatml"])
def test_an_unpaired_row_is_the_side_of_the_pair_it_would_be(name, tmp_path):
    """Text and conversational rows on real tokenizers: the tokens and trained positions of an unpaired row
    are those of a preference pair's chosen side with that completion."""
    if name == "mistral":
        tok = FA.mistral_tokenizer("v1", tmp_path)
        tok.chat_template = FA.MISTRAL
    else:
        corpus = ["What is 2+2?", "4, of course.", "It is 7.", "Question: capital of France? Answer: Paris"]
        tok = FA.make_tokenizer(FA.FAMILIES["qwen2"], corpus, tmp_path)
        tok.chat_template = FA.CHATML
    rows = [{"prompt": "Question: capital of France? Answer: ", "completion": "Paris", "label": True},
            {"prompt": [{"role": "user", "content": "What is 2+2?"}],
             "completion": [{"role": "assistant", "content": "4, of course."}], "label": False}]
    got = encode_unpaired(rows, tok, 256)
    pairs = encode_pairs([{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"]}
                          for r in rows], tok, 256)
    assert got["input_ids"] == pairs["chosen_input_ids"] and got["labels"] == pairs["chosen_labels"]
    assert got["desirable"] == [1, 0] and all(n > 0 for n in got["n_targets"])
    trained = [tok.decode([t for t in labels if t != D.IGNORE]) for labels in got["labels"]]
    assert "Paris" in trained[0] and "4, of course." in trained[1] and "2+2" not in trained[1]


def test_the_format_is_detected_and_bad_rows_are_one_line(tmp_path):
    assert D.detect_format(["prompt", "completion", "label"], "x") == "unpaired"
    for row, words in (({"prompt": "p", "completion": "c", "label": "yes"}, "field 'label' must be true"),
                       ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}], "label": True},
                        "'prompt' is a string and 'completion' a list of messages"),
                       ({"prompt": "p", "completion": "", "label": False}, "the completion is empty"),
                       ({"prompt": [{"role": "user", "content": "q"}],
                         "completion": [{"role": "user", "content": "c"}], "label": True},
                        "'completion' has no assistant message")):
        with pytest.raises(D.DataError, match=words):
            D.check_row(row, "unpaired", "f.jsonl row 0")
    D.check_row({"prompt": "p", "completion": "c", "label": 1}, "unpaired", "f.jsonl row 0")
    kto = tmp_path / "kto.jsonl"
    kto.write_text("".join(json.dumps(r) + "\n" for r in tiny_rows()))
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    D.prevalidate_recipe(Recipe(objective="kto", dataset=str(kto)))
    D.prevalidate_recipe(Recipe(objective="kto", dataset="builtin:tiny-kto"))
    with pytest.raises(D.DataError, match="objective=kto needs unpaired rows"):
        D.prevalidate_recipe(Recipe(objective="kto", dataset=str(sft)))
    with pytest.raises(D.DataError, match="has unpaired rows .* which train with objective=kto"):
        D.prevalidate_recipe(Recipe(objective="sft", dataset=str(kto)))


@pytest.mark.parametrize("overrides,words", [
    ({"objective": "dpo", "kto_beta": 0.2}, "kto_beta=0.2 applies to objective=kto only; set objective=kto"),
    ({"objective": "sft", "desirable_weight": 1.33}, "desirable_weight=1.33 applies to objective=kto only"),
    ({"dpo_beta": 0.2}, "dpo_beta=0.2 applies to objective=dpo only"),
    ({"kto_beta": 0.0}, "kto_beta=0: must be in [0.001, 1000]"),
    ({"undesirable_weight": 0.0}, "undesirable_weight=0: must be in (0, 1000]"),
    ({"micro_batch_size": 1}, "micro_batch_size=1 with objective=kto: the KL estimate pairs each prompt"),
    ({"packing": True}, "packing=true with objective=kto"),
    ({"sequence_parallel": 2, "precompute_reference": True},
     "precompute_reference=true with sequence_parallel=2 and objective=kto"),
    ({"max_prompt_len": 64, "max_seq_len": 64}, "max_prompt_len=64 leaves no room for a response"),
])
def test_recipe_rules(overrides, words):
    base = {"objective": "kto", "dataset": "builtin:tiny-kto", "micro_batch_size": 4}
    with pytest.raises(RecipeError) as e:
        validate(Recipe(**(base | overrides)))
    assert words in str(e.value), str(e.value)


def test_what_kto_takes_of_dpo_s_keys_and_its_reference():
    from finetune.recipe import reference_kind

    base = Recipe(objective="kto", dataset="builtin:tiny-kto", micro_batch_size=4)
    validate(base)
    assert reference_kind(base) == "frozen" and reference_kind(Recipe(objective="kto", lora=True)) == "adapter"
    precomputed = Recipe(objective="kto", dataset="builtin:tiny-kto", micro_batch_size=4, precompute_reference=True,
                         max_prompt_len=32)
    validate(precomputed)
    assert reference_kind(precomputed) == "precomputed"
    validate(Recipe(objective="kto", dataset="builtin:tiny-kto", micro_batch_size=1, kto_loss="apo_zero_unpaired"))
    assert isinstance(objective_for(base), KTO)


def test_a_resume_may_not_change_the_micro_batch_that_pairs_the_kl_rows(monkeypatch):
    import dataclasses
    from pathlib import Path

    from finetune.checkpointing.resume import ResumePoint, changes

    monkeypatch.setenv("WORLD_SIZE", "1")
    saved = Recipe(objective="kto", max_steps=12, micro_batch_size=4, global_batch_size=16, output_dir="/runs/a")
    point = ResumePoint(path=Path("/runs/a/checkpoints/step_000000005"), step=5, world_size=2, global_batch_size=16,
                        strategy=saved.strategy, recipe=json.loads(json.dumps(saved.to_dict())))
    with pytest.raises(RecipeError) as e:
        changes(point, Recipe(objective="kto", max_steps=12, micro_batch_size=8, global_batch_size=16))
    assert "micro_batch_size: 4 -> 8: objective=kto's KL rows pair" in str(e.value) and "\n" not in str(e.value)
    apo = Recipe(objective="kto", kto_loss="apo_zero_unpaired", max_steps=12, micro_batch_size=4, global_batch_size=16)
    point = dataclasses.replace(point, recipe=json.loads(json.dumps(apo.to_dict())))
    assert changes(point, Recipe(objective="kto", kto_loss="apo_zero_unpaired", max_steps=12, micro_batch_size=8,
                                 global_batch_size=16)) == [
        "micro_batch_size: 4 -> 8 (the global batch is kept, accumulation is recomputed)"]


def test_conversational_rows_without_a_chat_template_are_called_unpaired_rows(tiny_tokenizer):
    """The refusal spoke of "preference rows" for KTO's rows; it names them as they are."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
             "label": True}]
    with pytest.raises(D.DataError) as e:
        encode_unpaired(rows, tokenizer, 64)
    assert str(e.value).startswith("unpaired rows (objective=kto) of messages need a tokenizer with a chat_template; "
                                   "set chat_template=...")
    with pytest.raises(D.DataError, match="^preference rows of messages need a tokenizer with a chat_template"):
        encode_pairs([{"prompt": rows[0]["prompt"], "chosen": rows[0]["completion"],
                       "rejected": rows[0]["completion"]}], tokenizer, 64)


@pytest.mark.parametrize("labels,side", [([True] * 5, "desirable (label true)"),
                                         ([False] * 5, "undesirable (label false)"), ([True, False] * 3, None)])
def test_data_with_one_label_only_is_said(labels, side, tiny_tokenizer, caplog):
    """Every row true (or false) trained with `margin nan` and no word. KTO's loss takes each row alone
    against the KL, so one side trains (TRL too); the run says, once, what that does."""
    import types

    import datasets

    rows = [r | {"label": label} for r, label in zip(tiny_rows() * 2, labels)]
    ds = datasets.Dataset.from_dict(encode_unpaired(rows, tiny_tokenizer, 64))
    objective = KTO(Recipe(objective="kto", micro_batch_size=2))
    context = types.SimpleNamespace(recipe=objective.recipe, datasets=types.SimpleNamespace(train=ds, eval=None),
                                    to_device=None, schedule=None, total_steps=0,
                                    accelerator=types.SimpleNamespace(is_main_process=True))
    caplog.clear()
    with caplog.at_level("WARNING"):
        objective.before_model(context)
    said = [r.getMessage() for r in caplog.records if "training rows is labelled" in r.getMessage()]
    if side is None:
        assert not said
    else:
        assert len(said) == 1 and said[0].startswith(f"every one of the {len(labels)} training rows is labelled {side}")
        assert said[0].endswith("check which field they are read from")


def test_what_a_user_sees_of_kto_data_labels_in_the_dry_run_show_and_summary(tmp_path, capsys):
    """Thumbs-up/down rows (the label a field `thumbs`, mapped on the command line): the dry run says each
    source's rows as stored and their label balance without tokenizing; `finetune data --show` says each
    row's label, and its summary the labels of the train and eval rows (issue 52)."""
    from in_process import run_main

    from finetune.commands import data as data_command

    rows = [{"prompt": f"Copy: {w}\nAnswer: ", "completion": w if k % 4 else w.upper(), "thumbs": bool(k % 4)}
            for k, w in enumerate(f"{a}{b}" for a in "abcdefgh" for b in "ijkl")]  # 24 of 32 desirable
    path = tmp_path / "thumbs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--recipe", "tiny_kto", f"dataset={path}", "dataset_format=auto", "columns=label:thumbs",
            "eval_fraction=0.25", f"output_dir={tmp_path / 'out'}"]
    code, out, err = run_main(args + ["--dry-run"])
    assert code == 0, err
    assert f"data dataset={path}: 32 unpaired rows as stored; labels: 24 desirable (true), 8 undesirable (false)\n" \
           "data eval: 25% of the rows held out (eval_fraction=0.25)\n" in out
    assert data_command.main(args[:-1] + ["--show", "3", "--color", "never"]) == 0
    shown = capsys.readouterr().out
    heads = [line for line in shown.splitlines() if line.startswith("--- row")]
    assert len(heads) == 3 and all(h.endswith(("; label true (desirable)", "; label false (undesirable)"))
                                   for h in heads), heads
    train, = [line for line in shown.splitlines() if line.startswith("train: ")]
    evals, = [line for line in shown.splitlines() if line.startswith("eval: ")]
    good = [int(line.split(" rows (")[1].split(" desirable")[0]) for line in (train, evals)]
    assert train.startswith("train: 24 rows (") and evals.startswith("eval: 8 rows (") and sum(good) == 24, shown
