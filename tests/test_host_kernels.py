"""mixed_precision=bf16 on CPU computes with kernels torch picks from this machine's CPU: ATen's
vectorized kernels per CPU capability (ATEN_CPU_CAPABILITY, at most what the CPU has) and, on a CPU
with AVX512-BF16 or AMX, oneDNN's bf16 matmul (torch.backends.mkldnn). test_bf16 compares a bf16
curve with the fp32 one within BF16_RTOL (1e-2); here the tiny model's bf16 loss stays far inside
it under every kernel set this machine can run: the scalar ATen kernels (a subprocess with
ATEN_CPU_CAPABILITY=default), the machine's own, and each with oneDNN on and off. See
docs/host-dependence.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A tenth of test_bf16's BF16_RTOL; measured on an AVX2 CPU: 2.1e-5 (default) and 1.8e-5 (AVX2).
FORWARD_BF16_RTOL = 1e-3


def losses(path: str) -> dict:
    """The tiny model's loss on one batch in fp32, and in bf16 with oneDNN on and off."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(8, 120, (4, 64), generator=torch.Generator().manual_seed(0))
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    out = {"capability": torch.backends.cpu.get_cpu_capability(),
           "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
    with torch.no_grad():
        out["fp32"] = fp32(input_ids=ids, labels=ids).loss.item()
        for onednn in (True, False):
            with torch.backends.mkldnn.flags(enabled=onednn):
                out[f"bf16 onednn={onednn}"] = bf16(input_ids=ids, labels=ids).loss.float().item()
    return out


@pytest.mark.parametrize("capability", ["host", "default"])
def test_bf16_loss_within_tolerance_on_every_cpu_kernel_set(capability):
    from finetune.assets import tiny_model_dir

    if capability == "host":
        result = losses(str(tiny_model_dir()))
    else:
        repo = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=str(repo), ATEN_CPU_CAPABILITY=capability)  # read at torch's start;
        # a capability above the CPU's dies of SIGILL, so only the machine's own and lower ones can be forced
        code = ("import json, sys; from tests.test_host_kernels import losses; "
                "print('RESULT ' + json.dumps(losses(sys.argv[1])))")
        proc = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir())], env=env, cwd=repo,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.split("RESULT ", 1)[1])
        assert result["capability"] == capability.upper(), result  # the forcing took effect
    want = result["fp32"]
    for onednn in (True, False):
        deviation = abs(result[f"bf16 onednn={onednn}"] - want) / want
        assert 1e-6 < deviation < FORWARD_BF16_RTOL, (onednn, result)
