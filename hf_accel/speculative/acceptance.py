"""Acceptance rules for a verified draft tree: greedy (exact match) and lossless sampling. Pure functions.

Notation (verification numbering of [`~hf_accel.speculative.tree`]: node 0 is the root, the last committed token):
`p_i` is the target's (processed) next-token distribution after the path ending at node `i`, `q_c` the draft
distribution node `c`'s token was sampled from, and `x_c` node `c`'s token.

- Greedy: node `c` is *valid* if `x_c == argmax p_parent(c)` and its parent is valid; the engine keeps the deepest
  valid node (first one in node order on a tie) and appends the bonus token `argmax p_best`. The output is the
  target's greedy decoding by construction.
- Sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023; the multi-candidate form of SpecInfer, Miao et al.
  2024): at node `u`, try its children in order; child `c` is accepted with probability `min(1, p(x_c) / q_c(x_c))`
  where `p` starts as `p_u`; after a rejection, `p <- norm(max(0, p - q_c))` (the residual) and the next child is
  tried. If every child is rejected, the bonus token is drawn from the current residual; at a leaf it is drawn from
  `p_leaf`. This emits exactly one token from `p_u` at each step, so the output distribution is the target's, as long
  as siblings are i.i.d. draws from `q_c`.
- Point-mass rule (deterministic drafters, `q_c = onehot(x_c)`): accept with probability `p(x_c)`; the residual is `p`
  with `x_c` zeroed and renormalised. Equivalent to "sample `y ~ p_u`, descend into the child whose token is `y`".
"""

import numpy as np
import torch

from .tree import children_lists


def greedy_accept(
    tree_ids: torch.LongTensor,
    ancestors: torch.BoolTensor,
    parent: torch.LongTensor,
    target_ids: torch.LongTensor,
    node_valid: torch.BoolTensor | None = None,
) -> tuple[torch.LongTensor, torch.BoolTensor, torch.LongTensor]:
    """Longest accepted path of a batch of trees under greedy (exact-match) verification.

    Args:
        tree_ids (`torch.LongTensor` of shape `(batch_size, num_nodes)`): node tokens, root first.
        ancestors (`torch.BoolTensor` of shape `(batch_size, num_nodes, num_nodes)`): ancestor-or-self matrix.
        parent (`torch.LongTensor` of shape `(batch_size, num_nodes)`): parents, `-1` at the root.
        target_ids (`torch.LongTensor` of shape `(batch_size, num_nodes)`): the target's choice after each node.
        node_valid (`torch.BoolTensor` of shape `(batch_size, num_nodes)`, *optional*): `False` for padding nodes.

    Returns:
        `tuple`: `best_node` `(B,)`, the deepest accepted node; `path_mask` `(B, N)`, the nodes on the root-to-best
        path (root included, in node order = path order); `bonus` `(B,)`, the target's token after `best_node`.
    """
    parent_target = target_ids.gather(1, parent.clamp(min=0))  # [B, N]: the target's pick at each node's parent
    match = tree_ids == parent_target
    if node_valid is not None:
        match &= node_valid
    match[:, 0] = True  # the root is committed already
    # A node is on an accepted path iff no node on its root path mismatches.
    path_ok = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N]
    depths = ancestors.sum(-1) - 1
    score = torch.where(path_ok, depths, -1)
    best_node = score.argmax(-1)  # first maximum: ties between equal siblings go to the earlier node
    rows = torch.arange(tree_ids.shape[0], device=tree_ids.device)
    return best_node, ancestors[rows, best_node], target_ids[rows, best_node]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`norm(max(0, p - q))` over the last axis (Leviathan et al. 2023, Eq. in Alg. 1).

    If `p <= q` everywhere (only possible through rounding, since a rejection then has probability 0), `p` is
    returned unchanged, which keeps the sampler well defined.
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def match_draft_vocab(draft_probs: torch.FloatTensor, vocab_size: int) -> torch.FloatTensor:
    """Draft distributions over the target's `vocab_size` logits: a draft vocabulary that is a prefix of the target's
    (the same tokenizer, the target's embedding padded to a multiple) gets zero probability on the extra ids."""
    width = draft_probs.shape[-1]
    if width > vocab_size:
        raise ValueError(f"the drafter's probabilities cover {width} token ids, the target's logits only {vocab_size}")
    return torch.nn.functional.pad(draft_probs, (0, vocab_size - width)) if width < vocab_size else draft_probs


