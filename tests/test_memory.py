"""The memory planner (finetune/memory.py, python -m finetune.plan): exact parameter counts, the ZeRO
paper's model-state formulas (../shared/reference/figures.md), activations, offload, LoRA, the cheapest
setup that fits, the command line, and held_bytes on live one-process models."""

import json
import os
import subprocess
import sys
import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest

from finetune import arch as A
from finetune import memory as M
from finetune import memory_tables as MT
from bench.helpers.held import held_bytes
from finetune.recipe import RecipeError, resolve

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def arch(model: str) -> M.Architecture:
    return M.load_architecture(model)


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("model,count", [
    ("meta-llama/Llama-2-7b-hf", 6_738_415_616),
    ("meta-llama/Llama-2-13b-hf", 13_015_864_320),
    ("meta-llama/Llama-2-70b-hf", 68_976_648_192),
    ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", 8_030_261_248),
    ("meta-llama/Meta-Llama-3-70B", 70_553_706_496),
    ("mistralai/Mistral-7B-v0.1", 7_241_732_096),
    ("Qwen/Qwen2.5-7B", 7_615_616_512),
    ("Qwen/Qwen2.5-14B", 14_770_033_664),
])
def test_parameter_count_of_known_models(model, count):
    a = arch(model)
    assert a.num_parameters() == count
    assert "table" in a.source


def test_table_lookup_ignores_case():
    assert arch("META-LLAMA/llama-2-7b-HF").num_parameters() == 6_738_415_616


def _numel_of_real_model(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("kind", ["llama", "llama_tied_biased", "qwen2", "mistral"])
def test_count_matches_transformers(kind):
    """The formula, against the numel of the real transformers model of small configs of each family."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2)
    config = {
        "llama": lambda: LlamaConfig(**common),
        "llama_tied_biased": lambda: LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True,
                                                 mlp_bias=True),
        "qwen2": lambda: Qwen2Config(**common),
        "mistral": lambda: MistralConfig(**common),
    }[kind]()
    a = A.architecture_from_config(config.to_dict(), kind)
    assert a.num_parameters() == _numel_of_real_model(config)


def test_builtin_tiny_llama_counts_its_real_parameters():
    from transformers import AutoConfig

    from finetune.assets import tiny_model_dir

    a = arch("builtin:tiny-llama")
    assert a.num_parameters() == _numel_of_real_model(AutoConfig.from_pretrained(tiny_model_dir()))


def test_local_directory_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
           "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = arch(str(tmp_path))
    assert a.num_parameters() == 6_738_415_616
    assert str(tmp_path) in a.source


def test_local_directory_without_config(tmp_path):
    with pytest.raises(M.EstimateError, match="no config.json"):
        arch(str(tmp_path))


def test_unknown_hub_id_offline_says_what_and_how(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(M.EstimateError) as e:
        arch("some-org/some-unknown-model")
    msg = str(e.value)
    assert "model=some-org/some-unknown-model" in msg and "config.json" in msg
    assert "HF_HUB_OFFLINE=1" in msg and "local directory" in msg
    assert isinstance(e.value, RecipeError)  # printed as one `error:` line by the command lines


def test_mixture_of_experts_is_counted_from_the_model():
    """Mixtral-8x7B's config.json numbers: 46.7 B parameters (the published count), every expert included."""
    cfg = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
           "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}
    a = A.architecture_from_config(cfg)
    assert a.measured and a.num_parameters() == 46_702_792_704


def test_mixture_of_experts_transformers_cannot_build_is_refused():
    cfg = {"model_type": "some_new_moe", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
           "vocab_size": 32000, "num_attention_heads": 32, "num_local_experts": 8}
    with pytest.raises(M.EstimateError, match="mixture of experts"):
        A.architecture_from_config(cfg)


# ---------------------------------------------------------------- model states: the ZeRO paper / figures.md


def test_zero_paper_figure_1_example():
    """ZeRO paper figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K=12):
    120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU."""
    psi, n = 7.5e9, 64
    assert M.paper_model_states("ddp", "bf16", psi, n) / 1e9 == pytest.approx(120)
    assert M.paper_model_states("zero1", "bf16", psi, n) / 1e9 == pytest.approx(31.4, abs=0.05)
    assert M.paper_model_states("zero2", "bf16", psi, n) / 1e9 == pytest.approx(16.6, abs=0.05)
    assert M.paper_model_states("zero3", "bf16", psi, n) / 1e9 == pytest.approx(1.9, abs=0.05)
    assert M.paper_model_states("fsdp", "bf16", psi, n) == M.paper_model_states("zero3", "bf16", psi, n)


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_figures_md_formulas(n):
    p = 1000
    assert M.paper_model_states("ddp", "bf16", p, n) == 16 * p
    assert M.paper_model_states("zero1", "bf16", p, n) == pytest.approx(4 * p + 12 * p / n)
    assert M.paper_model_states("zero2", "bf16", p, n) == pytest.approx(2 * p + 14 * p / n)
    assert M.paper_model_states("zero3", "bf16", p, n) == pytest.approx(16 * p / n)
    assert M.paper_model_states("zero1", "no", p, n) == pytest.approx(8 * p + 8 * p / n)
    assert M.paper_model_states("zero2", "no", p, n) == pytest.approx(4 * p + 12 * p / n)
    assert M.paper_model_states("zero3", "no", p, n) == pytest.approx(16 * p / n)


LLAMA7B = A.KNOWN_ARCHITECTURES["meta-llama/Llama-2-7b-hf"]


def est(setup, n=8, precision="bf16", **kw):
    return M.estimate(LLAMA7B, setup, world_size=n, mixed_precision=precision, **kw)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_deepspeed_16bit_model_states_are_the_papers(strategy, n):
    p = LLAMA7B.num_parameters()
    e = est(M.Setup(strategy), n)
    assert e.model_states == pytest.approx(M.paper_model_states(strategy, "bf16", p, n), abs=2)
    split = {"zero1": (2 * p, 2 * p, 12 * p / n), "zero2": (2 * p, 2 * p / n, 12 * p / n),
             "zero3": (2 * p / n, 2 * p / n, 12 * p / n)}[strategy]
    assert (e.params, e.grads, e.optimizer) == pytest.approx(split, abs=1)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
@pytest.mark.parametrize("n", [1, 8])
def test_ddp_and_fsdp_totals_are_the_papers(precision, n):
    """ddp and fsdp hold fp32 weights and gradients (autocast / FSDP's mixed-precision policy):
    4 + 4 + 8 bytes per parameter, the paper's total of 16."""
    p = LLAMA7B.num_parameters()
    ddp, fsdp = est(M.Setup("ddp"), n, precision), est(M.Setup("fsdp"), n, precision)
    assert ddp.model_states == M.paper_model_states("ddp", precision, p, n)
    assert fsdp.model_states == pytest.approx(M.paper_model_states("fsdp", precision, p, n), abs=2)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == pytest.approx((4 * p / n, 4 * p / n, 8 * p / n), abs=1)


def test_ddp_sharded_optimizer_shards_only_adam_states():
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup("ddp", ddp_shard_optimizer=True), n)
    assert (e.params, e.grads, e.optimizer) == pytest.approx((4 * p, 4 * p, 8 * p / n), abs=1)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_fp32_keeps_a_separate_master_copy(strategy):
    """Documented deviation from the paper's fp32 split: DeepSpeed clones an fp32 master partition
    even when the weights are fp32, so the optimizer holds 12 bytes per parameter / N."""
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup(strategy), n, "no")
    assert e.optimizer == pytest.approx(12 * p / n, abs=1)
    assert e.model_states == pytest.approx(M.paper_model_states(strategy, "no", p, n) + 4 * p / n, abs=2)


