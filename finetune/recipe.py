"""The recipe: what to train, on what, and how. Every user error is caught here or in plan.py.

A recipe is a frozen dataclass so that recipe files stay plain, diffable specs and a derived recipe
is just `dataclasses.replace(base, ...)`. Field metadata carries the allowed choices and ranges so
that one generic validator can name the key, the bad value and what is allowed.

It is longer than 700 lines because it is one spec read top to bottom: every key with its default,
choices, range and help (the Recipe class, most of the file), then how a recipe is loaded, overridden from
the command line and validated. Each objective's own keys and rules live in objective_rules/, the
strategies' in strategy/.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from finetune.assets import BUILTIN_DATASETS, BUILTIN_MODELS
from finetune.errors import RecipeError, refuse_switched_on
from finetune import objective_rules
from finetune.objective_rules import reference_kind  # noqa: F401 (asked of the recipe by reference.py, memory.py, resume)
from finetune.objective_rules.dpo import DPO_BETA_RANGE, SIMPO_GAMMA_MAX  # noqa: F401 (the tests read them here)
from finetune.objective_rules.grpo import GRPO_LISTS, GRPO_OBJECTS
from finetune.strategy import NAMES as STRATEGIES, strategy_for

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
DATA_EXTENSIONS = (".json", ".jsonl", ".parquet", ".csv")
BUILTIN_PREFIX = "builtin:"
TRACKERS = ("none", "tensorboard", "wandb", "mlflow")
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _opt(default, *, choices=None, min=None, max=None, help=""):
    metadata = {"choices": choices, "min": min, "max": max, "help": help}
    if isinstance(default, dict):  # a mapping: each recipe its own
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


FORMATS = ("auto", "alpaca", "messages", "prompt_completion", "text", "preference", "prompt", "unpaired")
# What `columns` may map: a format's fields, and inside `messages` each message's role and content.
MAPPABLE = ("messages", "role", "content", "instruction", "input", "output", "prompt", "completion", "text",
            "chosen", "rejected", "label")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture (`Recipe.datasets`), or an eval set (`Recipe.eval_dataset`).

        DataSource(path="data/sharegpt.jsonl", format="messages", weight=0.5,
                   columns={"messages": "conversations", "role": "from", "content": "value"})

    weight: the share of the source's rows taken per epoch (alignment-handbook's dataset_mixer): 0.5 a
    seeded half of them, 2.0 every row twice, 1.5 every row once and a seeded half again. rows: exactly
    this many rows per epoch instead (fewer than the source has: a seeded subset; more: repeats).
    Either is counted after rows without a target token within max_seq_len are dropped.
    columns: the format's field -> the dataset's field; for messages also role and content, each
    message's fields (ShareGPT's conversations of from/value need none: data.with_sharegpt). roles:
    the data's role names -> system/user/assistant/tool; ShareGPT's human/gpt are understood without it.
    """

    path: str
    format: str = "auto"
    split: str = "train"
    config: str = ""  # a hub dataset's configuration (load_dataset's `name`)
    revision: str = ""  # a hub dataset's branch, tag or commit
    columns: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)
    weight: float = 1.0
    rows: int = 0

    def __hash__(self):
        return hash((self.path, self.format, self.split, self.config, self.revision,
                     tuple(sorted(self.columns.items())), tuple(sorted(self.roles.items())), self.weight, self.rows))


SOURCE_FIELDS = {f.name: f for f in dataclasses.fields(DataSource)}


