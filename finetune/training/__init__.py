"""A run's training: the loop (setup, optimizer step, reporter, finish), the objectives it asks, a DPO
run's reference, the samples at eval, the metrics and the signals a run stops on.

Imports checkpointing/ and the ground floor (finetune/*.py, strategy/, data/); nothing below
commands/ imports it (tests/test_layout.py checks)."""
