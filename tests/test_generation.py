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


# ---------------------------------------------------------------- the sampler: counter-based noise, Gumbel-max

def splitmix64(state: int) -> int:
    """The published splitmix64 step's output (Steele et al. 2014; Vigna's C reference), in Python ints."""
    mask = (1 << 64) - 1
    z = (state + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def as_unsigned(x: torch.Tensor) -> list[int]:
    return [v & ((1 << 64) - 1) for v in x.tolist()]


def test_the_hash_is_splitmix64_and_its_values_are_fixed():
    from finetune.generation import GAMMA, mix64, noise_bits

    # splitmix64 seeded 0: its first outputs, as every implementation gives them
    assert splitmix64(0) == 0xE220A8397B1DCDAF and splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    states = [0, 1, 42, 2**63 - 1, 2**63, 2**64 - 1, 0x123456789ABCDEF0]
    signed = torch.tensor([s - 2**64 if s >= 2**63 else s for s in states], dtype=torch.int64)
    assert as_unsigned(mix64(signed + GAMMA)) == [splitmix64(s) for s in states]
    # noise of (seed, position, token id): fixed values, which no change may move (the sampled tokens follow)
    bits = noise_bits(torch.tensor([0, 7, 2**62 + 5]), 3, 4)
    assert [as_unsigned(row) for row in bits] == NOISE_BITS
    assert NOISE_BITS == [[reference_bits(s, 3, v) for v in range(4)] for s in (0, 7, 2**62 + 5)]
    assert torch.equal(noise_bits(torch.tensor([7]), 3, 4)[0], bits[1])  # the same row alone


def reference_bits(seed: int, position: int, token: int) -> int:
    """noise_bits' definition in Python ints: splitmix64's finalizer over the counter (seed, position, id)."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z):
        return splitmix64((z - gamma) & mask)

    key = mix(mix((seed + gamma) & mask) ^ mix(((position + 1) * gamma) & mask))
    return mix((key + (token + 1) * gamma) & mask)


# noise_bits([0, 7, 2**62 + 5], position 3, 4 ids) as first computed; reference_bits gives the same
NOISE_BITS = [[11504326061892920320, 14258287031011967747, 11059012597447608871, 10771978082784373745],
              [9301308972040754525, 3926809467056848703, 8906762080995474721, 10448857664043669431],
              [14039264565928181804, 6419270726637347647, 9032336944369089237, 9098362570781628847]]


def test_noise_depends_on_seed_position_and_id_only():
    from finetune.generation import gumbel_noise, noise_bits

    seeds = torch.tensor([11, 22, 33, 11])
    a = noise_bits(seeds, 0, 64)
    assert torch.equal(a[0], a[3]) and not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], noise_bits(seeds, 1, 64)[0])
    assert torch.equal(noise_bits(seeds, 5, 64), torch.cat([noise_bits(seeds[i:i + 1], 5, 64) for i in range(4)]))
    assert len(set(a[:3].flatten().tolist())) == 3 * 64  # no repeats among 192 64-bit values
    g = gumbel_noise(torch.arange(2000), 0, 50)
    assert g.dtype == torch.float64 and torch.isfinite(g).all()
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)  # the Euler-Mascheroni constant
    assert g.var().item() == pytest.approx(torch.pi ** 2 / 6, rel=0.02)


def test_gumbel_max_draws_follow_the_filtered_softmax():
    """Over many seeds, each token's share of the draws is its probability under softmax(logits / T)
    after top_k / top_p (and 0 for the ids past the tokenizer's vocabulary)."""
    from finetune.generation import next_tokens

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 5.0, 5.0])  # the last two: padded embedding rows
    seeds = torch.arange(40_000)
    for sampling, want in [
        (Sampling(1, temperature=1.0), torch.softmax(logits[:6], -1)),
        (Sampling(1, temperature=0.5), torch.softmax(logits[:6] / 0.5, -1)),
        (Sampling(1, temperature=1.0, top_k=3), torch.softmax(torch.tensor([2.0, 1.0, 3.0]), -1)),
        (Sampling(1, temperature=1.0, top_p=0.8), None),
    ]:
        drawn = next_tokens(logits.expand(len(seeds), -1), sampling, seeds, 4, vocab_size=6)
        share = torch.bincount(drawn, minlength=8).double() / len(seeds)
        assert share[6:].sum() == 0, "the padded rows are never drawn"
        if sampling.top_k == 3:
            want = torch.zeros(6).index_put_((torch.tensor([0, 1, 5]),), want)
        if sampling.top_p < 1:  # 3.0 (0.63) then 2.0 (0.23) reach 0.8: those two only
            p = torch.softmax(logits[:6], -1)
            want = torch.zeros(6).index_put_((torch.tensor([0, 5]),), p[[0, 5]] / p[[0, 5]].sum())
        assert torch.allclose(share[:6], want.double(), atol=0.01), (sampling, share, want)
    greedy = next_tokens(logits.expand(3, -1), Sampling(1), None, 0, vocab_size=6)
    assert greedy.tolist() == [5, 5, 5] and next_tokens(logits[None], Sampling(1), None, 0).tolist() == [6]


