"""async_save's snapshot (finetune/checkpointing/snapshot.py): a deferred torch.save, safetensors
save_file or DCP save writes the bytes the direct call writes, from a copy taken at the call, so
that what training changes afterwards is not what the checkpoint holds. No launch."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file

from finetune.checkpointing.snapshot import Snapshotter, copy_tensors


def state():
    """What a save serialises, with what makes torch.save's bytes depend on more than the values:
    views of one storage (an offset, a stride), a Parameter, a tensor met twice, an int tensor, an
    empty one, a tensor that requires grad, OrderedDict and nested containers, a Python number."""
    flat = torch.randn(64)
    w = torch.nn.Parameter(torch.randn(4, 3))
    shared = torch.arange(10, dtype=torch.int64)
    return OrderedDict(
        a=flat[8:24].view(4, 4), b=flat[1::3], whole=flat, w=w, again=w, ints=shared, ints_view=shared[2:5],
        empty=torch.empty(0, 5), grad=torch.ones(3, requires_grad=True),
        nested={"groups": [{"lr": 1e-3, "params": [0, 1]}], "step": torch.tensor(7.0), "same": shared},
        count=12)


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def mutate(obj):
    """What the next optimizer step does: every tensor changed in place."""
    with torch.no_grad():
        for t in tensors_of(obj):
            if t.numel():
                t.add_(1) if t.dtype.is_floating_point else t.mul_(3)


def deferred(directory, save):
    """save() inside the staging block: returns the snapshotter's jobs, not yet written."""
    snap = Snapshotter()
    with snap.deferring(directory):
        save()
    return snap.take()


def test_a_deferred_torch_save_writes_torch_saves_bytes(tmp_path):
    obj = state()
    (tmp_path / "direct").mkdir()
    (tmp_path / "stage").mkdir()
    torch.save(obj, tmp_path / "direct" / "optimizer.bin")
    jobs = deferred(tmp_path / "stage", lambda: torch.save(obj, tmp_path / "stage" / "optimizer.bin"))
    assert len(jobs) == 1 and not (tmp_path / "stage" / "optimizer.bin").exists(), "written later, not now"
    jobs[0].write(jobs[0].path, None)
    assert (tmp_path / "stage" / "optimizer.bin").read_bytes() == (tmp_path / "direct" / "optimizer.bin").read_bytes()
    distinct = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors_of(obj)}
    assert jobs[0].nbytes == sum(distinct.values())


def test_this_torch_defers_torch_save():
    """The installed torch passes the self-check, so the fast path is the one the suite runs (a check that
    failed here would silently make every async save serialise while the loop waits)."""
    from finetune.checkpointing import snapshot

    snapshot._DEFERRABLE.clear()
    assert snapshot.torch_save_is_deferrable()


def test_a_torch_whose_internals_changed_serialises_at_the_call_with_the_same_bytes(tmp_path, monkeypatch):
    """Another torch (torch.serialization._save called differently, as a release may change it): the
    self-check fails, one warning says so, and torch.save runs at the call into the staging directory:
    the same file, written while the loop waits."""
    from finetune.checkpointing import snapshot

    original = torch.serialization._save

    def changed_save(obj, zip_file, *args, **kwargs):
        """A torch whose writer interface moved on: torch.save itself still works; a stand-in writer
        offering the old interface (the snapshot's recorder) does not."""
        if not isinstance(zip_file, torch._C.PyTorchFileWriter):
            zip_file.write_record_v2("data.pkl", b"", 0)
        return original(obj, zip_file, *args, **kwargs)

    monkeypatch.setattr(torch.serialization, "_save", changed_save)
    monkeypatch.setattr(snapshot, "_DEFERRABLE", {})
    obj = state()
    (tmp_path / "stage").mkdir()
    (tmp_path / "direct").mkdir()
    with pytest.warns(UserWarning, match="serialisation internals are not what finetune's snapshot defers"):
        jobs = deferred(tmp_path / "stage", lambda: torch.save(obj, tmp_path / "stage" / "optimizer.bin"))
    assert jobs == [] and (tmp_path / "stage" / "optimizer.bin").exists(), "written at the call, not deferred"
    monkeypatch.undo()
    torch.save(obj, tmp_path / "direct" / "optimizer.bin")
    assert (tmp_path / "stage" / "optimizer.bin").read_bytes() == (tmp_path / "direct" / "optimizer.bin").read_bytes()


def test_a_tensor_changed_after_the_snapshot_is_written_as_it_was(tmp_path):
    obj = state()
    (tmp_path / "stage").mkdir()
    (tmp_path / "before").mkdir()
    torch.save(obj, tmp_path / "before" / "optimizer.bin")
    jobs = deferred(tmp_path / "stage", lambda: torch.save(obj, tmp_path / "stage" / "optimizer.bin"))
    mutate(obj)
    jobs[0].write(jobs[0].path, None)
    assert (tmp_path / "stage" / "optimizer.bin").read_bytes() == (tmp_path / "before" / "optimizer.bin").read_bytes()
    loaded = torch.load(tmp_path / "stage" / "optimizer.bin", weights_only=True)
    assert loaded["a"].data_ptr() != 0 and torch.equal(loaded["nested"]["step"], torch.tensor(7.0))