@dataclass(frozen=True)
class Recipe:
    # What to train
    model: str = _opt("builtin:tiny-llama", help="hub id, local directory, or builtin:tiny-llama")
    tokenizer: str = _opt("", help="hub id or directory; empty means the model's own")
    chat_template: str = _opt("", help="a Jinja chat template, or a file holding one (.jinja, or a .json with a "
                              "chat_template key); empty means the tokenizer's own")
    attn_implementation: str = _opt("sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    # On what
    dataset: str = _opt("builtin:tiny-tasks", help="hub id, local json/jsonl/parquet/csv file or directory")
    dataset_split: str = _opt("train")
    dataset_format: str = _opt("auto", choices=FORMATS)
    columns: dict = _opt({}, help="dataset's fields read as the format's: the format's field -> the dataset's, "
                         "label:thumbs,completion:answer on the command line, columns={'label': 'thumbs'} in a "
                         "recipe file (messages also role:from,content:value); also eval_dataset's and eval_split's "
                         "rows; a mixture maps each source's own (datasets.N.columns=...)")
    datasets: tuple[DataSource, ...] = _opt((), help="a mixture, in the recipe file: DataSource(path=..., "
                                            "format=..., weight=... or rows=..., split=..., columns={...}) "
                                            "entries; overrides: datasets.0.weight=0.5; empty: dataset above")
    eval_dataset: str | DataSource = _opt("", help="like dataset, or a DataSource in the recipe file; empty "
                                          "means eval_split of dataset, else hold out eval_fraction")
    eval_split: str = _opt("", help="the split evaluated (test, validation): eval_dataset's (default: "
                           "dataset_split), else dataset's own instead of a held-out eval_fraction")
    eval_fraction: float = _opt(0.05, min=0.0, max=0.5)
    num_proc: int = _opt(0, min=0, help="processes that tokenize; 0: one per 20,000 rows, at most 8 and the "
                         "CPU count")
    max_seq_len: int = _opt(2048, min=8)
    packing: bool = _opt(False)
    padding_free: bool = _opt(False, help="each micro-batch as ONE row: its examples (the packed rows' examples "
                              "with packing=true, else the micro-batch's rows) concatenated with no pad token, "
                              "position ids restarting at 0 per example, no attention mask. Pays with "
                              "attn_implementation=flash_attention_2 (GPU): attention is varlen, per example. With "
                              "sdpa/eager the model builds a block-diagonal mask over the whole row, whose attention "
                              "costs micro_batch_size times a padded row's: it pays only when padding is most of "
                              "the batch and attention a small part of the compute (bench/parts/padding_free.py)")
    train_on_prompt: bool = _opt(False, help="false: loss on the responses only")
    # How
    strategy: str = _opt("zero3", choices=STRATEGIES)
    fsdp_version: int = _opt(2, choices=(1, 2))
    shard_size: int = _opt(0, min=0, help="strategy=hsdp: the GPUs that shard one copy of the model (FSDP2 on a 2-D "
                           "mesh), the copies replicated across the groups; 0: one node's GPUs (docs/multi-node.md)")
    zero_hpz_partition_size: int = _opt(1, min=1, help="strategy=zero3: ZeRO++ hpZ, a secondary copy of the "
                                        "parameters sharded within groups of this many GPUs (a node's), from "
                                        "which all but the step's first all-gather read (docs/multi-node.md)")
    mics_shard_size: int = _opt(0, min=0, help="strategy=zero3: MiCS sharding groups (refused: removed from "
                                "DeepSpeed 0.19)")
    ddp_shard_optimizer: bool = _opt(False, help="ddp only: torch ZeroRedundancyOptimizer")
    offload_optimizer: str = _opt("none", choices=("none", "cpu", "nvme"))
    offload_params: str = _opt("none", choices=("none", "cpu", "nvme"))
    nvme_path: str = _opt("", help="directory on a fast local disk for offload=nvme")
    sequence_parallel: int = _opt(1, min=1, help="Ulysses sequence parallelism: each sequence split across N ranks "
                                  "(DeepSpeed's all-to-all attention), activations per rank / N; N divides the "
                                  "processes and the attention heads; data parallel over processes / N "
                                  "(finetune/sequence_parallel.py)")
    tiled_mlp: bool = _opt(False, help="each decoder layer's MLP computed a slice of the sequence at a time "
                           "(DeepSpeed's TiledMLP, ALST): its [tokens, intermediate] activations exist for one slice "
                           "only, at the cost of the MLP's forward again in backward; for long rows "
                           "(finetune/sequence_parallel.py tile_mlps)")
    context_parallel: int = _opt(1, min=1, help="ring-attention context parallelism (torch, GPUs only): not "
                                 "available yet; use sequence_parallel")
    mixed_precision: str = _opt("bf16", choices=("no", "bf16", "fp16"))
    activation_checkpointing: bool = _opt(False)
    activation_offload: bool = _opt(False, help="with activation_checkpointing: each decoder layer's checkpointed "
                                    "input kept in CPU memory from the forward to the backward instead of on the "
                                    "GPU (torch saved-tensor hooks, every strategy): the planner's L x tokens x "
                                    "hidden term leaves the GPU, at the cost of a copy each way per layer "
                                    "(finetune/offload.py)")
    compile: bool = _opt(False, help="torch.compile each decoder layer (fuses the element-wise ops: norms, rotary, "
                         "activations) for faster steps; costs compile time at the start on every rank (about 50 s "
                         "for the 2-layer tiny model on one CPU core; more for more kinds of layer, not more "
                         "layers), part of it when the sequence length first changes; strategy=ddp, fsdp (FSDP2), zero1 or zero2, not zero3 (finetune/model.py "
                         "compile_layers)")
    loss_impl: str = _opt("chunked", choices=("chunked", "liger", "full"),
                          help="chunked: cross-entropy a chunk of tokens at a time, never the full logits; "
                          "liger: Liger-Kernel's fused kernel (CUDA, pip install liger-kernel); full: all "
                          "logits at once (finetune/loss.py)")
    loss_chunk_tokens: int = _opt(0, min=0, help="tokens per chunk of loss_impl=chunked; 0: as many as keep one "
                                  "chunk's fp32 logits within 256 MiB (finetune/loss.py CHUNK_BYTES)")
    # What to optimize: sft (next-token loss on the responses), dpo (preference pairs: finetune/training/objectives/dpo.py),
    # grpo (rewarded completions: finetune/training/objectives/grpo.py) or reward (a reward model trained on preference
    # pairs, Bradley-Terry: finetune/training/objectives/reward.py), kto (unpaired rows, each completion desirable
    # or not: finetune/training/objectives/kto.py) or distill (on-policy distillation from a teacher:
    # finetune/training/objectives/distill.py)
    objective: str = _opt("sft", choices=objective_rules.NAMES)
    dpo_loss: str = _opt("sigmoid", choices=("sigmoid", "ipo", "simpo"),
                         help="sigmoid: DPO (Rafailov et al.); ipo: IPO's squared loss; simpo: SimPO, reference-free "
                         "(length-normalised log-probs and a margin simpo_gamma): loads no reference model")
    dpo_beta: float = _opt(0.1, min=0.0, help="how far the policy may move from the reference (DPO's beta; "
                           "IPO's tau; SimPO's beta, usually 2.0)")
    dpo_label_smoothing: float = _opt(0.0, min=0.0, max=0.5, help="sigmoid only: the share of pairs assumed "
                                      "mislabelled (conservative DPO)")
    simpo_gamma: float = _opt(0.5, min=0.0, help="simpo only: the target reward margin over beta (gamma/beta)")
    precompute_reference: bool = _opt(False, help="dpo, kto: the reference's log-probs of every pair (kto: row and "
                                      "its KL row) in one pass before training, cached beside the prepared data; "
                                      "training then holds no reference")
    center_rewards_coefficient: float = _opt(0.0, min=0.0, help="reward: adds this x mean((r_chosen + r_rejected)^2) "
                                             "to the loss, keeping the rewards centred on 0 (TRL's; 0: off, "
                                             "Eisenstein et al. use 0.01)")
    # KTO (finetune/training/objectives/kto.py, TRL's KTOConfig names and defaults, beta as kto_beta)
    kto_loss: str = _opt("kto", choices=("kto", "apo_zero_unpaired"),
                         help="kto: KTO (Ethayarajh et al.), each completion's log-ratio to the reference against "
                         "the batch's KL estimate; apo_zero_unpaired: APO-zero's unpaired form, no KL estimate")
    kto_beta: float = _opt(0.1, min=0.0, help="kto: how far the policy may move from the reference (TRL's beta)")
    desirable_weight: float = _opt(1.0, min=0.0, help="kto: the weight of a desirable completion's loss (TRL's; "
                                   "raise it where desirable rows are fewer)")
    undesirable_weight: float = _opt(1.0, min=0.0, help="kto: the weight of an undesirable completion's loss")
    max_prompt_len: int = _opt(0, min=0, help="dpo, reward, kto: the most tokens a pair's (a row's) prompt keeps (its start is cut); "
                               "grpo: the most tokens a prompt may have (its start is cut); 0: no limit but "
                               "max_seq_len")
    # GRPO (finetune/training/objectives/grpo.py, TRL's GRPOConfig names and defaults): each prompt gets num_generations
    # sampled completions, scored by reward functions (finetune/rewards.py); the global batch counts prompts
    reward_funcs: tuple[object, ...] = _opt((), help="grpo: reward functions: callables in the recipe file, or module:function "
                               "names, comma-separated (built in: finetune.rewards:exact_match, "
                               "finetune.rewards:char_match, finetune.rewards:answer_chars, "
                               "finetune.rewards:math_answer, finetune.rewards:think_format; in a recipe file also "
                               "exact_match_on(column), regex_reward(pattern), RewardModel(directory))")
    reward_weights: tuple[object, ...] = _opt((), help="grpo: one weight per reward function, comma-separated; empty: 1 each")
    # Agents (finetune/tools.py, finetune/training/agent.py, docs/agents.md; TRL's names): tools the model calls over
    # several turns, each answer rendered by the chat template, in the sequence but out of the loss
    tools: tuple[object, ...] = _opt((), help="grpo: tools the model may call between turns: functions with type "
                                     "hints and a docstring, callables in the recipe file or module:function names, "
                                     "comma-separated (docs/agents.md)")
    environment_factory: object = _opt("", help="grpo: a class (in the recipe file, or module:Class) made once per "
                                       "completion: reset(**row), its public methods are tools, get_reward() a "
                                       "reward (TRL's)")
    max_tool_calling_iterations: int = _opt(0, min=0, help="grpo with tools: the most rounds of tool calls a "
                                            "completion makes (0: as many as max_completion_len holds, TRL's None)")
    tool_timeout: float = _opt(60.0, min=0.0, help="grpo with tools: a call that runs longer answers an error the "
                               "model reads (0: no limit)")
    num_generations: int = _opt(8, help="grpo: completions sampled per prompt (a group), at least 2")
    temperature: float = _opt(1.0, min=0.0, help="grpo, distill: sampling temperature (0: greedy; distill: also the divergence's)")
    top_p: float = _opt(1.0, min=0.0, max=1.0, help="grpo, distill: nucleus sampling's probability mass (1: off)")
    top_k: int = _opt(0, min=0, help="grpo, distill: sample among the k likeliest tokens (0: off)")
    generation_compile: str = _opt("auto", choices=("auto", "true", "false"),
                                   help="grpo: the rollout's decode loop in a static KV cache with its one-token step "
                                   "compiled (CUDA graphs on a GPU); auto: on a GPU only (on CPU the compile costs "
                                   "more than it saves)")
    max_completion_len: int = _opt(256, min=1, help="grpo, distill: the most tokens a completion gets; also dr_grpo's "
                                   "normaliser")
    loss_type: str = _opt("dapo", choices=("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo",
                                           "rloo"),
                          help="grpo: the policy loss (finetune/rl_losses.py, docs/rl.md): grpo: each completion's "
                          "mean token loss, averaged; dapo: the mean over all completion tokens of the global batch; "
                          "dr_grpo: their sum / (completions x max_completion_len); bnpo: the mean over each "
                          "micro-batch's tokens; cispo: the capped ratio (epsilon_high) times logp; sapo: a soft "
                          "gate for the clip; luspo: each completion's summed loss; vespo: a gamma weight of the "
                          "sequence ratio times logp; rloo: TRL's RLOOTrainer (leave-one-out baseline, beta's KL in "
                          "the reward, the clipped ratio of whole sequences)")
    dynamic_sampling: bool = _opt(False, help="grpo: groups whose rewards are all equal (no learning signal) are "
                                  "dropped and more prompts sampled until the batch is full (DAPO)")
    max_generation_batches: int = _opt(10, min=1, help="grpo, dynamic_sampling: the most generation batches a step "
                                       "samples; then it trains on what it found (verl's max_num_gen_batches)")
    normalize_advantages: bool = _opt(False, help="grpo, loss_type=rloo: the advantages normalised over the batch "
                                      "(mean 0, std 1; TRL's RLOOConfig name)")
    importance_sampling_level: str = _opt("token", choices=("token", "sequence"),
                                          help="grpo: the importance ratio per token, or per completion (the mean "
                                          "of its tokens' log ratios: GSPO)")
    sapo_temperature_pos: float = _opt(1.0, min=0.0, help="grpo, loss_type=sapo: the gate's temperature where the "
                                       "advantage is positive")
    sapo_temperature_neg: float = _opt(1.05, min=0.0, help="grpo, loss_type=sapo: ... where it is not")
    vespo_k_pos: float = _opt(2.0, help="grpo, loss_type=vespo: the gamma weight's power where the advantage >= 0")
    vespo_lambda_pos: float = _opt(3.0, help="grpo, loss_type=vespo: the gamma weight's decay where the advantage >= 0")
    vespo_k_neg: float = _opt(3.0, help="grpo, loss_type=vespo: the gamma weight's power where the advantage < 0")
    vespo_lambda_neg: float = _opt(2.0, help="grpo, loss_type=vespo: the gamma weight's decay where the advantage < 0")
    entropy_coef: float = _opt(0.0, help="grpo: an entropy bonus: the loss less entropy_coef x the mean token "
                               "entropy of each micro-batch (TRL's name, its static form; 0: none)")
    cast_lm_head_to_fp32: bool = _opt(False, help="grpo: the output layer's matmul (the logits) in float32 for the "
                                      "policy, old and reference log-probs (ScaleRL); needs loss_impl=chunked")
    scale_rewards: str = _opt("group", choices=("group", "batch", "none"),
                              help="grpo: advantages divided by the group's reward std, the batch's, or not")
    epsilon: float = _opt(0.2, min=0.0, help="grpo: the importance ratio is clipped below at 1 - epsilon")
    epsilon_high: float = _opt(0.0, min=0.0, help="grpo: ... and above at 1 + epsilon_high (0: epsilon; DAPO: 0.28); "
                               "cispo: the cap on the ratio itself (ScaleRL: 5.0)")
    num_iterations: int = _opt(1, min=1, help="grpo: optimizer steps per rollout (old log-probs kept from it)")
    beta: float = _opt(0.0, min=0.0, help="grpo: the KL penalty's weight against the reference (0: no reference "
                       "held)")
    use_bias_correction_kl: bool = _opt(True, help="grpo, beta > 0: the KL term (k3) times the importance ratio, the "
                                        "unbiased reverse KL's gradient (TRL's default); false: the plain k3 term")
    mask_truncated_completions: bool = _opt(False, help="grpo: completions cut at max_completion_len count in no "
                                            "loss term (DAPO)")
    # On-policy distillation (finetune/training/objectives/distill.py; TRL's DistillationConfig, lmbda GKD's): the
    # student samples completions with temperature, top_p, top_k, max_completion_len and learns the teacher's
    # next-token distributions on them (docs/distillation.md)
    teacher_model: str = _opt("", help="distill: the teacher, a hub id, local directory or builtin:NAME, with the "
                              "student's vocabulary (TRL's teacher_model)")
    lmbda: float = _opt(1.0, min=0.0, max=1.0, help="distill: the share of steps trained on the student's own "
                        "sampled completions (on-policy), the rest on the dataset's completions (1: TRL's "
                        "DistillationTrainer; GKD's default 0.5)")
    distill_beta: float = _opt(1.0, min=0.0, max=1.0, help="distill: the generalized JSD's beta (TRL's beta): 0 "
                               "forward KL(teacher || student), 1 reverse KL(student || teacher), between: the JSD "
                               "against the mixture (1 - beta) student + beta teacher")
    # GRPO's generator (docs/vllm.md): finetune's own (finetune/generation.py), or a vLLM engine in each process
    # (finetune/vllm_engine.py) built once from the model's directory and given the trained weights before each
    # rollout; TRL's names and defaults for the vllm_ keys it has
    generation_backend: str = _opt("finetune", choices=("finetune", "vllm"),
                                   help="grpo: who generates the rollouts and the eval's completions: finetune's "
                                   "own generator, or vllm (pip install vllm; docs/vllm.md)")
    vllm_gpu_memory_utilization: float = _opt(0.3, min=0.0, max=1.0, help="vllm: the share of each GPU's memory the "
                                              "engine takes for its weights and KV cache (TRL's default)")
    vllm_enable_sleep_mode: bool = _opt(False, help="vllm, on GPUs: the engine sleeps between rollouts (weights to "
                                        "CPU memory, KV cache freed) so that the step gets its memory back")
    vllm_importance_sampling_correction: bool = _opt(True, help="vllm: weigh each token's loss by the trainer's "
                                                     "probability over the engine's (TRL 1.16)")
    vllm_importance_sampling_mode: str = _opt("sequence_mask", choices=("token_truncate", "token_mask",
                                              "sequence_truncate", "sequence_mask"),
                                              help="vllm: per token or per completion; ratios above "
                                              "vllm_importance_sampling_clip_max clipped (truncate) or zeroed (mask)")
    vllm_importance_sampling_clip_max: float = _opt(3.0, min=0.0, help="vllm: the importance ratio's upper bound "
                                                    "(TRL 1.16's name; vllm_importance_sampling_cap before it)")
    vllm_logp_tolerance: float = _opt(0.0, min=0.0, help="vllm: the most the mean |engine - trainer| log-prob of the "
                                      "sampled tokens may be before the run stops (the push did not take); 0: 1e-3 "
                                      "in fp32, 0.1 in bf16/fp16")
    vllm_push_timeout: float = _opt(600.0, min=1.0, help="vllm: seconds a weight push may take before the run stops "
                                    "with one line naming the rank")
    vllm_push_layers: int = _opt(4, min=1, help="vllm: decoder layers gathered at a time for a push (the transient "
                                 "on each rank)")
    # GRPO's generation on processes of its own (finetune/training/rollout_group.py, docs/async-rl.md): the last
    # rollout_processes of the launched processes generate and score the rollouts, the others train; TRL's
    # AsyncGRPO names where it has them
    rollout_processes: int = _opt(0, min=0, help="grpo: how many of the launched processes (the last ones) generate "
                                  "the rollouts while the others train; 0: every process generates its share, then "
                                  "trains")
    max_staleness: int = _opt(0, min=0, help="grpo, rollout_processes > 0: step s trains on a rollout generated from "
                              "the weights step s - max_staleness started from (a fixed lag); 0: synchronous")
    weight_sync_steps: int = _opt(1, min=1, help="grpo, rollout_processes > 0: the trained weights are pushed to the "
                                  "generating processes every this many optimizer steps")
    heartbeat_stale_after_s: float = _opt(300.0, min=1.0, help="grpo, rollout_processes > 0: seconds without a sign "
                                          "of progress from a generating process after which the run stops, naming it")
    # LoRA (peft): only the adapters train; the base model stays frozen and sharded
    lora: bool = _opt(False)
    lora_r: int = _opt(16, min=1)
    lora_alpha: float = _opt(32.0, min=0.0)
    lora_dropout: float = _opt(0.05, min=0.0, max=0.99)
    lora_target_modules: tuple[str, ...] = _opt((), help="module names, comma-separated; empty: every "
                                                "attention and MLP projection")
    merge_lora: bool = _opt(False, help="also write final_merged/: base + adapter as one plain model")
    load_in_4bit: bool = _opt(False, help="QLoRA: the frozen base in 4-bit NF4 through bitsandbytes (pip install "
                              "bitsandbytes); strategy=fsdp or zero3 shard it, ddp replicates it")
    # Hyper-parameters
    micro_batch_size: int = _opt(1, min=1)
    grad_accum: int = _opt(1, min=1)
    global_batch_size: int = _opt(0, min=0, help="0: micro_batch_size x grad_accum x processes; "
                                  "else fixed, and grad_accum is derived from it")
    lr: float = _opt(2e-5, min=0.0)
    lr_scheduler: str = _opt("cosine", choices=("constant", "constant_with_warmup", "linear", "cosine"))
    warmup_steps: int = _opt(0, min=0)
    weight_decay: float = _opt(0.0, min=0.0)
    adam_beta1: float = _opt(0.9, min=0.0, max=1.0)
    adam_beta2: float = _opt(0.999, min=0.0, max=1.0)
    adam_eps: float = _opt(1e-8, min=0.0)
    max_grad_norm: float = _opt(1.0, min=0.0, help="0 disables clipping")
    max_nonfinite_steps: int = _opt(0, min=0, help="steps with a NaN/inf loss or gradient norm to skip (no update) "
                                    "before the run stops with an error; 0: stop at the first")
    epochs: int = _opt(1, min=1)
    max_steps: int = _opt(0, min=0, help="0: run `epochs` epochs")
    seed: int = _opt(42, min=0, max=2**32 - 1)  # numpy's range; the data order and RNG streams derive from it
    # Outputs
    output_dir: str = _opt("runs/default")
    log_every: int = _opt(10, min=1)
    eval_every: int = _opt(100, min=0, help="0: evaluate only at the end")
    eval_at_start: bool = _opt(False, help="also evaluate before the first step, as a baseline")
    eval_max_samples: int = _opt(0, min=0, help="evaluate on the first N eval rows; 0: all")
    sample_prompts: int = _opt(3, min=0, help="at each eval, greedy answers to the first N eval rows' prompts: "
                               "samples.jsonl, the progress output, TensorBoard, the summary; 0: none")
    sample_max_new_tokens: int = _opt(32, min=1, help="the most tokens each sample answer gets")
    save_every: int = _opt(0, min=0, help="0: no periodic checkpoints")
    keep_last: int = _opt(2, min=1)
    async_save: bool = _opt(False, help="stage each checkpoint in host memory and write it in the background "
                            "while training goes on (docs/async-checkpoints.md)")
    log_level: str = _opt("warning", choices=("debug", "info", "warning", "error"))
    plot_loss: bool = _opt(True, help="draw loss.png: after an eval at most once a minute, and at the end")
    report_to: tuple[str, ...] = _opt(("none",), choices=TRACKERS,
                                      help="trackers, comma-separated: tensorboard, wandb, mlflow, or none")

    def __post_init__(self):
        if isinstance(self.datasets, list):  # a recipe file may write the mixture as a list
            object.__setattr__(self, "datasets", tuple(self.datasets))
        for name in ("reward_funcs", "reward_weights", "tools"):  # a recipe file may write them as lists, or one function
            value = getattr(self, name)
            if isinstance(value, list) or callable(value):
                object.__setattr__(self, name, tuple(value) if isinstance(value, list) else (value,))

    def to_dict(self) -> dict:
        """Plain values (recipe.json, trackers): a reward function given as a callable by its name."""
        values = dataclasses.asdict(self)
        if self.reward_funcs:
            from finetune.rewards import spec_name

            values["reward_funcs"] = tuple(spec_name(f) for f in self.reward_funcs)
        if self.tools:
            values["tools"] = tuple(f if isinstance(f, str) else f"{f.__module__}:{f.__qualname__}" for f in self.tools)
        if self.environment_factory and not isinstance(self.environment_factory, str):
            f = self.environment_factory
            values["environment_factory"] = f"{f.__module__}:{getattr(f, '__qualname__', type(f).__qualname__)}"
        return values


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}


