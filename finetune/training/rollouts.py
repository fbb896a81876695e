"""GRPO's rollout machinery: the prompts a rollout reads and each rank's share, every completion's
sampling seed, the generation itself (generate_completions), the micro-batches the loss reads
(rollout_batch), the rollout's metrics, the record of every completion (rollouts.jsonl), and a rollout as
the state a resumed run reads: in the checkpoint inside it (rollout_state), or recorded after a checkpoint by
a vLLM engine (save_recorded, rollout-cache/K/). The objective that drives them is
finetune/training/objectives/grpo.py; the loss they feed is finetune/rl_losses.py.

What a rollout gives the loop, per micro-batch (rollout_batch builds it):
    input_ids, attention_mask   [rows, length]: prompt then completion, right-padded
    labels                      [rows, length]: the completion's tokens where they count in the loss,
                                IGNORE elsewhere (prompt, padding, a truncated completion when
                                mask_truncated_completions, a tool's answer fed between turns: the
                                tool mask's 0s, finetune/training/agent.py)
    advantages                  [rows] float32 (rl_losses.group_advantages, on the whole global batch)
    real                        [rows] bool: False for a placeholder row keeping ranks in lock-step
    old_logps                   [rows, length] fp32 laid out as the labels (loss.token_logps under
                                no_grad at the rollout): only when num_iterations > 1
    ref_logps                   [rows, length] fp32, the reference's: only when beta > 0"""

from __future__ import annotations

import torch

from finetune import data as D
from finetune.data import IGNORE
from finetune.generation import Sampling, decode_compiled, generate, pad_id_for, stop_ids
from finetune.model import context_length
from finetune.objective_rules.grpo import IN_FLIGHT_ROLLOUT
from finetune.recipe import RecipeError
from finetune.rl_losses import group_advantages, nanstd
from finetune.rewards import weighted_rewards
from finetune.tools import TOOL_METRICS, tool_metrics
from finetune.training.metrics import json_values, log