def test_ids_past_the_tokenizers_vocabulary_are_never_generated():
    """The tiny model's 128 embedding rows hold a 108-token vocabulary: rows made the likeliest by far are
    still never generated, greedy or sampled, once vocab_size is given."""
    model = _tiny_llama(vocab_size=128)
    head = torch.nn.Linear(32, 128, bias=True)  # the same weights, with a bias that favours the padded rows
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[108:] = 50.0
    model.lm_head = head
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate(model, prompts, Sampling(6), stop_ids=(), pad_id=0, context=None)
    assert all(t >= 108 for c in free for t in c.tokens), "the check: without the mask those rows win"
    for sampling, seeds in [(Sampling(6), None), (Sampling(6, temperature=1.5), [1, 2]),
                            (Sampling(6, temperature=1.0, top_k=3), [3, 4])]:
        out = generate(model, prompts, sampling, stop_ids=(), pad_id=0, context=None, seeds=seeds, vocab_size=108)
        assert all(len(c.tokens) == 6 and max(c.tokens) < 108 for c in out)


@pytest.mark.internals
@pytest.mark.parametrize("sampling", [Sampling(12), Sampling(12, temperature=1.0, top_p=0.9)])
def test_the_compiled_static_cache_loop_gives_the_eager_tokens(sampling):
    """compiled=True (StaticCache, a torch.compile'd one-token step; what a GPU runs by default) on CPU:
    the eager loop's tokens, prompts of different lengths left-padded, stop ids ending some early, a
    context bound, and again (the compiled step reused for another batch)."""
    model = _tiny_llama(positions=48)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [4], [5 + i % 60 for i in range(40)]]
    seeds = [11, 22, 33, 44] if sampling.temperature else None
    kw = dict(stop_ids=(), pad_id=0, context=48, seeds=seeds)
    eager = generate(model, prompts, sampling, **kw)
    compiled = generate(model, prompts, sampling, compiled=True, **kw)
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]
    assert [len(c.tokens) for c in eager] == [12, 12, 12, 8]
    ends = {eager[0].tokens[4], eager[2].tokens[2]}
    kw["stop_ids"] = ends
    cut = generate(model, prompts[::-1], sampling, compiled=True, **{**kw, "seeds": seeds and seeds[::-1]})
    want = generate(model, prompts[::-1], sampling, **{**kw, "seeds": seeds and seeds[::-1]})
    assert [(c.tokens, c.stopped) for c in cut] == [(c.tokens, c.stopped) for c in want]
    assert any(c.stopped for c in cut)
    # a multi-turn generation (turns: tokens fed at each turn's end, the cache going on): the same in both loops
    from tests.test_agent import Feed

    talks = [generate(model, prompts[::-1], sampling, compiled=compiled, turns=Feed([50, 51], rounds=2),
                      **{**kw, "seeds": seeds and seeds[::-1]}) for compiled in (True, False)]
    assert [(c.tokens, c.mask, c.stopped) for c in talks[0]] == [(c.tokens, c.mask, c.stopped) for c in talks[1]]
    assert any(0 in c.mask for c in talks[0])


@pytest.mark.internals
def test_the_compiled_step_is_traced_once_for_new_weights_and_prompt_widths():
    """A rollout regathers the weights (new storage under ZeRO-3 and FSDP) and its longest prompt varies:
    the compiled step is reused, not traced again, and still gives the eager tokens."""
    from torch._dynamo.utils import counters

    model = _tiny_llama()
    kw = dict(stop_ids=(), pad_id=0, context=None)
    generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], Sampling(6), compiled=True, **kw)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone() * 1.01
    prompts = [[9] * 11, [1]]
    again = generate(model, prompts, Sampling(6, temperature=1.0), compiled=True, seeds=[5, 6], **kw)
    assert counters["stats"]["unique_graphs"] == graphs
    eager = generate(model, prompts, Sampling(6, temperature=1.0), seeds=[5, 6], **kw)
    assert [c.tokens for c in again] == [c.tokens for c in eager]


def _autocast_forward(model, dtype):
    """The model's forward under autocast over its fp32 weights, as Accelerate wraps it for
    mixed_precision=bf16/fp16 under ddp (accelerator.prepare_model: autocast around forward)."""
    import functools

    model.forward = functools.wraps(model.forward)(torch.autocast("cpu", dtype=dtype)(model.forward))
    return model


# what a GPU run's rollout computes in: autocast over fp32 weights (ddp), 16-bit weights (DeepSpeed's bf16
# engine, FSDP2's cast for compute, a 16-bit LoRA base), fp32
PRECISIONS = {"bf16 autocast": lambda m: _autocast_forward(m, torch.bfloat16),
              "fp16 autocast": lambda m: _autocast_forward(m, torch.float16),
              "bf16 weights": lambda m: m.to(torch.bfloat16), "fp32": lambda m: m}