# ---------------------------------------------------------------- loading


# transformers' TrainingArguments (and TRL's configs) name these keys otherwise: what a user coming from
# them types, and ours
PEER_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum (or global_batch_size, from which grad_accum is derived)",
    "per_device_train_batch_size": "micro_batch_size",
    "lr_scheduler_type": "lr_scheduler",
    "max_seq_length": "max_seq_len",
    "max_length": "max_seq_len",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "save_steps": "save_every",
    "save_total_limit": "keep_last",
    "gradient_checkpointing": "activation_checkpointing",
}


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def recipe_path(name: str) -> Path:
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise RecipeError(f"recipe file {name} does not exist")
        return path.resolve()
    path = RECIPES_DIR / f"{name}.py"
    if not path.is_file():
        close = difflib.get_close_matches(name, available_recipes(), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise RecipeError(
            f"unknown recipe {name!r}{hint}; available: {', '.join(available_recipes())}; "
            "or pass a path to a .py file that defines `recipe`"
        )
    return path


def load_recipe_module(name: str) -> Recipe:
    """Import recipes/<name>.py (or a file) and return its `recipe`.

    The repository root goes on sys.path so that a recipe can derive from another with
    `from recipes.tiny import recipe as tiny`.
    """
    path = recipe_path(name)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    module_name = f"recipes.{path.stem}" if path.parent == RECIPES_DIR else f"_user_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except RecipeError:
        raise
    except SyntaxError as e:
        raise RecipeError(f"recipe {path}: syntax error on line {e.lineno}: {e.msg}") from None
    except TypeError as e:
        unknown = _unknown_keyword(e, path)
        if unknown:
            raise RecipeError(unknown) from None
        raise RecipeError(f"recipe {path} failed to import: {type(e).__name__}: {e}") from None
    except Exception as e:  # a user's Python file can fail in any way; say where
        raise RecipeError(f"recipe {path} failed to import: {type(e).__name__}: {e}") from None
    recipe = getattr(module, "recipe", None)
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"recipe {path} must define `recipe = Recipe(...)` (found {type(recipe).__name__})")
    return recipe