def rollout_metrics(per_func: torch.Tensor, weights: torch.Tensor, names: list[str], zero_std: torch.Tensor,
                    lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """A step's rollout metrics, on the gathered global batch, under TRL's names: reward (mean, std) in
    all and per function (over the completions it scored), the share of completions in a group of
    equal rewards, completion lengths (mean, min, max, and the share cut at max_completion_len)."""
    out = {}
    per_func = per_func.double()  # as group_advantages: float32 squares of large rewards overflow
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    rewards = weighted_rewards(per_func, weights)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    lengths = lengths.float()
    out["completions/mean_length"] = lengths.mean().item()
    out["completions/min_length"] = lengths.min().item()
    out["completions/max_length"] = lengths.max().item()
    out["completions/clipped_ratio"] = truncated.float().mean().item()
    return out


def real_rows(batch: dict) -> torch.Tensor:
    """Which rows are completions of the step (not placeholders keeping ranks in lock-step)."""
    real = batch.get("real")
    return torch.ones(batch["input_ids"].shape[0], dtype=torch.bool) if real is None else real.bool()


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], stopped: list[bool],
                  advantages: torch.Tensor, pad_id: int, *, mask_truncated: bool = False,
                  real: list[bool] | None = None, masks: list | None = None) -> dict:
    """One micro-batch of the rollout as the loss reads it: each row the prompt's tokens then the
    completion's, right-padded; the completion's tokens as labels, none for a truncated completion
    (not stopped) when mask_truncated, none where a completion's tool mask (masks: one list of 0/1 per
    completion, or None) is 0. old_logps / ref_logps are added by the caller (token_logps of this batch
    under no_grad)."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attention[i, :len(p) + len(c)] = 1
        if not (mask_truncated and not stopped[i]):
            trained = torch.tensor(c, dtype=torch.long)
            if masks is not None and masks[i] is not None:
                trained = trained.masked_fill(torch.tensor(masks[i]) == 0, IGNORE)
            labels[i, len(p):len(p) + len(c)] = trained
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
            "advantages": advantages.float(),
            "real": torch.tensor([True] * len(rows) if real is None else real, dtype=torch.bool)}


ROLLOUTS = "rollouts.jsonl"
CACHE_DIR = "rollout-cache"


def rollout_metric_names(reward_names: list[str], tools: bool = False) -> tuple[str, ...]:
    per_func = tuple(f"rewards/{n}/{s}" for n in reward_names for s in ("mean", "std"))
    return per_func + ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                       "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                       "rollout_seconds") + (TOOL_METRICS if tools else ())


def model_lengths(tokens: list[list[int]], talk: list) -> torch.Tensor:
    """Each completion's length as TRL counts it: the tokens the model drew (a tool mask's 1s), all of them
    without tools (talk: each completion's conversation record, or None)."""
    return torch.tensor([sum(t["tool_mask"]) if t is not None and t["tool_mask"] is not None else len(ids)
                         for ids, t in zip(tokens, talk)])


def talk_of(parts: list) -> list:
    """The ranks' gathered conversation records (the sixth item of each part), one per completion (None
    without tools)."""
    return [t for p in parts for t in (p[5] if len(p) > 5 and p[5] is not None else [None] * len(p[0]))]


def padded_rows(rows: list[list[float]], shape, fill: float = 0.0) -> torch.Tensor:
    """Saved per-row values (each row's first tokens) back into a [rows, length] fp32 tensor."""
    out = torch.full(shape, fill, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def first_failure(parts: list) -> str | None:
    """The first rank's reward failure (the fourth item of each rank's gathered part), or None."""
    return next((p[3] for p in parts if p[3] is not None), None)


def joined(parts: list, functions: int) -> tuple[list, list, torch.Tensor]:
    """The ranks' gathered parts ((tokens, stopped, [completions, functions] rewards, failure) per rank)
    joined in their order: every completion's tokens, whether it stopped, and the rewards as one
    [completions, functions] tensor."""
    tokens = [t for p in parts for t in p[0]]
    stopped = [s for p in parts for s in p[1]]
    rewards = torch.tensor([v for p in parts for v in p[2]], dtype=torch.float32).view(len(tokens), functions)
    return tokens, stopped, rewards


def eval_metrics(batches: list[list], weights: torch.Tensor, names: list[str], g: int,
                 scale_rewards: str = "group") -> dict:
    """An eval's metrics (rollout_metrics' but the rollout's seconds) from its batches, each the ranks'
    gathered parts in rank order ((tokens, stopped, [completions, functions] rewards, failure) per rank):
    the completions in their global order (batch, then rank: each rank's share is contiguous), so the
    values do not depend on how many ranks generated them."""
    parts = [p for batch in batches for p in batch]
    tokens, stopped, per_func = joined(parts, len(names))
    talk = talk_of(parts)
    _, zero_std = group_advantages(per_func, weights, g, scale_rewards)
    return rollout_metrics(per_func, weights, names, zero_std, model_lengths(tokens, talk),
                           ~torch.tensor(stopped, dtype=torch.bool)) | (tool_metrics(talk) if any(talk) else {})


def generate_completions(run, prompts: list[list[int]], seeds: list[int], stop=None, turns=None) -> list:
    """This rank's completions of its prompts (each repeated num_generations times), the weights gathered
    once for the whole batch (a collective: every rank calls it), in eval mode, back to train after. A
    rank without prompts (an eval batch's uneven split) runs one forward of a one-token prompt, its token
    discarded: FSDP2 gathers each module's weights at its first forward, which every rank must join. A
    stop request (stop) ends the generation before its next token, from the second on (the first
    forward is that collective). turns: a multi-turn rollout's conversations (finetune/training/agent.py)."""
    r, model, accelerator = run.recipe, run.model, run.accelerator
    sampling = Sampling(r.max_completion_len, r.temperature, r.top_p, r.top_k)
    idle = not prompts
    if idle:
        prompts, seeds, sampling, turns = [[pad_id_for(run.tokenizer)]], None, Sampling(1), None
    was_training = model.training
    asked = []  # should_stop's calls: none before the first token

    def should_stop() -> bool:
        asked.append(True)
        return stop is not None and len(asked) > 1 and bool(stop.requested)

    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"), \
                run.parallel.strategy.whole_weights(accelerator, model) as whole:
            out = generate(whole, prompts, sampling, stop_ids=stop_ids(run.tokenizer, whole, run.generation_config),
                           pad_id=pad_id_for(run.tokenizer), context=context_length(whole.config),
                           seeds=seeds if sampling.temperature > 0 else None, should_stop=should_stop,
                           vocab_size=len(run.tokenizer), compiled=decode_compiled(r.generation_compile, accelerator.device),
                           turns=turns)
            return [] if idle else out
    finally:
        model.train(was_training)


def undecodable(tokens: list[list[int]], vocab: int) -> tuple[int, int]:
    """(completions holding ids the tokenizer has no token for, how many such ids): ids of the output
    layer's rows past len(tokenizer) (a vocabulary padded to a multiple), which decode to nothing."""
    counts = undecodable_counts(tokens, vocab)
    return sum(c > 0 for c in counts), sum(counts)


def undecodable_counts(tokens: list[list[int]], vocab: int) -> list[int]:
    """Each completion's ids past the tokenizer's `vocab` tokens."""
    return [sum(t >= vocab for t in ids) for ids in tokens]


def warn_undecodable(step: int, tokens: list[list[int]], vocab: int, warned: bool) -> bool:
    """One line, the first time a rollout holds ids the tokenizer cannot decode: the reward functions
    see those completions shorter than the model wrote them (an empty text where all ids are such).
    Whether that line has been written now."""
    completions, ids = undecodable(tokens, vocab)
    if completions and not warned:
        log.warning(f"step {step}: {completions} of {len(tokens)} completions hold {ids} token ids past the "
                    f"tokenizer's {vocab} tokens, which decode to nothing (the reward functions see the text "
                    "without them); rollouts.jsonl counts them per completion (undecodable_ids), the run summary "
                    "in all")
    return warned or bool(completions)


def rollouts_summary(path) -> dict:
    """The run summary's count of completions whose ids the tokenizer could not decode (rollouts.jsonl,
    the run's history, resumed attempts included): {} where there were none."""
    import json
    from pathlib import Path

    completions = ids = total = 0
    if Path(path).is_file():
        with open(path) as f:
            for line in f:
                total += 1
                if '"undecodable_ids": 0,' in line:  # the usual case, without parsing the line
                    continue
                try:
                    n = json.loads(line).get("undecodable_ids") or 0
                except ValueError:  # a torn last line
                    continue
                completions, ids = completions + (n > 0), ids + n
    return {"undecodable_completions": completions, "undecodable_ids": ids, "completions": total} if ids else {}


def write_rollouts(path, step: int, rollout: int, rows: list[int], ds, g: int, tokens, texts, stopped,
                   names: list[str], per_func: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor,
                   vocab: int | None = None, version: int = 0, talk: list | None = None):
    """One line per completion: the step that generated it, its rollout and the policy version (the optimizer
    steps the weights that generated it had taken), its prompt (dataset row and value), the
    row's other columns as the reward functions received them (`answer`, ...), its text and token ids,
    how many of those ids the tokenizer cannot decode (past its `vocab` tokens), whether it stopped, each
    function's reward (None: not scored), the weighted reward and the advantage; with tools (talk: each
    completion's conversation record) every turn (what the model wrote, the calls read from it, each
    tool's answer and error) and the tool mask (1: a token the model drew, 0: one it was fed)."""
    import json

    data = ds[rows]
    prompts = data["prompt"]
    columns = [c for c in ds.column_names if c not in ("prompt", *D.PROMPT_COLUMNS)]
    undecodable_ids = undecodable_counts(tokens, vocab) if vocab else [0] * len(tokens)

    def number(x):
        return json_values(float(x))  # None for NaN (not scored), as metrics.jsonl writes it

    lines = "".join(json.dumps({"step": step, "rollout": rollout, "policy_version": version, "row": rows[i // g],
                                "prompt": prompts[i // g],
                                "columns": {c: data[c][i // g] for c in columns},
                                "undecodable_ids": undecodable_ids[i],
                                "completion": text, "completion_ids": t, "stopped": stopped[i],
                                "rewards": {n: number(per_func[i, j]) for j, n in enumerate(names)},
                                "reward": number(rewards[i]), "advantage": float(advantages[i]),
                                **conversation(talk[i] if talk else None)}) + "\n"
                    for i, (t, text) in enumerate(zip(tokens, texts)))
    append_lines(path, step, lines)


def conversation(talk: dict | None) -> dict:
    """A completion's turns and tool mask for its rollouts.jsonl line ({} without tools)."""
    return {} if talk is None else {"turns": talk["turns"], "tool_mask": talk["tool_mask"]}


def append_lines(path, step: int, lines: str) -> None:
    """rollouts.jsonl's lines of `step` appended; a full disk is one line naming the file."""
    try:
        with open(path, "a") as f:
            f.write(lines)
    except OSError as e:  # a full disk: what it left past the last checkpoint is cut on resume (keep_rollouts)
        raise RecipeError(f"cannot write {path} at step {step}: {e.strerror or e}; the run stopped before step {step}'s "
                          "update, its last checkpoint is intact: free space there and continue with --resume "
                          "auto") from None


# A rollout kept for a resumed run: the completions, their rewards and advantages, the old log-probs (and a
# vLLM engine's importance weights), gathered from every rank, as tensors and plain data. Inside the
# checkpoint when a checkpoint falls inside the rollout (num_iterations > 1: Objective.in_flight, written
# and checksummed with the checkpoint, finetune/checkpointing/run_state.py); and with a vLLM engine, each
# rollout generated after the newest checkpoint, in output_dir/rollout-cache/K/, sealed with that
# checkpoint's save_id, so that a run resumed from that very checkpoint trains on what its engine had
# generated (and no other run's leftovers are ever read).
SEAL = "seal.json"


def rollout_state(k: int, record: dict) -> tuple[dict, dict]:
    """A rollout's record as (tensors, plain data), for run_state.save_in_flight."""
    from finetune.checkpointing.run_state import ragged

    tensors = {"rewards": record["rewards"], "advantages": record["advantages"]}
    tensors["tokens"], tensors["token_lengths"] = ragged(record["tokens"], torch.int64)
    tensors["old_logps"], tensors["old_logp_lengths"] = ragged(record["old_logps"], torch.float32)
    if record["is_ratio"] is not None:
        tensors["is_ratio"], tensors["is_ratio_lengths"] = ragged(record["is_ratio"], torch.float32)
    data = {"rollout": k, "rows": [int(r) for r in record["rows"]], "stopped": [bool(s) for s in record["stopped"]],
            "values": {name: (None if v is None else float(v)) for name, v in record["values"].items()}}
    if any(t is not None for t in record.get("talk") or ()):  # with tools: each conversation and its tool mask
        data["talk"] = record["talk"]
    return tensors, data


def rollout_record(tensors: dict, data: dict, what: str) -> dict:
    """rollout_state's (tensors, data) back as the record read_rollout takes; a part missing or of another
    shape is one line naming `what`."""
    from finetune.checkpointing.run_state import unragged

    try:
        record = {"rows": list(data["rows"]), "stopped": list(data["stopped"]), "values": dict(data["values"]),
                  "rewards": tensors["rewards"], "advantages": tensors["advantages"],
                  "tokens": unragged(tensors["tokens"], tensors["token_lengths"]),
                  "old_logps": unragged(tensors["old_logps"], tensors["old_logp_lengths"]),
                  "is_ratio": unragged(tensors["is_ratio"], tensors["is_ratio_lengths"]) if "is_ratio" in tensors
                  else None, "talk": list(data["talk"]) if data.get("talk") is not None else None}
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise RecipeError(f"{what} is damaged: its rollout lacks {e} or holds it in another form; nothing was "
                          "loaded; resume from an earlier checkpoint with --resume PATH") from None
    n = len(record["tokens"])
    if not (len(record["stopped"]) == len(record["old_logps"]) == record["rewards"].shape[0]
            == record["advantages"].shape[0] == n) or (record["talk"] is not None and len(record["talk"]) != n):
        raise RecipeError(f"{what} is damaged: its rollout's parts disagree on the number of completions; nothing "
                          "was loaded; resume from an earlier checkpoint with --resume PATH")
    return record


def save_recorded(out, k: int, record: dict, after: str | None, keep: int) -> None:
    """Rollout k, generated by a vLLM engine after the checkpoint whose save_id is `after`, into
    output_dir/rollout-cache/k/ (written aside, sealed, then renamed into place); entries before the last
    `keep` and any of a later rollout (the future of an interrupted run this one replaced) removed."""
    import shutil
    import tempfile
    from pathlib import Path

    from finetune.checkpointing.manifest import seal
    from finetune.checkpointing.run_state import save_in_flight
    from finetune.files import publish

    folder = Path(out) / CACHE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{k}.", suffix=".partial", dir=folder))
    try:
        save_in_flight(tmp, IN_FLIGHT_ROLLOUT, *rollout_state(k, record))
        seal(tmp, SEAL, {"after": after, "rollout": k})
        publish(tmp, folder / str(k))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in folder.iterdir():
        if old.name.isdigit() and (int(old.name) <= k - keep or int(old.name) > k):
            shutil.rmtree(old, ignore_errors=True)


def load_recorded(out, k: int, after: str | None) -> dict | None:
    """Rollout k as save_recorded wrote it after the checkpoint whose save_id is `after`; None where there is
    none, or it was recorded after another checkpoint (another run's, or this run's line before a resume
    from elsewhere), which is never read. One damaged is one line."""
    import json
    from pathlib import Path

    from finetune.checkpointing.manifest import seal_problem
    from finetune.checkpointing.run_state import load_in_flight

    entry = Path(out) / CACHE_DIR / str(k)
    if after is None or not (entry / SEAL).is_file():
        return None
    try:
        listing = json.loads((entry / SEAL).read_text())
    except (OSError, ValueError):
        listing = None
    if isinstance(listing, dict) and (listing.get("after") != after or listing.get("rollout") != k):
        return None
    what = f"{entry} (rollout {k}, generated by the engine after the checkpoint resumed from)"
    problem = seal_problem(entry, SEAL, {"after": after, "rollout": k})
    if problem:
        raise RecipeError(f"{what} is damaged: {problem}; nothing was loaded; remove {entry} to generate the "
                          "rollout again, or resume from an earlier checkpoint")
    return rollout_record(*load_in_flight(entry, IN_FLIGHT_ROLLOUT, listing, what, SEAL), what)


# ---------------------------------------------------------------- the rollout phase
#
# Each rollout serves num_iterations optimizer steps: steps k*n .. k*n + n - 1 (0-based, n =
# num_iterations) train on rollout k, generated at step k*n with the policy as it was then (TRL's
# num_iterations: the same generations reused; its old log-probs are that policy's). Rollout k's prompts
# are the k-th global batch of prompts of the prompt schedule (finetune/data/batches.py BatchSchedule over
# the prompt rows, one "micro-batch" of all the step's prompts), split into contiguous equal shares, one
# per data-parallel rank: every prompt's whole group on one rank. Completion j of the prompt at dataset row
# i in rollout k samples with its own seed completion_seed(seed, k, i, j), which keys the noise of its every
# token (finetune/generation.py next_tokens), so the tokens do not depend on the process count nor on the
# other sequences in the batch, and a resumed run samples what the uninterrupted one did.


def completion_seed(seed: int, rollout: int, row: int, completion: int, batch: int = 0) -> int:
    """A completion's sampling seed: a stable 63-bit hash of (recipe seed, rollout index, the prompt's
    dataset row, the completion's index in its group, and for dynamic sampling's further generation batches
    their index); not Python's hash(), which varies per process."""
    import hashlib

    key = f"grpo:{seed}:{rollout}:{row}:{completion}" if not batch else f"grpo:{seed}:{rollout}:{batch}:{row}:{completion}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---------------------------------------------------------------- dynamic sampling (DAPO)
#
# dynamic_sampling=true: a group whose rewards are all equal (std 0, or none scored) has every advantage 0
# and trains on nothing; it is dropped, and rollout k samples more prompts until the step's
# global_batch_size groups have a learning signal or max_generation_batches batches were generated.
# Generation batch 0 is the prompt schedule's (as without dynamic sampling); batch b > 0 reads the k-th
# batch of its own prompt schedule (refill_schedule: the rows permuted with a seed of (seed, b)), its
# completions seeded with b too (completion_seed), so that what a rollout samples depends on nothing
# but (seed, k) and the policy: the same on any process count and after a resume (a kill in the middle
# of refilling re-runs the rollout from its start, from the checkpoint's weights).


# the rollout's metrics under dynamic sampling: generation batches sampled, groups dropped (rewards all equal),
# and how many of the batch's groups have no signal all the same (max_generation_batches reached)
DYNAMIC_METRICS = ("dynamic_sampling/generation_batches", "dynamic_sampling/dropped_groups",
                   "dynamic_sampling/short_groups")


def refill_schedule(num_rows: int, prompts_per_step: int, seed: int, batch: int):
    """Dynamic sampling's prompt schedule for the further generation batch `batch` (>= 1) of every rollout."""
    import hashlib

    digest = hashlib.blake2b(f"grpo-refill:{seed}:{batch}".encode(), digest_size=4).digest()
    return prompt_schedule(num_rows, prompts_per_step, int.from_bytes(digest, "little"))


def signal_groups(per_func: torch.Tensor, weights: torch.Tensor, g: int) -> torch.Tensor:
    """Which groups of g adjacent completions have a learning signal: weighted rewards not all equal (two or
    more scored, std above 0, as frac_reward_zero_std counts them)."""
    rewards = weighted_rewards(per_func.double(), weights).view(-1, g)
    std = nanstd(rewards, dim=1)
    return ~(torch.isnan(std) | torch.isclose(std, torch.zeros_like(std)))


def fill_groups(batches: list[tuple[list[int], list, list, torch.Tensor, list]], wanted: int,
                weights: torch.Tensor, g: int) -> tuple[list[int], list, list, torch.Tensor, list, int, list[tuple[int, int]]]:
    """Dynamic sampling's batch from its generation batches (each: its prompt rows, every completion's
    tokens, whether each stopped, [completions, functions] rewards, conversation records; the whole batch,
    every rank's in order): the first `wanted` groups with a learning signal in generation order; when
    fewer were found, dropped groups (advantage 0: they train on nothing) in generation order after them.
    Returns the rows, tokens, stopped, rewards, conversation records of the batch, how many of its groups
    have a signal, and the (batch, group) of every dropped group that is not in it."""
    kept, dropped = [], []
    for b, (rows, tokens, stopped, rewards, _) in enumerate(batches):
        signal = signal_groups(rewards, weights, g).tolist()
        for i, row in enumerate(rows):
            (kept if signal[i] else dropped).append((b, i))
    chosen = kept[:wanted]
    found = len(chosen)
    chosen += dropped[:wanted - found]
    out_rows, out_tokens, out_stopped, out_rewards, out_talk = [], [], [], [], []
    for b, i in chosen:
        rows, tokens, stopped, rewards, talk = batches[b]
        out_rows.append(rows[i])
        out_tokens += tokens[i * g:(i + 1) * g]
        out_stopped += stopped[i * g:(i + 1) * g]
        out_rewards.append(rewards[i * g:(i + 1) * g])
        out_talk += talk[i * g:(i + 1) * g]
    left_out = [d for d in dropped if d not in chosen]
    return out_rows, out_tokens, out_stopped, torch.cat(out_rewards), out_talk, found, left_out


def write_dropped(path, step: int, rollout: int, batches: list, dropped: list[tuple[int, int]], ds, g: int,
                  names: list[str], weights: torch.Tensor) -> None:
    """One line per group dynamic sampling dropped (its rewards all equal): the step, rollout, policy version
    (the weights of step - 1 updates generated it), generation batch, dataset row and prompt, and the group's
    rewards (weighted, per completion)."""
    import json

    if not dropped:
        return
    rows = [batches[b][0][i] for b, i in dropped]
    prompts = ds[rows]["prompt"]
    lines = []
    for (b, i), row, prompt in zip(dropped, rows, prompts):
        rewards = weighted_rewards(batches[b][3][i * g:(i + 1) * g].double(), weights)
        lines.append(json.dumps({"step": step, "rollout": rollout, "policy_version": step - 1, "row": row,
                                 "prompt": prompt, "dropped": True,
                                 "generation_batch": b, "rewards": [json_values(float(x)) for x in rewards]}) + "\n")
    append_lines(path, step, "".join(lines))


def eval_seed(seed: int, row: int, completion: int) -> int:
    """An eval completion's sampling seed: completion j of eval row i, the same at every eval (a stable
    63-bit hash as completion_seed's, apart from the training rollouts' seeds)."""
    import hashlib

    digest = hashlib.blake2b(f"grpo-eval:{seed}:{row}:{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eval_prompt_batches(count: int, size: int) -> list[list[int]]:
    """The eval rows 0..count-1 in batches of `size` prompts (the last may be smaller)."""
    return [list(range(a, min(a + size, count))) for a in range(0, count, size)]


def eval_share(rows: list[int], rank: int, ranks: int) -> list[int]:
    """This rank's contiguous share of an eval batch: the first len(rows) % ranks ranks one row more (a
    rank may get none; it joins the generation's collective all the same)."""
    q, extra = divmod(len(rows), ranks)
    start = rank * q + min(rank, extra)
    return rows[start:start + q + (rank < extra)]


def rank_prompts(prompts: list[int], rank: int, ranks: int) -> list[int]:
    """This data-parallel rank's contiguous share of a step's prompts (len(prompts) divisible by ranks)."""
    if len(prompts) % ranks:
        raise ValueError(f"{len(prompts)} prompts do not split over {ranks} ranks")
    share = len(prompts) // ranks
    return prompts[rank * share:(rank + 1) * share]


def prompt_schedule(num_rows: int, prompts_per_step: int, seed: int):
    """The prompt rows each rollout reads: a BatchSchedule whose one micro-batch is the step's prompts."""
    return D.BatchSchedule(num_rows, prompts_per_step, 1, 1, seed)


def read_rollouts(path) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def kept_length(lines, step: int) -> int:
    """How many bytes at the start of rollouts.jsonl (`lines`: the file opened in binary) hold the records
    of steps up to `step`: the lines up to the first one of a later step, or the first one that is not
    a whole record line (a write cut short by a kill or a full disk). Each line is read only as far as
    its step ({"step": N, ... as write_rollouts starts it); nothing past the cut is parsed."""
    import re

    head = re.compile(rb'\{"step": (\d+), .*\}\n\Z', re.DOTALL)
    end = 0
    for line in lines:
        match = head.match(line)
        if match is None or int(match.group(1)) > step:
            break
        end += len(line)
    return end


def keep_rollouts(path, step: int) -> None:
    """rollouts.jsonl cut to the records of steps up to `step` (a resumed run writes the rest again), or
    removed (step 0: a fresh run)."""
    import os
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    with path.open("rb") as lines:
        end = kept_length(lines, step)
    if end < path.stat().st_size:
        os.truncate(path, end)
