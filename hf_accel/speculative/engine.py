"""The verification engine: one target pass over a draft tree, acceptance, cache rollback, and the decoding loop.

Every hf-accel drafter runs through this file; a drafter only proposes.

## Drafter protocol

A drafter is any object with a `propose(request: DraftRequest) -> DraftTree | None` method. Optional methods and
*capability attributes* say what else it needs; the engine reads them with `getattr`, never with class checks:

- `begin(input_ids, attention_mask, generation_config)`: called once per `generate` call, before the prefill
  (reset per-call state; `input_ids` are the left-padded prompts). No `position_ids`: the engine places every input
  itself, and a drafter's own RoPE layer (SpecFormer's causal attention) counts positions from `attention_mask`,
  which changes no attention score where a call's `position_ids` start elsewhere (RoPE sees position differences).
- `propose_prefill(request)`: optional, called once after `begin`; returns a `DraftTree` with no draft nodes whose
  auxiliary inputs join the prefill pass under the last prompt token (`aux_parent` `-1`; the request's root), or
  `None`. PPD's prompt tokens (spec 004 §5.2): their logits, in the prefill's `VerifyResult.aux_logits`, are the first
  pass's guesses, so the first verification pass has a draft too. The prompt's logits are unchanged.
- `propose(request)`: returns a [`~hf_accel.speculative.tree.DraftTree`] for the rows in `request.rows` (a chain is
  a tree), or `None` for "no draft this step" (the step is then a plain decoding step).
- `update(result: VerifyResult)`: called after the prefill (`result.is_prefill`) and after every verification
  pass, with the tokens committed per row, the accepted nodes, and what the capability attributes asked for. Rows
  with `result.finished` leave the batch right after this call: later requests and results hold only the others, in
  the same order, each named by its original batch index in `rows` (keep per-row state by that index, and drop the
  finished rows' state here).
- `requires_hidden_states` (`tuple[int, ...]`, default `()`): indices into the model's `hidden_states` output
  (e.g. `(-1,)` for the last layer, `(0, L // 2, -2, -1)` for SpecFormer; `VerifyResult.hidden_states` is keyed by
  them as given; one the target has not is refused); the engine runs the target with
  `output_hidden_states=<those indices>` (transformers then keeps those layers alone) and hands back those layers
  at the committed positions, in order and padded on the
  right (the real prompt positions at the prefill; root + accepted nodes after a verification pass): the same
  layout every time, so CP heads read `[b, path_length[b] - 1]` of layer `-1`, and SpecFormer appends
  `[b, :path_length[b]]` to its own history.
- `provides_draft_probs` (`bool`, default `False`): documentation of intent; the engine uses
  `DraftTree.draft_probs` whenever it is set (lossless rejection sampling) and the point-mass rule otherwise.
- Auxiliary inputs (PPD): a `DraftTree` may carry `aux_embeds` / `aux_parent`; they get their own tree mask rows
  and positions, their KV entries are always dropped, and `VerifyResult.aux_logits` holds their logits. Like draft
  nodes, those deeper than `request.max_depth` sit at that depth (a position table's end, or a longrope or dynamic
  RoPE switch, may lie past it): their logits are not the text's, and could only seed drafts deeper than the next
  pass may verify (an aux input at depth `a` predicts depth `a + 1`, the next pass's depth `a - accepted`).
- `DraftTree.draft_probs` is dense, `[rows, nodes, vocab]`: 263 MB in float32 at batch 8, 64 nodes and Llama 3's
  128,256 tokens, as large as the pass's own float32 logits. Only stochastic drafters need it (CP heads sampling from
  their conditionals; trees of i.i.d. samples); drafts picked deterministically (PPD's top-k guesses, SpecFormer's
  argmax chain, CP's top-k branches) leave it `None`, and sampling stays lossless by the point-mass rule.

## Cache contract

See [`~hf_accel.speculative.cache`]: the engine keeps accepted nodes with `select_cache_positions` (per-layer
`select_positions(index)` if the layer has it, else a gather on axis `-2` of `keys` / `values`) and drops finished
rows with `batch_select_indices`. Any cache class (MLA latents in one-head entries, quantized latents) that offers
these works without engine changes.

## Batching

Rows accept different numbers of tokens. The cache stays rectangular: each pass appends `max_b(path_length_b)`
slots to every row and a per-row validity mask (`past_mask`) hides the unused ones ("holes"), exactly like left
padding; once holes fill 1/8 of the cache, every row's valid slots are moved, in order, to its end
([`_close_holes`]). Position ids count only real tokens, so each row sees the same positions as in an unpadded run.
Finished rows are removed from the batch (cache rows dropped) instead of being carried along as padding. On a CPU a
ragged batch is prefilled in groups of rows of similar prompt length, skipping most of the padding that `generate`'s
one batched prefill computes, into the same left-padded cache ([`~hf_accel.speculative.prefill`]). A model that
RoPEs *cached* keys at attention time (latent caches: CARE, Palu) cannot tell a slot's position from its index once
there are holes; if it sets `_accepts_key_positions = True`, each pass also gets `key_positions`
`[B, cache + new]`, the position of every slot (holes: any value, they are masked). CARE and Palu checkpoints
converted before that attribute existed infer positions from slots: for them holes are closed after every pass.

## Sliding windows

Layers that attend to a window of recent tokens are served from full cache layers (a plain `DynamicCache()`: an
empty cache `generate` built with sliding layers is replaced), and every pass gets a 4D mask windowed by position
(holes make slot indices and positions differ): one mask, or `{"full_attention": ..., "sliding_attention": ...}`
for models whose config names each layer's type ([`attention_window`]).

## Ambiguities resolved here (issue 6)

- Finished rows are right-padded with `pad_token_id` (falling back to the first EOS id, then 0), like `generate`
  with an EOS criterion; `generate` without one keeps sampling for rows stopped by a stop string, we do not.
- Stopping criteria are asked after each accepted token of a row: transformers' own (EOS, max length and time, stop
  strings) on that row alone; any other given the whole batch (other rows as they stand) and read at that row's
  index, so criteria answering per row are exact, and one answering for the whole batch (a single bool) stops only
  the row being checked, since rows reach each length at different times.
- Logits processors that read the context (repetition penalty, min-length, ...) are applied per node with that
  node's own path as context, in a batch of the original size (exact, slow: one call per node), skipping nodes whose
  token their parent's processed scores forbid (never committed), so they see only paths they allow; processors known
  to ignore the context (temperature, top-k/p, ...) are applied once to all nodes.
- Greedy mode is "argmax of the processed logits", as in `generate`; a node is accepted iff its token equals it.
- Sampling with deterministic drafts samples each output position by inversion of its distribution with a uniform
  number keyed by (seed, row, position), and accepts a node iff it equals that sample: lossless (acceptance probability
  `p(draft)`, the point-mass rule's) and the text does not depend on the draft tree. Only the accepted nodes' positions
  are sampled (a walk down the tree), so a wide tree costs no more sampling than a chain. With draft probabilities,
  rejection sampling.
"""