def sample_accept_tree(
    tree_ids: list[int],
    parent: list[int],
    target_probs: torch.FloatTensor,
    draft_probs: torch.FloatTensor | None = None,
    node_valid: list[bool] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless speculative sampling along one draft tree (one batch row).

    Args:
        tree_ids (`list[int]`): node tokens, root first (verification numbering).
        parent (`list[int]`): parents, `-1` at the root.
        target_probs (`torch.FloatTensor` of shape `(num_nodes, vocab_size)`): `p_i`, the processed target
            distribution after each node.
        draft_probs (`torch.FloatTensor` of shape `(num_nodes, vocab_size)`, *optional*): `q_c`, the distribution
            each node's token was sampled from (row 0 unused). `None` applies the point-mass rule.
        node_valid (`list[bool]`, *optional*): `False` for padding nodes, which are never tried.
        generator (`torch.Generator`, *optional*): random source; the global one by default, so `torch.manual_seed`
            makes runs reproducible as with plain `generate`.

    Returns:
        `tuple`: the accepted path (node indices, root first) and the bonus token drawn at its end.
    """
    children = children_lists(parent)
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        accepted = None
        for child in children[node]:
            if node_valid is not None and not node_valid[child]:
                continue
            token = tree_ids[child]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[token] = 1.0
            else:
                q = draft_probs[child]
            ratio = (p[token] / q[token].clamp(min=torch.finfo(p.dtype).tiny)).clamp(max=1.0)
            if torch.rand((), generator=generator, device=p.device) < ratio:
                accepted = child
                break
            p = residual_distribution(p, q)
        if accepted is None:
            bonus = torch.multinomial(p, 1, generator=generator).item()
            return path, bonus
        node = accepted
        path.append(node)


def position_uniform(seed: int, row: int, position: int) -> float:
    """A number in `[0, 1)`, uniform over the keys and a fixed function of `(seed, row, position)` (53 bits of numpy's
    `SeedSequence` hash of the three)."""
    high, low = np.random.SeedSequence([seed, row, position]).generate_state(2, np.uint32).tolist()
    return ((high << 21) | (low >> 11)) / 2.0**53


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.LongTensor:
    """The token `u` picks from each distribution by inversion: the first `i` with `cdf(i) > u * cdf(V - 1)`.

    Args:
        probs (`torch.Tensor` of shape `(K, vocab_size)`): non-negative, rows not all zero (need not sum to one).
        uniforms (`torch.Tensor` of shape `(K,)`): numbers in `[0, 1)`.

    Returns:
        `torch.LongTensor` of shape `(K,)` on `probs`' device. For `u` uniform, token `i` comes with probability
        `p_i / sum(p)`; a token of probability zero is never picked (its `cdf` equals the one before it). The sum runs
        in float64 on the CPU (MPS has no float64). A row that sums to zero, infinity or NaN raises, as
        `torch.multinomial` does in plain `generate`.
    """
    cdf = probs.detach().to("cpu", torch.float64).cumsum(-1)
    totals = cdf[:, -1]
    if not bool((totals.isfinite() & (totals > 0)).all()):
        raise ValueError("probability tensor contains either `inf`, `nan` or sums to zero: nothing to sample from")
    targets = uniforms.to(cdf)[:, None] * totals[:, None]
    tokens = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    return tokens.to(probs.device)


def position_samples(scores: torch.Tensor, seed: int, rows: list[int], positions: list[int]) -> torch.LongTensor:
    """The token sampled from `softmax(scores)` `[K, V]` at each of K output positions: [`inverse_cdf_sample`] with the
    position's [`position_uniform`]. The engine samples with it and `assisted_generate` hands it to transformers'
    greedy loop, so both sample the same text.

    Drawing the randomness per output position, not per draft node, makes the sampled token at a position the same
    whatever the draft tree: a deterministic draft is accepted iff it equals that token, which happens with probability
    `p(draft)` (the point-mass rule's), so sampling stays lossless and a seeded run never depends on how the drafter
    sized its trees.
    """
    uniforms = torch.tensor([position_uniform(seed, r, p) for r, p in zip(rows, positions)], dtype=torch.float64)
    return inverse_cdf_sample(torch.softmax(scores.float(), dim=-1), uniforms)


def accept_by_picks(
    tree_ids: list[int], parent: list[int], pick, node_valid: list[bool] | None = None
) -> tuple[list[int], int]:
    """[`greedy_accept`] for one tree whose picks are computed on demand: `pick(node)` is the target's token after
    `node`. Only the accepted nodes' picks are asked for (the root's, then each accepted child's), level by level, so a
    costly pick (a sample) is paid for the accepted path, not the whole tree.

    Returns:
        `tuple`: the accepted path (node indices, root first): the deepest node whose every ancestor's pick is its
        child's token, the first in node order among equally deep ones, as `greedy_accept` chooses; and the bonus
        token, that node's pick.
    """
    children = children_lists(parent)
    picks, level, best = {}, [0], 0
    while level:
        best = level[0]
        next_level = []
        for node in level:
            picks[node] = pick(node)
            next_level += [
                c for c in children[node] if tree_ids[c] == picks[node] and (node_valid is None or node_valid[c])
            ]
        level = sorted(next_level)
    path = [best]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1], picks[best]
