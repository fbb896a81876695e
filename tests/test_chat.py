"""`finetune chat` on what a user may point it at: a checkpoint is verified as export verifies it
(sizes and checksums: finetune.checkpointing.manifest.verify), a damaged or foreign directory is one `error:` line
and exit 2, and the prompt is rendered the way the run trained its prompts. The checkpoints here are
the tiny model's real weights written the way a DDP run's save_state writes them (model.safetensors,
hf/, recipe.json, a sealed manifest); chat on the checkpoints of real launches is in
tests/distributed/test_samples_run.py."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from test_checkpoint_files import flip_byte


def write_checkpoint(path: Path, weights: str = "safetensors", checksums: bool = True, recipe: dict | None = None):
    """The tiny model's weights as a checkpoint: model.safetensors (or pytorch_model.bin), hf/ (config,
    tokenizer), recipe.json and a manifest listing every file with its size (and checksum)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.assets import tiny_model_dir
    from finetune.checkpointing.layout import HF_DIR, MANIFEST
    from finetune.checkpointing.manifest import seal

    tiny = tiny_model_dir()
    path.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if weights == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    model.config.save_pretrained(path / HF_DIR)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path / HF_DIR)
    (path / "recipe.json").write_text(json.dumps(recipe or {"model": str(tiny), "mixed_precision": "no",
                                                            "dataset_format": "alpaca"}))
    manifest = seal(path, MANIFEST, {"step": 4, "world_size": 1, "global_batch_size": 8,
                                     "fingerprint": {"strategy": "ddp", "model": str(tiny)}})
    if not checksums:  # as an older finetune wrote it
        manifest = {k: v for k, v in manifest.items() if k not in ("checksum", "checksums")}
        (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def chat(capsys, *argv) -> tuple[int, str, str]:
    from finetune.commands.chat import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def pickle_offset(archive: Path) -> int:
    """Where the pickle (data.pkl) of a torch.save archive starts: a byte flipped there is in the pickle."""
    with zipfile.ZipFile(archive) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with open(archive, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def test_chat_verifies_a_checkpoints_checksums_as_export_does(tmp_path, capsys):
    """A shard corrupted at the same size passes a size check; chat answered from it (exit 0) where
    export refused. Now both refuse with the same line, before any weight is read."""
    from finetune.commands.export import main as export_main

    ckpt = write_checkpoint(tmp_path / "step_000000004")
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    assert code == 0 and out.strip(), err  # the intact checkpoint answers
    flip_byte(ckpt / "model.safetensors", offset=(ckpt / "model.safetensors").stat().st_size - 1000)  # a weight
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert line == (f"error: checkpoint {ckpt} is damaged: model.safetensors does not match the xxh3_128 checksum in "
                    f"its manifest.json; nothing was deleted; to continue from the newest intact checkpoint before it, move "
                    f"it out of the way (mv {ckpt} {tmp_path / 'damaged-step_000000004'}) and --resume auto")
    capsys.readouterr()
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == line


def test_an_unfinished_checkpoint_or_a_run_directory_names_what_to_give_instead(tmp_path, capsys):
    """A `.partial` checkpoint (its save never finished): export and chat named `--resume auto`, which
    neither has; now they name the complete checkpoints beside it. A run's output directory given as
    the checkpoint was "a checkpoint whose save never finished"; now it is named as what it is, with
    its checkpoints and final/."""
    import shutil

    from finetune.commands.export import main as export_main

    run = tmp_path / "run"
    done = write_checkpoint(run / "checkpoints" / "step_000000004")
    partial = run / "checkpoints" / ".step_000000008.partial"
    shutil.copytree(done, partial)
    (partial / "manifest.json").unlink()
    expected = (f"error: checkpoint {partial} is incomplete (no manifest.json: its save never finished); give a "
                f"complete one: step_000000004 (in {run / 'checkpoints'})")
    code, out, err = chat(capsys, partial, "Say hi", "--max-new-tokens", "2")
    assert code == 2 and one_error_line(err) == expected, err
    assert export_main([str(partial), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == expected

    (run / "final").mkdir()
    assert export_main([str(run), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {run} is a run's output directory, not a checkpoint; it holds its checkpoints: step_000000004 (in "
        f"{run / 'checkpoints'}); its finished model: {run / 'final'}; give one checkpoint (or final/ to finetune "
        "chat)")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_deleted_during_its_export_is_named(tmp_path, capsys, monkeypatch):
    """keep_last of a run still training removes the checkpoint being exported (after export verified it,
    while it reads the weights): that was "holds no model weights this tool knows"."""
    import shutil

    from finetune.checkpointing import export
    from finetune.commands.export import main as export_main

    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000004")
    read = export.checkpoint_state_dict

    def rotated_away(path, template):
        shutil.rmtree(path)  # as layout.rotate removes an old checkpoint
        return read(path, template)

    monkeypatch.setattr(export, "checkpoint_state_dict", rotated_away)
    capsys.readouterr()
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: checkpoint {ckpt} was deleted while it was being exported ("), line
    assert "keep_last" in line and "holds no model weights" not in line
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_export_leaves_every_file_it_did_not_create(tmp_path, capsys):
    """Issue 52, item 3: `finetune export CKPT DIR/model` removed an existing DIR/model.tmp and all in it.
    It stages in a directory of its own now: a user's model.tmp, .model.tmp and .model.previous stay as
    they were, the export is written whole, and nothing of its own is left beside it."""
    from finetune.commands.export import main as export_main

    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000004")
    out = tmp_path / "dir"
    for name in ("model.tmp", ".model.tmp", ".model.previous", ".model.adapter.tmp"):
        (out / name / "sub").mkdir(parents=True)
        (out / name / "sub" / "mine.txt").write_text("a user's file")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    capsys.readouterr()
    assert export_main([str(ckpt), str(out / "model")]) == 0, capsys.readouterr().err
    assert (out / "model" / "config.json").is_file()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.parts[len(out.parts)] != "model") == before


@pytest.mark.parametrize("checksums", [True, False])
def test_a_flipped_pickle_byte_is_one_line(tmp_path, capsys, checksums):
    """A checkpoint whose weights are a torch.save archive, one byte of its pickle flipped: with
    checksums the checksum names the file; without (an older manifest) torch's weights-only unpickler
    refuses it, in one line rather than a traceback."""
    ckpt = write_checkpoint(tmp_path / "step_000000004", weights="bin", checksums=checksums)
    flip_byte(ckpt / "pytorch_model.bin", offset=pickle_offset(ckpt / "pytorch_model.bin") + 40)
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    if checksums:
        assert line.startswith(f"error: checkpoint {ckpt} is damaged: pytorch_model.bin does not match the xxh3_128")
    else:
        # read as the archive's pickle, before anything loads: what the flip made (a string no longer UTF-8) is
        # damage, said as such (or a global outside the allow-list, refused)
        assert line.startswith(f"error: checkpoint {ckpt}") and "weights_only=False" not in line, line
        assert "is damaged: pytorch_model.bin is a damaged torch.save archive" in line or "is refused" in line, line


# ---------------------------------------------------------------- prompts rendered as the run trained them


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PROMPT = "Name a colour.\n"
TEXT_PAIRS = [{"prompt": PROMPT, "chosen": f"red {i}", "rejected": f"none {i}"} for i in range(8)]
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": PROMPT}], "chosen": [{"role": "assistant", "content": f"red {i}"}],
               "rejected": [{"role": "assistant", "content": f"none {i}"}]} for i in range(8)]


@pytest.mark.parametrize("rows,expected", [(TEXT_PAIRS, "prompt_completion"), (CHAT_PAIRS, "chat")],
                         ids=["string-prompts", "conversations"])
def test_chat_renders_a_dpo_runs_prompts_as_the_run_trained_them(tmp_path, capsys, rows, expected):
    """A DPO run of string prompts tokenizes each side as a prompt_completion row (BOS, prompt, answer);
    chat rendered its prompts with the chat template, a layout the run never trained. recipe.json's
    data.sources now says which kind of pairs the run had, and chat's prompt is token for token the
    prompt the run trained (the prompt eval samples give the model)."""
    from finetune.assets import resolve_model
    from finetune.chat import prompt_format
    from finetune.data import build_datasets
    from finetune.model import load_tokenizer
    from finetune.recipe import resolve
    from finetune.generation import render_prompt
    from finetune.training.samples import eval_prompts

    data_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    recipe = resolve("tiny_dpo", [f"dataset={data_file}", "eval_fraction=0", f"output_dir={tmp_path / 'out'}"])
    tokenizer = load_tokenizer(recipe, resolve_model(recipe.model))
    data = build_datasets(recipe, tokenizer)
    run = json.loads(json.dumps({"data": {"sources": data.sources}}))  # as recipe.json holds it
    assert run["data"]["sources"][0]["pairs"] == ("text" if expected == "prompt_completion" else "conversational")
    assert bool(tokenizer.chat_template)  # the template was there to be chosen wrongly
    fmt = prompt_format(None, tokenizer, run, tmp_path)
    assert fmt == expected
    trained = eval_prompts(data.train, 1, tokenizer)[0].ids
    assert render_prompt(tokenizer, PROMPT, fmt) == trained
    assert "note:" not in capsys.readouterr().err


def test_a_dpo_run_that_does_not_say_its_kind_of_pairs_is_named(tmp_path, tiny_tokenizer, capsys):
    """recipe.json of an older finetune: no "pairs"; the chat template is used, and a note says how to
    choose the other layout."""
    from finetune.chat import prompt_format

    run = {"data": {"sources": [{"format": "preference", "path": "pairs.jsonl"}]}}
    assert prompt_format(None, tiny_tokenizer, run, tmp_path) == "chat"
    assert "pass --format prompt_completion for string prompts" in capsys.readouterr().err
    assert prompt_format("prompt_completion", tiny_tokenizer, run, tmp_path) == "prompt_completion"
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- what chat is given


def garbage(path: Path, kind: str) -> Path:
    """A directory that looks like a model to a glance at its file names, with files that are not."""
    import os

    from finetune.assets import tiny_model_dir

    path.mkdir()
    tiny = tiny_model_dir()
    if kind == "config-not-json":
        (path / "config.json").write_text("garbage{")
        (path / "model.safetensors").write_bytes(os.urandom(5000))
    elif kind == "weights-not-safetensors":
        (path / "config.json").write_text((tiny / "config.json").read_text())
        (path / "model.safetensors").write_bytes(os.urandom(5000))
    elif kind == "config-without-model-type":
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    elif kind == "adapter-config-not-json":
        (path / "adapter_config.json").write_text("{nope")
    elif kind == "weights-not-a-torch-archive":
        (path / "config.json").write_text((tiny / "config.json").read_text())
        (path / "pytorch_model.bin").write_bytes(os.urandom(5000))
    return path


@pytest.mark.parametrize("kind", ["config-not-json", "weights-not-safetensors", "config-without-model-type",
                                  "adapter-config-not-json", "weights-not-a-torch-archive"])
def test_a_garbage_model_directory_is_one_line(tmp_path, capsys, kind):
    path = garbage(tmp_path / "model", kind)
    code, out, err = chat(capsys, path, "Say hi", "--max-new-tokens", "2")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert line.startswith(f"error: {path}") and "cannot be loaded" in line, line


@pytest.mark.parametrize("kind", ["model-bin-bare-pickle", "model-bin-archive", "adapter-bin-archive"])
def test_a_planted_payload_in_what_chat_reads_never_runs(tmp_path, capsys, kind):
    """Issue 52: the exports chat reads (final/, an export, final_merged/: a plain model directory; a LoRA
    adapter) with a pickle payload as their weights (pytorch_model.bin, adapter_model.bin, bare or inside
    a torch.save archive): one line, exit 2, and the payload never runs (every load under safe_loading)."""
    import pickle

    import torch

    from finetune.assets import tiny_model_dir
    from test_checkpoint_files import RunsCode

    tiny, marker, path = tiny_model_dir(), tmp_path / "code-ran", tmp_path / "model"
    path.mkdir()
    if kind.startswith("adapter"):
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "base_model_name_or_path": str(tiny)}))
        weights = path / "adapter_model.bin"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_text((tiny / name).read_text())
    else:
        (path / "config.json").write_text((tiny / "config.json").read_text())
        weights = path / "pytorch_model.bin"
    if kind.endswith("bare-pickle"):
        weights.write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "hook": RunsCode(marker)}, weights)
    code, out, err = chat(capsys, path, "Say hi", "--max-new-tokens", "2")
    line = one_error_line(err)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert line.startswith(f"error: {path}"), line
    assert not marker.exists(), f"{weights.name} ran code"


