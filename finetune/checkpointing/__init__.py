"""A run's state on disk: sharded checkpoints (save, load, verify), where a run resumes from and what
may change across a resume, what identifies a model's weights, and the export of any checkpoint as a
plain Hugging Face model.

Imports only the ground floor (finetune/*.py, strategy/, data/); training/ and commands/ build on it
(tests/test_layout.py checks)."""