# ---------------------------------------------------------------- offload


def test_zero3_offload_both_leaves_no_model_states_on_the_gpu():
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup("zero3", offload_optimizer="cpu", offload_params="cpu"), n)
    assert e.model_states == 0
    # bf16 partition + (bf16 gradient buffer + fp32 gradient for CPU Adam) + fp32 master, m, v
    assert e.cpu == pytest.approx((2 + 2 + 4 + 12) * p / n, abs=2)
    assert e.buffers > 0  # gathered layers still pass through the GPU


def test_zero3_offload_optimizer_only_keeps_the_parameter_partition():
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup("zero3", offload_optimizer="cpu"), n)
    assert (e.params, e.grads, e.optimizer) == pytest.approx((2 * p / n, 0, 0), abs=1)


def test_zero2_offload_optimizer():
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup("zero2", offload_optimizer="cpu"), n)
    assert (e.params, e.grads, e.optimizer) == pytest.approx((2 * p, 0, 0), abs=1)
    assert e.cpu == pytest.approx((4 + 12) * p / n, abs=2)


def test_nvme_offload_goes_to_nvme():
    e = est(M.Setup("zero3", offload_optimizer="nvme", offload_params="nvme"))
    assert e.nvme > e.cpu > 0 and e.model_states == 0


def test_fsdp_cpu_offload_moves_params_grads_and_optimizer():
    p, n = LLAMA7B.num_parameters(), 8
    e = est(M.Setup("fsdp", offload_params="cpu"), n)
    assert e.model_states == 0
    assert e.cpu == pytest.approx(16 * p / n, abs=2)


# ---------------------------------------------------------------- activations


