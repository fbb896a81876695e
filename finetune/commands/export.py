"""`python -m finetune.export CHECKPOINT OUT_DIR`: any checkpoint -> a plain Hugging Face model, verified."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import warnings
from pathlib import Path

from finetune.checkpointing.export import ExportError, export_checkpoint
from finetune.training.metrics import setup_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.export",
                                     description="Turn any finetune checkpoint into a plain Hugging Face model.")
    parser.add_argument("checkpoint", type=Path, help="e.g. OUTPUT_DIR/checkpoints/step_000000200")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA checkpoints: write base + adapter as one plain model (default: a peft adapter)")
    parser.add_argument("--base", help="LoRA checkpoints: the base model (default: the one the run loaded)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # export never needs a GPU
    warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")  # one process is the intent
    setup_logging("warning", 0)
    try:
        result = export_checkpoint(args.checkpoint, args.out_dir, args.max_shard_size, args.merge, args.base,
                                   log=lambda m: print(m, file=sys.stderr))
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except pickle.UnpicklingError as e:  # a file outside the allow-lists (finetune/checkpointing/safe_loading.py)
        print(f"error: checkpoint {args.checkpoint}: {e}; use a checkpoint from a source you trust; nothing was "
              "written", file=sys.stderr)
        return 2
    except OSError as e:  # writing failed after all (a full disk, storage that went away); the partial is removed
        print(f"error: writing {args.out_dir} failed: {type(e).__name__}: {e}; it was not created (its partial "
              "copy was removed); free space or choose another OUT_DIR", file=sys.stderr)
        return 2
    if result.get("lora") and not result["merged"]:
        print(f"exported the LoRA adapter of step {result['step']} (written by {result['world_size']} process(es)) "
              f"to {result['out_dir']}: {result['adapter_parameters']:,} parameters; reloaded with "
              f"PeftModel.from_pretrained on {result['base']}, probe logits identical")
        return 0
    if result.get("lora"):
        print(f"exported step {result['step']} merged into {result['base']} to {result['out_dir']}: "
              f"{result['parameters']:,} parameters, {result['dtype']}; reloaded with from_pretrained, probe logits "
              f"identical, within {result['probe_max_abs_diff']:.2g} of base + adapter")
        return 0
    print(f"exported step {result['step']} (written by {result['world_size']} process(es)) to {result['out_dir']}: "
          f"{result['parameters']:,} parameters, {result['dtype']}; reloaded with from_pretrained, probe logits "
          "identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
