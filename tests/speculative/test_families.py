"""The engine on every decoder family a transformers user would try: tiny random float32 models (hidden 64, 2
layers, vocabulary 300) whose greedy speculative output must equal plain greedy `generate`, or be refused in one line
before anything is generated (GPT-Neo's local attention, ALiBi)."""

import random

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_accel.compat import CACHE_NAME
from hf_accel.speculative import DraftTree, assisted_generate, custom_generate
from hf_accel.speculative.drafters import build_drafter
from hf_accel.speculative.engine import attention_window
from tests.speculative.test_engine import ReferenceDrafter


VOCAB = 300
_COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_LLAMA_LIKE = {
    **_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip
_FULL = {"layer_types": ["full_attention"] * 2}  # families whose default layout alternates sliding layers

# family -> (config class, model class, config keys)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA_LIKE, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _LLAMA_LIKE),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", _LLAMA_LIKE),
    "gemma2": (  # attention and final logit softcapping
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**_LLAMA_LIKE, **_FULL, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_LLAMA_LIKE, **_FULL}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _LLAMA_LIKE),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _LLAMA_LIKE),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _LLAMA_LIKE),
    "cohere": ("CohereConfig", "CohereForCausalLM", _LLAMA_LIKE),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_LLAMA_LIKE, "sliding_window": None}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **_LLAMA_LIKE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {**_COMMON, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**_COMMON, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            **_COMMON,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "max_position_embeddings": 64,
        },
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {**_COMMON, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "alibi": False},
    ),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**_COMMON, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**_COMMON, "n_embd": 64, "n_layer": 2, "n_head": 4}),
}

# Attention over a window of 8 recent tokens, shorter than prompt + generation (14 + 16): the engine keeps whole
# layers and windows positions in its masks, one for all layers or one per layer type.
WINDOWED = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA_LIKE, "sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_LLAMA_LIKE, "sliding_window": 8}),
    "qwen2": (  # layer 0 slides, layer 1 is full
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**_LLAMA_LIKE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_LLAMA_LIKE, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_LLAMA_LIKE, "sliding_window": 8}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_LLAMA_LIKE, "sliding_window": 8}),
}
# GPT-Neo's local layers mask a window of cache slot indices inside the attention module: refused.
GPT_NEO_LOCAL = (
    "GPTNeoConfig",
    "GPTNeoForCausalLM",
    {**_COMMON, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "window_size": 8,
     "attention_types": [[["global", "local"], 1]]},
)  # fmt: skip


def _build(spec, seed: int = 0):
    config_class, model_class, keys = spec
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**keys)).eval()


