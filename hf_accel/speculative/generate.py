"""`generate()` integration: the `custom_generate` callable, and a `CandidateGenerator` adapter for chain drafters.

```python
from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters import build_drafter

drafter = build_drafter("ngram", None, model, tokenizer)
out = model.generate(**inputs, custom_generate=custom_generate, drafter=drafter, max_new_tokens=64)
out.speculative_stats.mean_accepted  # tokens per target pass, bonus included
```

transformers 5.23 runs its usual preparation (generation config, cache, logits processors, stopping criteria,
`max_length`) and then calls the callable as `custom_generate(model, input_ids, logits_processor=...,
stopping_criteria=..., generation_config=..., **model_kwargs)`, passing through the extra keyword arguments named
in its signature (here `drafter`). It does *not* forward `streamer` to a callable (it only feeds it the prompt), so
this function finds the streamer of the enclosing `generate` call itself; see [`_generate_argument`].
"""

import copy
import functools
import inspect
import sys
import threading
import time

import torch
from transformers import __version__ as transformers_version
from transformers.generation import (
    CandidateGenerator,
    GenerateDecoderOnlyOutput,
    GenerationMode,
    LogitsProcessor,
    LogitsProcessorList,
    SynthIDTextWatermarkLogitsProcessor,
)

from ..compat import CACHE_NAME, check_cache_argument
from .acceptance import position_samples
from .cache import refuse_filled_cache
from .engine import (
    DraftRequest,
    SpeculativeEngine,
    VerifyResult,
    check_draft_ids,
    draft_position_limit,
    input_vocab_size,
    longrope_switch,
    max_draft_depth,
)
from .tree import DraftTree


def custom_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    **model_kwargs,
):
    """Speculative decoding as a `custom_generate` callable for `model.generate`.

    Args:
        model (`PreTrainedModel`): the target model (transformers passes it first).
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): left-padded prompts.
        logits_processor (`LogitsProcessorList`): prepared by `generate`.
        stopping_criteria (`StoppingCriteriaList`): prepared by `generate` (EOS, max length, stop strings).
        generation_config (`GenerationConfig`): prepared by `generate`; `do_sample` selects lossless sampling.
        synced_gpus (`bool`, *optional*): unsupported (must be `False`; `generate` turns it on for a model sharded
            by DeepSpeed ZeRO-3 or FSDP across processes, which is refused too).
        streamer (`BaseStreamer`, *optional*): batch size 1 only.
        drafter: an object following the drafter protocol of [`~hf_accel.speculative.engine`] (required).
        **model_kwargs: `attention_mask`, `cache` (`past_key_values` before transformers 5.24), `position_ids`, ...
            as prepared by `generate`.

    Stop strings: transformers 5.23 drops `generate(tokenizer=...)` when `custom_generate` is a callable, so
    `stop_strings=` alone raises there; pass them as a criterion instead, which this loop honours exactly:
    `stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, ["\n\n"])])`.

    Returns:
        `torch.LongTensor` of shape `(batch_size, prompt_length + generated)` (or a `GenerateDecoderOnlyOutput` with
        `return_dict_in_generate=True`, whose cache is `None`: the engine's cache has holes between a
        batch's rows and has dropped finished rows, so it is not the cache plain `generate` would return), with
        `.speculative_stats` attached ([`SpeculativeStats`]). `drafter.last_stats` is set to them too (what a
        thread that only started the call, as with `TextIteratorStreamer`, can read after joining it); with one
        drafter serving calls in several threads at once, `last_stats` is the last call to end, so read each call's
        from its output.

    Example:

    ```python
    >>> out = model.generate(**inputs, custom_generate=custom_generate, drafter=drafter, max_new_tokens=32)
    ```
    """
    _validate_call(
        "custom_generate", model, drafter, generation_config, logits_processor, stopping_criteria, model_kwargs,
        input_ids,
    )  # fmt: skip
    _validate_engine_call(model, generation_config, _synced_gpus(model, synced_gpus), model_kwargs)
    drafter.last_stats = None  # an earlier call's until this one ends: a call that raises leaves none
    streamer = streamer if streamer is not None else _generate_argument("streamer")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(f"streaming supports batch size 1, got {input_ids.shape[0]}; drop `streamer=` or the batch")
    engine = SpeculativeEngine(model, drafter, generation_config, logits_processor, stopping_criteria, streamer)
    sequences = engine.generate(
        input_ids,
        attention_mask=model_kwargs.get("attention_mask"),
        cache=model_kwargs.get(CACHE_NAME),
        position_ids=model_kwargs.get("position_ids"),
    )
    drafter.last_stats = engine.stats
    if generation_config.return_dict_in_generate:
        output = GenerateDecoderOnlyOutput(sequences=sequences)
        output.speculative_stats = engine.stats
        return output
    sequences.speculative_stats = engine.stats
    return sequences