class Unreadable:
    """Standard input whose reading fails (a descriptor that was closed under it)."""

    closed = False

    def isatty(self):
        return False

    def __iter__(self):
        raise OSError(9, "Bad file descriptor")


@pytest.mark.parametrize("stdin", [None, Unreadable()], ids=["closed", "unreadable"])
def test_chat_without_a_prompt_and_no_standard_input_is_one_line(capsys, monkeypatch, stdin):
    """`finetune chat PATH <&-`: Python sets sys.stdin to None; that was an AttributeError traceback."""
    from finetune.assets import tiny_model_dir

    monkeypatch.setattr("sys.stdin", stdin)
    code, out, err = chat(capsys, tiny_model_dir(), "--max-new-tokens", "2")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert ("no standard input" if stdin is None else "standard input cannot be read (OSError") in line, line


@pytest.mark.parametrize("how", ["argument", "stdin", "input"])
def test_a_prompt_that_is_not_utf8_is_one_line(capsys, monkeypatch, how):
    """Bytes that are not UTF-8 (caf\xe9: Latin-1) in the prompt argument, on standard input or in --input:
    Python hands them over as lone surrogates (os.fsdecode for arguments; standard input in the UTF-8
    mode a C locale turns on reads with errors="surrogateescape"), which the UnicodeDecodeError guard
    never saw and the tokenizer failed on with a TypeError."""
    import io
    import os

    from finetune.assets import tiny_model_dir

    latin1 = "caf\xe9".encode("latin-1")
    argv = [tiny_model_dir(), "--max-new-tokens", "2"]
    if how == "argument":
        argv.append(os.fsdecode(b"Say " + latin1))
    elif how == "stdin":
        stdin = io.TextIOWrapper(io.BytesIO(b"Say hi\n---\nSay " + latin1 + b"\n"), encoding="utf-8",
                                 errors="surrogateescape")
        monkeypatch.setattr("sys.stdin", stdin)
    else:
        argv += ["Say hi", "--input", os.fsdecode(latin1)]
    code, out, err = chat(capsys, *argv)
    what, at = {"argument": ("the prompt", 7), "stdin": ("standard input's prompt 2", 7), "input": ("--input", 3)}[how]
    assert code == 2 and one_error_line(err) == (
        f"error: {what} is not UTF-8 text (byte 0xe9 at character {at}: Latin-1 or Windows-1252?); give it as UTF-8 "
        "(for example: iconv -f latin1 -t utf-8)"), err
    assert "TypeError" not in err and out == ""  # standard input's prompts are all checked before any answer


