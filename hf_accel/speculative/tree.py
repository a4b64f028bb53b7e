"""Draft trees: the proposal format every drafter speaks, and the pure functions that verify one in a single pass.

A draft tree is stored as a flat list of nodes in *topological order* (a node's parent comes before it), each node
with a token id and the index of its parent. A chain is the tree whose node `i` has parent `i - 1`.

Two index conventions are used, and each function says which:

- **drafter-facing** ([`DraftTree`]): nodes `0..N-1` are the draft tokens, `-1` as a parent means "the root", the
  last committed token (not yet in the KV cache), which the engine prepends itself. Auxiliary nodes (PPD prompt
  tokens, see below) follow as nodes `N..N+M-1` in the same numbering.
- **verification** (everything else in this module): node `0` is the root and node `i >= 1` is draft node `i - 1`.
  `parent[..., 0] == -1`. [`to_verification_parents`] converts.

Every function here is pure (no model, no cache) and is tested against a brute-force construction.
"""

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A drafter's proposal for every active row of the batch.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, num_nodes)`):
            Draft token of each node. Rows with fewer nodes are padded; mark the padding in `node_mask`.
        parent (`torch.LongTensor` of shape `(batch_size, num_nodes)`):
            Parent of each node: `-1` for a child of the root (the last committed token), otherwise the index of an
            earlier node (`parent[b, i] < i`). A chain of `k` tokens is `parent = [-1, 0, 1, ..., k - 2]`.
        draft_probs (`torch.FloatTensor` of shape `(batch_size, num_nodes, vocab_size)`, *optional*):
            The distribution each node's token was *sampled* from (siblings are i.i.d. draws from the same
            distribution). Only needed for lossless sampling with a stochastic drafter. Leave it `None` for
            deterministic drafters (argmax, n-gram lookups): the engine then uses the point-mass rule. A draft model
            whose vocabulary is a prefix of the target's (its embedding padded to another multiple) may give fewer
            than the target's `vocab_size` columns: the missing ids have probability 0.
        node_mask (`torch.BoolTensor` of shape `(batch_size, num_nodes)`, *optional*):
            `False` for padding nodes: they are computed (the batch is rectangular) but never accepted.
        aux_embeds (`torch.FloatTensor` of shape `(batch_size, num_aux, hidden_size)`, *optional*):
            Auxiliary inputs appended to the verification pass (PPD prompt tokens). They are never accepted and
            their KV entries are always dropped; the engine hands their logits back to the drafter.
        aux_parent (`torch.LongTensor` of shape `(batch_size, num_aux)`, *optional*):
            Parent of each auxiliary node, in the joint numbering `[draft nodes; aux nodes]` (`-1` = root). An aux
            node attends to the cache, its ancestors and itself, and sits at position `parent position + 1`, at most
            at depth `request.max_depth` (as draft nodes; deeper aux logits predict tokens no pass can commit).
            Every row has `num_aux` of them and there is no mask: a row that needs fewer (PPD's trees differ per row)
            pads with any, e.g. one prompt token under the root (`-1`), and does not read their logits.
    """

    input_ids: torch.LongTensor
    parent: torch.LongTensor
    draft_probs: torch.FloatTensor | None = None
    node_mask: torch.BoolTensor | None = None
    aux_embeds: torch.FloatTensor | None = None
    aux_parent: torch.LongTensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_aux(self) -> int:
        return 0 if self.aux_parent is None else self.aux_parent.shape[1]

    @classmethod
    def from_chains(cls, chains: list[list[int]], pad_token_id: int = 0, device=None) -> "DraftTree":
        """Builds a batch of chains (one list of tokens per row, possibly empty or of different lengths)."""
        width = max([len(c) for c in chains] + [0])
        input_ids = torch.full((len(chains), width), pad_token_id, dtype=torch.long)
        node_mask = torch.zeros((len(chains), width), dtype=torch.bool)
        for b, chain in enumerate(chains):
            input_ids[b, : len(chain)] = torch.tensor(chain, dtype=torch.long)
            node_mask[b, : len(chain)] = True
        parent = torch.arange(-1, width - 1).expand(len(chains), width).clone()
        return cls(input_ids.to(device), parent.to(device), node_mask=node_mask.to(device))

    @classmethod
    def from_parent_lists(cls, trees: list[tuple[list[int], list[int]]], pad_token_id: int = 0, device=None):
        """Builds a batch of trees from `(tokens, parents)` lists per row (drafter-facing parents)."""
        width = max([len(t) for t, _ in trees] + [0])
        input_ids = torch.full((len(trees), width), pad_token_id, dtype=torch.long)
        # Padding nodes hang off the root: any valid parent works, they are masked out of acceptance.
        parent = torch.full((len(trees), width), -1, dtype=torch.long)
        node_mask = torch.zeros((len(trees), width), dtype=torch.bool)
        for b, (tokens, parents) in enumerate(trees):
            if len(tokens) != len(parents):  # a missing parent would silently hang its node off the root
                raise ValueError(f"draft tree row {b} has {len(tokens)} tokens and {len(parents)} parents")
            input_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            parent[b, : len(parents)] = torch.tensor(parents, dtype=torch.long)
            node_mask[b, : len(tokens)] = True
        return cls(input_ids.to(device), parent.to(device), node_mask=node_mask.to(device))


def to_verification_parents(parent: torch.LongTensor) -> torch.LongTensor:
    """Prepends the root: drafter-facing parents `(B, N)` -> verification parents `(B, N + 1)`."""
    root = parent.new_full((parent.shape[0], 1), -1)
    return torch.cat([root, parent + 1], dim=1)


def check_tree_shapes(tree: DraftTree, batch_size: int) -> None:
    """Refuses in one line a tree whose fields disagree on rows or nodes, or that has only one of `aux_embeds` /
    `aux_parent` (embeddings without parents would be dropped silently; the rest failed as size errors in the pass)."""
    if (tree.aux_embeds is None) != (tree.aux_parent is None):
        raise ValueError("a draft tree's auxiliary inputs need both `aux_embeds` and `aux_parent`")
    nodes, aux = (batch_size, tree.num_nodes), (batch_size, tree.num_aux)
    expected = {"input_ids": nodes, "parent": nodes, "node_mask": nodes, "draft_probs": nodes, "aux_parent": aux}
    expected["aux_embeds"] = aux
    for name, shape in expected.items():
        value = getattr(tree, name)
        if value is not None and tuple(value.shape[:2]) != shape:
            raise ValueError(
                f"the draft tree's `{name}` has shape {tuple(value.shape)}, expected (rows, nodes) = {shape} first"
            )


def validate_parents(parent: torch.LongTensor) -> None:
    """Raises `ValueError` unless every parent index points to an earlier node (verification numbering)."""
    index = torch.arange(parent.shape[-1], device=parent.device)
    if (parent[..., 0] != -1).any() or (parent[..., 1:] < 0).any() or (parent >= index).any():
        raise ValueError(
            "draft tree parents must be topologically ordered: parent[i] < i for every node (and -1 only for the"
            f" root); got {parent.tolist()}"
        )


def compute_ancestor_matrix(parent: torch.LongTensor) -> torch.BoolTensor:
    """Ancestor-or-self relation of a batch of trees.

    Args:
        parent (`torch.LongTensor` of shape `(batch_size, num_nodes)`): verification numbering (`parent[:, 0] == -1`).

    Returns:
        `torch.BoolTensor` of shape `(batch_size, num_nodes, num_nodes)`: `[b, i, j]` is True iff node `j` is on the
        path from the root to node `i` (both included).
    """
    batch_size, num_nodes = parent.shape
    ancestors = torch.zeros(batch_size, num_nodes, num_nodes, dtype=torch.bool, device=parent.device)
    rows = torch.arange(batch_size, device=parent.device)
    ancestors[:, 0, 0] = True
    # Topological order: a node's row is its parent's row plus itself. N <= ~64, so the loop is cheap.
    for i in range(1, num_nodes):
        ancestors[:, i] = ancestors[rows, parent[:, i]]
        ancestors[:, i, i] = True
    return ancestors


def prefill_ancestors(prompt_mask: torch.BoolTensor, aux_parent: torch.LongTensor) -> torch.BoolTensor:
    """Who each input of a prefill pass with auxiliary inputs sees: the ancestor-or-self matrix of the prompt
    (left-padded, a chain) with the auxiliary inputs hung under its last token.

    Args:
        prompt_mask (`torch.BoolTensor` of shape `(batch_size, prompt_length)`): `False` at left padding.
        aux_parent (`torch.LongTensor` of shape `(batch_size, num_aux)`): drafter-facing parents of the auxiliary
            inputs (`-1`: the last prompt token).

    Returns:
        `torch.BoolTensor` of shape `(batch_size, prompt_length + num_aux, prompt_length + num_aux)`: a prompt token
        sees the real prompt tokens up to itself (what `generate`'s prefill mask allows), an auxiliary input every
        real prompt token, its auxiliary ancestors and itself; no prompt token sees an auxiliary input. A left-padding
        position sees nothing (a masked position inside a prompt sees the real tokens before it, as in `generate`).
        Use it as `ancestors` of [`build_tree_attention_mask`] with an empty `past_mask`.
    """
    prompt_mask = prompt_mask.bool()
    batch_size, prompt_length = prompt_mask.shape
    num_aux = aux_parent.shape[1]
    aux = compute_ancestor_matrix(to_verification_parents(aux_parent))[:, 1:, 1:]  # without the last prompt token
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=prompt_mask.device).tril()
    prompt_rows = torch.cat([causal & prompt_mask[:, None, :], aux.new_zeros(batch_size, prompt_length, num_aux)], -1)
    aux_rows = torch.cat([prompt_mask[:, None, :].expand(batch_size, num_aux, prompt_length), aux], -1)
    return torch.cat([prompt_rows, aux_rows], dim=1)


def compute_depths(ancestors: torch.BoolTensor) -> torch.LongTensor:
    """Depth of each node (the root has depth 0): `(B, N, N)` ancestor matrix -> `(B, N)`."""
    return ancestors.sum(-1) - 1


def build_tree_attention_mask(
    ancestors: torch.BoolTensor,
    past_mask: torch.BoolTensor,
    dtype: torch.dtype = torch.float32,
    positions: torch.LongTensor | None = None,
    window: int | None = None,
) -> torch.FloatTensor:
    """The 4D additive mask that lets each tree node see the valid cache entries, its ancestors and itself.

    Args:
        ancestors (`torch.BoolTensor` of shape `(batch_size, num_nodes, num_nodes)`): from [`compute_ancestor_matrix`].
        past_mask (`torch.BoolTensor` of shape `(batch_size, past_length)`): which cache slots hold a real token
            of that row (left padding and the holes left by shorter acceptances are `False`).
        dtype (`torch.dtype`): dtype of the additive mask (the model's compute dtype).
        positions (`torch.LongTensor` of shape `(batch_size, past_length + num_nodes)`, *optional*): the position of
            every cache slot and then of every node; needed with `window`.
        window (`int`, *optional*): a sliding window: a node sees only keys less than `window` positions before its
            own (transformers' rule, `kv > q - window`). Positions, not slot indices: holes take no room in it.

    Returns:
        `torch.FloatTensor` of shape `(batch_size, 1, num_nodes, past_length + num_nodes)`: 0 where attention is
        allowed and the dtype's minimum elsewhere (not `-inf`, so a fully masked row can never produce NaN).
    """
    batch_size, num_nodes, _ = ancestors.shape
    past = past_mask[:, None, :].expand(batch_size, num_nodes, past_mask.shape[1])  # [B, N, S]
    allowed = torch.cat([past, ancestors], dim=-1)  # [B, N, S + N]
    if window is not None:
        node_positions = positions[:, past_mask.shape[1] :]
        allowed = allowed & (positions[:, None, :] > node_positions[:, :, None] - window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ancestors.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # [B, 1, N, S + N]


def tree_position_ids(depths: torch.LongTensor, next_position: torch.LongTensor) -> torch.LongTensor:
    """Position id of each node: the root sits at `next_position[b]`, a node of depth `d` at `next_position[b] + d`."""
    return next_position[:, None] + depths


def extract_path(parent: list[int] | torch.Tensor, node: int) -> list[int]:
    """Nodes from the root to `node`, both included (verification numbering, one row)."""
    parent = parent.tolist() if isinstance(parent, torch.Tensor) else parent
    path = [node]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


def children_lists(parent: list[int]) -> list[list[int]]:
    """Children of each node, in node order (verification numbering, one row)."""
    children = [[] for _ in parent]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    return children
