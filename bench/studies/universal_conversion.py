"""DeepSpeed's universal conversion, the step a ZeRO resume on another process count adds
(finetune/checkpointing/resume.py ensure_universal: done once per checkpoint and kept beside it,
verified before each reuse): seconds for a checkpoint, with the command resume.py runs (1 extract and
1 merge worker) and with more workers, against the checkpoint's size and the parameters it holds;
docs/async-checkpoints.md extrapolates per parameter.

    python bench/studies/universal_conversion.py CHECKPOINT [--workers 1,2]

CHECKPOINT: a ZeRO checkpoint directory (step_N/ with pytorch_model/ inside), e.g. one of
bench/studies/async_checkpoints.py's zero3 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def convert(checkpoint: Path, workers: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="universal-", dir=checkpoint.parent))
    cmd = [sys.executable, "-m", "finetune.checkpointing.safe_loading", "to-universal",
           "--input_folder", str(checkpoint / "pytorch_model"), "--output_folder", str(out / "pytorch_model"),
           "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                              str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))))
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return seconds


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--workers", default="1,2")
    a = p.parse_args()
    manifest = json.loads((a.checkpoint / "manifest.json").read_text())
    size = sum(v for k, v in manifest["files"].items() if k.startswith("pytorch_model/"))
    config = json.loads((a.checkpoint / "hf" / "config.json").read_text())
    from finetune.arch import Architecture

    params = Architecture(hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
                          intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                          num_attention_heads=config["num_attention_heads"],
                          num_key_value_heads=config.get("num_key_value_heads"), source="config").num_parameters()
    rows = []
    for workers in map(int, a.workers.split(",")):
        seconds = convert(a.checkpoint, workers)
        rows.append({"workers": workers, "seconds": round(seconds, 2), "parameters": params,
                     "zero_files_bytes": size, "world_size": manifest["world_size"],
                     "seconds_per_billion_parameters": round(seconds / params * 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