def test_a_lone_surrogate_in_a_prompt_is_named():
    from finetune.commands.chat import check_prompt
    from finetune.recipe import RecipeError

    assert check_prompt("café 🙂", "the prompt") == "café 🙂"
    with pytest.raises(RecipeError, match="the prompt holds a lone surrogate"):
        check_prompt("half \ud83d of it", "the prompt")


def test_a_prompt_beyond_the_context_is_warned(capsys):
    """The tiny model places 1,024 positions; a longer prompt is answered, with a warning that says so.
    Options may come after the prompt, as anywhere else."""
    from finetune.assets import tiny_model_dir

    code, out, err = chat(capsys, tiny_model_dir(), "word " * 1100, "--max-new-tokens", "2", "--format", "raw")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: the prompt is ")]
    assert len(warnings) == 1 and "the model's context is 1024 positions" in warnings[0], err
    code, out, err = chat(capsys, tiny_model_dir(), "word " * 10, "--max-new-tokens", "2", "--format", "raw")
    assert code == 0 and "warning" not in err, err


def test_a_prompt_longer_than_the_runs_rows_is_warned():
    from types import SimpleNamespace

    from finetune.chat import context_warnings

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024))
    assert context_warnings(model, {"max_seq_len": 128}, 100) == []
    assert "max_seq_len=128: the model never saw one this long" in context_warnings(model, {"max_seq_len": 128}, 200)[0]
    assert "context is 1024 positions" in context_warnings(model, {"max_seq_len": 128}, 1024)[0]


