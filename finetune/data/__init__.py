"""Datasets -> formatted, tokenized, masked (and optionally packed) rows -> per-rank micro-batches.

Which rows global step N consumes on which rank is a pure function of (seed, N, world size,
micro batch, accumulation): `BatchSchedule` answers it without reading the data before N, which is
what makes resume O(1). The global batch at step N is the same set of rows whatever its split into
processes and accumulation steps, so runs on different world sizes see identical batches.

The package, by stage: formats (detection, row checks), sources (where data comes from, splits,
column mapping, prevalidation), tokenization (rows -> ids and labels, chat templates, packing),
loading (a source -> a cached tokenized dataset), mixtures (the train and eval sets of a recipe),
batches (the resumable schedule and the collated micro-batch), inspector (rows shown as trained),
preference (the preference pairs of objective=dpo: their shapes, checks and tokenization), unpaired
(objective=kto's rows of one labelled completion, and their KL rows), prompts (the prompt rows of
objective=grpo and their tokenization).
Every public name is importable from `finetune.data` itself.
"""

from __future__ import annotations

from finetune.data.formats import (ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, DataError, FORMAT_FIELDS, IGNORE,
                                   PIPELINE_VERSION, check_messages, check_pair, check_prompt_row, check_roles, check_row,
                                   detect_format, extract_prompt, format_hint, sharegpt_hint, split_pair, unknown_role)
from finetune.data.sources import (CSV_MISSING, SHAREGPT_COLUMNS, SHAREGPT_ROLES, check_columns, eval_source,
                                   first_row_of, is_saved_dataset, local_splits, map_row, need_fields, need_split,
                                   overview_lines, prevalidate, prevalidate_recipe, saved_splits, top_level_columns,
                                   train_sources, with_sharegpt)
from finetune.data.tokenization import (GENERATION_TAG, assistant_spans, bos_ids, encode_batch, encode_conversations,
                                        encode_messages, encode_prompt_completion, encode_row, encode_text, pack_rows,
                                        plan_packing, render_chat, render_chats, text_ids)
from finetune.data.loading import (COUNTS, ROWS_PER_PROCESS, cache_fingerprint, load_source, num_processes,
                                   pack_dataset, tokenize_dataset, tokenizer_fingerprint)
from finetune.data.mixtures import (Datasets, build_datasets, mixture_counts, mixture_indices, summary_lines)
from finetune.data.batches import (BatchSchedule, PAIR_SIDES, REFERENCE_COLUMNS, collate, collate_pairs, concatenate,
                                   eval_batches, fetch, input_tokens, is_preference, packed_length, target_tokens)
from finetune.data.preference import (PAIR_COLUMNS, PREFERENCE_VERSION, encode_pair, encode_pairs, prompt_length,
                                      trained)
from finetune.data.prompts import PROMPT_COLUMNS, PROMPT_VERSION, encode_prompts, fit_prompt
from finetune.data.inspector import (GREEN, RESET, prompt_columns, show_pair, show_prompt, show_row)