@torch.no_grad()
def compiled_against_eager_logits(model, prompts: list[list[int]], tokens: int) -> tuple[float, int, int]:
    """The compiled loop's logits (finetune.generation._Decoder: its StaticCache and compiled step) fed the
    eager loop's greedy tokens, against the eager loop's own logits at each step (prompts of one length).
    Returns (the largest |difference| over the logits' range, steps whose argmax differs where eager's top
    two are apart by more than that difference, steps compared). In 16 bits the compiled kernels round
    differently (a near tie can go the other way, so whole sequences may part), but the logits stay
    within rounding of each other; a cache that stored or read the wrong values would not."""
    from finetune.generation import _Decoder

    ids = torch.tensor(prompts)
    n, width = ids.shape
    step = _Decoder(model, n, width, tokens, None, None)
    past, fed_eager, fed_compiled, worst, span, flips = None, ids, ids, 0.0, 0.0, []
    for t in range(tokens):
        result = model(input_ids=fed_eager, past_key_values=past, use_cache=True, logits_to_keep=1)
        past, want = result.past_key_values, result.logits[:, -1].float()
        got = step(fed_compiled, t).float()
        diff = (got - want).abs().max().item()
        worst, span = max(worst, diff), max(span, (want.max() - want.min()).item())
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        flips.append(int((clear & (got.argmax(-1) != want.argmax(-1))).sum()))
        fed_eager = fed_compiled = want.argmax(-1, keepdim=True)
    return worst / span, sum(flips), tokens


@pytest.mark.internals
@pytest.mark.parametrize("precision, family", [(p, "llama3") for p in PRECISIONS] + [
    ("bf16 autocast", "mistral"), ("bf16 autocast", "qwen2"), ("bf16 weights", "gemma2")])
def test_the_compiled_loop_runs_in_every_precision_and_matches_the_eager_loop(precision, family):
    """The compiled loop in the precisions GPU users run: its static cache holds one dtype per tensor, while
    autocast gives 16-bit values and fp32 keys (the rotary embedding is computed in fp32), which failed at
    the prefill's first cache write ("index_copy_(): self and source expected to have the same dtype") for
    every GRPO run at mixed_precision=bf16 on a GPU. fp32: the eager loop's tokens, greedy and sampled.
    16 bits: the logits of each step, fed the same tokens, within rounding of the eager loop's, and the
    same token wherever the eager loop's choice is not a near tie. Small random-weight models of real
    families (Mistral's sliding window, Qwen2's tied embeddings, Gemma 2's alternating sliding layers)."""
    import transformers

    torch.manual_seed(0)
    config = FA.family_config(family, vocab_size=96)
    model = getattr(transformers, FA.FAMILIES[family].config.replace("Config", "ForCausalLM"))(config).eval()
    model = PRECISIONS[precision](model)
    if precision == "fp32":
        prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [4], [5 + i % 60 for i in range(30)]]
        for sampling, seeds in [(Sampling(10), None), (Sampling(10, temperature=1.0), [11, 22, 33, 44])]:
            kw = dict(stop_ids=(), pad_id=0, context=None, seeds=seeds)
            eager = generate(model, prompts, sampling, **kw)
            compiled = generate(model, prompts, sampling, compiled=True, **kw)
            assert [c.tokens for c in compiled] == [c.tokens for c in eager], sampling
        return
    compiled = generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], Sampling(6, temperature=1.0), stop_ids=(), pad_id=0,
                        context=None, seeds=[1, 2], compiled=True)
    assert [len(c.tokens) for c in compiled] == [6, 6]
    relative, flips, steps = compiled_against_eager_logits(model, [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5]], 10)
    assert relative < (0.02 if "bf16" in precision else 0.005), relative
    assert flips == 0


@pytest.mark.internals
@pytest.mark.parametrize("base", ["lora on a bf16 base", "qlora (nf4 base, bf16 compute)"])
def test_the_compiled_loop_runs_lora_and_a_4bit_base_in_bf16(base):
    """GRPO with LoRA generates from peft's model (16-bit base, fp32 adapters) and with QLoRA from an NF4
    base (bitsandbytes' Linear4bit), under autocast as ddp runs it: the compiled loop runs, and its logits
    match the eager loop's as in test_the_compiled_loop_runs_in_every_precision_and_matches_the_eager_loop."""
    from transformers import AutoModelForCausalLM

    from finetune.assets import tiny_model_dir
    from finetune.model import add_lora, load_4bit_base
    from finetune.recipe import Recipe

    path = str(tiny_model_dir())
    if base.startswith("qlora"):
        model = load_4bit_base(path, torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = add_lora(model, Recipe(lora=True, lora_dropout=0.0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model = _autocast_forward(model.eval(), torch.bfloat16)
    compiled = generate(model, [[1, 5, 9, 13], [1, 7]], Sampling(6, temperature=1.0), stop_ids=(), pad_id=0,
                        context=None, seeds=[1, 2], compiled=True)
    assert [len(c.tokens) for c in compiled] == [6, 6]
    relative, flips, _ = compiled_against_eager_logits(model, [[1, 5, 9, 13], [1, 7, 7, 7], [1, 20, 21, 22]], 8)
    assert relative < 0.02, relative
    assert flips == 0