# ---------------------------------------------------------------- a GRPO run's prompts, and a reward model


def test_chat_renders_a_grpo_runs_prompts_as_its_samples(tmp_path, capsys):
    """Issue 38 defect 8: chat rendered a GRPO run's text prompts through the chat template, so its answers
    differed from samples.jsonl's. recipe.json's data.sources says the prompts were text; chat gives the
    prompt the run's samples gave the model (BOS + text), token for token, not the template's."""
    from finetune.assets import resolve_model
    from finetune.chat import prompt_format
    from finetune.data import build_datasets
    from finetune.generation import render_prompt
    from finetune.model import load_tokenizer
    from finetune.recipe import resolve
    from finetune.training.samples import eval_prompts

    recipe = resolve("tiny_grpo", ["eval_fraction=0.02", f"output_dir={tmp_path / 'out'}"])
    tokenizer = load_tokenizer(recipe, resolve_model(recipe.model))
    data = build_datasets(recipe, tokenizer)
    run = json.loads(json.dumps({"objective": "grpo", "data": {"sources": data.sources}}))  # as recipe.json holds it
    assert run["data"]["sources"][0]["prompts"] == "text"
    fmt = prompt_format(None, tokenizer, run, tmp_path)
    assert fmt == "prompt"
    for sample, row in zip(eval_prompts(data.eval, 3, tokenizer), data.eval.select(range(3))):
        assert "\n" in row["prompt"]  # GRPO prompts span lines
        assert render_prompt(tokenizer, row["prompt"], fmt) == sample.ids
        assert render_prompt(tokenizer, row["prompt"], "chat") != sample.ids  # what chat gave before
    assert "note:" not in capsys.readouterr().err