def test_activation_formula():
    """Kept for the backward plus the larger of the loss's and one layer backward's working sets; the
    attention scores only under eager (sdpa and flash kernels keep none)."""
    a = M.Architecture(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=100,
                       num_attention_heads=4, num_key_value_heads=2)
    b, t, h, i, heads, layers, v = 2, 16, 64, 128, 4, 4, 100
    per_token16 = 2 * (4 + 4) * h + 2 * (2 * h + 2 * 32) + 4 * heads + 4 * 2 * i
    assert M.layer_bytes_per_token(a, "bf16") == per_token16
    assert M.layer_bytes_per_token(a, "no") == 2 * 12 * h + 4 * (2 * h + 2 * 32) + 4 * heads + 16 * i
    tokens = b * t
    final_norm, grad_hidden = 8 * h * tokens, 2 * h * tokens
    backward = 2 * tokens * (i + h) + grad_hidden
    loss = tokens * v * (2 + 8)  # loss_impl=full
    kept = layers * per_token16 * tokens + final_norm
    assert M.activation_bytes(a, b, t, "bf16", False) == kept + max(loss, backward)
    ckpt = layers * 2 * h * tokens + final_norm
    assert M.activation_bytes(a, b, t, "bf16", True) == ckpt + max(loss, per_token16 * tokens + backward)
    offload = M.activation_bytes(a, b, t, "bf16", True, activation_offload=True)
    assert offload == max(loss, per_token16 * tokens + backward)
    assert M.offloaded_activation_bytes(a, b, t, "bf16") == ckpt
    # eager keeps each layer's softmax (fp32 and its bf16 copy) and a float causal mask
    scores, mask = heads * b * t * t * 6, b * t * t * 2
    assert M.activation_bytes(a, b, t, "bf16", False, attn_implementation="eager") == \
        kept + layers * scores + mask + max(loss, backward + scores)


def test_sdpa_has_no_sequence_squared_term():
    a = A.known_architecture("meta-llama/Meta-Llama-3-8B")
    sdpa = [M.activation_bytes(a, 1, t, "bf16", True, "chunked") for t in (32768, 65536)]
    eager = [M.activation_bytes(a, 1, t, "bf16", True, "chunked", attn_implementation="eager") for t in (32768, 65536)]
    assert sdpa[1] < 2.1 * sdpa[0]  # linear in T
    assert eager[1] > 3.5 * eager[0]  # T^2


def test_activation_offload_moves_the_layer_inputs_to_cpu():
    r = M.Recipe(model="meta-llama/Meta-Llama-3-8B", strategy="zero3", activation_checkpointing=True,
                 max_seq_len=65536, sequence_parallel=8)
    a = A.known_architecture("meta-llama/Meta-Llama-3-8B")
    on = M.recipe_estimate(dataclasses.replace(r, activation_offload=True), 8, a)
    off = M.recipe_estimate(r, 8, a)
    moved = M.offloaded_activation_bytes(a, 1, 65536, "bf16", 8)
    assert off.activations - on.activations == moved and on.cpu - off.cpu == moved
    assert moved == 32 * 2 * 4096 * 8192 + 8 * 4096 * 8192


def test_checkpointing_saves_most_activations():
    full = est(M.Setup("zero3"), micro_batch_size=4, seq_len=2048, activation_checkpointing=False)
    ckpt = est(M.Setup("zero3"), micro_batch_size=4, seq_len=2048, activation_checkpointing=True)
    assert ckpt.activations < full.activations / 10
    assert full.model_states == ckpt.model_states  # activations are not sharded or offloaded


# ---------------------------------------------------------------- LoRA


def test_lora_adapter_count_llama3_8b_all_projections():
    """r=16 on q/k/v/o/gate/up/down of Llama-3-8B: 41.9 M adapter parameters (peft's count)."""
    assert M.lora_parameters(arch("meta-llama/Meta-Llama-3-8B"), 16) == 41_943_040


def test_lora_adapter_count_attention_only():
    a = LLAMA7B  # q and v: r * (4096 + 4096) each, 32 layers
    assert M.lora_parameters(a, 8, ("q_proj", "v_proj")) == 32 * 2 * 8 * 8192


def test_lora_unknown_target_is_an_error():
    with pytest.raises(M.EstimateError, match="lora_target_modules: 'qkv'"):
        M.lora_parameters(LLAMA7B, 8, ("qkv",))


def test_lora_estimate_full_frozen_params_adapter_only_states():
    p, n = LLAMA7B.num_parameters(), 8
    adapters = M.lora_parameters(LLAMA7B, 16)
    z3 = est(M.Setup("zero3"), n, lora_params=adapters)
    assert z3.params == pytest.approx((2 * p + 2 * adapters) / n, abs=1)  # frozen base in bf16, sharded
    assert z3.grads == pytest.approx(2 * adapters / n, abs=1)
    assert z3.optimizer == pytest.approx(12 * adapters / n, abs=1)
    assert z3.trained_parameters == adapters
    fsdp = est(M.Setup("fsdp"), n, lora_params=adapters)
    assert fsdp.params == pytest.approx((2 * p + 4 * adapters) / n, abs=1)  # bf16 base, fp32 adapters, sharded
    fp32 = est(M.Setup("fsdp"), n, "no", lora_params=adapters)
    assert fp32.params == pytest.approx(4 * (p + adapters) / n, abs=1)


