"""A 2-source mixture trained by 2 processes (issue 13): the builtin alpaca tasks at a weight and
ShareGPT-style chats (conversations of from/value, mapped onto messages) at a row count. One
uninterrupted run with checkpoints serves every assert; one resume from a copy of its middle
checkpoint must log the same losses, bit for bit, as the run that was never interrupted (the mix is
a pure function of the seed, and the data skip on resume stays O(1))."""

from __future__ import annotations

import json

import pytest
from test_checkpoint import records, resume_copy

RUN = ["strategy=ddp", "max_steps=6", "save_every=3", "keep_last=3", "eval_every=3"]


def write_sharegpt(path, n):
    rows = []
    for i in range(n):
        word = "".join("abcdefghij"[(i * 7 + k) % 10] for k in range(3 + i % 4))
        rows.append({"id": i, "conversations": [{"from": "human", "value": f"Reverse {word}"},
                                                {"from": "gpt", "value": word[::-1]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    chats = write_sharegpt(root / "chats.jsonl", 60)
    recipe = root / "mixture.py"
    recipe.write_text(f'''from dataclasses import replace

from finetune.recipe import DataSource
from recipes.tiny import recipe as tiny

recipe = replace(tiny, datasets=[
    DataSource(path="builtin:tiny-tasks", format="alpaca", weight=0.05),
    DataSource(path={str(chats)!r}, columns={{"messages": "conversations", "role": "from", "content": "value"}},
               rows=120),
])
''')
    return recipe


@pytest.fixture(scope="module")
def mixture_run(launch, mixture):
    return launch(2, *RUN, recipe=str(mixture))


def test_mixture_run_reports_each_source(mixture_run):
    recipe = json.loads((mixture_run.output_dir / "recipe.json").read_text())
    sources = recipe["data"]["sources"]
    assert [s["source"] for s in sources] == ["datasets[0]", "datasets[1]"]
    assert sources[0]["rows"] == 3800 and sources[0]["rows_in_mix"] == 190  # 5% of 4000 held out for eval
    assert sources[1]["rows"] == 57 and sources[1]["rows_in_mix"] == 120
    assert all(s["target_tokens"] > 0 for s in sources)
    assert recipe["data"]["summary"]["rows"] == 310
    assert [d["path"] for d in recipe["datasets"]] == ["builtin:tiny-tasks", sources[1]["path"]]
    for s in sources:  # the log says the same, one line per source
        assert (f"data {s['source']} {s['path']} ({s['format']}, split train): {s['rows']} rows"
                in mixture_run.stderr)
    assert len(mixture_run.losses) == 6
    assert [r["step"] for r in mixture_run.eval_records] == [0, 3, 6]  # tiny evaluates at the start too
    # one source is chats: the model stops at the template's <|end|> (7) as well as at </s> (3)
    final = mixture_run.output_dir / "final"
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [3, 7]
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == 3


def test_mixture_resumes_bit_for_bit(launch, mixture, mixture_run, tmp_path_factory):
    out = resume_copy(mixture_run, 3, tmp_path_factory)
    resumed = launch(2, *RUN, "--resume", "auto", recipe=str(mixture), output_dir=out)
    assert "resumed from" in resumed.stderr
    want = [r for r in records(mixture_run) if r[0] > 3]
    assert records(resumed) == want and len(want) == 4  # steps 4, 5, 6 and the eval at 6, exactly
