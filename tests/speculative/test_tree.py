import random

import pytest
import torch

from hf_accel.compat import CACHE_NAME
from hf_accel.speculative.tree import (
    DraftTree,
    build_tree_attention_mask,
    compute_ancestor_matrix,
    compute_depths,
    extract_path,
    prefill_ancestors,
    to_verification_parents,
    tree_position_ids,
    validate_parents,
)


def _random_parents(num_nodes, rng):
    return [-1] + [rng.randrange(i) for i in range(1, num_nodes)]


def test_ancestors_depths_and_paths_match_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        parents = [_random_parents(rng.randint(1, 12), rng) for _ in range(1)]
        parent = torch.tensor(parents)
        ancestors = compute_ancestor_matrix(parent)[0]
        depths = compute_depths(ancestors[None])[0]
        for i in range(parent.shape[1]):
            path = extract_path(parents[0], i)
            assert path[0] == 0 and path[-1] == i
            assert sorted(ancestors[i].nonzero().flatten().tolist()) == sorted(path)
            assert depths[i] == len(path) - 1


def test_tree_mask_and_positions_brute_force():
    parent = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 3]])
    past_mask = torch.tensor([[False, True, True], [True, True, True]])
    ancestors = compute_ancestor_matrix(parent)
    mask = build_tree_attention_mask(ancestors, past_mask)
    assert mask.shape == (2, 1, 5, 8)
    for b in range(2):
        for i in range(5):
            path = extract_path(parent[b], i)
            for j in range(8):
                allowed = bool(past_mask[b, j]) if j < 3 else (j - 3) in path
                assert (mask[b, 0, i, j] == 0) == allowed
    positions = tree_position_ids(compute_depths(ancestors), torch.tensor([2, 3]))
    assert positions.tolist() == [[2, 3, 3, 4, 5], [3, 4, 5, 6, 7]]


def test_windowed_tree_mask_brute_force():
    """A sliding window counts positions, not slots: the hole (slot 2) takes no room in it."""
    parent = torch.tensor([[-1, 0, 0, 1]])
    past_mask = torch.tensor([[True, True, False, True, True]])
    ancestors = compute_ancestor_matrix(parent)
    node_positions = tree_position_ids(compute_depths(ancestors), torch.tensor([4]))  # [[4, 5, 5, 6]]
    positions = torch.cat([torch.tensor([[0, 1, 9, 2, 3]]), node_positions], dim=1)  # the hole's: any value
    for window in (1, 2, 3, 4, 8):
        full = build_tree_attention_mask(ancestors, past_mask)
        mask = build_tree_attention_mask(ancestors, past_mask, positions=positions, window=window)
        for i in range(4):
            query = int(node_positions[0, i])
            for j in range(9):
                allowed = bool(full[0, 0, i, j] == 0) and query - int(positions[0, j]) < window
                assert (mask[0, 0, i, j] == 0) == allowed, (window, i, j)
    # window 2: the root (position 4) sees position 3 and itself; node 3 (position 6) sees only node 1 and itself
    mask = build_tree_attention_mask(ancestors, past_mask, positions=positions, window=2)[0, 0] == 0
    assert mask[0].nonzero().flatten().tolist() == [4, 5]
    assert mask[3].nonzero().flatten().tolist() == [6, 8]


def test_draft_tree_builders():
    tree = DraftTree.from_chains([[5, 6, 7], [], [8]])
    assert tree.input_ids.shape == (3, 3)
    assert tree.node_mask.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    full = to_verification_parents(tree.parent)
    validate_parents(full)
    assert full[0].tolist() == [-1, 0, 1, 2]
    tree = DraftTree.from_parent_lists([([4, 5, 6], [-1, -1, 0])])
    assert to_verification_parents(tree.parent)[0].tolist() == [-1, 0, 0, 1]
    with pytest.raises(ValueError, match="draft tree row 1 has 3 tokens and 2 parents"):
        DraftTree.from_parent_lists([([4], [-1]), ([4, 5, 6], [-1, 0])])


def test_tree_mask_matches_sequential_decoding(tiny_llama):
    """Each node's logits equal those of plain sequential decoding along its path (DESIGN.md, checked fact)."""
    from transformers import DynamicCache

    prompt = torch.tensor([[5, 9, 13, 17]])
    tree_ids = torch.tensor([[21, 30, 31, 40, 41]])
    parent = torch.tensor([[-1, 0, 0, 1, 2]])
    cache = DynamicCache(config=tiny_llama.config)
    tiny_llama(prompt, **{CACHE_NAME: cache}, use_cache=True)
    ancestors = compute_ancestor_matrix(parent)
    mask = build_tree_attention_mask(ancestors, torch.ones(1, 4, dtype=torch.bool))
    positions = tree_position_ids(compute_depths(ancestors), torch.tensor([4]))
    logits = tiny_llama(tree_ids, attention_mask=mask, position_ids=positions, **{CACHE_NAME: cache}).logits
    for node in range(5):
        path = extract_path(parent[0], node)
        full = torch.cat([prompt, tree_ids[:, path]], dim=1)
        expected = tiny_llama(full).logits[0, -1]
        torch.testing.assert_close(logits[0, node], expected, atol=1e-5, rtol=1e-5)


def test_validate_parents_refuses_self_parents_and_orphans():
    """A node that is its own parent, or a non-root node without one, is no tree: refused, not verified as garbage."""
    import pytest

    validate_parents(torch.tensor([[-1, 0, 1, 1]]))
    for bad in ([-1, 0, 2, 1], [-1, 0, -1, 1], [0, 0, 1, 2], [-1, 0, 3, 1]):
        with pytest.raises(ValueError, match="topologically ordered"):
            validate_parents(torch.tensor([bad]))


def test_prefill_ancestors_brute_force():
    """A prompt token sees the real prompt up to itself; an aux input the real prompt, its aux path and itself."""
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    aux_parent = torch.tensor([[-1, 0, -1], [-1, -1, 1]])
    ancestors = prefill_ancestors(prompt_mask, aux_parent)
    for b in range(2):
        parents = aux_parent[b].tolist()
        for i in range(6):
            for j in range(6):
                if i < 3:
                    expected = j <= i and bool(prompt_mask[b, j])
                elif j < 3:
                    expected = bool(prompt_mask[b, j])
                else:
                    path = [i - 3]
                    while parents[path[-1]] >= 0:
                        path.append(parents[path[-1]])
                    expected = j - 3 in path
                assert bool(ancestors[b, i, j]) == expected, (b, i, j)