GRPO_PROMPTS = ["Copy: abc\nAnswer: ", "Capitals: dog\nAnswer: "]


def test_chat_on_a_grpo_run_answers_piped_multi_line_prompts(tmp_path, capsys, monkeypatch):
    """Two multi-line prompts piped in, separated by '---': each is printed ('> ' before each of its lines)
    with its answer under it, an answer of at most the run's max_completion_len tokens (the default), from
    the prompt as the run rendered it (BOS + text). Before: one prompt per line (each prompt became two),
    256 tokens, the chat template."""
    import io

    import torch
    from transformers import AutoTokenizer

    from finetune.assets import tiny_model_dir
    from finetune.chat import load
    from finetune.data import encode_prompts
    from finetune.generation import Sampling, generate, pad_id_for, stop_ids
    from finetune.model import context_length

    run = {"model": str(tiny_model_dir()), "mixed_precision": "no", "objective": "grpo", "max_completion_len": 5,
           "sample_max_new_tokens": 32, "dataset_format": "prompt",
           "data": {"sources": [{"format": "prompt", "prompts": "text"}]}}
    ckpt = write_checkpoint(tmp_path / "step_000000004", recipe=run)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{GRPO_PROMPTS[0]}\n---\n{GRPO_PROMPTS[1]}\n"))
    code, out, err = chat(capsys, ckpt)
    assert code == 0, err
    items = out.split("---\n")
    assert len(items) == 3 and items[2] == "", out
    model, tokenizer, _ = load(ckpt)
    trained = encode_prompts([{"prompt": p} for p in GRPO_PROMPTS], tokenizer)["prompt_input_ids"]
    for text, ids, item in zip(GRPO_PROMPTS, trained, items):
        lines = item.split("\n")
        assert lines[:2] == [f"> {line}" for line in text.split("\n")], item
        printed = "\n".join(lines[2:]).removesuffix("\n")
        with torch.no_grad():
            [want] = generate(model, [ids], Sampling(5), stop_ids=stop_ids(tokenizer, model),
                              pad_id=pad_id_for(tokenizer), context=context_length(model.config))
        assert len(want.tokens) <= 5
        assert printed == tokenizer.decode(want.tokens, skip_special_tokens=True)
    assert isinstance(AutoTokenizer.from_pretrained(tiny_model_dir()).chat_template, str)