import contextlib
import copy
import functools
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers.generation import (
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    StopStringCriteria,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..compat import CACHE_NAME
from ..kernels.cpu_linear import verification_layout
from ..kernels.gqa_attention import packed_gqa_attention
from .acceptance import accept_by_picks, greedy_accept, match_draft_vocab, position_samples, sample_accept_tree
from .cache import refuse_filled_cache, select_cache_positions, select_cache_rows, validate_cache_for_speculation
from .prefill import grouped_prefill, plan_prefill
from .tree import (
    DraftTree,
    build_tree_attention_mask,
    check_tree_shapes,
    compute_ancestor_matrix,
    compute_depths,
    prefill_ancestors,
    to_verification_parents,
    tree_position_ids,
    validate_parents,
)


# Processors whose output depends on the scores only, never on `input_ids`: one batched call serves every node.
# Matched by exact class: a user's subclass may read the context, and takes the exact per-node path.
_CONTEXT_FREE_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, TopHLogitsWarper, SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor, LogitNormalization,
)  # fmt: skip


@dataclass
class SpeculativeStats:
    """Per-call statistics of a speculative `generate` call (also attached to the output as `.speculative_stats`).

    `accepted_histogram[k]` counts (row, verification pass) pairs that committed `k` tokens, *bonus included*;
    `mean_accepted` is its mean (the tokens per target pass of one row). `target_forward_passes` includes the prefill
    (one pass per row group where a ragged batch is prefilled in groups: [`~hf_accel.speculative.prefill`]).
    `drafter_time_s` is the time spent in the drafter's methods (`propose_prefill`, `propose` and `update`, where CP
    heads and SpecFormer run their forward on the pass's hidden states); `prefill_time_s` the prefill's passes (and
    its cache assembly); `verify_time_s` the verification passes without the drafter's time.
    """

    target_forward_passes: int = 0
    accepted_histogram: Counter = field(default_factory=Counter)
    drafter_time_s: float = 0.0
    prefill_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    new_tokens: int = 0
    draft_nodes: int = 0

    @property
    def mean_accepted(self) -> float:
        passes = sum(self.accepted_histogram.values())
        return sum(k * v for k, v in self.accepted_histogram.items()) / passes if passes else 0.0

    def to_dict(self) -> dict:
        return {
            "target_forward_passes": self.target_forward_passes,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "mean_accepted": self.mean_accepted,
            "drafter_time_s": self.drafter_time_s,
            "prefill_time_s": self.prefill_time_s,
            "verify_time_s": self.verify_time_s,
            "total_time_s": self.total_time_s,
            "new_tokens": self.new_tokens,
            "draft_nodes": self.draft_nodes,
        }


@dataclass
class DraftRequest:
    """What a drafter sees when asked for a proposal.

    Args:
        sequences (`torch.LongTensor` of shape `(num_active, max_length)`): committed tokens of the active rows
            (left-padded prompt, then generated tokens; columns at and after `lengths` are padding).
        lengths (`torch.LongTensor` of shape `(num_active,)`): used columns; the root is `sequences[b, lengths[b]-1]`.
        prompt_length (`int`): the (padded) prompt width; generated tokens start at this column.
        attention_mask (`torch.LongTensor` of shape `(num_active, prompt_length)`): the prompt's padding mask.
        rows (`torch.LongTensor` of shape `(num_active,)`): original batch index of each active row.
        max_depth (`torch.LongTensor` of shape `(num_active,)`): deepest draft node that can still be committed.
        do_sample (`bool`): whether the call samples.
    """

    sequences: torch.LongTensor
    lengths: torch.LongTensor
    prompt_length: int
    attention_mask: torch.LongTensor
    rows: torch.LongTensor
    max_depth: torch.LongTensor
    do_sample: bool

    def context(self, b: int) -> torch.LongTensor:
        """The real (unpadded) committed tokens of active row `b`."""
        start = int((self.attention_mask[b] == 0).sum())
        return self.sequences[b, start : int(self.lengths[b])]


@dataclass
class VerifyResult:
    """What the engine hands back to the drafter after the prefill and after each verification pass.

    Args:
        rows (`torch.LongTensor` of shape `(num_active,)`): original batch index of each row of this pass.
        new_tokens (`list[list[int]]`): tokens committed per row (accepted drafts, then the bonus token), cut at a
            stop condition.
        best_node (`torch.LongTensor` of shape `(num_active,)`): deepest accepted draft node (drafter numbering,
            `-1` if none was accepted).
        path_length (`torch.LongTensor` of shape `(num_active,)`): committed positions this pass (root + accepted
            nodes; the prompt length at the prefill).
        finished (`torch.BoolTensor` of shape `(num_active,)`): rows that stopped in this pass.
        hidden_states (`dict[int, torch.FloatTensor]`): requested layers at the committed positions,
            `(num_active, max(path_length), hidden_size)` each, in path order and padded on the right (at the
            prefill: the real prompt positions, left padding dropped), so `[b, path_length[b] - 1]` is always the
            position whose logits chose row `b`'s last new token.
        aux_logits (`torch.FloatTensor` of shape `(num_active, num_aux, vocab_size)`, *optional*): raw logits at the
            auxiliary nodes (at the prefill: those of `propose_prefill`).
        is_prefill (`bool`): whether this result comes from the prefill.
        num_input_tokens (`int`): tokens fed to the target in this pass (`num_active * (1 + nodes + aux)`); `0` at the
            prefill, which is not timed.
        pass_seconds (`float`): wall time of the pass: the target's forward, acceptance, commit and cache rollback
            (what a drafter's cost model should weigh a draft against, see `cost.py`); `0.0` at the prefill.
    """

    rows: torch.LongTensor
    new_tokens: list
    best_node: torch.LongTensor
    path_length: torch.LongTensor
    finished: torch.BoolTensor
    hidden_states: dict = field(default_factory=dict)
    aux_logits: torch.FloatTensor | None = None
    is_prefill: bool = False
    num_input_tokens: int = 0
    pass_seconds: float = 0.0