def _validate_call(
    loop: str, model, drafter, generation_config, logits_processor, stopping_criteria, model_kwargs, input_ids
):
    """What both loops refuse, in one line each."""
    if generation_config is None or logits_processor is None or stopping_criteria is None:
        raise TypeError(
            f"{loop} runs inside `model.generate(..., custom_generate={loop}, drafter=...)`, which prepares its "
            "generation config, logits processors and stopping criteria; a direct call must pass all three"
        )
    if not callable(getattr(drafter, "propose", None)):  # a name such as "ngram" is built with `build_drafter` first
        got = "none" if drafter is None else f"{type(drafter).__name__} {drafter!r}"[:80]
        raise TypeError(
            f"{loop} needs a drafter object, got {got}: pass `drafter=build_drafter('ngram', None, model, tok)`"
        )
    check_cache_argument(model)
    # modes both loops would silently run as greedy search or sampling (beams, contrastive, DoLa, CFG)
    if generation_config.num_beams not in (None, 1):
        raise ValueError(f"speculative decoding needs num_beams=1, got {generation_config.num_beams}")
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION):
        raise ValueError(f"speculative decoding does greedy search or sampling, not {mode.value}; drop its arguments")
    if generation_config.guidance_scale not in (None, 1):
        raise ValueError("`guidance_scale` (classifier-free guidance) is not supported by speculative decoding")
    # processors that keep a state assuming one committed token per call: both loops call them once per draft node,
    # so rejected drafts would enter their state
    if any(isinstance(p, SynthIDTextWatermarkLogitsProcessor) for p in logits_processor or ()):
        raise ValueError("SynthID watermarking (`watermarking_config`) is not supported by speculative decoding")
    # PEFT's generate hooks its prompt learning (virtual tokens, a KV prefix) into `prepare_inputs_for_generation`,
    # which the engine never calls (it would decode without them) and transformers' assisted loop misaligns
    peft_model = getattr(getattr(model, "prepare_inputs_for_generation", None), "__self__", None)
    if getattr(getattr(peft_model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError(
            "speculative decoding does not support PEFT prompt learning (prompt, prefix or p-tuning: its virtual "
            "tokens); adapters such as LoRA are supported"
        )
    # aLoRA adapts only the last `offset` tokens of each forward pass (one per decoding step in `generate`): a pass
    # over several draft tokens would score the first ones without the adapter
    hooked = _peft_hook_arguments(model)
    if any(offset is not None for offset in hooked.get("alora_offsets") or ()):
        raise ValueError(
            "speculative decoding does not support aLoRA (PEFT's activated LoRA): it adapts only the last tokens of "
            "each forward pass, so draft tokens verified together would be scored without the adapter"
        )
    if _has_xlora_layers(model):
        raise ValueError(
            "speculative decoding does not support X-LoRA (PEFT's mixture of LoRA experts): every forward pass runs "
            "the model twice, the first time to compute its scalings, and both passes would write into the cache "
            "(X-LoRA needs `use_cache=False`); use plain `generate`"
        )
    if input_ids.shape[0] > 1 and "adapter_names" in hooked:
        raise ValueError(
            "PEFT's mixed-adapter batches (`adapter_names`) run with batch size 1 in speculative decoding: a row that "
            "finishes leaves the batch, which PEFT's per-row adapter list cannot follow; generate each adapter's rows "
            "in their own call (`set_adapter`)"
        )
    if input_ids.shape[0] > 1 and "task_ids" in hooked:
        raise ValueError(
            "PEFT Poly's `task_ids` run with batch size 1 in speculative decoding: a row that finishes leaves the "
            "batch, which Poly's per-row task list cannot follow; generate each row in its own call"
        )
    switch = longrope_switch(model)
    prompt_mask = model_kwargs.get("attention_mask")
    shortest = int(prompt_mask.sum(-1).min()) if prompt_mask is not None else input_ids.shape[1]
    if switch is not None and shortest <= switch < generation_config.max_length:
        raise ValueError(
            f"{type(model).__name__}'s longrope RoPE switches every position to its long factors once a sequence "
            f"passes {switch} tokens (`original_max_position_embeddings`), which speculative decoding cannot follow "
            f"mid-generation: keep prompt + new tokens within {switch} (every prompt longer is fine), or use plain "
            "`generate`"
        )
    # drafters read tokens; transformers' assisted loop would also run its first pass on the prompt's embeddings
    # alone, without the draft, and accept drafts against the wrong logits
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "speculative decoding needs `input_ids` (drafters read tokens); `inputs_embeds` is not supported"
        )


# What `generate` prepares for a decoder-only model and the engine reads (or may ignore: `use_cache`, as it always
# caches; the output flags, which change no token and are refused below where `return_dict_in_generate` would use them)
_ENGINE_MODEL_KWARGS = (
    "attention_mask", CACHE_NAME, "position_ids", "use_cache", "logits_to_keep",
    "output_attentions", "output_hidden_states",
)  # fmt: skip


def _validate_engine_call(model, generation_config, synced_gpus, model_kwargs):
    """What hf-accel's own loop refuses besides [`_validate_call`]."""
    if synced_gpus:
        raise ValueError(
            "speculative decoding does not support `synced_gpus=True` (a model sharded by DeepSpeed ZeRO-3 or FSDP "
            "across processes); use plain `generate`"
        )
    # the engine runs the model on tokens, positions, the mask and the cache only: any other input `generate` would
    # pass on (a vision-language model's encoded `pixel_values`, ...) would be dropped and the text silently differ;
    # those of a text-only call change nothing (see `_text_only`)
    dropped = sorted(k for k, v in model_kwargs.items() if k not in _ENGINE_MODEL_KWARGS and not _text_only(k, v))
    if dropped:
        raise ValueError(
            "hf-accel's speculative decoding runs the model on `input_ids` alone (no images or other inputs) and "
            f"would ignore {', '.join(f'`{k}`' for k in dropped)}; use plain `generate` for such inputs"
        )
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag, False):
            raise ValueError(f"`{flag}=True` is not supported by hf-accel's speculative decoding; drop it")
    attention = str(getattr(model.config, "_attn_implementation", None))
    if "flash" in attention or "paged" in attention:
        # FlashAttention kernels take no 4D mask: a draft tree would be attended to as one causal sequence
        raise ValueError(
            f"attn_implementation={attention!r} takes no 4D attention mask, which tree verification needs; load the "
            "model with attn_implementation='sdpa' or 'eager' for speculative decoding"
        )
    forward = inspect.signature(type(model).forward).parameters  # the class's: an instance's may be wrapped
    if "position_ids" not in forward or getattr(model.config, "alibi", False):
        # Tree verification gives every node its own position; ALiBi models (Bloom, MPT, Falcon with alibi) derive
        # positions from the attention mask and would score a tree as if its nodes were one sequence.
        raise ValueError(
            f"{type(model).__name__} takes no per-token `position_ids` (ALiBi or no positions), which tree "
            "verification needs; hf-accel's speculative decoding supports models with `position_ids`"
        )


