"""Section 8: data preparation speed and memory, finetune against TRL's SFTTrainer, on the same rows.

    python bench/studies/data_prep.py [--rows 200000] [--num-proc 1,2] [--doc docs/benchmarks.md]

Generates ROWS multi-turn `messages` rows (a system prompt and 2 or 3 user/assistant exchanges of
generated sentences) into one jsonl, loads it with `datasets` (not timed, the same for both), then,
each in a fresh process with an empty datasets cache:

- finetune: `finetune.data.tokenize_dataset` (what a run does before its first step: chat template,
  batched tokenizer calls, labels on assistant turns, rows without targets dropped; Arrow-backed, in
  num_proc processes);
- TRL: `SFTTrainer(..., args=SFTConfig(assistant_only_loss=True, dataset_num_proc=N))`, whose
  constructor prepares the dataset (chat template with the assistant mask, one row per call, then
  labels and truncation, each a pass over the rows). Its constructor's own overhead, measured on 64 rows first, is subtracted.

Both use Mistral-7B-Instruct v0.3's real tokenizer (from the mistral_common wheel, a dev dependency) and
a ChatML template whose assistant turns are marked with {% generation %}, which both honour: the labels
of the first rows are compared (equal assistant masks). Also measured: finetune with the same template
without the marks, where every assistant turn is located by rendering the conversation up to it.
TRL is a bench-only dependency: pip install -e .[bench].
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: finetune and bench.* import from it
sys.path.insert(0, str(REPO / "tests"))
MAX_LEN = 2048
WORDS = ("the a model data train token answer question small large fast slow river mountain city number "
         "seven three blue green write read reverse count sort list explain why how when where which").split()


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def make_rows(path: Path, n: int) -> Path:
    if path.is_file():
        return path
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": sentence(rng, 4, 10)}]
            for _ in range(rng.randint(2, 3)):
                messages.append({"role": "user", "content": sentence(rng, 6, 20)})
                messages.append({"role": "assistant", "content": " ".join(sentence(rng, 5, 15)
                                                                          for _ in range(rng.randint(1, 3)))})
            f.write(json.dumps({"messages": messages}) + "\n")
    tmp.rename(path)
    return path


def tokenizer_dirs(work: Path) -> dict:
    import family_assets as FA

    out = {"marked": work / "tok-marked", "plain": work / "tok-plain"}
    if not all((d / "tokenizer_config.json").is_file() for d in out.values()):
        tok = FA.mistral_tokenizer("v3", work / "tok-src")
        tok.pad_token = tok.eos_token
        for name, template in (("marked", FA.with_generation_marks(FA.CHATML)), ("plain", FA.CHATML)):
            tok.chat_template = template
            tok.save_pretrained(out[name])
    return out


def peak_rss_gib() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return round(own, 3), round(children, 3)


def child(args) -> dict:
    """One measurement, in its own process (a fresh datasets cache is set by the parent)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ds = datasets.load_dataset("json", data_files=args.data, split="train")
    before = peak_rss_gib()
    result = {"variant": args.child, "num_proc": args.num_proc, "rows": len(ds), "rss_after_load_gib": before[0]}
    if args.child.startswith("finetune"):
        from finetune import data as D
        from finetune.recipe import Recipe

        recipe = Recipe(max_seq_len=MAX_LEN, num_proc=args.num_proc)
        t0 = time.perf_counter()
        out = D.tokenize_dataset(ds, "messages", tok, recipe, "bench")
        seconds = time.perf_counter() - t0
        result["kept"] = len(out)
        sample = out.select(range(200))
        result["sample"] = [[i, lab] for i, lab in zip(sample["input_ids"], sample["labels"])]
    else:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from trl import SFTConfig, SFTTrainer

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))

        def prepare(rows, where):
            config = SFTConfig(output_dir=where, assistant_only_loss=True, max_length=MAX_LEN, packing=False,
                               dataset_num_proc=args.num_proc if args.num_proc > 1 else None, report_to="none",
                               bf16=False, use_cpu=True)
            t0 = time.perf_counter()
            trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tok)
            return trainer, time.perf_counter() - t0

        with tempfile.TemporaryDirectory() as tmp:
            _, overhead = prepare(ds.select(range(64)), tmp)
            trainer, total = prepare(ds, tmp)
        seconds = max(total - overhead, 1e-9)
        result |= {"constructor_seconds": round(total, 2), "overhead_seconds_64_rows": round(overhead, 2)}
        out = trainer.train_dataset
        result["kept"] = len(out)
        sample = out.select(range(200))
        result["sample"] = [[i, lab] for i, lab in zip(sample["input_ids"], sample["labels"])]
    own, children = peak_rss_gib()
    result |= {"seconds": round(seconds, 2), "rows_per_s": round(len(ds) / seconds), "peak_rss_gib": own,
               "peak_rss_worker_gib": children}
    return result


def run_child(variant: str, num_proc: int, tokenizer: Path, data: Path, work: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"cache-{variant}-{num_proc}-", dir=work))
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", variant, "--num-proc", str(num_proc),
                           "--tokenizer", str(tokenizer), "--data", str(data), "--out", str(cache / "result.json")],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} num_proc={num_proc} failed:\n{proc.stderr[-4000:]}")
    result = json.loads((cache / "result.json").read_text())
    result["process_seconds"] = round(time.perf_counter() - t0, 1)
    subprocess.run(["rm", "-rf", str(cache)])
    return result


def load_elsewhere() -> float:
    """The CPU load of the rest of the machine (1-minute load average), for the report."""
    return os.getloadavg()[0]