def _unknown_keyword(error: TypeError, path: Path) -> str | None:
    """Recipe(learning_rate=...) or DataSource(colums=...) in a recipe file, as one line naming the file's
    line, the key and the key meant, as the command line names it; None for any other TypeError."""
    import re
    import traceback

    found = re.search(r"(Recipe|DataSource)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(error))
    if not found:
        return None
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == str(path)]
    where = f"recipe {path}" + (f" line {lines[-1]}" if lines else "")
    kind, key = found.groups()
    if kind == "Recipe":
        return f"{where}: {unknown_key_message(key)}"
    close = difflib.get_close_matches(key, SOURCE_FIELDS, n=1)
    return (f"{where}: DataSource has no field {key!r}{f'; did you mean {close[0]}?' if close else ''} (fields: "
            f"{', '.join(SOURCE_FIELDS)})")


def unknown_key_message(key: str) -> str:
    """An unknown recipe key, with the key meant: a close spelling, or ours for the Trainer's and TRL's name."""
    close = difflib.get_close_matches(key, FIELDS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    if key in PEER_NAMES:
        hint = f" (the Trainer's and TRL's name); did you mean {PEER_NAMES[key]}?"
    return f"unknown recipe key {key!r}{hint} (see finetune/recipe.py for all keys)"


# ---------------------------------------------------------------- overrides


@functools.cache
def _recipe_types() -> dict:
    """Recipe's field types, resolved once (typing.get_type_hints evaluates every annotation of the class on each
    call: validating a recipe called it per field, a second of each process's start)."""
    return typing.get_type_hints(Recipe)


def _type_of(name: str):
    return _recipe_types()[name]


def parse_value(key: str, text: str):
    kind = _type_of(key)
    origin = typing.get_origin(kind)
    if kind is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise RecipeError(f"{key}={text}: expected a boolean (true or false)")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            try:
                as_float = float(text)  # accept 1e3 written for an int
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise RecipeError(f"{key}={text}: expected an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise RecipeError(f"{key}={text}: expected a number such as 1e-5") from None
    if origin in (list, tuple):
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        return items if origin is tuple else list(items)
    if kind is dict:
        return _parse_mapping(key, text)
    return text


def _parse_mapping(key: str, text: str) -> dict:
    """a:b,c:d -> {"a": "b", "c": "d"}"""
    out = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        if ":" not in item:
            raise RecipeError(f"{key}={text}: expected field:field pairs, the format's field first, comma-separated "
                              "(label:thumbs,completion:answer)")
        a, b = item.split(":", 1)
        out[a.strip()] = b.strip()
    return out


def _mapping_text(columns: dict) -> str:
    """{"label": "thumbs"} as the command line writes it: label:thumbs"""
    return ",".join(f"{k}:{v}" for k, v in columns.items())


def _source_override(recipe: Recipe, sources: list, key: str, value: str) -> None:
    """datasets.N.FIELD=value: one field of one source of the mixture."""
    parts = key.split(".")
    if len(parts) != 3 or not parts[1].isdigit():
        raise RecipeError(f"{key}={value}: a mixture source is overridden as datasets.N.FIELD=value "
                          "(for example datasets.0.weight=0.5)")
    index, name = int(parts[1]), parts[2]
    if index >= len(sources):
        raise RecipeError(f"{key}={value}: the recipe has {len(sources)} source(s) in datasets "
                          f"(datasets.0{f' to datasets.{len(sources) - 1}' if len(sources) > 1 else ''})")
    if name not in SOURCE_FIELDS:
        raise RecipeError(f"{key}={value}: unknown DataSource field {name!r}; fields: {', '.join(SOURCE_FIELDS)}")
    kind = typing.get_type_hints(DataSource)[name]
    if kind is dict:
        parsed = _parse_mapping(key, value)
    elif kind in (int, float):
        try:
            parsed = kind(float(value)) if kind is int and float(value).is_integer() else kind(value)
        except ValueError:
            raise RecipeError(f"{key}={value}: expected {'an integer' if kind is int else 'a number'}") from None
    else:
        parsed = value
    sources[index] = dataclasses.replace(sources[index], **{name: parsed})


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    changes = {}
    sources = list(recipe.datasets)
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (for example lr=1e-5)")
        key, value = item.split("=", 1)
        key = key.strip()
        if key.startswith("datasets."):
            _source_override(recipe, sources, key, value)
            changes["datasets"] = tuple(sources)
            continue
        if key == "datasets":
            raise RecipeError(f"datasets={value}: a mixture is written in the recipe file as a list of "
                              "DataSource(...); on the command line override one source's field "
                              "(datasets.0.weight=0.5), or train on one source with dataset=...")
        if key not in FIELDS:
            raise RecipeError(unknown_key_message(key))
        changes[key] = parse_value(key, value)
    if recipe.datasets and "dataset" in changes:
        changes["datasets"] = ()  # dataset=... on a mixture recipe: train on that one source
    elif recipe.datasets:
        for key in ("dataset_split", "dataset_format"):
            if key in changes:
                field_name = {"dataset_split": "split", "dataset_format": "format"}[key]
                raise RecipeError(f"{key}={changes[key]}: this recipe mixes {len(recipe.datasets)} sources "
                                  f"(datasets=...), each with its own {field_name}; override one with "
                                  f"datasets.N.{field_name}=..., or train on one source with dataset=...")
    return dataclasses.replace(recipe, **changes)


# ---------------------------------------------------------------- validation


def _check_field(name: str, value) -> None:
    meta = FIELDS[name].metadata
    kind = _type_of(name)
    if name == "datasets":
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, DataSource) for v in value):
            raise RecipeError(f"datasets={value!r:.120}: expected a list of DataSource(path=..., ...)")
        for i, source in enumerate(value):
            check_source_fields(f"datasets[{i}]", source)
        return
    if name in GRPO_LISTS or name in GRPO_OBJECTS:
        return  # checked with the objective (finetune/objective_rules/grpo.py): callables and numbers, not strings only
    if name == "eval_dataset":
        if isinstance(value, DataSource):
            check_source_fields("eval_dataset", value, weighted=False)
        elif not isinstance(value, str):
            raise RecipeError(f"eval_dataset={value!r:.120}: expected a path, a hub id or a DataSource(...)")
        return
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise RecipeError(f"{name}={value!r:.120}: expected a dict of field names ({{'label': 'thumbs'}})")
        problem = columns_problem(name, value)
        if problem:
            raise RecipeError(problem)
        return
    if kind is bool and not isinstance(value, bool):
        raise RecipeError(f"{name}={value!r}: expected true or false")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RecipeError(f"{name}={value!r}: expected an integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise RecipeError(f"{name}={value!r}: expected a number")
    if kind is str and not isinstance(value, str):
        raise RecipeError(f"{name}={value!r}: expected a string")
    choices = meta.get("choices")
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            raise RecipeError(f"{name}={value!r}: expected a comma-separated list")
        bad = [v for v in value if choices and v not in choices]
        if bad:
            raise RecipeError(f"{name}={','.join(value)}: {bad[0]!r} is not one of {', '.join(choices)}")
        return
    if choices and value not in choices:
        raise RecipeError(f"{name}={value}: must be one of {', '.join(map(str, choices))}")
    low, high = meta.get("min"), meta.get("max")
    if kind is float and not math.isfinite(value):  # nan < low is False: without this, nan passes every bound
        bounds = " and ".join(b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None
                                            else "") if b)
        raise RecipeError(f"{name}={value}: must be a finite number{' ' + bounds if bounds else ''}")
    if low is not None and value < low:
        raise RecipeError(f"{name}={value}: must be >= {low}")
    if high is not None and value > high:
        raise RecipeError(f"{name}={value}: must be <= {high}")