def test_recipe_estimate_reads_lora_fields():
    base = resolve("llama7b_zero3", [])
    a = LLAMA7B
    lora = replace(base, lora=True, lora_r=8, lora_target_modules=("q_proj", "v_proj"))
    e = M.recipe_estimate(lora, 8, a)
    assert e.trained_parameters == M.lora_parameters(a, 8, ("q_proj", "v_proj"))


def test_qlora_base_is_4bit_under_ddp_fsdp_zero3():
    recipe = resolve("llama8b_lora_fsdp", ["strategy=ddp", "load_in_4bit=true"])
    a = arch(recipe.model)
    rows = M.all_estimates(recipe, 1, a)
    assert {e.setup.strategy for _, e in rows} == {"ddp", "fsdp", "zero3"}  # tests/test_qlora_plan.py: per rank
    plain = M.recipe_estimate(replace(recipe, load_in_4bit=False), 1, a)
    q = M.recipe_estimate(recipe, 1, a)
    linear = a.num_hidden_layers * sum(i * o for i, o, _ in a.projections().values())
    # LoRA base in bf16; NF4 0.5 byte per weight, double-quantized constants (1/64 + 1/4096) and two
    # fp32 code tables (16 + 256 entries) per quantized Linear
    tables = a.num_hidden_layers * 7 * (16 + 256) * 4
    assert plain.params - q.params == pytest.approx(linear * (2 - 0.5 - 1 / 64 - 1 / 4096) - tables, abs=2)
    assert (q.grads, q.optimizer) == (plain.grads, plain.optimizer)


# ---------------------------------------------------------------- the setup it would run (the fastest that fits)


def _rows(recipe_name="llama7b_zero3", n=8, overrides=()):
    recipe = resolve(recipe_name, list(overrides))
    return recipe, M.all_estimates(recipe, n, arch(recipe.model))


def _choice(budget, recipe_name="llama7b_zero3", n=8, overrides=(), headroom=M.HEADROOM):
    from finetune.comm import one_node_choice

    recipe, rows = _rows(recipe_name, n, overrides)
    return one_node_choice(recipe, arch(recipe.model), n, budget, headroom)([e for _, e in rows])[0]


def test_choice_is_the_least_communication_that_fits():
    """bf16, 4 micro-batches a step on 8 GPUs: zero1 sends 2 bytes a parameter twice a step (gradients
    all-reduced at the step's end, weights gathered), ddp all-reduces fp32 gradients (8 bytes a parameter),
    zero2 reduces in every micro-batch, fsdp and zero3 gather in every one: zero1 even when ddp fits. Where
    only fsdp and zero3 fit, fsdp: it reduce-scatters once a step, zero3 in every micro-batch."""
    assert _choice(1000 * GIB).setup == M.Setup("zero1")
    assert _choice(MT.parse_size("80GB")).setup == M.Setup("zero1")  # ddp (157 GiB) does not fit; zero1 (44 GiB) does
    assert _choice(MT.parse_size("30GB")).setup == M.Setup("fsdp")  # zero1 and zero2 do not fit


def test_choice_goes_to_offload_when_it_must_and_offloads_least():
    pick = _choice(MT.parse_size("24GB"), n=1)  # a 7B on one GPU
    assert pick.setup.offload_optimizer == "cpu" and pick.setup.offload_params == "none"  # ZeRO-Offload
    pick = _choice(MT.parse_size("18GB"), n=1)  # the parameters too: fsdp's or zero3's, as fast on one GPU: the first
    assert pick.setup == M.Setup("fsdp", offload_params="cpu")
    assert _choice(MT.parse_size("4GB"), n=1) is None


def test_choice_on_one_gpu_is_the_simplest():
    """Nothing moves between GPUs on one: every setup that fits is as fast; the first in the table, ddp."""
    assert _choice(1000 * GIB, n=1).setup == M.Setup("ddp")


def test_choice_respects_headroom():
    recipe, rows = _rows()
    zero1 = next(e for _, e in rows if e.setup == M.Setup("zero1"))
    exactly = zero1.total
    assert _choice(exactly, headroom=0.0).setup == M.Setup("zero1")
    assert _choice(exactly, headroom=0.10).setup != M.Setup("zero1")


@pytest.mark.parametrize("text,value", [("80GB", 80 * 10**9), ("40GiB", 40 * 2**30), ("24G", 24 * 2**30),
                                        ("1.5TB", 1.5e12), ("512MiB", 512 * 2**20), ("80 gb", 80 * 10**9)])
