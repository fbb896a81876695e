"""LoRA on 2 real processes under FSDP2 and ZeRO-3: the frozen base stays as it was, the loss falls,
final/ is an adapter that plain peft loads (with real, trained weights, not ZeRO-3's empty
placeholders), final_merged/ gives the logits of base + adapter, checkpoints hold the adapter and
not the base, and a resumed LoRA run continues bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import once
from safetensors.torch import load_file

LORA = ["lora=true", "merge_lora=true", "save_every=4", "keep_last=3"]


@pytest.fixture(scope="module")
def lora_runs(launch):
    return once(lambda strategy: launch(2, f"strategy={strategy}", *LORA))


def _base_dir(run):
    import json

    return json.loads((run.output_dir / "recipe.json").read_text())["model"]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_lora_trains_adapter_only(strategy, lora_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = lora_runs(strategy)
    out = run.output_dir
    losses = run.losses
    assert losses[-1] < losses[0] - 0.1, losses

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.numel() > 0 for v in adapter.values())  # ZeRO-3 once saved empty tensors
    assert all(v.abs().max() > 0 for v in lora_b)  # B starts at zero: non-zero means trained weights were saved

    base = AutoModelForCausalLM.from_pretrained(_base_dir(run), dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = AutoModelForCausalLM.from_pretrained(out / "final_merged", dtype=torch.float32).eval()
    merged_state = merged.state_dict()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, value in base_state.items():
        if any(t in name for t in targets):
            assert not torch.equal(merged_state[name], value), f"{name}: the adapter was not merged in"
        else:  # embeddings, norms, lm_head: frozen and untouched
            assert torch.equal(merged_state[name], value), f"{name} changed in a LoRA run"

    with_adapter = PeftModel.from_pretrained(base, out / "final").eval()
    probe = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(input_ids=probe).logits
        got = merged(input_ids=probe).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    for checkpoint in (out / "checkpoints").iterdir():
        keys = saved_model_keys(checkpoint)
        assert len(keys) == len(adapter) and all("lora_" in k for k in keys), \
            f"{checkpoint.name} holds frozen base weights: {[k for k in keys if 'lora_' not in k][:3]}"


def saved_model_keys(checkpoint):
    """The model tensors a checkpoint holds: FSDP's distributed-checkpoint metadata, or the module
    of DeepSpeed's model-states file (loaded weights_only)."""
    fsdp = checkpoint / "pytorch_model_fsdp_0"
    if fsdp.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        return list(FileSystemReader(str(fsdp)).read_metadata().state_dict_metadata)
    from finetune.checkpointing.safe_loading import weights_only_torch_load

    with weights_only_torch_load():
        states = torch.load(checkpoint / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                            weights_only=True)
    return list(states["module"])


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_lora_resume_is_exact(strategy, lora_runs, launch, tmp_path_factory):
    reference = lora_runs(strategy)
    out = tmp_path_factory.mktemp(f"lora-resume-{strategy}")
    name = "step_000000004"
    shutil.copytree(reference.output_dir / "checkpoints" / name, out / "checkpoints" / name)
    resumed = launch(2, f"strategy={strategy}", *LORA, "--resume", "auto", output_dir=out)
    assert "at step 4" in resumed.stderr
    tail = [(r["step"], r["loss"]) for r in reference.train_records if r["step"] > 4]
    assert [(r["step"], r["loss"]) for r in resumed.train_records if r["step"] > 4] == tail
    assert [r["eval_loss"] for r in resumed.eval_records if r["step"] > 4] == \
        [r["eval_loss"] for r in reference.eval_records if r["step"] > 4]
    a = load_file(str(reference.output_dir / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_lora_checkpoint_exports(strategy, lora_runs, export_in_process, tmp_path):
    """`python -m finetune.export` of a LoRA checkpoint (its main, called in this process) writes the
    adapter, which peft loads on the base and which equals final/ tensor for tensor; with --merge, the
    plain model equal to final_merged/ (checked on the fsdp run; export merges the adapter it rebuilt,
    the same for every strategy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = lora_runs(strategy)
    ckpt = run.output_dir / "checkpoints" / "step_000000012"
    adapter = export_in_process(ckpt, tmp_path / "adapter")
    assert adapter.returncode == 0, adapter.stderr[-3000:]
    assert "exported the LoRA adapter of step 12" in adapter.stdout and "probe logits identical" in adapter.stdout
    a = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run.output_dir / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 28 and all(torch.equal(a[k], b[k]) for k in a)
    base = AutoModelForCausalLM.from_pretrained(_base_dir(run), dtype=torch.float32)
    probe = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base(input_ids=probe).logits
        tuned = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=probe).logits
    assert not torch.equal(plain, tuned)  # the adapter is loaded and does something

    if strategy != "fsdp":  # --merge works from the adapter above whatever wrote it: one strategy is enough
        return
    merged = export_in_process(ckpt, tmp_path / "merged", "--merge")
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "merged into" in merged.stdout and "probe logits identical" in merged.stdout
    a = load_file(str(tmp_path / "merged" / "model.safetensors"))
    b = load_file(str(run.output_dir / "final_merged" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged.")], "the staging is removed"
    # alpaca rows end with the EOS: every generation config keeps it alone (chat runs: test_families)
    for directory in (run.output_dir / "final", run.output_dir / "final_merged", tmp_path / "adapter",
                      tmp_path / "merged"):
        assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == 3, directory


def test_lora_export_without_its_base_says_so(lora_runs, tmp_path):
    from finetune.checkpointing.export import ExportError, export_checkpoint

    ckpt = lora_runs("zero3").output_dir / "checkpoints" / "step_000000012"
    with pytest.raises(ExportError, match="holds a LoRA adapter, not a whole model, and its base .* cannot be loaded"
                                          ".* pass --base"):
        export_checkpoint(ckpt, tmp_path / "out", base=str(tmp_path / "no-such-model"), log=lambda m: None)
    assert not (tmp_path / "out").exists()
