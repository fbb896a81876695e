"""finetune/generation.py's batched generation: greedy tokens equal one sequence at a time (the loop the
samples and chat used before, kept below as the oracle) on three real tokenizers (Mistral v1 and v3
sentencepiece, tekken byte-level BPE) with small random-weight models of three families (Llama-3 with
its rope scaling, Mistral with a sliding window, Qwen2 with tied embeddings), prompts of different
lengths left-padded into one batch; seeded sampling does not depend on what else is in the batch;
stop ids, max_new_tokens and the context end each sequence on its own; a stop request ends all."""

from __future__ import annotations

import pytest
import torch

import family_assets as FA
from finetune.generation import Completion, Sampling, generate, pad_id_for, render_prompt, stop_ids


@torch.no_grad()
def one_sequence(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """The greedy loop samples and `finetune chat` ran before (f685e70's finetune/samples.generate)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    past, out = None, []
    for _ in range(max_new_tokens):
        result = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        past = result.past_key_values
        token = int(result.logits[0, -1].float().argmax())
        out.append(token)
        if token in stop:
            break
        ids = torch.tensor([[token]], device=device)
    return out


def until(tokens: list[int], stop: set[int]) -> list[int]:
    """The loop's answer with stop ids: its tokens up to and with the first stop id."""
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in stop), tokens)


def _tiny_llama(vocab_size: int = 96, positions: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(config).eval()


# tokenizer -> the family whose small random-weight model reads it
REAL = {"mistral_v1": "llama3", "mistral_v3": "mistral", "tekken": "qwen2"}
QUESTIONS = ["What is 2+2?", "Name the capital of France, then spell it backwards, one letter at a time.",
             "Hi", "Write a haiku about a tokenizer that pads on the left."]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """name -> (tokenizer, model, prompts of different lengths rendered as a run renders them)."""
    import transformers

    toks = {"mistral_v1": FA.mistral_tokenizer("v1", tmp_path_factory.mktemp("v1")),
            "mistral_v3": FA.mistral_tokenizer("v3", tmp_path_factory.mktemp("v3")),
            "tekken": FA.tekken_tokenizer(tmp_path_factory.mktemp("tekken") / "tok")}
    toks["mistral_v1"].chat_template = toks["mistral_v3"].chat_template = FA.MISTRAL
    out = {}
    for name, tok in toks.items():
        family = FA.FAMILIES[REAL[name]]
        torch.manual_seed(0)
        config = FA.family_config(REAL[name], vocab_size=len(tok))
        model = getattr(transformers, family.config.replace("Config", "ForCausalLM"))(config).eval()
        prompts = [render_prompt(tok, q, fmt) for q, fmt in zip(QUESTIONS, ("alpaca", "prompt_completion", "raw"))]
        prompts += [render_prompt(tok, QUESTIONS[3], "chat" if name != "tekken" else "alpaca")]
        assert len({len(p) for p in prompts}) >= 3, [len(p) for p in prompts]  # padded to the longest
        out[name] = tok, model, prompts
    return out


@pytest.mark.parametrize("name", list(REAL))
def test_batched_greedy_equals_one_sequence_at_a_time_on_real_tokenizers(real, name):
    tok, model, prompts = real[name]
    stop = stop_ids(tok, model)
    alone = [one_sequence(model, p, 16, set()) for p in prompts]
    batched = generate(model, prompts, Sampling(16), stop_ids=stop, pad_id=pad_id_for(tok), context=None)
    assert [c.tokens for c in batched] == [until(a, stop) for a in alone]
    # and with a stop id some answers meet midway (a token the first answer makes): each ends on its own
    ends = {alone[0][5]}
    cut = generate(model, prompts, Sampling(16), stop_ids=ends, pad_id=pad_id_for(tok), context=None)
    assert [c.tokens for c in cut] == [until(a, ends) for a in alone]
    assert cut[0].stopped and cut[0].tokens[-1] in ends and len(cut[0].tokens) <= 6
    assert all(c.stopped == (c.tokens[-1] in ends) for c in cut)
    assert all(c.stopped or len(c.tokens) == 16 for c in cut)


def test_greedy_equals_transformers_generate():
    model = _tiny_llama()
    model.generation_config.eos_token_id = None
    prompt = [1, 5, 9, 14, 3]
    [ours] = generate(model, [prompt], Sampling(12), stop_ids=(), pad_id=0, context=None)
    with torch.no_grad():
        peer = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours.tokens == peer[0, len(prompt):].tolist() and not ours.stopped


@pytest.mark.parametrize("sampling", [Sampling(10, temperature=1.0), Sampling(10, temperature=0.7, top_k=5),
                                      Sampling(10, temperature=1.3, top_p=0.8)])
def test_seeded_sampling_does_not_depend_on_the_batch(sampling):
    model = _tiny_llama()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [4], [5, 6, 5, 6, 5]]
    seeds = [11, 22, 33, 44]
    together = generate(model, prompts, sampling, stop_ids=(), pad_id=0, context=None, seeds=seeds)
    alone = [generate(model, [p], sampling, stop_ids=(), pad_id=0, context=None, seeds=[s])[0]
             for p, s in zip(prompts, seeds)]
    reordered = generate(model, prompts[::-1], sampling, stop_ids=(), pad_id=0, context=None, seeds=seeds[::-1])
    assert [c.tokens for c in together] == [c.tokens for c in alone] == [c.tokens for c in reordered[::-1]]
    again = generate(model, prompts, sampling, stop_ids=(), pad_id=0, context=None, seeds=[12, 22, 33, 44])
    assert again[0].tokens != together[0].tokens  # its own seed only
    assert [c.tokens for c in again[1:]] == [c.tokens for c in together[1:]]
    assert len({tuple(c.tokens) for c in together}) > 1


