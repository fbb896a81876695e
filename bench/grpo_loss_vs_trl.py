"""TRL's own GRPOTrainer._compute_loss (called with a stand-in trainer: TRL's per-token log-probs replaced by
fixed tensors) against the lines tests/test_grpo_objective.py reproduces from it, on that test's tensors,
for grpo, dapo, dr_grpo x num_iterations 1, 2 x beta 0, 0.04: loss and metrics. Needs trl importable
(pip install -e .[bench], or PYTHONPATH=DIR holding a `pip install --no-deps --target DIR trl==1.16.0`):

    PYTHONPATH=.:/path/to/trl python bench/grpo_loss_vs_trl.py
"""
from pathlib import Path
import collections
import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from trl.trainer.grpo_trainer import GRPOTrainer
import test_grpo_objective as T
worst = 0
for loss_type in ("grpo", "dapo", "dr_grpo"):
    for it in (1, 2):
        for beta in (0.0, 0.04):
            base, old, ref, adv, mask = T.rollout_tensors(iterations=it)
            fake = T.trainer(loss_type, beta, ga=1, world=1, max_len=9)
            fake.top_entropy_quantile = 1.0; fake.aux_loss_enabled = False; fake.off_policy_mask_threshold = None
            fake.use_vllm = False; fake._entropy_bonus_enabled = False
            fake.args.delta = None; fake.args.use_bias_correction_kl = False
            fake.accelerator.gather = lambda t: t.reshape(-1)
            fake._metrics["train"] = collections.defaultdict(list)
            logp = base.clone().requires_grad_()
            fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
            inputs = {"prompt_ids": torch.ones(8, 1, dtype=torch.long), "prompt_mask": torch.ones(8, 1),
                      "completion_ids": torch.ones(8, 9, dtype=torch.long), "completion_mask": mask,
                      "advantages": adv, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
            if old is not None: inputs["old_per_token_logps"] = old
            real = GRPOTrainer._compute_loss(fake, None, inputs)
            f2 = T.trainer(loss_type, beta, ga=1, world=1, max_len=9)
            copy = T.trl_compute_loss(f2, base, inputs)
            worst = max(worst, abs(real.item() - copy.item()))
            for k, v in f2._metrics["train"].items():
                if v: worst = max(worst, abs(v[0] - fake._metrics["train"][k][0]))
print("trl", __import__("trl").__version__, "max diff real TRL vs copied lines:", worst)