def check_source_fields(key: str, source: DataSource, weighted: bool = True) -> None:
    """One DataSource's fields: types, format, weight or rows, the column and role mappings."""
    for name, kind in typing.get_type_hints(DataSource).items():
        value = getattr(source, name)
        ok = (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
              if kind is dict else isinstance(value, (int, float)) and not isinstance(value, bool)
              if kind is float else isinstance(value, int) and not isinstance(value, bool)
              if kind is int else isinstance(value, kind))
        if not ok:
            want = {dict: "a dict of strings", float: "a number", int: "an integer", str: "a string"}[kind]
            raise RecipeError(f"{key}.{name}={value!r:.80}: expected {want}")
    if not source.path:
        raise RecipeError(f"{key}.path is empty; give a hub id, a local json/jsonl/parquet/csv file or directory, "
                          "or a folder written by save_to_disk")
    if source.format not in FORMATS:
        raise RecipeError(f"{key}.format={source.format}: must be one of {', '.join(FORMATS)}")
    if not source.split:
        raise RecipeError(f"{key}.split is empty; name a split (train, test, validation)")
    if not math.isfinite(source.weight) or source.weight <= 0:
        raise RecipeError(f"{key}.weight={source.weight}: must be a positive number (the share of the source's "
                          "rows per epoch: 0.5 half of them, 2 every row twice); leave a source out to drop it")
    if source.rows < 0:
        raise RecipeError(f"{key}.rows={source.rows}: must be >= 0 (0: use weight)")
    if source.rows and source.weight != 1.0:
        raise RecipeError(f"{key}: weight={source.weight} and rows={source.rows} both say how much of the source "
                          "to take; set one of them")
    if not weighted and (source.rows or source.weight != 1.0):
        raise RecipeError(f"{key}: weight and rows apply to training sources (datasets=...); an eval set is "
                          "used whole")
    problem = columns_problem(f"{key}.columns", source.columns)
    if problem:
        raise RecipeError(problem)
    for name, role in source.roles.items():
        if role not in ROLES:
            raise RecipeError(f"{key}.roles maps {name!r} to {role!r}; the roles are {', '.join(ROLES)}")
    _check_source(f"{key}.path", source.path)


