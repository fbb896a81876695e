"""Our tokenized rows against TRL's SFTTrainer's own (trainer.train_dataset), row for row.

    python bench/studies/tokens_vs_trl.py

For four real tokenizers (Mistral v1 and v3 sentencepiece and tekken from the mistral_common wheel, a
Llama-3-style byte-level BPE) it tokenizes prompt/completion rows, including prompts that end in a space
or mid-word (the seam cases of tests/test_tokenization.py), and a chat whose template marks assistant
turns with {% generation %} (Llama 3 and ChatML), with finetune.data and with TRL's SFTTrainer
(completion_only_loss / assistant_only_loss), and counts the rows whose input_ids and labels are equal.
TRL is a bench-only dependency: pip install -e .[bench].
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def main() -> int:
    warnings.filterwarnings("ignore")
    import transformers
    import trl
    from datasets import Dataset

    import family_assets as FA
    from finetune import data as D
    from test_tokenization import CHAT, SEAMS

    print("trl", trl.__version__, "transformers", transformers.__version__)
    tmp = Path(tempfile.mkdtemp())
    llama3_texts = [m["content"] for m in CHAT] + [p + c for p, c in SEAMS]
    tokenizers = {"mistral-v1": FA.mistral_tokenizer("v1", tmp / "v1"),
                  "mistral-v3": FA.mistral_tokenizer("v3", tmp / "v3"),
                  "tekken": FA.tekken_tokenizer(tmp / "tekken"),
                  "llama3-bpe": FA.make_tokenizer(FA.FAMILIES["llama3"], llama3_texts, tmp / "l3")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=131072, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))

    def trl_rows(tok, ds, **kw):
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        cfg = trl.SFTConfig(output_dir=str(tmp / "out"), report_to=[], max_length=None, bf16=False, use_cpu=True,
                            **kw)
        return trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok).train_dataset

    total = same = 0
    for name, tok in tokenizers.items():
        rows = [{"prompt": p, "completion": c} for p, c in SEAMS] + [
            {"prompt": "2+2=", "completion": "4"}, {"prompt": "Translate: chat\n", "completion": " cat"}]
        theirs = trl_rows(tok, Dataset.from_list(rows), completion_only_loss=True)
        for row, t in zip(rows, theirs):
            ids, labels = D.encode_row(row, "prompt_completion", tok, False, 512)
            ok = ids == t["input_ids"] and labels == t["labels"]
            total, same = total + 1, same + ok
            if not ok:
                print("differs:", name, row, tok.convert_ids_to_tokens(ids[-4:]),
                      tok.convert_ids_to_tokens(t["input_ids"][-4:]))
        for template in ("llama3", "chatml"):
            tok.chat_template = FA.with_generation_marks(FA.TEMPLATES[template])
            t = trl_rows(tok, Dataset.from_list([{"messages": CHAT}]), assistant_only_loss=True)[0]
            ids, labels = D.encode_messages(tok, CHAT, False, 512)
            ok = ids == t["input_ids"] and labels == t["labels"]
            total, same = total + 1, same + ok
            if not ok:
                print("differs: chat", name, template, sum(a != b for a, b in zip(labels, t["labels"])),
                      "labels")
    print(f"equal to TRL (input_ids and labels): {same} of {total} rows")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
