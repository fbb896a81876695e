"""bench/gpu/gpu.py's table (`bench/run.py --gpu`), from a synthetic result: formatting only, no launches.
Every number below is made up to exercise the render; none was measured."""

from bench.gpu import gpu

GIB = 2**30


def synthetic() -> dict:
    def row(toolkit, strategy, variant, tps, **kw):
        return {"toolkit": toolkit, "strategy": strategy, "variant": variant, "ok": True, "tokens_per_s": tps,
                "mfu": tps * 6.5e9 / 989e12, "peak_memory": 20 * GIB, "losses": [10.5, 2.0], "seconds": 60.0, **kw}

    return {"ok": True, "smoke": False, "gpu": "SYNTHETIC GPU", "gpu_memory_gib": 80.0, "torch_cuda": "0.0",
            "model": "synthetic", "parameters": 1000, "seq_len": 2048, "micro_batch_size": 4, "steps": 30,
            "warmup": 10, "precision": "bf16", "flops_per_token": 6.5e9, "peak_flops": 989e12, "peak_name": "H100",
            "base_overrides": ["max_steps=30"], "versions": {"torch": "0"},
            "rows": [row("finetune", "ddp", "default", 50000.0), row("trainer", "ddp", "default", 40000.0),
                     {"toolkit": "finetune", "strategy": "fsdp", "variant": "default", "ok": False,
                      "error": "RuntimeError: CUDA out of memory | see log", "seconds": 12.0},
                     row("trainer", "fsdp", "default", 30000.0),
                     row("finetune", "zero3", "default", 20000.0), row("trainer", "zero3", "default", 25000.0),
                     {"toolkit": "finetune", "strategy": "ddp", "variant": "loss_impl=liger", "ok": None,
                      "skipped": "liger_kernel not installed"},
                     row("finetune", "fsdp", "compile=true", 45000.0)]}


def cells(text: str, toolkit: str, strategy: str, variant: str) -> list[str]:
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if parts[:3] == [toolkit, strategy, variant]:
            return parts
    raise AssertionError(f"no row {toolkit} {strategy} {variant} in:\n{text}")


def test_render_ratio_failed_and_skipped_rows():
    text = gpu.render(synthetic(), "python bench/run.py --gpu", "now", {})
    ddp = cells(text, "finetune", "ddp", "default")
    assert ddp[3] == "50,000" and ddp[5] == "1.25x" and ddp[6] == "20.00"
    assert ddp[4] == f"{50000 * 6.5e9 / 989e12:.1%}"
    assert cells(text, "Trainer", "ddp", "default")[5] == "-"  # the reference has no ratio
    assert cells(text, "finetune", "zero3", "default")[5] == "0.80x"
    failed = cells(text, "finetune", "fsdp", "default")
    assert failed[3] == "failed" and "CUDA out of memory" in failed[-1] and failed[5] == "-"
    assert "|" not in failed[-1]  # the error's own "|" must not split the table's cells
    assert cells(text, "finetune", "ddp", "loss_impl=liger")[-1] == "liger_kernel not installed"
    # no Trainer row for compile=true: compared with the Trainer's fsdp default, and said so
    assert cells(text, "finetune", "fsdp", "compile=true")[5] == "1.50x (Trainer default)"
    assert "ahead of the Trainer, ddp: met (1.250x)" in text
    assert "ahead of the Trainer, fsdp: not compared" in text
    assert "ahead of the Trainer, zero3: not met (0.800x)" in text
    assert "MFU >= 40%: not met (best finetune row 32.9%, ddp default)" in text


def test_render_without_rows_says_why():
    text = gpu.render({"ok": False, "error": "no CUDA GPU on this machine"}, "python bench/run.py --gpu", "now", {})
    assert text.startswith("Not measured: no CUDA GPU on this machine")
