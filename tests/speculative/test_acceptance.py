import itertools

import pytest
import torch

from hf_accel.speculative.acceptance import greedy_accept, residual_distribution, sample_accept_tree
from hf_accel.speculative.tree import compute_ancestor_matrix, extract_path


def test_greedy_accept_hand_computed():
    # root -> (1: tok 5, 2: tok 6); 1 -> 3: tok 7; 2 -> 4: tok 8; 3 -> 5: tok 9
    tree_ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    parent = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    ancestors = compute_ancestor_matrix(parent)
    # target picks: after root 6, after node 2 -> 8, after node 4 -> 11
    target = torch.tensor([[6, 7, 8, 9, 11, 3]])
    best, path_mask, bonus = greedy_accept(tree_ids, ancestors, parent, target)
    assert best.tolist() == [4] and path_mask[0].nonzero().flatten().tolist() == [0, 2, 4] and bonus.tolist() == [11]
    # nothing matches: the root only, bonus = target after root
    target = torch.tensor([[1, 1, 1, 1, 1, 1]])
    best, path_mask, bonus = greedy_accept(tree_ids, ancestors, parent, target)
    assert best.tolist() == [0] and bonus.tolist() == [1]
    # padding nodes are never accepted
    target = torch.tensor([[5, 7, 8, 9, 11, 3]])
    valid = torch.tensor([[True, True, True, False, True, True]])
    best, _, bonus = greedy_accept(tree_ids, ancestors, parent, target, valid)
    assert best.tolist() == [1] and bonus.tolist() == [7]


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, torch.tensor([1.0, 0, 0])), torch.tensor([0.0, 0.6, 0.4]))


def _first_token_distribution(tree_ids, parent, p, q, n, seed=0):
    torch.manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        if q is not None:  # stochastic drafter: the root's children are i.i.d. draws from q
            tree_ids = [0] + torch.multinomial(q[1], len(tree_ids) - 1, replacement=True).tolist()
        path, bonus = sample_accept_tree(tree_ids, parent, p, q)
        first = tree_ids[path[1]] if len(path) > 1 else bonus
        counts[first] += 1
    return counts / n


def test_sampling_tree_keeps_first_token_distribution():
    """Point-mass siblings and stochastic siblings: the first emitted token is distributed as p_root."""
    vocab = 5
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05]] + [[0.2] * vocab] * 3)
    tree_ids, parent = [0, 1, 3, 1], [-1, 0, 0, 0]  # duplicate sibling token on purpose
    freq = _first_token_distribution(tree_ids, parent, p, None, 4000)
    assert 0.5 * (freq - p[0]).abs().sum() < 0.04
    q_row = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    q = torch.stack([q_row] * 4)
    freq = _first_token_distribution(tree_ids, parent, p, q, 4000, seed=1)
    assert 0.5 * (freq - p[0]).abs().sum() < 0.04


def test_position_uniform_is_a_function_of_seed_row_and_position():
    from hf_accel.speculative.acceptance import position_uniform

    u = [position_uniform(7, r, p) for r, p in [(0, 5), (0, 6), (1, 5), (0, 5)]]
    assert u[0] == u[3] and len(set(u[:3])) == 3
    assert position_uniform(8, 0, 5) != u[0]
    many = torch.tensor([position_uniform(3, k % 5, k // 5) for k in range(20000)])
    assert 0 <= many.min() and many.max() < 1
    # uniform: every tenth of [0, 1) gets a tenth of the keys (binomial sd ~0.002)
    assert (torch.histc(many, bins=10, min=0, max=1) / len(many) - 0.1).abs().max() < 0.01


def test_inverse_cdf_sample_at_the_boundaries_and_on_zero_probabilities():
    from hf_accel.speculative.acceptance import inverse_cdf_sample

    p = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 6)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1 - 2**-53, 0.5], dtype=torch.float64)
    assert inverse_cdf_sample(p, u).tolist() == [1, 1, 3, 3, 3, 3]
    # unnormalised rows: the same picks as normalised ones
    assert inverse_cdf_sample(p * 7, u).tolist() == [1, 1, 3, 3, 3, 3]
    # nothing to sample from: an error, as `torch.multinomial` gives in plain `generate`, not the last token
    for bad in (torch.zeros(1, 5), torch.tensor([[0.5, float("nan"), 0.5]]), torch.tensor([[1.0, float("inf")]])):
        with pytest.raises(ValueError, match="nothing to sample from"):
            inverse_cdf_sample(bad, torch.tensor([0.5]))