def columns_problem(key: str, columns: dict) -> str | None:
    """A column mapping's first wrong entry: each maps a field some format reads (MAPPABLE) to a field of
    the dataset, both non-empty names; a mapping written the wrong way round is named as such."""
    for target, name in columns.items():
        if not target or not name:
            return f"{key} maps {target!r} to {name!r}: both sides need a field name (label:thumbs)"
        if target not in MAPPABLE and name in MAPPABLE:
            return (f"{key} maps {target!r}, which no format has: the wrong way round? the format's field comes "
                    f"first ({name}:{target} reads the dataset's field {target} as {name})")
        if target not in MAPPABLE:
            return (f"{key} maps {target!r}, which no format has; map one of {', '.join(MAPPABLE)} to the dataset's "
                    "field (label:thumbs reads the dataset's field thumbs as label)")
    return None


def looks_local(source: str) -> bool:
    """A dataset/model reference is local if it exists, or if it is shaped like a path, not a hub id."""
    if source.startswith(BUILTIN_PREFIX):
        return False
    p = Path(source).expanduser()
    return (
        p.exists()
        or source.startswith(("/", "./", "../", "~"))
        or source.lower().endswith(DATA_EXTENSIONS)
        or source.count("/") > 1
    )


def validate(recipe: Recipe) -> Recipe:
    """Check every field and every combination; cheap, touches no model or data content."""
    for name in FIELDS:
        _check_field(name, getattr(recipe, name))

    r = recipe
    _check_optimizer(r)
    strategy = strategy_for(r.strategy)  # what it cannot take, it says (finetune/strategy)
    problem = strategy.offload_problem(r)
    if problem:
        raise RecipeError(problem)
    if "nvme" in (r.offload_optimizer, r.offload_params) and not r.nvme_path:
        raise RecipeError("offload to nvme needs nvme_path=/a/directory/on/a/local/nvme/disk")
    problem = strategy.option_problem(r)
    if problem:
        raise RecipeError(problem)
    if not r.lora:
        for key, default in (("merge_lora", False), ("load_in_4bit", False)):
            if getattr(r, key) != default:
                raise RecipeError(f"{key}={getattr(r, key)} applies to LoRA runs only; set lora=true or {key}=false")
    problem = strategy.quantized_base_problem(r)
    if problem:
        raise RecipeError(problem)
    if r.load_in_4bit and r.offload_params != "none":
        raise RecipeError(f"load_in_4bit=true with offload_params={r.offload_params}: offloading a 4-bit base is "
                          "not supported; use offload_params=none (the 4-bit base is a quarter of a 16-bit one; "
                          "shard it over more GPUs) or load_in_4bit=false")
    if r.packing and not r.padding_free and r.attn_implementation == "flash_attention_2" and r.micro_batch_size > 1:
        raise RecipeError(f"packing=true with attn_implementation=flash_attention_2 and micro_batch_size="
                          f"{r.micro_batch_size}: transformers keeps packed examples apart under flash-attention only "
                          "in a batch of one row (its varlen path), so each row's examples would attend to one "
                          "another; set padding_free=true (one row per micro-batch, varlen) or micro_batch_size=1")
    problem = strategy.compile_problem(r) if r.compile else None
    if problem:
        raise RecipeError(problem)
    if r.activation_offload and not r.activation_checkpointing:
        raise RecipeError("activation_offload=true without activation_checkpointing: what is offloaded is each "
                          "layer's checkpointed input (without checkpointing every tensor each layer keeps would "
                          "cross to the CPU and back); set activation_checkpointing=true or activation_offload=false")
    if r.activation_offload and r.compile:
        raise RecipeError("activation_offload=true with compile=true: compiled layers under saved-tensor hooks were "
                          "not tried; set compile=false or activation_offload=false")
    _check_sequence_parallel(r, strategy)
    objective_rules.check(r, strategy)  # the objective's keys only with it, and what it cannot take
    if r.warmup_steps and r.max_steps and r.warmup_steps > r.max_steps:
        raise RecipeError(f"warmup_steps={r.warmup_steps} is longer than max_steps={r.max_steps}; lower warmup_steps")
    trackers = [t for t in r.report_to if t != "none"]
    for tracker in trackers:
        if importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is None:
            raise RecipeError(f"report_to={tracker}, but {TRACKER_PACKAGES[tracker]} is not installed; "
                              f"pip install {TRACKER_PACKAGES[tracker]} (or pip install -e .[{tracker}]), "
                              "or drop it from report_to")
    if r.datasets and r.columns:
        raise RecipeError(f"columns={_mapping_text(r.columns)} maps the fields of dataset=..., but this recipe mixes "
                          f"{len(r.datasets)} sources (datasets=...), each with its own columns: set "
                          f"datasets.N.columns={_mapping_text(r.columns)} for the source that needs it")
    if not r.datasets:
        _check_source("dataset", r.dataset)
    if r.eval_dataset and isinstance(r.eval_dataset, str):
        _check_source("eval_dataset", r.eval_dataset)
    if r.datasets and r.eval_split and not r.eval_dataset:
        raise RecipeError(f"eval_split={r.eval_split} with a mixture (datasets=...): name the eval set with "
                          "eval_dataset=... (its split is eval_split), or leave eval_split empty to hold out "
                          "eval_fraction of every source")
    if looks_local(r.model) and not Path(r.model).expanduser().is_dir():
        raise RecipeError(f"model={r.model}: no such directory; give a hub id (org/name), a directory written "
                          "by save_pretrained, or builtin:tiny-llama")
    for key in ("model", "teacher_model"):
        name = getattr(r, key)
        if name.startswith(BUILTIN_PREFIX) and name[len(BUILTIN_PREFIX):] not in BUILTIN_MODELS:
            raise RecipeError(f"{key}={name}: unknown builtin; available: "
                              + ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_MODELS))
    return recipe