def test_parse_size(text, value):
    assert MT.parse_size(text) == value


@pytest.mark.parametrize("text", ["80", "lots", "", "-5GB", "80XB", "0GB"])
def test_parse_size_rejects(text):
    with pytest.raises(M.EstimateError, match="--gpu-mem"):
        MT.parse_size(text)


# ---------------------------------------------------------------- reports


def test_memory_report_for_a_dry_run():
    text = MT.memory_report(resolve("llama7b_zero3", []), 8, "llama7b_zero3")
    assert "memory per GPU (planner estimate, zero3 on 8 process(es))" in text
    assert "total 20.82 GiB" in text  # the training step: what must fit
    assert ("samples at eval (sample_prompts=3) gather the whole model on each GPU: 12.55 GiB, a peak of 25.10 GiB "
            "per GPU at each eval; where that does not fit, the run skips them with a warning") in text
    assert "not checked:" in text and "config.json" in text and "--recipe llama7b_zero3 --gpus 8" in text


def test_memory_report_never_raises_for_an_unknown_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = MT.memory_report(resolve("llama7b_zero3", ["model=some-org/unknown"]), 8)
    assert text.startswith("memory per GPU: not estimated: model=some-org/unknown")


# ---------------------------------------------------------------- command line


def _plan(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HUB_OFFLINE="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "finetune.plan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_table():
    proc = _plan("--recipe", "llama7b_zero3", "--gpus", "8", "--gpu-mem", "80GB")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "6,738,415,616 parameters" in out
    header = next(line for line in out.splitlines() if line.startswith("per GPU"))
    for col in ("params", "grads", "optimizer", "activations", "total", "fits"):
        assert col in header
    labels = [M.Setup(s).label for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
    for label in labels + ["zero3, optimizer->cpu, params->cpu", "fsdp, params->cpu", "ddp + sharded optimizer"]:
        assert any(line[2:].startswith(label) for line in out.splitlines()), label
    own = next(line for line in out.splitlines() if line.startswith("* zero3 "))
    assert own.split()[-1] == "yes" and "20.82" in own
    assert "would run: zero1 (41.68 GiB per GPU, each GPU sending 35.38 GB per step); override with strategy=zero1" in out
    assert "why: the fastest that fits: of the layouts whose memory per GPU fits" in out
    assert "global batch 128 = micro 4 x accum 4 x 8 GPUs" in out
    assert proc.stderr == ""


def test_cli_overrides_and_nothing_fits():
    proc = _plan("--recipe", "llama7b_zero3", "--gpus", "1", "--gpu-mem", "2GiB", "micro_batch_size=1",
                 "global_batch_size=0")
    assert proc.returncode == 0, proc.stderr
    assert "nothing fits" in proc.stdout
    assert "micro batch 1 x 2048" in proc.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--recipe", "llama7b_zero3", "--gpus", "8", "--gpu-mem", "80"], "--gpu-mem 80: give a unit"),
    (["--recipe", "llama7b_zero3", "--gpu-mem", "lots"], "--gpu-mem lots: not a size"),
    (["--recipe", "llama7b_zero3", "--gpus", "0"], "--gpus 0: must be at least 1"),
    (["--recipe", "llama7b_zero3", "--gpus", "three"], "--gpus: invalid int value"),
    (["--recipe", "llama7b_zero3", "--gpus", "3"], "global_batch_size=128 is not a multiple"),
    (["--recipe", "lama7b_zero3"], "unknown recipe 'lama7b_zero3' (did you mean llama7b_zero3?)"),
    (["--recipe", "llama7b_zero3", "lrr=1"], "unknown recipe key 'lrr'"),
    (["--recipe", "llama7b_zero3", "model=some-org/unknown"], "model=some-org/unknown: cannot read its config.json"),
    (["--gpus", "2"], "required: --recipe"),
    (["--recipe", "llama7b_zero3", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_errors_are_one_line_and_exit_2(args, fragment):
    proc = _plan(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0]
    assert proc.stdout == ""


# ---------------------------------------------------------------- held_bytes on live models


def _tiny_llama(tie=False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config), config


def _step(model, optimizer):
    import torch

    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("tie", [False, True])
def test_held_bytes_plain_module_and_adamw(tie):
    import torch

    model, config = _tiny_llama(tie)
    p = sum(t.numel() for t in model.parameters())
    a = A.architecture_from_config(config.to_dict())
    assert a.num_parameters() == p
    optimizer = torch.optim.AdamW(model.parameters())
    assert held_bytes(model, optimizer)["total"] == 4 * p  # before the first backward: weights only
    _step(model, optimizer)
    held = held_bytes(model, optimizer)
    assert (held["params"], held["grads"], held["optimizer"]) == (4 * p, 4 * p, 8 * p)
    assert held["device"] == "cpu" and held["cpu_total"] == 0
    planned = M.estimate(a, M.Setup("ddp"), world_size=1, mixed_precision="no")
    assert (planned.params, planned.grads, planned.optimizer) == (held["params"], held["grads"], held["optimizer"])


def test_held_bytes_counts_shared_storage_once_and_meta_as_zero():
    import torch

    with torch.device("meta"):
        meta = torch.nn.Linear(1000, 1000)
    assert held_bytes(meta)["total"] == 0
    lin = torch.nn.Linear(10, 10, bias=False)
    twin = torch.nn.Linear(10, 10, bias=False)
    twin.weight = lin.weight
    both = torch.nn.Sequential(lin, twin)
    assert held_bytes(both)["params"] == 10 * 10 * 4


def test_held_bytes_unwraps_optimizer_wrappers():
    """Accelerate's AcceleratedOptimizer (and DeepSpeedOptimizerWrapper) keep the real one in .optimizer."""
    import torch

    class Wrapper:  # the shape of accelerate.optimizer.AcceleratedOptimizer, without an Accelerator
        def __init__(self, optimizer):
            self.optimizer = optimizer

    model, _ = _tiny_llama()
    p = sum(t.numel() for t in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    assert held_bytes(model, Wrapper(Wrapper(optimizer)))["optimizer"] == 8 * p


def test_the_chunked_loss_holds_one_chunk_of_logits():
    """The logits term is B*T rows with loss_impl=full and one chunk with the chunked loss, the same
    chunk finetune/loss.py takes."""
    from finetune.loss import CHUNK_BYTES, chunk_rows

    assert M.LOSS_CHUNK_BYTES == CHUNK_BYTES
    a = A.known_architecture("meta-llama/Meta-Llama-3-8B")
    assert M.loss_rows(a.vocab_size, 4 * 4096, "chunked") == chunk_rows(a.vocab_size) == 523
    assert M.loss_rows(a.vocab_size, 4 * 4096, "chunked", 1024) == 1024
    assert M.loss_rows(a.vocab_size, 100, "chunked") == 100 and M.loss_rows(a.vocab_size, 4 * 4096) == 4 * 4096
    full = M.activation_bytes(a, 4, 4096, "bf16", True, "full")
    chunked = M.activation_bytes(a, 4, 4096, "bf16", True, "chunked")
    assert full - chunked > 14 * 2**30  # all 16K tokens' logits (19.6 GiB) against one chunk, beyond a layer's backward


# ---------------------------------------------------------------- GRPO's rollout phase


def _grpo(**change):
    r = resolve("llama8b_grpo_zero3", [])
    return replace(r, **change)


def test_grpo_rollout_terms_by_hand():
    """Llama-3.1-8B (32 layers, 8 kv heads of 128, h=4096), 8 GPUs, 64 prompts x 8 completions: 64 rows of
    up to 512 + 512 tokens on each GPU; bf16 KV cache 2 x 32 x 8 x 128 x 2 bytes = 128 KiB a token."""
    r = _grpo()
    a = arch(r.model)
    rollout = M.Rollout.of(r, 8)
    assert rollout == M.Rollout(rows=64, prompt_tokens=512, tokens=1024, logp_copies=0, compiled=True)
    e = M.recipe_estimate(r, 8, a)
    assert e.kv_cache == 64 * 1024 * 128 * 2**10 == 8 * GIB
    assert e.prefill == 34 * 64 * 512 * 4096
    assert e.logps == 0 and e.reference == 0  # beta=0, num_iterations=1: nothing kept, no reference
    # zero3 gathers the whole model (bf16) for the rollout, as Strategy.gathered_bytes says
    assert e.rollout_weights == a.num_parameters() * 2
    assert e.rollout_peak == e.model_states + e.rollout_weights + e.kv_cache + e.prefill
    assert e.peak == max(e.total, e.rollout_peak) == e.rollout_peak
    # no global batch: the rank's completions are micro_batch_size x grad_accum
    assert M.Rollout.of(replace(r, global_batch_size=0, grad_accum=2), 8).rows == 16
    # a prompt budget of max_seq_len - max_completion_len when max_prompt_len is 0
    assert M.Rollout.of(replace(r, max_prompt_len=0, max_seq_len=2048), 8).prompt_tokens == 1536
    # rloo's KL penalty in the reward keeps the old log-probs beside the reference's at one iteration too
    assert M.Rollout.of(replace(r, loss_type="rloo", beta=0.05), 8).logp_copies == 2
    assert M.Rollout.of(replace(r, loss_type="rloo"), 8).logp_copies == 0
    # other objectives have no rollout phase
    assert M.Rollout.of(resolve("llama8b_dpo_zero3", []), 8) is None
    assert M.recipe_estimate(resolve("llama8b_dpo_zero3", []), 8, a).rollout_peak == 0


def test_grpo_with_tools_counts_the_longest_conversation():
    """recipes/llama8b_grpo_tools_zero3 (64 conversations a GPU): each conversation's turns and the calculator's
    answers share max_completion_len=1024 after a prompt of up to 768 tokens (the tool's schema in it), one
    KV cache across the turns: 64 x 1792 positions x 128 KiB = 14 GiB a GPU, as the recipe's header says."""
    r = resolve("llama8b_grpo_tools_zero3", [])
    assert M.Rollout.of(r, 8) == M.Rollout(rows=64, prompt_tokens=768, tokens=1792, logp_copies=0, compiled=True)
    e = M.recipe_estimate(r, 8, arch(r.model))
    assert e.kv_cache == 64 * 1792 * 128 * 2**10 == 14 * GIB
    assert round(e.rollout_peak / GIB, 2) == 50.29 and round(e.total / GIB, 2) == 28.30


def test_grpo_compiled_rollout_counts_the_static_cache_rounded_up():
    """generation_compile (auto on a GPU, true) preallocates a StaticCache of the row's length rounded up to
    256 positions (generation._Decoder uses the same function); eager generation holds what rows reach."""
    r = _grpo(max_prompt_len=300, max_completion_len=100, max_seq_len=400)
    a = arch(r.model)
    per_token = 2 * 32 * 8 * 128 * 2
    assert M.static_cache_length(400) == 512 and M.static_cache_length(512) == 512 and M.static_cache_length(1) == 256
    for setting, positions in (("auto", 512), ("true", 512), ("false", 400)):
        e = M.recipe_estimate(replace(r, generation_compile=setting), 8, a)
        assert e.kv_cache == 64 * positions * per_token, setting


@pytest.mark.parametrize("strategy,gathers", [("ddp", False), ("zero1", False), ("zero2", False), ("zero3", True),
                                              ("fsdp", True)])
def test_grpo_rollout_gathers_only_sharded_weights(strategy, gathers):
    r = _grpo()
    e = M.recipe_estimate(r, 8, arch(r.model), M.Setup(strategy))
    assert (e.rollout_weights > 0) == gathers
    assert e.kv_cache == 8 * GIB  # the cache is per GPU whatever the strategy


def test_grpo_log_probs_and_reference():
    """num_iterations > 1 keeps the rollout's old log-probs, beta > 0 the reference's (fp32, a row's every
    token); beta > 0 holds a frozen reference under a full fine-tune, the adapter disabled under LoRA."""
    r = _grpo(num_iterations=2, beta=0.04)
    a = arch(r.model)
    e = M.recipe_estimate(r, 8, a)
    assert e.logps == 2 * 64 * 1024 * 4
    assert e.reference == a.num_parameters() * 2 // 8  # bf16, sharded by zero3
    assert e.total == e.model_states + e.reference + e.logps + e.activations + e.buffers
    assert M.reference_kind(r) == "frozen" and M.holds_reference(r)
    from finetune.checkpointing.resume import reads_model_again

    assert reads_model_again(r) == "the GRPO reference (a frozen copy of the model as training started)"
    lora = replace(r, lora=True, strategy="fsdp")
    assert M.reference_kind(lora) == "adapter" and M.recipe_estimate(lora, 8, a).reference == 0
    assert M.reference_kind(replace(r, beta=0.0)) is None
    ddp = M.recipe_estimate(r, 8, a, M.Setup("ddp"))
    assert ddp.reference == a.num_parameters() * 2  # whole on each GPU


def test_grpo_fits_needs_the_rollout_too():
    """A budget between the step's total and the rollout's peak does not fit: the rollout is no option."""
    r = _grpo()
    e = M.recipe_estimate(r, 8, arch(r.model))
    assert e.total < e.rollout_peak
    between = int((e.total + e.rollout_peak) / 2 / (1 - M.HEADROOM))
    assert not e.fits(between) and e.fits(int(e.rollout_peak / (1 - M.HEADROOM)) + 1)


def test_grpo_plan_table_and_dry_run_report():
    r = _grpo()
    table = MT.plan_table(r, 8, MT.parse_size("80GB"), name="llama8b_grpo_zero3")
    assert "GRPO dapo: 64 completions per GPU each rollout (num_generations=8), up to 512 prompt + 512 completion " \
           "tokens, reference: none (beta=0)" in " ".join(table.split())  # in lines a terminal shows whole
    header = next(line for line in table.splitlines() if line.startswith("per GPU"))
    for column in ("log-probs", "total", "gathered", "kv cache", "prefill", "rollout"):
        assert column in header
    zero3 = next(line for line in table.splitlines() if line.startswith("* zero3"))
    assert zero3.split()[-6:-2] == ["14.96", "8.00", "4.25", "42.17"]  # gathered, kv cache, prefill, rollout
    assert "the recipe's setup (zero3): 42.17 GiB per GPU, fits" in table
    report = MT.memory_report(r, 8, "llama8b_grpo_zero3")
    assert ("GRPO rollout per GPU (64 completions of up to 1024 tokens generated in one batch): gathered weights "
            "14.96, KV cache 8.00, prefill 4.25; a peak of 42.17 GiB per GPU (with the model states)") in report
    sft = MT.plan_table(resolve("llama7b_zero3", []), 8, name="llama7b_zero3")
    assert "rollout" not in sft and "kv cache" not in sft


def test_a_dry_run_without_a_gpu_checks_this_machines_memory(monkeypatch):
    """On a machine without a GPU the run trains on the CPU: the dry run says whether every process's
    estimated peak fits the memory available (tiny_grpo at max_completion_len=2000 was OOM-killed at
    24 GiB with no word before; that memory was an autograd graph generation kept by mistake, see
    tests/test_generation.py, and the estimate is what it takes now)."""
    monkeypatch.setattr(MT, "_gpu_memory", lambda: None)
    r = resolve("tiny_grpo", ["max_completion_len=2000", "max_seq_len=2048"])
    monkeypatch.setattr(MT, "_host_memory", lambda: 64 * 2**30)
    line = next(x for x in MT.memory_report(r, 2, "tiny_grpo").splitlines() if x.startswith("this machine's"))
    assert line.startswith("this machine's memory, if it trains here on the CPU: 2 process(es) x ")
    assert " of 64.00 GiB available; the estimate fits with 10% headroom" in line
    monkeypatch.setattr(MT, "_host_memory", lambda: 2**20)
    assert "the estimate does NOT fit" in MT.memory_report(r, 2, "tiny_grpo")
    monkeypatch.setattr(MT, "_host_memory", lambda: None)
    assert "this machine's memory" not in MT.memory_report(r, 2, "tiny_grpo")


def test_grpo_longest_completion_fits_and_one_step_more_does_not():
    """python -m finetune.plan --max-seq-len under objective=grpo answers with the longest
    max_completion_len after the recipe's prompt, the rollout's peak counted: at that length the
    estimate fits, at the next multiple of sequence_parallel it does not."""
    from dataclasses import replace

    from finetune.recipe import resolve

    recipe = resolve("llama8b_grpo_longctx", [])
    arch = M.load_architecture(recipe.model)
    budget = MT.parse_size("80GB")
    for n in (1, 2):
        setup = M.Setup.of(recipe)
        longest = MT.longest_sequence(recipe, 8, arch, setup, budget, sequence_parallel=n)
        assert longest > 0 and longest % n == 0

        def estimate(tokens):
            r = replace(recipe, max_seq_len=512 + tokens, max_completion_len=tokens, sequence_parallel=n)
            return M.recipe_estimate(r, 8, arch, setup)

        assert estimate(longest).fits(budget, M.HEADROOM) and not estimate(longest + n).fits(budget, M.HEADROOM)
        assert estimate(longest + n).rollout_peak > estimate(longest).rollout_peak
    assert "longest max_completion_len after a 512-token prompt" in MT.max_seq_len_table(recipe, 8, budget)


@pytest.mark.parametrize("name, reference", [
    ("tiny_kto", "reference: the KTO reference model"), ("tiny_dpo", "reference: the DPO reference model"),
    ("llama8b_kto_lora_fsdp", None), ("llama8b_grpo_zero3", None), ("tiny_distill", None)])
def test_the_planner_reads_in_a_terminal_and_names_what_it_counts(name, reference):
    """Issue 52: the recipe line ran to 300 characters, a KTO run's reference was "the DPO reference model",
    `buffers` was not explained, and nothing said that --gpu-mem tells which setups fit."""
    recipe = resolve(name, [])
    without = MT.plan_table(recipe, 4, name=name).splitlines()
    rule = next(k for k, line in enumerate(without) if set(line) == {"-"})
    end = next(k for k, line in enumerate(without) if line.startswith("* the recipe's own setup"))
    prose = without[:rule - 1] + without[end:]  # all but the table
    assert max(map(len, prose)) <= 120, max(prose, key=len)
    assert without[0].startswith(f"recipe {name}: ") and without[1].startswith("  ") and without[2].startswith("  ")
    text = "\n".join(without)
    if reference:
        assert reference in text and "DPO" not in text.replace(reference if "DPO" in reference else "-", "")
    else:  # LoRA (the adapter disabled), or GRPO's beta=0: no reference column, no note of one
        assert "reference model" not in text
    assert "buffers: what the strategy holds beside the model states" in text
    assert without[-2] == "which of these fit, and the one it would run: add --gpu-mem, one GPU's memory (--gpus 4 " \
                          "--gpu-mem 80GB)"
    with_budget = MT.plan_table(recipe, 4, MT.parse_size("80GB"), name=name)
    assert "add --gpu-mem" not in with_budget and "fits" in with_budget
