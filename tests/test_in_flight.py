"""Work in flight in a checkpoint (finetune/checkpointing/run_state.py: save_in_flight / load_in_flight), GRPO's
rollout as that state (training/rollouts.py: rollout_state / rollout_record), and a vLLM engine's rollouts
recorded after a checkpoint, sealed with its save_id (save_recorded / load_recorded): exact round trips,
and everything else one line, nothing unpickled, nothing another run left ever read."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from finetune.checkpointing.layout import MANIFEST
from finetune.checkpointing.manifest import file_checksums, seal
from finetune.checkpointing.run_state import (IN_FLIGHT_DIR, check_in_flight, load_in_flight, ragged, save_in_flight,
                                              unragged)
from finetune.recipe import RecipeError
from finetune.training.rollouts import (CACHE_DIR, IN_FLIGHT_ROLLOUT, load_recorded, rollout_record, rollout_state,
                                        save_recorded)
from test_checkpoint_files import RunsCode


def rollout(seed: int = 0, ratios: bool = False, tools: bool = False) -> dict:
    """A rollout's record as GRPO keeps it: 3 completions (one empty), 2 reward functions, old log-probs
    per row (fp32 values as Python floats, as .tolist() gives them); with tools, each completion's
    conversation record (finetune/training/agent.py: turns, tool mask, counts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (5, 7, 4)
    rows = lambda: [torch.randn(n, generator=g).tolist() for n in lengths]  # noqa: E731
    return {"values": {"reward": 0.25, "reward_std": float("nan"), "rollout_seconds": 1.5},
            "old_logps": rows(), "is_ratio": rows() if ratios else None, "rows": [11, 3],
            "tokens": [[5, 6, 7], [8], []], "stopped": [True, False, True],
            "rewards": torch.tensor([[1.0, float("nan")], [0.0, 2.0], [0.5, 0.5]]),
            "advantages": torch.randn(3, generator=g),
            "talk": [{"turns": [{"role": "assistant", "content": "", "tool_calls": [{"name": "mul", "arguments":
                                                                                   {"a": 3, "b": 4}}]},
                                {"role": "tool", "name": "mul", "content": "12", "error": None}],
                      "tool_mask": [1, 0, 1], "calls": 1, "failures": 0, "timeouts": 0, "unparsed": 0,
                      "assistant_turns": 1}, None,
                     {"turns": [], "tool_mask": [], "calls": 0, "failures": 0, "timeouts": 0, "unparsed": 1,
                      "assistant_turns": 0}] if tools else None}


def same(a: dict, b: dict) -> bool:
    tensors = all(torch.equal(a[k], b[k]) for k in ("advantages",)) and torch.equal(
        a["rewards"].nan_to_num(-9), b["rewards"].nan_to_num(-9))
    values = json.dumps(a["values"]) == json.dumps(b["values"])  # NaN as NaN
    return tensors and values and all(a[k] == b[k] for k in ("old_logps", "is_ratio", "rows", "tokens", "stopped",
                                                             "talk"))


def checkpoint_with(tmp_path: Path, record: dict, k: int = 1) -> tuple[Path, dict]:
    ckpt = tmp_path / "step_000000003"
    ckpt.mkdir(parents=True)
    (ckpt / "loop_state.json").write_text('{"step": 3}')
    save_in_flight(ckpt, IN_FLIGHT_ROLLOUT, *rollout_state(k, record))
    return ckpt, seal(ckpt, MANIFEST, {"step": 3})


@pytest.mark.parametrize("ratios,tools", [(False, False), (True, False), (False, True)])
def test_a_rollout_round_trips_exactly_through_a_checkpoint(tmp_path, ratios, tools):
    """Every value a resumed step trains on comes back as it was: the tokens, the fp32 old log-probs and
    importance weights (as the same Python floats), the rewards with their NaN (not scored), the advantages
    bit for bit, the metrics, with tools each conversation and its tool mask; only safetensors and JSON
    are written."""
    record = rollout(ratios=ratios, tools=tools)
    ckpt, manifest = checkpoint_with(tmp_path, record)
    assert sorted(p.name for p in (ckpt / IN_FLIGHT_DIR).iterdir()) == [f"{IN_FLIGHT_ROLLOUT}.json",
                                                                         f"{IN_FLIGHT_ROLLOUT}.safetensors"]
    tensors, data = load_in_flight(ckpt, IN_FLIGHT_ROLLOUT, manifest, f"checkpoint {ckpt}")
    assert data["rollout"] == 1
    assert same(rollout_record(tensors, data, "x"), record)
    check_in_flight(ckpt, manifest)  # what a resume asks before anything loads
    assert load_in_flight(ckpt, "other", manifest, "x") is None


def test_ragged_rows_keep_fp32_values_exactly():
    rows = [torch.randn(n).tolist() for n in (0, 3, 9)]
    flat, lengths = ragged(rows, torch.float32)
    assert flat.dtype == torch.float32 and lengths.tolist() == [0, 3, 9]
    assert unragged(flat, lengths) == rows


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_damaged_or_planted_in_flight_state_is_one_line_and_never_runs(tmp_path):
    """The in-flight files cut to 100 bytes (its size no longer the manifest's), a pickle payload in their
    place with the manifest made to match (as an attacker could), a file put there after the save: each is
    one line naming the file, and the payload never runs."""
    record = rollout()
    marker = tmp_path / "code-ran"
    ckpt, manifest = checkpoint_with(tmp_path / "a", record)
    weights = ckpt / IN_FLIGHT_DIR / f"{IN_FLIGHT_ROLLOUT}.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RecipeError) as e:
        check_in_flight(ckpt, manifest)
    assert f"checkpoint {ckpt} is damaged: {IN_FLIGHT_DIR}/{IN_FLIGHT_ROLLOUT}.safetensors does not match its " \
           f"{MANIFEST} (size)" in one_line(e)

    for name in (f"{IN_FLIGHT_ROLLOUT}.safetensors", f"{IN_FLIGHT_ROLLOUT}.json"):
        ckpt, _ = checkpoint_with(tmp_path / name, record)
        (ckpt / IN_FLIGHT_DIR / name).write_bytes(pickle.dumps(RunsCode(marker)))
        (ckpt / MANIFEST).unlink()
        manifest = seal(ckpt, MANIFEST, {"step": 3})  # consistent: the reader, not the checksum, refuses it
        with pytest.raises(RecipeError) as e:
            check_in_flight(ckpt, manifest)
        kind = "is not a safetensors file" if name.endswith("safetensors") else "is not plain JSON"
        assert f"is damaged: {IN_FLIGHT_DIR}/{name} {kind}" in one_line(e)
    assert not marker.exists(), "a planted in-flight file ran code"

    ckpt, manifest = checkpoint_with(tmp_path / "planted", record)
    shutil.copy(ckpt / IN_FLIGHT_DIR / f"{IN_FLIGHT_ROLLOUT}.json", ckpt / IN_FLIGHT_DIR / "extra.json")
    with pytest.raises(RecipeError) as e:
        check_in_flight(ckpt, manifest)
    assert f"{IN_FLIGHT_DIR}/extra.json is not in its {MANIFEST} (put there after the save)" in one_line(e)
    (ckpt / IN_FLIGHT_DIR / "extra.json").rename(ckpt / IN_FLIGHT_DIR / "extra.pt")
    with pytest.raises(RecipeError) as e:
        check_in_flight(ckpt, manifest)
    assert "is not work in flight a save writes" in one_line(e)


def test_a_rollout_of_another_shape_is_one_line(tmp_path):
    tensors, data = rollout_state(1, rollout())
    del tensors["old_logps"]
    with pytest.raises(RecipeError) as e:
        rollout_record(tensors, data, "checkpoint X")
    assert one_line(e).startswith("checkpoint X is damaged: its rollout lacks 'old_logps'")
    tensors, data = rollout_state(1, rollout())
    data["stopped"] = data["stopped"][:2]
    with pytest.raises(RecipeError, match="disagree on the number of completions"):
        rollout_record(tensors, data, "checkpoint X")


def test_recorded_rollouts_are_read_only_after_the_checkpoint_they_name(tmp_path):
    """A vLLM engine's rollout recorded after checkpoint A is read by a run resumed from A, and by no other:
    another run's (or another line's) leftovers are never read, an old-format pickle never unpickled; an
    entry cut short is one line; writing rollout k removes entries past it (a replaced future) and before
    the last `keep`."""
    record, marker = rollout(ratios=True), tmp_path / "code-ran"
    out = tmp_path / "run"
    save_recorded(out, 3, record, after="save-a", keep=2)
    assert same(load_recorded(out, 3, "save-a"), record)
    assert load_recorded(out, 3, "save-b") is None and load_recorded(out, 3, None) is None
    assert load_recorded(out, 4, "save-a") is None
    (out / CACHE_DIR / "4.pt").write_bytes(pickle.dumps(RunsCode(marker)))  # what an older finetune read
    assert load_recorded(out, 4, "save-a") is None and not marker.exists()

    for k in (4, 5, 6):
        save_recorded(out, k, record, after="save-a", keep=2)
    assert sorted(p.name for p in (out / CACHE_DIR).iterdir() if not p.name.endswith(".pt")) == ["5", "6"]
    save_recorded(out, 4, record, after="save-a", keep=2)  # a resumed run regenerating rollout 4
    assert sorted(p.name for p in (out / CACHE_DIR).iterdir() if not p.name.endswith(".pt")) == ["4"]
    assert not [p for p in (out / CACHE_DIR).iterdir() if p.name.startswith(".")], "no staging left behind"

    entry = out / CACHE_DIR / "4" / IN_FLIGHT_DIR / f"{IN_FLIGHT_ROLLOUT}.safetensors"
    entry.write_bytes(entry.read_bytes()[:100])
    with pytest.raises(RecipeError) as e:
        load_recorded(out, 4, "save-a")
    assert f"{out / CACHE_DIR / '4'} (rollout 4, generated by the engine after the checkpoint resumed from) is " \
           "damaged" in one_line(e) and f"remove {out / CACHE_DIR / '4'} to generate the rollout again" in str(e.value)
    assert load_recorded(out, 4, "save-b") is None, "another checkpoint's entry, damaged or not, is not read"


def test_the_checksum_names_a_changed_in_flight_file(tmp_path):
    """A same-size change (a flipped byte in the tokens) is found by the manifest's checksum."""
    ckpt, manifest = checkpoint_with(tmp_path, rollout())
    f = ckpt / IN_FLIGHT_DIR / f"{IN_FLIGHT_ROLLOUT}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    assert file_checksums(ckpt, [str(f.relative_to(ckpt))]) != manifest["checksums"]
    with pytest.raises(RecipeError, match=r"does not match its manifest.json \(xxh3_128\)"):
        load_in_flight(ckpt, IN_FLIGHT_ROLLOUT, manifest, f"checkpoint {ckpt}")