def test_position_samples_sample_the_softmax():
    """The keyed inverse-CDF sample over many (row, position) keys is distributed as `softmax(scores)`."""
    from hf_accel.speculative.acceptance import position_samples

    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    n = 20000
    tokens = position_samples(p.log().expand(n, -1), 3, [k % 5 for k in range(n)], [k // 5 for k in range(n)])
    freq = torch.bincount(tokens, minlength=len(p)) / n
    assert freq[4] == 0 and 0.5 * (freq - p).abs().sum() < 0.015, freq  # sampling noise ~0.005


def _root_path(parent: list[int], node: int) -> list[int]:
    path = [node]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path


def _random_tree(rng, num_nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)]
    return [int(t) for t in rng.integers(0, vocab, num_nodes)], parent


def test_accept_by_picks_equals_greedy_accept_and_picks_only_the_accepted_nodes():
    """On random trees (duplicate siblings and padding nodes included), the on-demand walk accepts the same path and
    bonus as the vectorised `greedy_accept`, and asks for no pick off the accepted nodes."""
    import numpy as np

    from hf_accel.speculative.acceptance import accept_by_picks

    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 12))
        tree_ids, parent = _random_tree(rng, n, 3)
        picks = [int(t) for t in rng.integers(0, 3, n)]
        valid = [True] + [bool(v) for v in rng.random(n - 1) > 0.2]
        asked = []

        def pick(node, picks=picks, asked=asked):
            asked.append(node)
            return picks[node]

        path, bonus = accept_by_picks(tree_ids, parent, pick, valid)
        _best, path_mask, expected_bonus = greedy_accept(
            torch.tensor([tree_ids]),
            compute_ancestor_matrix(torch.tensor([parent])),
            torch.tensor([parent]),
            torch.tensor([picks]),
            torch.tensor([valid]),
        )
        assert path == path_mask[0].nonzero().flatten().tolist() and bonus == expected_bonus.item()
        matches = [True] + [valid[c] and tree_ids[c] == picks[parent[c]] for c in range(1, n)]
        on_accepted_paths = {c for c in range(n) if all(matches[a] for a in _root_path(parent, c))}
        assert len(asked) == len(set(asked)) and set(asked) <= on_accepted_paths