def test_top_k_one_is_greedy_and_sampling_needs_seeds():
    model = _tiny_llama()
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    greedy = generate(model, prompts, Sampling(8), stop_ids=(), pad_id=0, context=None)
    top1 = generate(model, prompts, Sampling(8, temperature=2.0, top_k=1), stop_ids=(), pad_id=0, context=None,
                    seeds=[1, 2])
    assert [c.tokens for c in top1] == [c.tokens for c in greedy]
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(model, prompts, Sampling(8, temperature=1.0), stop_ids=(), pad_id=0, context=None)


def test_left_padding_keeps_each_prompt_as_it_is_alone():
    model = _tiny_llama()
    short, long = [3, 4], [5 + i % 60 for i in range(40)]
    together = generate(model, [short, long, short], Sampling(15), stop_ids=(), pad_id=0, context=None)
    assert together[0].tokens == together[2].tokens == one_sequence(model, short, 15, set())
    assert together[1].tokens == one_sequence(model, long, 15, set())
    # the pad id is never attended to: another pad id gives the same tokens
    other = generate(model, [short, long], Sampling(15), stop_ids=(), pad_id=17, context=None)
    assert [c.tokens for c in other] == [c.tokens for c in together[:2]]


def test_context_ends_each_sequence_where_prompt_and_answer_fill_it():
    model = _tiny_llama(positions=48)
    long, short = [1 + i % 90 for i in range(40)], [1, 2, 3]
    out = generate(model, [long, short, long + long[:8]], Sampling(10_000_000), stop_ids=(), pad_id=0,
                   context=48)
    assert [len(c.tokens) for c in out] == [8, 45, 0]  # 40 + 8, 3 + 45: the context; no room at all
    assert out[0].tokens == one_sequence(model, long, 8, set()) and not any(c.stopped for c in out)
    assert out[1].tokens == one_sequence(model, short, 45, set())


def test_a_stop_request_ends_every_sequence_before_the_next_token():
    model = _tiny_llama()
    asked = iter([False, False, False, True])
    out = generate(model, [[1, 2], [3, 4, 5]], Sampling(50), stop_ids=(), pad_id=0, context=None,
                   should_stop=lambda: next(asked))
    assert [len(c.tokens) for c in out] == [3, 3] and not any(c.stopped for c in out)
    assert generate(model, [], Sampling(5), stop_ids=(), pad_id=0, context=None) == []
    assert isinstance(out[0], Completion) and out[0].seconds > 0


def test_generation_keeps_no_autograd_graph():
    """The model's weights require grad (a policy being trained): generation must not record their
    forwards. It did (no_grad sat on the argument check, not on generate): every token's forward stayed
    in a graph the KV cache held, quadratic in the length (tiny_grpo, 128 completions: 1.41 GiB more at
    256 tokens, 24 GiB at max_completion_len=2000 before an OOM kill; 0.03 GiB without it)."""
    model = _tiny_llama()
    assert all(p.requires_grad for p in model.parameters())
    recorded = []
    model.register_forward_hook(lambda module, args, out: recorded.append(
        (torch.is_grad_enabled(), out.logits.requires_grad)))
    for sampling, seeds in ((Sampling(4), None), (Sampling(4, temperature=1.0), [1, 2])):
        generate(model, [[1, 2], [3, 4, 5]], sampling, stop_ids=(), pad_id=0, context=None, seeds=seeds)
    assert len(recorded) == 8 and not any(grad or needs for grad, needs in recorded)