def report(results: list[dict], args, started: str, wall: float) -> str:
    from bench.parts.common import git_state, machine

    m = machine()
    from importlib.metadata import version

    base = {(r["variant"], r["num_proc"]): r for r in results}
    lines = [f"Measured {started} by `python bench/studies/data_prep.py --rows {args.rows} --num-proc {args.num_proc}` at git "
             f"{git_state()}, {wall:.0f} s in all; {m['cpu']}, {m['cores']} cores, shared with other jobs (load average "
             f"{args.load_before:.2f} before, {load_elsewhere():.2f} after); datasets {version('datasets')}, "
             f"transformers {version('transformers')}, tokenizers {version('tokenizers')}, trl {version('trl')}.", "",
             f"{args.rows:,} generated `messages` rows (a system prompt, 2 or 3 user/assistant exchanges; "
             f"{results[0]['tokens_per_row']:.0f} tokens a row on average), Mistral-7B-Instruct v0.3's tokenizer, a "
             "ChatML template, max_seq_len 2048, loss on assistant turns only. Each row of the table is one fresh "
             "process with an empty datasets cache; loading the jsonl into Arrow is not timed. TRL's figure is its "
             "SFTTrainer constructor's time minus the same constructor on 64 rows.", "",
             "| preparation | template | num_proc | seconds | rows/s | vs TRL (same num_proc) | peak RSS GiB (main / worker) | machine load before |",
             "| ----------- | -------- | -------- | ------- | ------ | ---------------------- | ---------------------------- | ------------------- |"]
    for r in results:
        trl = base.get(("trl", r["num_proc"]))
        ratio = f"{r['rows_per_s'] / trl['rows_per_s']:.2f}x" if trl else "-"
        name = {"finetune": "finetune tokenize_dataset", "finetune-plain": "finetune tokenize_dataset",
                "trl": "TRL SFTTrainer"}[r["variant"]]
        template = "ChatML, turns searched" if r["variant"] == "finetune-plain" else "ChatML + {% generation %}"
        workers = f"{r['peak_rss_worker_gib']:.2f}" if r["num_proc"] > 1 else "-"
        lines.append(f"| {name} | {template} | {r['num_proc']} | {r['seconds']:.1f} | {r['rows_per_s']:,} | {ratio} | "
                     f"{r['peak_rss_gib']:.2f} / {workers} | {r['load_before']:.2f} |")
    lines += ["", args.agreement]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--num-proc", default="1,2", help="comma-separated")
    parser.add_argument("--variants", default="finetune,trl,finetune-plain")  # the order they run in
    parser.add_argument("--work", default=os.environ.get("BENCH_CACHE", str(REPO / "bench" / ".cache")) + "/data_prep")
    parser.add_argument("--doc", help="write the result as section 8 of this file (docs/benchmarks.md)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.num_proc = int(args.num_proc)
        Path(args.out).write_text(json.dumps(child(args)))
        return 0
    args.load_before = load_elsewhere()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = make_rows(work / f"chats-{args.rows}.jsonl", args.rows)
    toks = tokenizer_dirs(work)
    results = []
    procs = [int(x) for x in args.num_proc.split(",")]
    for n in procs:  # finetune and TRL back to back at each num_proc: the machine's load moves between them
        for variant in args.variants.split(","):
            if variant == "finetune-plain" and n != max(procs):
                continue  # one row is enough to show what locating turns costs
            load = os.getloadavg()[0]
            r = run_child(variant, n, toks["plain" if variant == "finetune-plain" else "marked"], data, work)
            r["load_before"] = round(load, 2)
            print(json.dumps({k: v for k, v in r.items() if k != "sample"}), flush=True)
            results.append(r)
    ours = next(r for r in results if r["variant"] == "finetune")
    theirs = next((r for r in results if r["variant"] == "trl"), None)
    ours["tokens_per_row"] = sum(len(i) for i, _ in ours["sample"]) / len(ours["sample"])
    for r in results:
        r.setdefault("tokens_per_row", ours["tokens_per_row"])
    if theirs:
        # finetune starts a row with the BOS the tokenizer adds by itself (<s>) when the template renders none,
        # as inference does; TRL's apply_chat_template does not add it. Compared without it:
        pairs = [((a[0][1:], a[1][1:]) if a[0][:1] != b[0][:1] else a, b)
                 for a, b in zip(ours["sample"], theirs["sample"])]
        bos = sum(a[0][:1] != b[0][:1] for a, b in zip(ours["sample"], theirs["sample"]))
        same_ids = sum(a[0] == b[0] for a, b in pairs)
        same_labels = sum(a[1] == b[1] for a, b in pairs)
        args.agreement = (f"Same rows, same labels: of the first 200 rows, finetune starts {bos} with the BOS its "
                          "tokenizer adds by itself (as `tokenizer(prompt)` at inference does; TRL's "
                          "apply_chat_template adds none); past it, the input ids equal TRL's in "
                          f"{same_ids} and the trained tokens equal TRL's labels in {same_labels}. Rows kept: "
                          f"finetune {ours['kept']:,}, TRL {theirs['kept']:,}.")
    else:
        args.agreement = ""
    text = report(results, args, started, time.perf_counter() - t0)
    print(text)
    if args.doc:
        from bench.parts.report import DATA_BEGIN, DATA_END, DATA_TITLE, write_marked_section

        write_marked_section(Path(args.doc), DATA_TITLE, DATA_BEGIN, DATA_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