class _DecodeState:
    """Mutable per-call bookkeeping: committed tokens, active rows, cache validity and positions."""

    def __init__(self, input_ids, attention_mask, max_length, pad_token_id, position_ids=None, position_limit=None):
        batch_size, self.prompt_length = input_ids.shape
        device = input_ids.device
        self.sequences = torch.full((batch_size, max_length), pad_token_id, dtype=torch.long, device=device)
        self.sequences[:, : self.prompt_length] = input_ids
        self.lengths = torch.full((batch_size,), self.prompt_length, dtype=torch.long, device=device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.prompt_mask = attention_mask
        self.rows = torch.arange(batch_size, device=device)
        self.past_mask = attention_mask.bool()  # [B_active, S_cache]
        # position id of each row's root: one past the prompt's last, as `generate` continues the `position_ids` it
        # is given (its default ones count real tokens, the mask's sum; so do M-RoPE's 3D ones on text)
        if position_ids is not None and position_ids.dim() == 2:
            self.next_position = position_ids[:, -1].to(device=device, dtype=torch.long).expand(batch_size) + 1
        else:
            self.next_position = attention_mask.sum(-1)
        self.max_length = max_length
        self.position_limit = position_limit

    def max_depth(self) -> torch.LongTensor:
        """`[B_active]`: the deepest draft node that can still be committed (`max_length`) and sits before the
        model's [`draft_position_limit`]."""
        return max_draft_depth(self.max_length - self.lengths[self.rows] - 1, self.next_position, self.position_limit)

    def request(self, do_sample: bool) -> DraftRequest:
        lengths = self.lengths[self.rows]
        return DraftRequest(
            self.sequences[self.rows], lengths, self.prompt_length, self.prompt_mask[self.rows], self.rows,
            self.max_depth(), do_sample,
        )  # fmt: skip


def _process_scores(logits_processor, contexts, logits):
    """Applies the logits processors to `logits` `[K, V]` whose contexts are `contexts` `[K, L]`."""
    return logits_processor(contexts, logits) if len(logits_processor) else logits


def _process_tree_scores(logits_processor, state, tree_ids, parent, ancestors, logits):
    """Processed scores `[B, N, V]` of every tree node, each with its own path as the processors' context.

    Context-dependent processors see only paths they allow: a node whose token its parent's processed scores forbid
    (`-inf`: a `prefix_allowed_tokens_fn`, bad words, ...) can never be committed, nor can its descendants, so they
    keep their raw logits (never read) and the processors never get a context that plain `generate` could not
    produce (a constraint function may fail on one: `prefix_allowed_tokens_fn` returning `[]` raises)."""
    if not len(logits_processor):
        return logits
    batch_size, num_nodes, vocab = logits.shape
    if all(type(p) in _CONTEXT_FREE_PROCESSORS for p in logits_processor):
        flat = logits.reshape(batch_size * num_nodes, vocab)
        dummy = tree_ids.reshape(-1, 1)
        return logits_processor(dummy, flat).view(batch_size, num_nodes, vocab)
    # Context-dependent processors may also hold per-row state sized to the original batch (e.g. the repetition
    # penalty's `prompt_ignore_length`), so each node is processed in a full-size batch at its row's original index.
    full_batch = state.sequences.shape[0]
    scores = logits.clone()
    allowed = torch.ones_like(tree_ids, dtype=torch.bool)  # the node's path has positive probability
    for b in range(batch_size):
        row = int(state.rows[b])
        processors = _for_row(logits_processor, row)
        prefix = state.sequences[row, : state.lengths[row] - 1]  # the root is the tree's node 0
        for node in range(num_nodes):
            up = int(parent[b, node])  # topological order: processed before its children
            # Only -inf forbids: greedy decoding picks a NaN score.
            if up >= 0 and (not allowed[b, up] or torch.isneginf(scores[b, up, tree_ids[b, node]])):
                allowed[b, node] = False
                continue
            context = torch.cat([prefix, tree_ids[b][ancestors[b, node]]])  # path order = node order
            out = processors(context.expand(full_batch, -1), logits[b, node].expand(full_batch, -1).clone())
            scores[b, node] = out[row]
    return scores


def _for_row(logits_processor, row: int):
    """`logits_processor` for a full-size batch whose every row holds a context of row `row`: a
    `prefix_allowed_tokens_fn` is asked with `batch_id=row` at every index, since the others' constraints may have no
    answer for that context (a per-row trie returns `[]`, which transformers raises on)."""
    if not any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor):
        return logits_processor
    bound = LogitsProcessorList()
    for processor in logits_processor:
        if isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = functools.partial(_ask_row, processor._prefix_allowed_tokens_fn, row)
        bound.append(processor)
    return bound


def _ask_row(prefix_allowed_tokens_fn, row: int, batch_id: int, sent: torch.LongTensor) -> list[int]:
    return prefix_allowed_tokens_fn(row, sent)