def test_a_save_outside_the_staging_directory_is_not_deferred(tmp_path):
    (tmp_path / "stage").mkdir()
    jobs = deferred(tmp_path / "stage", lambda: torch.save({"x": torch.ones(2)}, tmp_path / "elsewhere.bin"))
    assert jobs == [] and (tmp_path / "elsewhere.bin").is_file()
    assert torch.save.__module__ == "torch.serialization", "the patch is undone after the block"


def test_a_deferred_safetensors_file_is_the_same_and_taken_at_the_call(tmp_path):
    base = torch.randn(6, 8)
    tensors = {"model.embed": base, "model.norm": torch.randn(8).to(torch.bfloat16), "lm_head": torch.randn(3, 8)}
    (tmp_path / "stage").mkdir()
    save_file(tensors, str(tmp_path / "direct.safetensors"), metadata={"format": "pt"})
    import accelerate.utils.other as other

    jobs = deferred(tmp_path / "stage", lambda: other.safe_save_file(
        tensors, str(tmp_path / "stage" / "model.safetensors"), metadata={"format": "pt"}))
    mutate(tensors)
    jobs[0].write(jobs[0].path, None)
    assert (tmp_path / "stage" / "model.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()


def test_safetensors_refusal_of_shared_tensors_comes_at_the_call(tmp_path):
    base = torch.randn(8)
    with pytest.raises(RuntimeError, match="share memory"):
        deferred(tmp_path, lambda: save_file({"a": base, "b": base}, str(tmp_path / "m.safetensors")))


def test_copies_keep_views_sharing_one_storage():
    obj = state()
    out = copy_tensors(obj, pin=False)
    assert out["a"].untyped_storage()._cdata == out["b"].untyped_storage()._cdata == out["whole"].untyped_storage()._cdata
    assert out["a"].untyped_storage()._cdata != obj["a"].untyped_storage()._cdata
    assert (out["b"].storage_offset(), out["b"].stride()) == (obj["b"].storage_offset(), obj["b"].stride())
    assert out["w"] is out["again"] and isinstance(out["w"], torch.nn.Parameter) and out["grad"].requires_grad
    assert out["nested"]["same"].untyped_storage()._cdata == out["ints"].untyped_storage()._cdata
    assert pickle.dumps(out["nested"]["groups"]) == pickle.dumps(obj["nested"]["groups"])
    assert type(out) is OrderedDict and list(out) == list(obj)


def test_a_deferred_dcp_save_writes_the_same_shards(tmp_path):
    import torch.distributed.checkpoint as dcp

    def sd():
        torch.manual_seed(0)
        return {"model": {"w": torch.randn(16, 4), "b": torch.randn(4)[::2], "step": torch.tensor(3)},
                "meta": {"lr": 0.5}}

    direct, staged = tmp_path / "direct", tmp_path / "stage" / "pytorch_model_fsdp_0"
    dcp.save(sd(), storage_writer=dcp.FileSystemWriter(str(direct)))
    obj = sd()
    jobs = deferred(tmp_path / "stage", lambda: dcp.save(obj, storage_writer=dcp.FileSystemWriter(str(staged))))
    assert len(jobs) == 1 and not list(staged.glob("*.distcp"))
    mutate(obj)
    jobs[0].write(jobs[0].path, None)
    shards = sorted(p.name for p in direct.iterdir())
    assert shards == sorted(p.name for p in staged.iterdir()) and any(s.endswith(".distcp") for s in shards)
    for name in shards:
        a, b = (direct / name).read_bytes(), (staged / name).read_bytes()
        if name == ".metadata":  # the directory written to and a random save id (as between any two saves)
            a, b = pickle.loads(a), pickle.loads(b)
            a.storage_meta = b.storage_meta = None
            a, b = pickle.dumps(a), pickle.dumps(b)
        assert a == b, name


def test_the_background_write_serialises_the_snapshot_and_copies_it(tmp_path):
    """The thread runs the deferred serialisations into the staging directory and copies each file
    into the partial checkpoint with its checksum; the files are those of direct calls."""
    from finetune.checkpointing import background as B
    from finetune.checkpointing.checkpoint import first_failure
    from finetune.checkpointing.manifest import file_checksums

    obj, weights = state(), {"w": torch.randn(1 << 20), "b": torch.randn(7)}  # 4 MiB: more than one copy block
    direct, staged, partial = tmp_path / "direct", tmp_path / "stage", tmp_path / "ckpt" / ".step.partial"
    for d in (direct, staged / "sub", partial):
        d.mkdir(parents=True)
    torch.save(obj, direct / "optimizer.bin")
    save_file(weights, str(direct / "model.safetensors"))
    snap = Snapshotter()
    with snap.deferring(staged):
        torch.save(obj, staged / "optimizer.bin")
        save_file(weights, str(staged / "model.safetensors"))
        (staged / "sub" / "loop_state.json").write_text('{"step": 5}\n')  # written now, as before
    mutate(obj)
    mutate(weights)
    w = B.BackgroundWrite(5, "step_000000005", 0, staged, partial, blocking_s=0.1, describe=first_failure,
                          jobs=snap.take())
    w.start()
    assert w.nbytes > (1 << 22) and w.join(60) and w.error is None
    for name in ("optimizer.bin", "model.safetensors"):
        assert (partial / name).read_bytes() == (direct / name).read_bytes(), name
    assert (partial / "sub" / "loop_state.json").read_text() == '{"step": 5}\n'
    assert w.checksums == file_checksums(partial, sorted(w.checksums)) and len(w.checksums) == 3
    assert not staged.exists() and w.jobs == []


def test_a_fault_mid_shard_cuts_the_largest_deferred_file(tmp_path, monkeypatch):
    from finetune.checkpointing import background as B
    from finetune.checkpointing.checkpoint import first_failure

    monkeypatch.setenv("FINETUNE_FAULT", "async_mid_shard:0:5:ENOSPC")
    staged, partial = tmp_path / "stage", tmp_path / "ckpt" / ".step.partial"
    staged.mkdir()
    partial.mkdir(parents=True)
    big = {"m": torch.randn(3 << 20)}  # 12 MiB
    snap = Snapshotter()
    with snap.deferring(staged):
        torch.save({"x": torch.ones(4)}, staged / "scheduler.bin")
        torch.save(big, staged / "optimizer.bin")
    w = B.BackgroundWrite(5, "step_000000005", 0, staged, partial, blocking_s=0.1, describe=first_failure,
                          jobs=snap.take())
    w.start()
    assert w.join(60) and w.error.startswith("the filesystem is full")
    assert 0 < (partial / "optimizer.bin").stat().st_size < (3 << 20) * 4 // 2 + B.BLOCK, "torn halfway"
    assert not staged.exists()


def test_the_next_save_copies_into_the_same_buffers(tmp_path):
    """The host buffers are kept between saves (no new memory, no page faults): the second save of
    the changed state takes the first save's buffers, and writes the changed state's bytes."""
    obj = state()
    snap = Snapshotter()
    for i in range(2):
        (tmp_path / f"direct{i}").mkdir()
        (tmp_path / f"stage{i}").mkdir()
        torch.save(obj, tmp_path / f"direct{i}" / "optimizer.bin")
        with snap.deferring(tmp_path / f"stage{i}"):
            torch.save(obj, tmp_path / f"stage{i}" / "optimizer.bin")
        lent = [id(buf) for _, buf in snap.buffers.lent]
        if i == 0:
            first = lent
        job = snap.take()[0]
        job.write(job.path, None)
        assert (tmp_path / f"stage{i}" / "optimizer.bin").read_bytes() == (tmp_path / f"direct{i}" / "optimizer.bin").read_bytes()
        mutate(obj)
    assert sorted(lent) == sorted(first) and len(first) == len({t.untyped_storage()._cdata for t in tensors_of(obj)
                                                               if t.numel()})


def test_the_finite_check_before_a_save_counts_exactly():
    """nonfinite_count (every save, sync or async, blocks on it): finite sums pass at once; a NaN or
    inf is counted exactly, and finite weights whose sum overflows are not counted."""
    from finetune.optim import nonfinite_count

    def count(*tensors):
        params = [torch.nn.Parameter(t) for t in tensors]
        return int(nonfinite_count(torch.optim.AdamW(params)))

    assert count(torch.randn(100), torch.randn(3, 4)) == 0
    bad = torch.randn(100)
    bad[[3, 50]] = float("nan")
    bad[7] = float("-inf")
    assert count(torch.randn(10), bad, torch.full((4,), float("inf"))) == 7
    assert count(torch.full((10,), 3e38)) == 0, "a sum that overflows is not a NaN in the weights"


def test_the_first_saves_host_memory_is_sized_from_the_state_and_reserved_on_a_thread():
    """On a GPU the first async save's pinned host memory is allocated beside the first steps
    (reserve_pinned), sized from the state's storages (state_storage_sizes): the same code on CPU tensors
    and pageable memory here. Before the optimizer's first step, Adam's two moments per trainable
    parameter; after it, its real states."""
    from finetune.checkpointing.snapshot import reserve_pinned, state_storage_sizes

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False), torch.nn.LayerNorm(10))
    model[2].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    params = [p.numel() * 4 for p in model.parameters()]  # 40, 40, 10 (frozen), 10 (bias)
    before = state_storage_sizes(model, optimizer, device_type="cpu")
    assert sorted(before) == sorted(params + [n for p, n in zip(model.parameters(), params) if p.requires_grad] * 2)
    assert state_storage_sizes(model, optimizer) == []  # no GPU storage here: nothing to pin
    model(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
    after = state_storage_sizes(model, optimizer, device_type="cpu")
    moments = [n for p, n in zip(model.parameters(), params) if p.requires_grad] * 2
    steps = [4] * 3  # AdamW's step counters (0-d fp32 tensors)
    assert sorted(after) == sorted(params + moments + steps)
    thread = reserve_pinned(after, pin=False)
    thread.join(timeout=30)
    assert not thread.is_alive()