# The largest finite float32 (torch.finfo(torch.float32).max) and its smallest normal number (.tiny):
# the master weights and Adam's moments are float32 (bf16 has the same exponent range).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


def _check_optimizer(r: Recipe) -> None:
    """AdamW's hyper-parameters where its first update is finite. Adam divides the first moment by
    sqrt(second moment) + adam_eps: with adam_eps 0 (or below float32's range, where it rounds to 0)
    a weight whose gradient is 0 gets 0/0 = NaN while the loss and gradient norm stay finite. A beta
    of 1 divides by its bias correction 1 - beta^t = 0. The first update moves a weight by up to
    lr / (1 - adam_beta1) (the bias-corrected step size) and weight decay scales it by lr x
    weight_decay: both must be finite in float32."""
    if r.adam_eps < FLOAT32_TINY:
        raise RecipeError(f"adam_eps={r.adam_eps}: must be > 0 (at least {FLOAT32_TINY:.3g}, float32's smallest "
                          "normal number): Adam divides by sqrt(v) + adam_eps, and a weight whose gradient is 0 "
                          "would become 0/0 = NaN; the usual value is 1e-8")
    for key in ("adam_beta1", "adam_beta2"):
        if getattr(r, key) >= 1.0:
            raise RecipeError(f"{key}={getattr(r, key)}: must be >= 0 and < 1 (Adam divides by 1 - {key}^step, "
                              "which is 0 at 1); the usual values are adam_beta1=0.9, adam_beta2=0.999")
    step = max(r.lr / (1.0 - r.adam_beta1), r.lr * r.weight_decay)
    if step >= FLOAT32_MAX:
        raise RecipeError(f"lr={r.lr} with adam_beta1={r.adam_beta1} and weight_decay={r.weight_decay}: the first "
                          f"update would move a weight by up to max(lr / (1 - adam_beta1), lr x weight_decay) = "
                          f"{step:.3g}, beyond float32's largest number ({FLOAT32_MAX:.3g}); lower lr (fine-tunes "
                          "use 1e-6 to 1e-3)")


