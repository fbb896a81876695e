"""The prompt a sample or `finetune chat` gives the model is the prompt training rendered before the
answer (real tokenizers: Mistral v1/v3 sentencepiece, tekken byte-level BPE, the tiny one); bad input
to `finetune chat` is one line, exit 2; a sample length that can never fit the model is one line before
the model loads; an eval reads stop requests between batches. The generation itself:
tests/test_generation.py."""

from __future__ import annotations

import json

import pytest
import torch

import family_assets as FA
from finetune import data as D
from finetune.recipe import RecipeError
from finetune.generation import render_prompt
from finetune.training.samples import eval_prompts

QUESTION = "What is 2+2?"
ROWS = {
    "alpaca": {"instruction": "Add the numbers.", "input": "", "output": "4"},
    "alpaca_input": {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
    "prompt_completion": {"prompt": "The capital of France is", "completion": " Paris"},
    "messages": {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "4"}]},
}


def _user_side(name: str) -> tuple[str, str, str]:
    """(text, format, input) as a user would give them to `finetune chat` for the row."""
    row = ROWS[name]
    if name.startswith("alpaca"):
        return row["instruction"], "alpaca", row["input"]
    if name == "prompt_completion":
        return row["prompt"], "prompt_completion", ""
    return QUESTION, "chat", ""


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from finetune.assets import build_tokenizer

    v1 = FA.mistral_tokenizer("v1", tmp_path_factory.mktemp("v1"))
    v3 = FA.mistral_tokenizer("v3", tmp_path_factory.mktemp("v3"))
    v1.chat_template = v3.chat_template = FA.MISTRAL
    tekken = FA.tekken_tokenizer(tmp_path_factory.mktemp("tekken") / "tok")
    tekken.chat_template = FA.CHATML.replace("<|im_start|>", "[INST]").replace("<|im_end|>", "</s>")
    return {"mistral_v1": v1, "mistral_v3": v3, "tekken": tekken, "tiny": build_tokenizer()}


@pytest.mark.parametrize("tok_name", ["mistral_v1", "mistral_v3", "tekken", "tiny"])
@pytest.mark.parametrize("row_name", list(ROWS))
def test_prompt_is_rendered_as_training_rendered_it(tokenizers, tok_name, row_name):
    """The eval prompt (tokens before the first target) equals chat's rendering of the user's text,
    and its decoded text (samples.jsonl's prompt) through --format raw gives the same tokens again."""
    import datasets

    tok = tokenizers[tok_name]
    fmt = "alpaca" if row_name.startswith("alpaca") else row_name
    ids, labels = D.encode_row(ROWS[row_name], fmt, tok, False, 512)
    ds = datasets.Dataset.from_list([{"input_ids": ids, "labels": labels}])
    (prompt,) = eval_prompts(ds, 1, tok)
    text, chat_fmt, extra = _user_side(row_name)
    assert render_prompt(tok, text, chat_fmt, extra) == prompt.ids
    assert render_prompt(tok, prompt.text, "raw") == prompt.ids
    assert prompt.reference.strip() == (ROWS[row_name].get("output") or ROWS[row_name].get("completion")
                                        or "4").strip()


def test_eval_prompts_skip_rows_without_a_prompt_and_refuse_too_many(tokenizers):
    import datasets

    tok = tokenizers["tiny"]
    text = D.encode_text(tok, "just text", 64)
    answer = D.encode_row(ROWS["alpaca"], "alpaca", tok, False, 64)
    ds = datasets.Dataset.from_list([{"input_ids": i, "labels": lab} for i, lab in (text, answer)])
    assert [p.reference for p in eval_prompts(ds, 2, tok)] == ["4"]
    with pytest.raises(RecipeError, match=r"^sample_prompts=3 is more than the 2 eval rows; lower sample_prompts"):
        eval_prompts(ds, 3, tok)
    with pytest.raises(RecipeError, match=r"sample_prompts=2 is more than the 1 eval rows \(eval_max_samples\)"):
        eval_prompts(ds, 2, tok, limit=1)


def test_a_prompt_row_gives_its_prompt_and_answer(tokenizers):
    """objective=grpo's eval rows (prompt rows): the prompt's tokens as the rollout generates from them,
    its `answer` column as the reference (empty without one)."""
    import datasets

    tok = tokenizers["tiny"]
    rows = [{"prompt": "Copy: abc Answer:", "answer": "abc"}, {"prompt": "Say hi", "answer": None}]
    ds = datasets.Dataset.from_list([r | {"prompt_input_ids": ids, "n_tokens": len(ids)} for r, ids in
                                     zip(rows, D.encode_prompts(rows, tok)["prompt_input_ids"])])
    prompts = eval_prompts(ds, 2, tok)
    assert [p.ids for p in prompts] == ds["prompt_input_ids"] and prompts[0].ids == render_prompt(tok, rows[0]["prompt"],
                                                                                                 "prompt_completion")
    assert [p.reference for p in prompts] == ["abc", ""]