def _prompts(rows: int, width: int = 14):
    """Left-padded prompts of different lengths, each repeating its start (the n-gram drafter finds matches)."""
    generator = torch.Generator().manual_seed(rows)
    input_ids = torch.randint(3, VOCAB, (rows, width), generator=generator)
    input_ids[:, width // 2 :] = input_ids[:, : width - width // 2]
    attention_mask = torch.ones_like(input_ids)
    for b in range(rows):
        input_ids[b, : 4 * b], attention_mask[b, : 4 * b] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class _RandomTrees:
    """Seeded random trees of up to 10 nodes per row, each node the reference's token at its depth or a random one.
    It reads the first and last hidden states, as SpecFormer does: every family must hand back the layers named."""

    requires_hidden_states = (0, -1)

    def __init__(self, reference, seed: int = 0):
        self.reference, self.rng = reference, random.Random(seed)

    def update(self, result):
        for layer in self.requires_hidden_states:
            states = result.hidden_states[layer]
            assert states.shape[:2] == (len(result.rows), int(result.path_length.max())), layer

    def propose(self, request):
        trees = []
        for row, length in zip(request.rows.tolist(), request.lengths.tolist()):
            parents, depths, tokens = [], [], []
            for i in range(self.rng.randrange(11)):
                parents.append(self.rng.randrange(-1, i))
                depths.append(1 if parents[-1] < 0 else depths[parents[-1]] + 1)
                column = length + depths[-1] - 1
                good = int(self.reference[row, column]) if column < self.reference.shape[1] else 5
                tokens.append(good if self.rng.random() < 0.7 else self.rng.randrange(3, VOCAB))
            trees.append((tokens, parents))
        return DraftTree.from_parent_lists(trees)


def _assert_speculation_equals_generate(model, family):
    for rows in (1, 3):
        kwargs = {**_prompts(rows), "max_new_tokens": 16, "do_sample": False}
        reference = model.generate(**kwargs)
        drafters = {
            "chain": ReferenceDrafter(reference, depth=5),
            "tree": ReferenceDrafter(reference, depth=4, tree=True),
            "random trees": _RandomTrees(reference),
            "ngram": build_drafter("ngram", None, model, None),
        }
        for name, drafter in drafters.items():
            out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
            assert torch.equal(out, reference), f"{family}, {rows} rows, {name} drafts"
        if rows == 1:
            out = model.generate(**kwargs, custom_generate=assisted_generate, drafter=ReferenceDrafter(reference))
            assert torch.equal(out, reference), f"{family}, transformers' assisted loop"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_speculation_equals_generate_on_every_family(family, prefill):
    _assert_speculation_equals_generate(_build(FAMILIES[family]), family)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_greedy_speculation_equals_generate_past_a_sliding_window(family, prefill):
    """Random trees leave holes between rows' cache slots, so a window over slot indices would differ here."""
    _assert_speculation_equals_generate(_build(WINDOWED[family]), family)


def test_sliding_window_applies_to_explicit_caches_and_plain_layers():
    """A config-less `DynamicCache()` has full layers: the window comes from the engine's masks, not the cache."""
    model = _build(WINDOWED["gemma2"])
    kwargs = {**_prompts(3), "max_new_tokens": 16, "do_sample": False}
    reference = model.generate(**kwargs)
    for cache in (DynamicCache(), DynamicCache(config=model.config)):
        drafter = ReferenceDrafter(reference, depth=4, tree=True)
        out = model.generate(**kwargs, **{CACHE_NAME: cache}, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(out, reference)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_prefill_auxiliary_inputs_see_the_window_of_their_positions(family):
    """Aux inputs of the prefill (PPD's prompt tokens) attend to the last window of the real prompt, as the text
    continued with their tokens would (one mask for Mistral, one per layer type for Gemma 2), in a left-padded batch
    whose prompts (14 tokens) are longer than the window (8)."""
    model = _build(WINDOWED[family])
    kwargs = {**_prompts(3), "max_new_tokens": 16, "do_sample": False}
    reference = model.generate(**kwargs)
    aux_tokens = torch.tensor([11, 12, 13])
    aux_embeds = model.get_input_embeddings()(aux_tokens).detach()  # Gemma's scaled by its embedding module

    class Prefill(ReferenceDrafter):
        def propose_prefill(self, request):
            rows, empty = len(request.rows), torch.zeros((len(request.rows), 0), dtype=torch.long)
            aux_parent = torch.tensor([[-1, 0, 1]]).expand(rows, -1)
            return DraftTree(empty, empty, aux_embeds=aux_embeds.expand(rows, -1, -1), aux_parent=aux_parent)

    drafter = Prefill(reference, depth=4, tree=True)
    assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    for b, (ids, mask) in enumerate(zip(kwargs["input_ids"], kwargs["attention_mask"])):
        expected = model(torch.cat([ids[mask.bool()], aux_tokens])[None]).logits[0, -3:]
        torch.testing.assert_close(drafter.results[0].aux_logits[b], expected, atol=1e-5, rtol=1e-5)


def test_local_attention_is_refused_in_one_line():
    model = _build(GPT_NEO_LOCAL)
    kwargs = {**_prompts(3), "max_new_tokens": 16, "do_sample": False}
    with pytest.raises(ValueError, match="local attention layers window slot indices"):
        model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(model.generate(**kwargs)))


def test_chunked_attention_is_refused_in_one_line():
    """Llama 4's chunked attention windows chunks, not the recent tokens the engine's masks keep."""
    model = _build(("Llama4TextConfig", "Llama4ForCausalLM", {**_LLAMA_LIKE, "attention_chunk_size": 8}))
    kwargs = {**_prompts(1), "max_new_tokens": 4, "do_sample": False}
    message = r"^llama4_text's windowed attention \(chunked_attention 8\) is not supported by speculative decoding, "
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(model.generate(**kwargs)))


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"sliding_window": 4}, r"^mistral's windowed attention \(sliding_attention 4, sliding_attention 8\) is not"),
        ({"sliding_window": None}, r"^mistral mixes sliding and full attention layers without naming them in `layer_"),
    ],
)
def test_windows_that_differ_between_layers_are_refused_in_one_line(layer, message):
    """One mask windows every layer alike: a heterogeneous config (`per_layer_config`) whose layers slide over other
    windows, or some of them over none, without `layer_types` to give each kind its own mask, is refused."""
    config = transformers.MistralConfig(**{**_LLAMA_LIKE, "sliding_window": 8, "per_layer_config": {1: layer}})
    with pytest.raises(ValueError, match=message) as error:
        attention_window(config)
    assert len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention"] * 2])
def test_mistral_given_layer_types_windows_every_layer_by_its_sliding_window(layer_types):
    """Mistral's config takes no `layer_types` field: one given (as old Ministral checkpoints of model type "mistral"
    carry) is kept as an extra key, but the model ignores it and windows every layer by `sliding_window` in one mask.
    The engine had read it: no window at all for full types (other text than generate), a dict of masks for sliding
    ones (a crash)."""
    model = _build(("MistralConfig", "MistralForCausalLM", {**WINDOWED["mistral"][2], "layer_types": layer_types}))
    assert attention_window(model.config) == (8, False)
    _assert_speculation_equals_generate(model, f"mistral with layer_types {layer_types}")