def attention_window(config) -> tuple[int | None, bool]:
    """The sliding window the engine's masks must apply for a model of `config`, and whether the model takes one mask
    per layer type.

    The engine keeps every layer's whole history (gathering accepted nodes in a sliding cache layer would have to
    know the window's origin) and hides in the mask what a window drops. Returns `(None, False)` for full attention;
    `(W, False)` when every layer slides over `W` tokens and the model takes one mask (Mistral, Phi-3, Starcoder2);
    `(W, True)` when the config's class names each layer's type, the model then taking `{"full_attention": mask,
    "sliding_attention": mask}` (Gemma 2/3, Qwen2/3, Cohere2). The layout is the one `DynamicCache(config=...)`
    gives. Raises `ValueError` for windows it cannot mask: chunked attention (Llama 4), GPT-Neo's local layers (a
    window over slot indices inside the attention module), windows that differ between layers.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = config.get_text_config(decoder=True)
    name = getattr(config, "model_type", type(config).__name__)
    if "local" in (getattr(config, "attention_layers", None) or ()):
        raise ValueError(f"{name}'s local attention layers window slot indices, which tree verification cannot mask")
    if getattr(config, "layer_types", None) is not None and not _declares_layer_types(config):
        # a `layer_types` its model ignores (Mistral given Ministral's): one mask windows every layer by `sliding_window`
        return getattr(config, "sliding_window", None), False
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    windowed_layers = [
        (kind, kw["sliding_window"]) for kind, kw in zip(layer_types, layer_kwargs) if "sliding_window" in kw
    ]
    windowed = set(windowed_layers)
    if not windowed:
        return None, False
    if {kind for kind, _ in windowed} != {"sliding_attention"} or len(windowed) > 1:
        raise ValueError(
            f"{name}'s windowed attention ({', '.join(sorted(f'{k} {w}' for k, w in windowed))}) is not supported by "
            "speculative decoding, which masks one sliding window"
        )
    per_layer_type = getattr(config, "layer_types", None) is not None
    if not per_layer_type and len(windowed_layers) != len(layer_types):
        raise ValueError(f"{name} mixes sliding and full attention layers without naming them in `layer_types`")
    return next(iter(windowed))[1], per_layer_type


def _rope_types(model):
    """`(rotary module, layer type, rope type)` of every rotary embedding of `model`: one triple per layer type where
    the module keeps a dict of them (Gemma 3, Qwen3-Next), else one with layer type `None`."""
    for module in model.modules():
        if "Rotary" in type(module).__name__:
            rope_types = getattr(module, "rope_type", None)
            for layer_type, rope_type in rope_types.items() if isinstance(rope_types, dict) else [(None, rope_types)]:
                yield module, layer_type, rope_type


def draft_position_limit(model) -> int | None:
    """The first position no draft node may take, or `None`.

    - A fixed position table (GPT-2's and OPT's learned positions, GPT-J's sinusoids): its size, the config's
      `max_position_embeddings`. Plain decoding may stop (EOS) before it reaches the table's end; a node past it
      would make the model index out of the table.
    - Dynamic (NTK) RoPE: the `max_position_embeddings` its rotary embedding starts from. Past it the frequencies grow
      with the largest position of each pass, so a pass must hold no position beyond the root's: plain decoding's
      one-token steps (drafting stops there).

    Other rotary models go on past `max_position_embeddings` as plain `generate` does: `None`.
    """
    rope = list(_rope_types(model))
    if not rope:
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        return None if limit is None else int(limit)
    return min((int(module.original_max_seq_len) for module, _, kind in rope if "dynamic" in str(kind)), default=None)


def longrope_switch(model) -> int | None:
    """The sequence length past which `model`'s longrope RoPE (Phi-3 and its kind) switches every position from its
    short factors to its long ones (`original_max_position_embeddings`), or `None` without longrope.

    A pass's factors follow its largest position, and Phi-3's `generate` recomputes the whole cache with the long
    factors when the sequence crosses that length: no verification pass can follow either, so speculative decoding
    refuses calls that may cross it.
    """
    switches = []
    for module, layer_type, kind in _rope_types(model):
        if kind == "longrope":
            parameters = module.config.rope_parameters
            parameters = parameters[layer_type] if layer_type is not None else parameters
            switches.append(int(parameters["original_max_position_embeddings"]))
    return min(switches, default=None)


def max_draft_depth(remaining, root_position, position_limit: int | None):
    """The deepest draft node a pass may verify, per row: at most `remaining` (what `max_length` still allows after
    the root), and every node (at `root_position + depth`) before the model's [`draft_position_limit`]."""
    if position_limit is None:
        return remaining
    return torch.minimum(remaining, (position_limit - 1 - root_position).clamp(min=0))


def _declares_layer_types(config) -> bool:
    """Whether `config`'s class takes a `layer_types` argument, which its model reads to build one mask per layer
    type; a class without one keeps a given `layer_types` as an extra key that its model never reads."""
    return "layer_types" in inspect.signature(type(config).__init__).parameters


def input_vocab_size(model) -> int | None:
    """Rows of `model`'s input embedding, the token ids a draft may hold (`None`: not known, drafts not checked)."""
    embeddings = model.get_input_embeddings()
    embeddings = getattr(embeddings, "base_layer", embeddings)  # PEFT's LoRA embedding wraps the original
    weight = getattr(embeddings, "weight", None)
    return weight.shape[0] if weight is not None else None


def check_draft_ids(draft_ids: torch.Tensor, vocab_size: int | None) -> None:
    """Refuses draft token ids outside `[0, vocab_size)` in one line (the embedding would fail with an IndexError)."""
    if vocab_size is not None and draft_ids.numel() and ((draft_ids < 0) | (draft_ids >= vocab_size)).any():
        raise ValueError(
            f"the drafter proposed token ids outside the target's vocabulary [0, {vocab_size}); was it built for "
            "another tokenizer?"
        )


def check_hidden_layers(layers, count: int) -> None:
    """Refuses in one line hidden-state indices (`requires_hidden_states`) outside the target's `count` states (the
    embeddings, then one per layer): a drafter built for a deeper target (SpecFormer's hooks `(0, 17, -2, -1)` of a
    36-layer model) failed with an IndexError inside the prefill."""
    missing = [i for i in layers if not -count <= i < count]
    if missing:
        raise ValueError(
            f"the drafter asks for hidden states {missing} (`requires_hidden_states`), the target has {count} (its "
            f"embeddings and {count - 1} layers); was the drafter built for another model?"
        )


def _has_sliding_layers(cache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


_ROW_WISE_CRITERIA = (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria)


class SpeculativeEngine:
    """Runs speculative decoding for one `generate` call.

    Args:
        model (`PreTrainedModel`): the target causal LM.
        drafter: any object following the drafter protocol of this module's docstring.
        generation_config (`GenerationConfig`): the prepared config of the call.
        logits_processor (`LogitsProcessorList`): processors prepared by `generate`.
        stopping_criteria (`StoppingCriteriaList`): criteria prepared by `generate` (EOS, max length, stop strings).
        streamer (`BaseStreamer`, *optional*): receives committed tokens (batch size 1 only).
    """

    def __init__(self, model, drafter, generation_config, logits_processor, stopping_criteria, streamer=None):
        self.model = model
        self.drafter = drafter
        self.generation_config = generation_config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        # transformers' own criteria answer each row from that row alone: ask them one row at a time (a criterion of
        # unknown kind sees the whole batch, which costs batch size times more per accepted token)
        self._row_wise_stopping = all(type(c) in _ROW_WISE_CRITERIA for c in stopping_criteria)
        self.vocab_size = input_vocab_size(model)
        self.streamer = streamer
        self.do_sample = bool(generation_config.do_sample)
        # Sampling draws its randomness per output position from this seed (taken from torch's seeded generator)
        self.noise_seed = int(torch.randint(2**31, ())) if self.do_sample else 0
        self.hidden_layers = tuple(getattr(drafter, "requires_hidden_states", ()) or ())
        self.window, self.mask_per_layer_type = attention_window(model.config)
        self.positions_from_slots = infers_positions_from_slots(model)
        # RoPE whose frequencies follow a pass's largest position (dynamic NTK, longrope): a group of short prompts
        # prefilled alone would be rotated otherwise than in the batch's one prefill
        self.rope_follows_pass = any(kind == "longrope" or "dynamic" in str(kind) for _, _, kind in _rope_types(model))
        # the GEMM layout of multi-row passes, measured on this machine (`hf_accel.kernels.cpu_linear`)
        self.linear_layout = verification_layout(model)
        self.stats = SpeculativeStats()

    # ----------------------------------------------------------------------------------------------- decoding loop
    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, cache=None, position_ids=None):
        """Decodes until every row stops; returns `sequences` `[B, prompt_length + generated]`."""
        start = time.perf_counter()
        pad = _pad_token_id(self.generation_config)
        state = _DecodeState(
            input_ids,
            attention_mask,
            self.generation_config.max_length,
            pad,
            position_ids,
            draft_position_limit(self.model),
        )
        if hasattr(self.drafter, "begin"):
            self.drafter.begin(input_ids, state.prompt_mask, self.generation_config)
        cache = self._prefill(state, input_ids, attention_mask, cache, position_ids)
        while len(state.rows):
            tic = time.perf_counter()
            tree = self.drafter.propose(state.request(self.do_sample))
            self.stats.drafter_time_s += time.perf_counter() - tic
            tic, drafting = time.perf_counter(), self.stats.drafter_time_s
            self._verify(state, cache, tree)  # the drafter's `update` inside counts as drafter time
            self.stats.verify_time_s += time.perf_counter() - tic - (self.stats.drafter_time_s - drafting)
        if self.streamer is not None:
            self.streamer.end()
        generated = int(state.lengths.max()) - state.prompt_length
        self.stats.new_tokens = int((state.lengths - state.prompt_length).sum())
        self.stats.total_time_s = time.perf_counter() - start
        return state.sequences[:, : state.prompt_length + generated]

    def _forward(self, cache, **inputs):
        """One target pass. As in `generate`, the prompts may stay on another device than the model's (CPU inputs,
        a model on a GPU): the pass's inputs go to the model's device, its logits and hidden states come back."""
        self.stats.target_forward_passes += 1
        home, device = inputs["position_ids"].device, self.model.device
        if device.type != "meta":  # accelerate's offloaded models move their inputs themselves
            inputs = {name: _to_device(value, device) for name, value in inputs.items()}
        # The layers by index: transformers' output capturing then keeps those alone (the others come back as `None`),
        # where `True` held every layer's states over the whole pass (a long prefill's largest allocation); a model
        # that records every layer regardless reads the list as `True`.
        hidden = list(self.hidden_layers) if self.hidden_layers else False
        with verification_pass(self.linear_layout):
            outputs = self.model(
                **{CACHE_NAME: cache}, use_cache=True, output_hidden_states=hidden, return_dict=True, **inputs
            )
        outputs.logits = outputs.logits.to(home)
        if outputs.hidden_states is not None:  # only the layers the drafter reads come back
            check_hidden_layers(self.hidden_layers, len(outputs.hidden_states))
            dropped = [i for i in self.hidden_layers if outputs.hidden_states[i] is None]
            if dropped:  # transformers resolves negative indices with the config's layer count, not the model's
                raise ValueError(
                    f"the target returned no hidden states {dropped} for `output_hidden_states={hidden}`: "
                    "transformers counts negative indices from the config's `num_hidden_layers`, which does not "
                    f"match the {len(outputs.hidden_states)} states the model returned (layers removed after loading?)"
                )
            wanted = {i % len(outputs.hidden_states) for i in self.hidden_layers}
            outputs.hidden_states = tuple(
                h.to(home) if i in wanted else None for i, h in enumerate(outputs.hidden_states)
            )
        return outputs

    def _prefill(self, state, input_ids, attention_mask, cache, position_ids):
        from transformers import DynamicCache

        if cache is not None and cache.get_seq_length() == 0 and _has_sliding_layers(cache):
            cache = None  # an empty cache `generate` made with sliding layers: the engine cannot gather those
        if cache is None:
            # Sliding-window models keep every layer's whole history here; their masks hide what a window drops.
            cache = DynamicCache() if self.window is not None else DynamicCache(config=self.model.config)
        validate_cache_for_speculation(cache)
        refuse_filled_cache(cache)
        if position_ids is None:
            position_ids = (state.prompt_mask.cumsum(-1) - 1).clamp(min=0)
        # Same inputs as `generate`'s own prefill (2D mask or None, cumsum positions), hence the same logits; like
        # `generate`, only the last position's logits where the model's forward takes `logits_to_keep`
        aux = self._propose_prefill(state)
        num_aux = aux.num_aux if aux is not None else 0
        keep = {"logits_to_keep": 1 + num_aux} if _takes_logits_to_keep(self.model) else {}
        tic = time.perf_counter()
        # a ragged batch on a CPU: rows of similar length prefilled in groups, skipping most of the padding
        grouped = not num_aux and not self.rope_follows_pass
        groups = plan_prefill(self.model, attention_mask, position_ids, cache) if grouped else None
        if groups is not None:
            all_logits, all_hidden = grouped_prefill(
                self._forward, groups, input_ids, attention_mask, position_ids, cache, self.hidden_layers, bool(keep)
            )
        else:
            if num_aux:
                inputs = self._prefill_inputs_with_aux(state, input_ids, position_ids, aux)
            else:
                inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
            outputs = self._forward(cache, **inputs, **keep)
            all_logits, all_hidden = outputs.logits, outputs.hidden_states
        if num_aux:  # the auxiliary inputs' entries are dropped, as after a verification pass
            select_cache_positions(cache, input_ids.shape[1], input_ids.new_zeros((input_ids.shape[0], 0)))
        self.stats.prefill_time_s = time.perf_counter() - tic
        logits = all_logits[:, -1 - num_aux].float()  # the last prompt token's
        scores = _process_scores(self.logits_processor, input_ids, logits)
        tokens = self._pick(scores, state.rows, state.next_position)
        new_tokens, finished = self._commit(state, [[t] for t in tokens.tolist()])
        path_length = state.prompt_mask.sum(-1)
        # the real prompt positions in order, then padding, as after a verification pass (a stable sort puts a row's
        # real positions first)
        keep = torch.sort((state.prompt_mask == 0).to(torch.int8), dim=1, stable=True).indices
        keep = keep[:, : int(path_length.max())]
        hidden = {i: _gather_nodes(all_hidden[i], keep) for i in self.hidden_layers}
        aux_logits = all_logits[:, all_logits.shape[1] - num_aux :].float() if num_aux else None
        result = VerifyResult(
            state.rows.clone(), new_tokens, torch.full_like(state.rows, -1), path_length, finished, hidden,
            aux_logits, is_prefill=True,
        )  # fmt: skip
        self._after_pass(state, cache, result)
        return cache

    def _propose_prefill(self, state) -> DraftTree | None:
        """The drafter's auxiliary inputs for the prefill pass (`propose_prefill`), checked; `None` without any."""
        propose = getattr(self.drafter, "propose_prefill", None)
        if propose is None:
            return None
        tic = time.perf_counter()
        tree = propose(state.request(self.do_sample))
        self.stats.drafter_time_s += time.perf_counter() - tic
        if tree is None:
            return None
        check_tree_shapes(tree, len(state.rows))
        if tree.num_nodes:
            raise ValueError(
                f"the drafter's prefill proposal has {tree.num_nodes} draft nodes; the prefill pass takes auxiliary "
                "inputs only (`aux_embeds` / `aux_parent`): the prompt's next token is not known yet"
            )
        return tree if tree.num_aux else None

    def _prefill_inputs_with_aux(self, state, input_ids, position_ids, aux: DraftTree) -> dict:
        """The prefill pass's inputs with auxiliary inputs under the last prompt token (PPD's prompt tokens): the
        prompt attends as in `generate`'s prefill, each auxiliary input to the real prompt, its auxiliary ancestors
        and itself, at the last prompt token's position + its depth (capped at `max_depth`, as in a pass)."""
        device = input_ids.device
        aux_parent = aux.aux_parent.to(device)
        validate_parents(to_verification_parents(aux_parent))
        ancestors = prefill_ancestors(state.prompt_mask, aux_parent)  # [B, L + M, L + M]
        prompt_length = input_ids.shape[1]
        aux_depths = ancestors[:, prompt_length:, prompt_length:].sum(-1)  # the last prompt token has depth 0
        aux_depths = torch.minimum(aux_depths, state.max_depth().clamp(min=0)[:, None])
        aux_positions = (state.next_position - 1)[:, None] + aux_depths
        key_positions = torch.cat([_slot_positions(state), aux_positions], dim=1)  # the prompt's slots, then the aux
        positions = position_ids.to(device).expand(*position_ids.shape[:-2], len(state.rows), -1)
        aux_positions = aux_positions.expand(*positions.shape[:-2], -1, -1)  # M-RoPE's 3D ids: one copy per axis
        return {
            "inputs_embeds": self._embeds_with_aux(input_ids, aux.aux_embeds),
            "attention_mask": self._tree_mask(ancestors, state.past_mask[:, :0], key_positions),  # no cache yet
            "position_ids": torch.cat([positions, aux_positions], dim=-1),
        }

    def _embeds_with_aux(self, input_ids, aux_embeds):
        """The target's input embeddings of `input_ids` `[B, N]`, then `aux_embeds` `[B, M, H]`."""
        embedding = self.model.get_input_embeddings()
        weights = embedding.weight.device  # meta when accelerate offloads it: its hook moves the ids itself
        embeds = embedding(input_ids if weights.type == "meta" else input_ids.to(weights))
        if aux_embeds.shape[-1] != embeds.shape[-1]:
            raise ValueError(
                f"the draft tree's `aux_embeds` have width {aux_embeds.shape[-1]}, the target's input embeddings "
                f"{embeds.shape[-1]}"
            )
        return torch.cat([embeds, aux_embeds.to(embeds)], dim=1)

    def _pick(self, scores, rows, positions):
        """The token each of `scores` `[K, V]` picks: the argmax, or, sampling, the sample keyed by the token's row and
        position ([`position_samples`])."""
        if self.do_sample:
            return position_samples(scores, self.noise_seed, rows.tolist(), positions.tolist())
        return scores.argmax(-1)

    # ------------------------------------------------------------------------------------------- verification pass
    def _attention_mask(self, state, ancestors, node_valid, key_positions, drafted: bool):
        """The pass's attention mask: the tree mask, windowed by position for sliding-window layers."""
        if self.window is None and not drafted:
            # No draft: exactly `generate`'s decoding step (2D mask, or none without padding/holes), with the GEMM
            # layout measured for one row (`kernels.cpu_linear`: on CPU one row may run as two, a matrix product).
            return None if bool(state.past_mask.all()) else torch.cat([state.past_mask, node_valid], 1).long()
        return self._tree_mask(ancestors, state.past_mask, key_positions)

    def _tree_mask(self, ancestors, past_mask, key_positions):
        """The 4D tree mask over `past_mask`'s cache slots and the pass's inputs, windowed by position for
        sliding-window layers: transformers would window slot indices, which holes make differ from positions, so the
        engine windows positions itself, in one mask for all layers or one per layer type."""
        if self.window is None:
            return build_tree_attention_mask(ancestors, past_mask, self.model.dtype)
        windowed = build_tree_attention_mask(ancestors, past_mask, self.model.dtype, key_positions, self.window)
        if not self.mask_per_layer_type:
            return windowed
        full = build_tree_attention_mask(ancestors, past_mask, self.model.dtype)
        return {"full_attention": full, "sliding_attention": windowed}

    def _verify(self, state, cache, tree: DraftTree | None):
        """One target pass over `root + tree` for every active row, then acceptance and cache rollback."""
        batch_size = len(state.rows)
        device = state.sequences.device
        roots = state.sequences[state.rows, state.lengths[state.rows] - 1][:, None]  # [B, 1]
        if tree is None:
            tree = DraftTree(roots.new_zeros((batch_size, 0)), roots.new_zeros((batch_size, 0)))
        if tree.input_ids.shape[0] != batch_size:
            raise ValueError(f"the drafter proposed {tree.input_ids.shape[0]} rows for {batch_size} active rows")
        check_tree_shapes(tree, batch_size)
        num_nodes = tree.num_nodes + 1
        tree_ids = torch.cat([roots, tree.input_ids.to(device)], dim=1)  # [B, N]
        check_draft_ids(tree.input_ids, self.vocab_size)
        parent = to_verification_parents(tree.parent.to(device))
        if tree.num_aux:
            parent = torch.cat([parent, tree.aux_parent.to(device) + 1], dim=1)  # [B, N + M]
        validate_parents(parent)
        ancestors = compute_ancestor_matrix(parent)  # [B, N + M, N + M]
        depths = compute_depths(ancestors)
        node_valid = torch.ones_like(tree_ids, dtype=torch.bool)
        if tree.node_mask is not None:
            node_valid[:, 1:] = tree.node_mask.to(device)
        # Never verify deeper than what can still be committed (max_length), or past a position table's end.
        max_depth = state.max_depth()  # [B]
        node_valid &= depths[:, :num_nodes] <= max_depth[:, None]
        self.stats.draft_nodes += int(node_valid[:, 1:].sum())

        # Deeper nodes are never accepted and no kept node sees them: their positions are capped at the deepest
        # committable one, the last position plain decoding reaches, so that models with a position table (GPT-2,
        # OPT) are never asked for a position past it.
        positions = tree_position_ids(depths.clamp(max=max_depth[:, None]), state.next_position)
        accepts_key_positions = getattr(self.model, "_accepts_key_positions", False)
        key_positions = None
        if self.window is not None or accepts_key_positions:
            # every cache slot's position, then every node's: holes make slot indices and positions differ (a hole's
            # entry is masked, its position never read)
            key_positions = torch.cat([_slot_positions(state), positions], dim=1)
        mask = self._attention_mask(state, ancestors, node_valid, key_positions, drafted=parent.shape[1] > 1)
        if tree.num_aux:
            inputs = {"inputs_embeds": self._embeds_with_aux(tree_ids, tree.aux_embeds)}
        else:
            inputs = {"input_ids": tree_ids}
        if accepts_key_positions:  # models that RoPE cached keys at attention time (CARE, Palu latents)
            inputs["key_positions"] = key_positions
        prefix_length = state.past_mask.shape[1]
        tic = time.perf_counter()
        outputs = self._forward(cache, attention_mask=mask, position_ids=positions, **inputs)
        logits = outputs.logits.float()  # [B, N + M, V]
        scores = _process_tree_scores(
            self.logits_processor,
            state,
            tree_ids,
            parent[:, :num_nodes],
            ancestors[:, :num_nodes, :num_nodes],
            logits[:, :num_nodes],
        )
        paths, bonus = self._accept(
            tree_ids,
            parent[:, :num_nodes],
            ancestors,
            node_valid,
            scores,
            tree,
            state.rows,
            positions[:, :num_nodes] + 1,
        )
        new_tokens, finished = self._commit(
            state, [tree_ids[b, p[1:]].tolist() + [bonus[b]] for b, p in enumerate(paths)]
        )
        self.stats.accepted_histogram.update(len(t) for t in new_tokens)
        path_length = torch.tensor([len(p) for p in paths], device=device)
        keep = torch.zeros((batch_size, int(path_length.max())), dtype=torch.long, device=device)
        for b, p in enumerate(paths):
            keep[b, : len(p)] = torch.tensor(p, device=device)  # the rest repeats the root and is masked out
        select_cache_positions(cache, prefix_length, keep)
        slot_valid = torch.arange(keep.shape[1], device=device)[None] < path_length[:, None]
        state.past_mask = torch.cat([state.past_mask, slot_valid], dim=1)
        state.next_position = state.next_position + path_length
        hidden = {i: _gather_nodes(outputs.hidden_states[i], keep) for i in self.hidden_layers}
        best = torch.tensor([p[-1] - 1 for p in paths], device=device)
        aux_logits = logits[:, num_nodes:] if tree.num_aux else None
        result = VerifyResult(
            state.rows.clone(), new_tokens, best, path_length, finished, hidden, aux_logits, False,
            int(tree_ids.shape[0] * parent.shape[1]), time.perf_counter() - tic,
        )  # fmt: skip
        self._after_pass(state, cache, result)

    def _accept(self, tree_ids, parent, ancestors, node_valid, scores, tree, rows, out_positions):
        """Accepted path (verification node indices, root first) and bonus token of every row (original indices
        `rows`); `out_positions` `[B, N]` is the output position each node's pick fills (its own position + 1).

        Greedy, and sampling with deterministic drafts: each node's pick is the token the target chooses after it
        (argmax, or the sample of that output position, the same for every node at that position); a node is
        accepted iff it equals its parent's pick, so the sampled text never depends on the tree. Sampling picks only
        along the accepted path ([`accept_by_picks`]). Sampling with draft probabilities: rejection sampling
        ([`sample_accept_tree`]).
        """
        num_nodes = tree_ids.shape[1]
        if self.do_sample and tree.draft_probs is None:
            paths, bonus = [], []
            for b in range(tree_ids.shape[0]):

                def pick(node, b=b):
                    return int(
                        self._pick(scores[b, node : node + 1], rows[b : b + 1], out_positions[b, node : node + 1])
                    )

                path, token = accept_by_picks(tree_ids[b].tolist(), parent[b].tolist(), pick, node_valid[b].tolist())
                paths.append(path)
                bonus.append(token)
            return paths, bonus
        if not self.do_sample:
            rows = rows[:, None].expand_as(out_positions)
            picks = self._pick(scores.reshape(-1, scores.shape[-1]), rows.reshape(-1), out_positions.reshape(-1))
            _best, path_mask, bonus = greedy_accept(
                tree_ids, ancestors[:, :num_nodes, :num_nodes], parent, picks.view(out_positions.shape), node_valid
            )
            return [m.nonzero().flatten().tolist() for m in path_mask], bonus.tolist()
        probs = torch.softmax(scores, dim=-1)  # [B, N, V]
        paths, bonus = [], []
        for b in range(tree_ids.shape[0]):
            q = match_draft_vocab(tree.draft_probs[b].to(probs), probs.shape[-1])
            q = torch.cat([torch.zeros_like(probs[b, :1]), q], dim=0)  # the root has no draft probability
            path, token = sample_accept_tree(
                tree_ids[b].tolist(), parent[b].tolist(), probs[b], q, node_valid[b].tolist()
            )
            paths.append(path)
            bonus.append(token)
        return paths, bonus

    # ----------------------------------------------------------------------------------------------- bookkeeping
    def _commit(self, state, proposals: list[list[int]]):
        """Appends each active row's tokens one by one, stopping at the first stop condition; never past it."""
        new_tokens, finished = [], []
        for b, tokens in enumerate(proposals):
            row = int(state.rows[b])
            length = int(state.lengths[row])
            done, kept = False, []
            for token in tokens:
                if length >= state.max_length:
                    done = True
                    break
                state.sequences[row, length] = token
                length += 1
                kept.append(token)
                if self._should_stop(state.sequences[:, :length], row):
                    done = True
                    break
            done = done or length >= state.max_length
            state.lengths[row] = length
            new_tokens.append(kept)
            finished.append(done)
            if self.streamer is not None and kept:
                self.streamer.put(torch.tensor([kept]))  # [1, n], as transformers' assisted loop puts them
        return new_tokens, torch.tensor(finished, dtype=torch.bool, device=state.sequences.device)

    def _should_stop(self, sequences, row: int) -> bool:
        if self._row_wise_stopping:
            return bool(self.stopping_criteria(sequences[row : row + 1], None)[0])
        # full-size batch, so criteria holding per-row state (or indexing rows) see row `row` at its own index
        return bool(self.stopping_criteria(sequences, None)[row])

    def _after_pass(self, state, cache, result: VerifyResult):
        if hasattr(self.drafter, "update"):
            tic = time.perf_counter()
            self.drafter.update(result)
            self.stats.drafter_time_s += time.perf_counter() - tic
        if result.finished.any():
            keep = (~result.finished).nonzero().flatten()
            state.rows = state.rows[keep]
            state.past_mask = state.past_mask[keep]
            state.next_position = state.next_position[keep]
            if len(keep):
                select_cache_rows(cache, keep)
        _close_holes(state, cache, every_hole=self.positions_from_slots)


@contextlib.contextmanager
def verification_pass(layout):
    """What every pass of the engine runs under: the GEMM layout `layout` ([`verification_layout`]'s; `None`: the
    default one) and packed grouped-query attention (`hf_accel.kernels.gqa_attention`)."""
    with layout or contextlib.nullcontext(), packed_gqa_attention():
        yield


def infers_positions_from_slots(model) -> bool:
    """Whether `model` RoPEs cached keys at positions it infers from cache slots (slot `j` of `S` at
    `position_ids[:, 0] - S + j`), so that a hole between slots shifts every key before it: CARE and Palu checkpoints
    converted before `key_positions` existed run their own modeling code, which does (those of one version say so with
    `_supports_cache_holes = False`, the older ones say nothing)."""
    if getattr(model, "_accepts_key_positions", False):
        return False
    model_type = str(getattr(model.config, "model_type", ""))
    return getattr(model, "_supports_cache_holes", True) is False or model_type.startswith(("care_", "palu_"))


def _close_holes(state, cache, every_hole: bool = False) -> None:
    """Moves each row's valid cache slots, in order, to the end of the cache once holes fill 1/8 of it, or with
    `every_hole` once any row has one after its first valid slot (a model that infers cached positions from slots:
    [`infers_positions_from_slots`]).

    Every pass appends the batch's longest accepted path to every row, so rows that accept less leave holes, and the
    cache grows faster than any row's text: attention, the mask and the cache's own concatenation grow with it (on CPU,
    batch 8, a pass over 3 tokens per row cost 103 ms over 250 slots and 119 ms over 350). The holes go to the front,
    where they are masked like left padding; slots keep their order, and positions count valid slots only, so every
    pass sees the same keys at the same positions. A row's first slots may then be holes (any content, masked).
    """
    if not len(state.rows):
        return
    length = state.past_mask.shape[1]
    kept = int(state.past_mask.sum(-1).max())
    if every_hole:  # a hole after a row's first valid slot, which a slot-counting model would take for a token
        if not (state.past_mask.int().cummax(dim=1).values.bool() & ~state.past_mask).any():
            return
    elif length - kept < max(1, length // 8):
        return
    # a stable sort puts a row's holes (0) first and its valid slots (1) last, each in slot order
    valid, order = torch.sort(state.past_mask.to(torch.int8), dim=1, stable=True)
    select_cache_positions(cache, 0, order[:, length - kept :])
    state.past_mask = valid[:, length - kept :].bool()


def _slot_positions(state) -> torch.LongTensor:
    """`[B_active, S_cache]`: the position of every cache slot (a hole's or a padding slot's is never read, it is
    masked). Real slots count up from a row's first real token, whose position is 0 unless the call gave
    `position_ids` starting elsewhere: every pass adds as many positions as valid slots, so that offset stays what
    the prompt set."""
    offset = state.next_position - state.past_mask.sum(-1)
    return (state.past_mask.long().cumsum(-1) - 1).clamp(min=0) + offset[:, None]


def _to_device(value, device):
    """A tensor, or each tensor of a dict (one attention mask per layer type), on `device`; anything else as it is."""
    if isinstance(value, dict):
        return {key: _to_device(v, device) for key, v in value.items()}
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _takes_logits_to_keep(model) -> bool:
    """Whether `model`'s forward names a `logits_to_keep` argument (transformers' own test before passing it; a
    model whose forward predates it, e.g. older remote code, would raise on the unexpected keyword)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def _gather_nodes(hidden: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`[B, N, H]` states at the node indices `[B, K]` -> `[B, K, H]`."""
    return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))


def _pad_token_id(generation_config) -> int:
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return 0 if pad is None else int(pad)