def test_chat_answers_as_long_as_the_runs_own_answers():
    """chat's default answer length is the run's samples' (finetune.generation.answer_length, which the
    loop gives the samples at eval): a GRPO run's max_completion_len, not the 32 tokens of an SFT sample."""
    from finetune.chat import DEFAULT_MAX_NEW_TOKENS, max_new_tokens_of
    from finetune.generation import answer_length
    from finetune.recipe import load_recipe_module

    for name in ("tiny_grpo", "tiny_dpo", "tiny"):
        recipe = load_recipe_module(name)
        assert max_new_tokens_of(json.loads(json.dumps(recipe.to_dict()))) == answer_length(recipe)
    assert answer_length(load_recipe_module("tiny_grpo")) == 8

    assert max_new_tokens_of({"objective": "grpo", "max_completion_len": 8, "sample_max_new_tokens": 32}) == 8
    assert max_new_tokens_of({"objective": "sft", "max_completion_len": 256, "sample_max_new_tokens": 32}) == 32
    assert max_new_tokens_of({}) == DEFAULT_MAX_NEW_TOKENS


def test_split_prompts_keeps_each_prompts_lines():
    from finetune.commands.chat import split_prompts

    text = "Copy: ab\nAnswer: \n---\n\n---\nline one\n\nline three\n---\n"
    assert split_prompts(text.splitlines(keepends=True), "---") == ["Copy: ab\nAnswer: ", "line one\n\nline three"]
    assert split_prompts(["one prompt\n", "of two lines\n"], "---") == ["one prompt\nof two lines"]


@pytest.mark.parametrize("how", ["recipe", "config"])
def test_chat_refuses_a_reward_model_in_one_line(tmp_path, capsys, how):
    """A reward model has a score head, no output layer over the vocabulary: loaded as a causal LM it
    answered from a random one. Refused before any weight is read (the directory holds none here)."""
    from finetune.assets import tiny_model_dir

    path = tmp_path / "final"
    path.mkdir()
    config = json.loads((tiny_model_dir() / "config.json").read_text())
    if how == "config":
        config["architectures"] = ["LlamaForSequenceClassification"]
    else:
        (tmp_path / "recipe.json").write_text(json.dumps({"objective": "reward"}))
    (path / "config.json").write_text(json.dumps(config))
    code, out, err = chat(capsys, path, "Say hi")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert line.startswith(f"error: {path} is a reward model (objective=reward)") and "RewardModel(" in line, line


def test_chat_with_tools_runs_the_calls_between_turns(tmp_path, capsys):
    """`finetune chat --tools module:function`: the prompt rendered with the tool's schema, the calls the model
    writes run between its turns and answered (each a [tool] line), then its last answer; a tool that cannot be
    described to the model is one line."""
    from finetune.commands.chat import main
    from tests.agent_tools import tool_happy_model

    model = tool_happy_model(tmp_path / "model", tool="calc")  # a model whose turns call calc (tests/agent_tools.py)
    argv = [str(model), "37*59", "--temperature", "1", "--seed", "9", "--max-new-tokens", "40"]
    assert main([*argv, "--tools", "tests.agent_tools:calc"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "real_accelerator" not in line]  # DeepSpeed's
    assert printed[:2] == ["[tool] calc {} -> 2183"] * 2 and len(printed) == 3
    assert main([*argv, "--tools", "tests.agent_tools:no_docstring"]) == 2
    err = capsys.readouterr().err
    assert "tool tests.agent_tools:no_docstring cannot be described to the model" in err and err.count("\n") == 1
    assert main([*argv, "--tools", "tests.agent_tools:calc", "--format", "raw"]) == 2
    assert "--tools with raw prompts" in capsys.readouterr().err