def test_sampling_never_tries_a_padding_node():
    """A padding node (`node_valid` False) is never accepted, even when its token would be: the emitted token is
    drawn from `p_root` alone (the padding node's zero draft row would otherwise accept it with probability 1)."""
    p = torch.tensor([[0.3, 0.7, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    tree_ids, parent = [2, 1, 0], [-1, 0, 0]  # node 1: a real draft of token 1; node 2: padding (token 0)
    q = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.manual_seed(0)
    counts, n = torch.zeros(3), 2000
    for _ in range(n):
        path, bonus = sample_accept_tree(tree_ids, parent, p, q, node_valid=[True, True, False])
        assert 2 not in path
        counts[tree_ids[path[1]] if len(path) > 1 else bonus] += 1
    assert 0.5 * (counts / n - p[0]).abs().sum() < 0.04, counts / n


class _Undecided(Exception):
    pass


class _Replay:
    """Plays [`sample_accept_tree`]'s random choices from a list, multiplying their probabilities: `torch.rand() <
    ratio` answers the next choice (`True` has probability `ratio`), `torch.multinomial(probs)` returns it (`probs` of
    it). Past the list's end it raises `_Undecided`, with the possible choices in `options`."""

    def __init__(self, choices):
        self.choices, self.used, self.weight, self.options = choices, 0, 1.0, None

    def _next(self, options, probability):
        if self.used == len(self.choices):
            self.options = options
            raise _Undecided
        choice = self.choices[self.used]
        self.used += 1
        self.weight *= probability(choice)
        return choice

    def rand(self, *args, **kwargs):
        replay = self

        class Uniform:
            def __lt__(self, ratio):
                return replay._next([True, False], lambda accept: float(ratio) if accept else 1 - float(ratio))

        return Uniform()

    def multinomial(self, probs, n, generator=None):
        options = [t for t in range(len(probs)) if probs[t] > 0]
        return torch.tensor([self._next(options, lambda t: float(probs[t]))])


def _exact_law(tree_ids, parent, p, q, monkeypatch):
    """Exact law of the tokens [`sample_accept_tree`] emits (accepted path, then bonus), every random choice
    enumerated."""
    law, todo = {}, [[]]
    while todo:
        replay = _Replay(todo.pop())
        monkeypatch.setattr(torch, "rand", replay.rand)
        monkeypatch.setattr(torch, "multinomial", replay.multinomial)
        try:
            path, bonus = sample_accept_tree(tree_ids, parent, p, q)
        except _Undecided:
            todo += [[*replay.choices, choice] for choice in replay.options]
            continue
        finally:
            monkeypatch.undo()
        emitted = tuple(tree_ids[n] for n in path[1:]) + (bonus,)
        if replay.weight > 0:  # a choice of probability 0 (accepting a token the target never emits)
            law[emitted] = law.get(emitted, 0.0) + replay.weight
    return law


class _PathLaws:
    """A random target: a next-token law per emitted prefix (with `zero`, token 0 never, as after top-k)."""

    def __init__(self, generator, vocab, zero):
        self.generator, self.vocab, self.zero, self.laws = generator, vocab, zero, {}

    def __call__(self, prefix):
        if prefix not in self.laws:
            p = torch.softmax(2 * torch.randn(self.vocab, generator=self.generator, dtype=torch.float64), -1)
            if self.zero:
                p[0] = 0.0
            self.laws[prefix] = p / p.sum()
        return self.laws[prefix]

    def at_nodes(self, tree_ids, parent):
        """`p_i` of every tree node: the law after the node's path."""
        paths = [extract_path(parent, n)[1:] for n in range(len(parent))]
        return torch.stack([self(tuple(tree_ids[i] for i in path)) for path in paths])


def test_tree_sampling_emits_the_targets_law_exactly(monkeypatch):
    """Spec B.5 by exact enumeration (no sampling) on a 3-token vocabulary: random trees of up to 4 nodes, a target
    law per path (some with a token of probability 0), point-mass drafts and trees of i.i.d. draws from `q` (every
    draw enumerated). After every emitted prefix, the next emitted token is distributed as the target's law there."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3
    for trial in range(24):
        num_nodes = int(torch.randint(1, 5, (), generator=gen))
        parent = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, num_nodes + 1)]
        target = _PathLaws(gen, vocab, zero=trial % 3 == 0)
        if trial % 2:  # a stochastic drafter: every node's token an i.i.d. draw from q
            q_row = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
            q, law = q_row.expand(num_nodes + 1, vocab), {}
            for draw in itertools.product(range(vocab), repeat=num_nodes):
                tree_ids, chance = [0, *draw], float(q_row[list(draw)].prod())
                p = target.at_nodes(tree_ids, parent)
                for emitted, weight in _exact_law(tree_ids, parent, p, q, monkeypatch).items():
                    law[emitted] = law.get(emitted, 0.0) + chance * weight
        else:  # a deterministic drafter: the point-mass rule
            tree_ids = [0] + torch.randint(0, vocab, (num_nodes,), generator=gen).tolist()
            law = _exact_law(tree_ids, parent, target.at_nodes(tree_ids, parent), None, monkeypatch)
        assert sum(law.values()) == pytest.approx(1.0)
        next_token = {}  # emitted prefix -> law of the token emitted after it
        for emitted, weight in law.items():
            for i in range(len(emitted)):
                next_token.setdefault(emitted[:i], torch.zeros(vocab, dtype=torch.float64))[emitted[i]] += weight
        for prefix, mass in next_token.items():
            torch.testing.assert_close(mass / mass.sum(), target(prefix), msg=f"trial {trial}, after {prefix}")