def padding_free_scores(recipe: Recipe) -> bool:
    """Whether the attention scores cover one row of all the micro-batch's tokens: padding_free=true
    under sdpa/eager, a block-diagonal mask over the whole row (the planner's one_row,
    memory.activation_bytes; the loop warns where that costs more than padding). flash_attention_2
    attends per example (varlen): the sum of its examples' squared lengths is at most B*T^2, the padded
    bound, which then holds."""
    return recipe.padding_free and recipe.attn_implementation != "flash_attention_2"


def _check_sequence_parallel(r: Recipe, strategy) -> None:
    """What Ulysses sequence parallelism (finetune/sequence_parallel.py) can take. That N divides the
    processes is plan.make_plan's check, that it divides the heads the loop's, from the model's config."""
    problem = strategy.tiled_mlp_problem(r)
    if problem:
        raise RecipeError(problem)
    if r.context_parallel > 1:
        raise RecipeError(f"context_parallel={r.context_parallel}: ring-attention context parallelism (torch's "
                          "context_parallel, GPUs only: it has no CPU path) is not available in finetune yet; use "
                          f"sequence_parallel={r.context_parallel} (Ulysses, every strategy, CPU and GPU)")
    n = r.sequence_parallel
    if n == 1:
        return
    if r.attn_implementation == "eager":
        raise RecipeError(f"sequence_parallel={n} with attn_implementation=eager: Ulysses attention needs a kernel "
                          "that is causal without a 4D mask (DeepSpeed refuses eager); use attn_implementation=sdpa "
                          "(or flash_attention_2 on GPUs)")
    refuse_switched_on(r, ("packing", "padding_free"), f"sequence_parallel={n}",
                       "Ulysses attention is causal over the whole gathered row and drops the mask that keeps a "
                       "row's examples apart, so they would attend to one another",
                       after=" (padded rows, one example each)")
    if r.compile:
        raise RecipeError(f"compile=true with sequence_parallel={n}: compiled layers around Ulysses' all-to-all "
                          "were not tried; set compile=false")


def _check_source(key: str, source: str) -> None:
    if not source:
        raise RecipeError(f"{key} is empty; give a hub id, a local json/jsonl/parquet/csv file or directory")
    if source.startswith(BUILTIN_PREFIX):
        if source[len(BUILTIN_PREFIX):] not in BUILTIN_DATASETS:
            raise RecipeError(f"{key}={source}: unknown builtin; available: "
                              + ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_DATASETS))
        return
    if looks_local(source):
        p = Path(source).expanduser()
        if not p.exists():
            raise RecipeError(f"{key}={source}: no such file or directory")
        if p.is_file() and not source.lower().endswith(DATA_EXTENSIONS):
            raise RecipeError(f"{key}={source}: unsupported file type; use one of {', '.join(DATA_EXTENSIONS)}")


def chat_template_text(recipe: Recipe) -> str | None:
    """The recipe's chat_template: the template itself (it holds Jinja tags), or a file with it (a
    .jinja/.txt file, or a .json such as tokenizer_config.json with a "chat_template" key). Cheap, so
    run.py checks it before anything is loaded; model.load_tokenizer applies it."""
    value = recipe.chat_template
    if not value:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise RecipeError(f"chat_template={value}: no such file; give a file holding a Jinja chat template "
                          "(.jinja, or a .json with a chat_template key), or the template text itself")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            text = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise RecipeError(f"chat_template={value}: the JSON file has no string \"chat_template\" key")
    if "{{" not in text and "{%" not in text:
        raise RecipeError(f"chat_template={value}: the file holds no Jinja tags ({{{{ ... }}}} or {{% ... %}}), so "
                          "it is not a chat template")
    return text


def resolve(name: str, overrides: list[str]) -> Recipe:
    return validate(apply_overrides(load_recipe_module(name), overrides))


def describe_fields() -> str:
    lines = []
    for name, f in FIELDS.items():
        meta = f.metadata
        allowed = f" ({'|'.join(map(str, meta['choices']))})" if meta.get("choices") else ""
        help_text = f"  {meta['help']}" if meta.get("help") else ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {name}={default!r}{allowed}{help_text}")
    return "\n".join(lines)


__all__ = ["Recipe", "DataSource", "RecipeError", "resolve", "load_recipe_module", "apply_overrides", "validate",
           "available_recipes", "describe_fields"]