def _peft_hook_arguments(model) -> dict:
    """The keyword arguments that forward pre-hooks inject into `model`'s layers: PEFT's `generate` passes a call's
    `adapter_names` (mixed-adapter batches) and aLoRA's `alora_offsets` to its LoRA layers this way, and Poly its
    `task_ids`, sized to the prompt's rows."""
    injected = {}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            injected.update(getattr(hook, "keywords", None) or {})  # LoRA's hooks are `functools.partial`s
            injected.update(_closure_variables(hook))  # Poly's is a closure over `task_ids`
    return injected


def _has_xlora_layers(model) -> bool:
    """Whether `model`'s LoRA layers run X-LoRA's forward (PEFT replaces their `forward` by an `XLoraLayer`'s); a model
    can have them only once PEFT's X-LoRA module is imported."""
    xlora = sys.modules.get("peft.tuners.xlora.layer")
    if xlora is None:
        return False
    return any(isinstance(getattr(m.forward, "__self__", None), xlora.XLoraLayer) for m in model.modules())


def _closure_variables(function) -> dict:
    """The variables a Python function closes over, by name (none for other callables)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    variables = {}
    for name, cell in zip(code.co_freevars if code is not None else (), cells):
        try:
            variables[name] = cell.cell_contents
        except ValueError:  # a cell not assigned yet
            pass
    return variables


def _text_only(name: str, value) -> bool:
    """Whether a model input says nothing beyond the tokens: none, empty (`mm_encoder_outputs={}` of a text-only call
    to a vision-language model), or the all-zero `mm_token_type_ids` a VLM's processor returns with text alone
    (transformers' modality types: 0 is text)."""
    if value is None or (isinstance(value, (dict, list, tuple)) and len(value) == 0):
        return True
    return name == "mm_token_type_ids" and torch.is_tensor(value) and not bool(value.any())


def _generate_argument(name: str):
    """The argument `name` of the enclosing `GenerationMixin.generate` frame, or `None`.

    transformers 5.23 passes a callable `custom_generate` only the keyword arguments its own loops do not take (it
    rebuilds them from the callable's extra parameters), dropping `streamer` (it calls `streamer.put(prompt)` itself)
    and `synced_gpus`; reading the caller's locals is the only way to honour `model.generate(..., streamer=s,
    custom_generate=...)`. A frame counts only if it also holds `custom_generate` (not a user's own `generate`).
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "generate" and name in frame.f_locals and "custom_generate" in frame.f_locals:
                return frame.f_locals[name]
            frame = frame.f_back
        return None
    finally:
        del frame


def _synced_gpus(model, synced_gpus) -> bool:
    """`synced_gpus` as `generate` decides it: the call's own value, else on for a model sharded by DeepSpeed ZeRO-3
    or FSDP across several processes (each then runs every forward pass, until all have finished)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    passed = synced_gpus or _generate_argument("synced_gpus")
    if passed is not None:
        return bool(passed)
    distributed = torch.distributed
    world_size = distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1
    return (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and world_size > 1


class DrafterCandidateGenerator(CandidateGenerator):
    """Adapter so that a *chain* drafter runs inside transformers' own assisted-generation loop (batch size 1).

    Use it through `model.generate(..., custom_generate=assisted_generate, drafter=d)`. The drafter's tree must be a chain (the first
    path is taken otherwise); draft probabilities are not passed on (transformers then uses the point-mass rule).
    Drafters that read the pass (hidden states, auxiliary inputs' logits) are refused: the loop exposes neither.

    Args:
        drafter: a drafter following hf-accel's protocol.
        generation_config (`GenerationConfig`): the call's config (for `do_sample` and `max_length`).
        prompt_length (`int`): length of the prompt in `input_ids`.
        vocab_size (`int`, *optional*): the target's input vocabulary; drafts of other ids are refused in one line.
        position_limit (`int`, *optional*): the target's [`~engine.draft_position_limit`]: no draft token is placed
            at or past it.
        stopping_criteria (`StoppingCriteriaList`, *optional*): the call's criteria; a draft ends before the first
            token at which they would stop (see [`_draft_length_before_stop`]).
        attention_mask (`torch.LongTensor` of shape `(1, prompt_length)`, *optional*): the prompt's padding mask
            (requests' `attention_mask`, so that their context leaves the left padding out); none: no padding.
    """

    def __init__(
        self,
        drafter,
        generation_config,
        prompt_length: int,
        vocab_size: int | None = None,
        position_limit=None,
        stopping_criteria=None,
        attention_mask=None,
    ):
        self.drafter = drafter
        self.attention_mask = attention_mask
        self.vocab_size = vocab_size
        self.position_limit = position_limit
        self.stopping_criteria = stopping_criteria
        self.generation_config = generation_config
        self.prompt_length = prompt_length
        self.drafter_time_s = 0.0
        self._chain_nodes, self._pass_start = [], None  # the last draft's node ids; when the target pass began

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError("transformers' assisted loop supports batch size 1; use `custom_generate` for batches")
        length = input_ids.shape[1]
        remaining = torch.tensor([self.generation_config.max_length - length - 1])
        max_depth = max_draft_depth(remaining, torch.tensor([length - 1]), self.position_limit)  # the root: length - 1
        prompt_mask = self.attention_mask
        if prompt_mask is None:
            prompt_mask = torch.ones_like(input_ids[:, : self.prompt_length])
        request = DraftRequest(
            input_ids, torch.tensor([length]), self.prompt_length, prompt_mask, torch.tensor([0]), max_depth,
            bool(self.generation_config.do_sample),
        )  # fmt: skip
        tic = time.perf_counter()
        tree = self.drafter.propose(request)
        self.drafter_time_s += time.perf_counter() - tic
        if tree is not None and tree.num_aux:  # PPD's prompt tokens: the loop feeds tokens only, returns no logits
            raise ValueError(
                "transformers' assisted loop cannot run a draft's auxiliary inputs (`aux_embeds`) nor return their "
                "logits; use `custom_generate`"
            )
        # a drafter may ignore `max_depth`: deeper candidates cannot be committed, and models with a position table
        # (GPT-2, OPT) have no position for them when `max_length` is the table's size
        self._chain_nodes = _first_chain(tree)[: max(0, int(request.max_depth[0]))]
        chain = tree.input_ids[0, self._chain_nodes].tolist() if self._chain_nodes else []
        chain = torch.tensor([chain], dtype=torch.long, device=input_ids.device)
        check_draft_ids(chain, self.vocab_size)
        keep = _draft_length_before_stop(self.stopping_criteria, input_ids, chain)
        chain, self._chain_nodes = chain[:, :keep], self._chain_nodes[:keep]
        candidates = torch.cat([input_ids, chain], 1)
        self._pass_start = time.perf_counter()
        return candidates, None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores, num_matches: int):
        # what the engine reports after a pass, so that drafters learn pass costs and acceptance here too
        if not hasattr(self.drafter, "update") or self._pass_start is None:
            return
        self.drafter.update(
            VerifyResult(
                rows=torch.tensor([0]),
                new_tokens=[input_ids[0, -(num_matches + 1) :].tolist()],
                best_node=torch.tensor([self._chain_nodes[num_matches - 1] if num_matches else -1]),
                path_length=torch.tensor([num_matches + 1]),
                finished=torch.tensor([False]),
                num_input_tokens=1 + len(self._chain_nodes),
                pass_seconds=time.perf_counter() - self._pass_start,
            )
        )


def _draft_length_before_stop(stopping_criteria, input_ids: torch.LongTensor, chain: torch.LongTensor) -> int:
    """How many tokens of `chain` `[1, n]` may be drafted after `input_ids`: those before the first one at which the
    stopping criteria would stop. transformers' assisted loop asks them once per pass, after appending every accepted
    token, and a stop string ends only the text it is found at the end of: a draft running past a stop point was kept
    and decoding went on. Cut there, the target's own token at that point is the pass's last (its bonus token), so
    the loop stops where plain `generate` does."""
    if not stopping_criteria:
        return chain.shape[1]
    for k in range(1, chain.shape[1] + 1):
        if bool(stopping_criteria(torch.cat([input_ids, chain[:, :k]], 1), None).any()):
            return k - 1
    return chain.shape[1]


def _first_chain(tree: DraftTree | None) -> list[int]:
    """Node ids (drafter numbering) of the chain starting at the first child of the root (the whole draft for a
    chain drafter)."""
    if tree is None or tree.num_nodes == 0:
        return []
    parent = tree.parent[0].tolist()
    valid = tree.node_mask[0].tolist() if tree.node_mask is not None else [True] * len(parent)
    chain, last = [], -1
    for i, p in enumerate(parent):
        if valid[i] and p == last:
            chain.append(i)
            last = i
    return chain


def assisted_generate(
    model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, synced_gpus=False,
    streamer=None, drafter=None, **model_kwargs,
):  # fmt: skip
    """Runs transformers' own assisted-generation loop with a chain drafter (via [`DrafterCandidateGenerator`]).

    Sampling draws its randomness per output position, as hf-accel's own loop does ([`_PositionSampling`]): a seeded
    call gives the same text whatever the drafter proposed (its drafts' lengths follow measured pass times), the text
    `custom_generate` gives with that seed. With `output_scores`, a sampled call's scores are `-inf` but at the sampled
    token, which keeps its log-probability (so `compute_transition_scores` gives the sampled tokens' log-probabilities)."""
    _validate_call(
        "assisted_generate", model, drafter, generation_config, logits_processor, stopping_criteria, model_kwargs,
        input_ids,
    )  # fmt: skip
    _check_assisted_loop(model)
    if getattr(drafter, "requires_hidden_states", ()):  # CP heads, SpecFormer: their `update` would get none
        raise ValueError(
            "transformers' assisted loop hands a drafter no hidden states (it asks for `requires_hidden_states`); "
            "use `custom_generate`"
        )
    if hasattr(drafter, "propose_prefill"):  # PPD: its first guesses come from its prompt tokens in the prefill
        raise ValueError(
            "transformers' assisted loop runs its prefill without a drafter's auxiliary inputs (it has "
            "`propose_prefill`); use `custom_generate`"
        )
    # transformers' assisted loop feeds its first pass the whole `input_ids` on top of the cached tokens (its own
    # prompt lookup does too): continuing from a filled cache would decode garbage
    refuse_filled_cache(model_kwargs.get(CACHE_NAME))
    if hasattr(drafter, "last_stats"):
        drafter.last_stats = None  # an earlier `custom_generate` call's: transformers' loop keeps no such statistics
    streamer = streamer if streamer is not None else _generate_argument("streamer")
    prompt_mask = model_kwargs.get("attention_mask")  # the drafter sees the prompt's padding as the engine shows it
    if prompt_mask is None:
        prompt_mask = torch.ones_like(input_ids)
    if hasattr(drafter, "begin"):
        drafter.begin(input_ids, prompt_mask, generation_config)
    candidate_generator = DrafterCandidateGenerator(
        drafter,
        generation_config,
        input_ids.shape[1],
        input_vocab_size(model),
        draft_position_limit(model),
        stopping_criteria,
        prompt_mask,
    )
    if generation_config.do_sample:
        # transformers samples every candidate position of a pass at once, so the randomness a pass takes from torch's
        # generator depends on the draft's length: sample per position instead, the loop's greedy pick taking the
        # one token `_PositionSampling` leaves finite
        padding = int((prompt_mask[0] == 0).sum())
        logits_processor = LogitsProcessorList([*(logits_processor or []), _PositionSampling(padding)])
        generation_config = copy.copy(generation_config)
        generation_config.do_sample = False
    # `_assisted_decoding` builds its generator with `_get_candidate_generator`; shadow that method on this instance
    # while calls are in flight (transformers 5.23 has no public hook to pass a CandidateGenerator in), each thread
    # getting its own call's generator
    _assisted_call.generator = candidate_generator
    with _shadow_lock:
        if not _calls_in_flight.get(id(model)):
            model._get_candidate_generator = functools.partial(_this_threads_candidate_generator, model)
        _calls_in_flight[id(model)] = _calls_in_flight.get(id(model), 0) + 1
    try:
        return model._assisted_decoding(
            input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, synced_gpus=_synced_gpus(model, synced_gpus), streamer=streamer,
            **model_kwargs,
        )  # fmt: skip
    finally:
        _assisted_call.generator = None
        with _shadow_lock:
            _calls_in_flight[id(model)] -= 1
            if not _calls_in_flight[id(model)]:
                del _calls_in_flight[id(model)], model._get_candidate_generator


# The private methods of transformers' assisted loop that `assisted_generate` runs (5.23 has no public way to hand that
# loop a `CandidateGenerator`): renamed or removed, the shadowed builder would be ignored and transformers' own would
# fail deep inside (`'NoneType' object has no attribute 'device'`: it builds an assistant-model generator without one)
_ASSISTED_LOOP_METHODS = ("_assisted_decoding", "_get_candidate_generator")


def _check_assisted_loop(model) -> None:
    """Refuses, in one line, a transformers whose `GenerationMixin` lacks the assisted loop's private methods."""
    missing = [name for name in _ASSISTED_LOOP_METHODS if not callable(getattr(type(model), name, None))]
    if missing:
        raise RuntimeError(
            f"assisted_generate runs transformers' assisted loop through its private {', '.join(missing)}, which "
            f"this transformers ({transformers_version}) does not have (written for 5.23); use `custom_generate`"
        )


class _PositionSampling(LogitsProcessor):
    """The last processor of a sampled [`assisted_generate`] call, whose loop then picks greedily: the scores become
    `-inf` but at the token sampled with a seed drawn from torch's generator and the output position
    ([`position_samples`], row 0, position counted without the prompt's `padding`), the sample hf-accel's engine
    draws there, whatever the draft, which keeps its log-probability."""

    def __init__(self, padding: int = 0):
        self.seed = int(torch.randint(2**31, ()))  # as the engine draws it
        self.padding = padding

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1] - self.padding
        tokens = position_samples(scores, self.seed, [0] * len(scores), [position] * len(scores))
        log_probs = torch.log_softmax(scores.float(), dim=-1)
        picked = torch.full_like(log_probs, -float("inf"))
        return picked.scatter_(1, tokens[:, None], log_probs.gather(1, tokens[:, None]))


_assisted_call = threading.local()  # `.generator`: the candidate generator of this thread's `assisted_generate`
_calls_in_flight: dict[int, int] = {}  # id(model) -> its `assisted_generate` calls in flight, in any thread
_shadow_lock = threading.Lock()


def _this_threads_candidate_generator(model, *args, **kwargs):
    """What a shadowed `model._get_candidate_generator` returns: this thread's `assisted_generate` generator, or
    transformers' own for a plain assisted `generate` running in another thread meanwhile."""
    generator = getattr(_assisted_call, "generator", None)
    return generator if generator is not None else type(model)._get_candidate_generator(model, *args, **kwargs)