def test_packed_row_gives_its_first_example(tokenizers):
    import datasets

    tok = tokenizers["tiny"]
    a = D.encode_row(ROWS["alpaca"], "alpaca", tok, False, 128)
    b = D.encode_row(ROWS["alpaca_input"], "alpaca", tok, False, 128)
    packed = D.pack_rows([a[0], b[0]], [a[1], b[1]], 256, tok.pad_token_id)
    ds = datasets.Dataset.from_dict(packed)
    prompts = eval_prompts(ds, 1, tok)
    first = a if packed["input_ids"][0][:len(a[0])] == a[0] else b
    assert prompts[0].ids == first[0][:next(i for i, x in enumerate(first[1]) if x != D.IGNORE)]
    assert prompts[0].reference == "4"


def _tiny_llama(vocab_size: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------- finetune chat


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory, tokenizers):
    """A plain model directory with the tiny tokenizer less its chat template, and no run around it."""
    out = tmp_path_factory.mktemp("plain") / "model"
    _tiny_llama(vocab_size=len(tokenizers["tiny"])).save_pretrained(out)
    tokenizers["tiny"].save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def _chat(capsys, *argv):
    from finetune.commands.chat import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_chat_answers_with_greedy_tokens(plain_model, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = _chat(capsys, plain_model, "abc", "--format", "prompt_completion", "--max-new-tokens", "6")
    assert code == 0, err
    tok = AutoTokenizer.from_pretrained(plain_model)
    model = AutoModelForCausalLM.from_pretrained(plain_model).eval()
    prompt = D.bos_ids(tok) + D.text_ids(tok, "abc")
    with torch.no_grad():  # transformers' own greedy generate, ended by the EOS as chat ends it
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)[0, len(prompt):]
    assert out == tok.decode(ids, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("argv, message", [
    (["{tmp}", "hi"], "error: {tmp} holds no model: give final/ or final_merged/ of a run, a LoRA adapter folder "
                      "(adapter_config.json), or a checkpoint (checkpoints/step_N)"),
    (["{tmp}/missing", "hi"], "error: {tmp}/missing does not exist; give final/ of a run, an adapter folder or a "
                              "checkpoint"),
    (["{model}", "hi"], "error: {model}: the tokenizer has no chat template and no recipe.json of its run says how "
                        "prompts were written; pass --format alpaca, prompt_completion or raw"),
    (["{model}", "hi", "--format", "chat"], "error: --format chat: the tokenizer in {model} has no chat template; "
                                            "pass --format alpaca, prompt_completion or raw"),
    (["{model}", "hi", "--max-new-tokens", "0"], "error: --max-new-tokens 0: must be at least 1"),
    (["{model}", "hi", "--temperature", "-1"], "error: --temperature -1.0: must be 0 (greedy) or more"),
    (["{model}", "hi", "--format", "yaml"], "error: argument --format: invalid choice: 'yaml' (choose from 'chat', "
                                            "'alpaca', 'prompt_completion', 'prompt', 'raw') (see finetune chat --help)"),
])
def test_chat_bad_input_is_one_line_exit_2(argv, message, plain_model, tmp_path, capsys):
    fill = {"tmp": tmp_path, "model": plain_model}
    code, out, err = _chat(capsys, *[a.format(**fill) for a in argv])
    assert code == 2 and out == "" and err == message.format(**fill) + "\n"


def test_planner_counts_the_gathered_model_under_sharded_strategies():
    """zero3/fsdp gather the whole model for samples in the dtype they compute in (fp32 here, 2 bytes under
    bf16, also for FSDP2's fp32 masters); ddp and zero2 hold it whole already. It is the eval's peak, apart
    from the training total that a setup must fit (samples that would not fit are skipped at run time)."""
    from finetune import memory as M
    from finetune.arch import Architecture

    arch = Architecture(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32)
    for strategy in ("zero3", "fsdp", "ddp", "zero2"):
        off = M.estimate(arch, M.Setup(strategy), world_size=8, mixed_precision="no")
        on = M.estimate(arch, M.Setup(strategy), world_size=8, mixed_precision="no", samples=True)
        whole = 4 * arch.num_parameters() if strategy in ("zero3", "fsdp") else 0
        assert on.samples == whole
        assert on.total == off.total and on.samples_peak == off.model_states + whole
        bf16 = M.estimate(arch, M.Setup(strategy), world_size=8, mixed_precision="bf16", samples=True)
        assert bf16.samples == whole // 2


def test_samples_are_skipped_when_the_gathered_model_would_not_fit_the_gpu():
    """An eval's samples gather the whole model on each GPU under zero3/fsdp: where that would not fit the
    memory training left free they are skipped with one line (an out-of-memory at an eval could come
    before any checkpoint); off a GPU (free unknown) and where it fits, they run."""
    from finetune.training.samples import gather_problem

    gib = 2**30
    assert gather_problem(14 * gib, None) is None
    assert gather_problem(14 * gib, 40 * gib) is None
    assert gather_problem(0, 0) is None
    problem = gather_problem(140 * gib, 40 * gib)
    assert problem == ("samples skipped: gathering the whole model for generation needs 140.0 GiB per GPU and 40.0 GiB "
                       "is free; set sample_prompts=0 (or generate from final/ with finetune chat)")
    assert gather_problem(37 * gib, 40 * gib) is not None  # within the 10% headroom


# ---------------------------------------------------------------- bounds and stop requests (issue 34)


def test_sample_max_new_tokens_that_never_fits_is_refused_before_the_model_loads():
    from transformers import GPT2Config

    from finetune.model import context_length, load_config, sample_length_problem
    from finetune.recipe import Recipe

    recipe = Recipe(model="builtin:tiny-llama", sample_max_new_tokens=10_000_000)
    _, config = load_config(recipe)  # the config only, as setup reads it before the model
    assert context_length(config) == 1024
    message = sample_length_problem(recipe, config)
    assert message.startswith("sample_max_new_tokens=10000000 can never fit: the model has 1024 positions"), message
    assert "at most 1023 new tokens" in message
    from dataclasses import replace

    assert sample_length_problem(replace(recipe, sample_max_new_tokens=1023), config) is None
    assert sample_length_problem(replace(recipe, sample_prompts=0), config) is None  # no samples: unused
    assert context_length(GPT2Config(n_positions=64)) == 64


class _StopAfter:
    """A stop request that comes after `reads` reads of it (as a signal between two batches does)."""

    def __init__(self, reads: int):
        self.reads = reads

    @property
    def requested(self):
        self.reads -= 1
        return self.reads < 0


def test_eval_reads_stop_requests_between_batches():
    import datasets

    from finetune.training.loop import evaluate
    from finetune.training.objectives import objective_for
    from finetune.recipe import Recipe

    model = _tiny_llama()
    rows = [list(range(1 + i, 17 + i)) for i in range(8)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    args = (model, ds, batches, 0, False, torch.device("cpu"), lambda t: t, objective_for(Recipe()))
    loss, _ = evaluate(*args)
    assert len(forwards) == 4
    forwards.clear()
    assert evaluate(*args, stop=_StopAfter(4)) == (loss, {})  # never asked: the same eval
    forwards.clear()
    assert evaluate(*args, stop=_StopAfter(2)) is None and len(forwards) == 2  # asked after the second batch
    assert model.training  # left as training expects it


def test_kto_samples_take_desirable_rows_and_never_call_an_undesirable_completion_the_reference(tmp_path, tiny_tokenizer):
    """An undesirable row's completion was shown as the sample's "reference" (issue 52): the desirable eval
    rows come first, with their completions as references, then undesirable rows with none."""
    from finetune.recipe import DataSource, Recipe

    rows = [{"prompt": f"Copy: {w}\nAnswer: ", "completion": w if good else w.upper(), "label": good}
            for w, good in (("ab", False), ("cd", True), ("ef", False), ("gh", True))]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = Recipe(dataset=str(path), objective="kto", micro_batch_size=2, max_seq_len=64, eval_fraction=0.0)
    ds = D.tokenize_dataset(D.load_source(DataSource(path=str(path))), "unpaired", tiny_tokenizer, recipe, "kto")
    prompts = eval_prompts(ds, 3, tiny_tokenizer)
    assert [(p.text.split("Copy: ")[1].split("\n")[0], p.reference) for p in prompts] == [
        ("cd", "cd"), ("gh", "gh"), ("ab", "")]
    assert [p.reference for p in eval_prompts(ds, 2, tiny_tokenizer, limit=2)] == ["cd", ""]  # eval_max_samples
