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


def test_position_gumbel_noise_is_a_function_of_seed_row_and_position():
    from hf_accel.speculative.acceptance import position_gumbel_noise

    noise = position_gumbel_noise(7, [0, 0, 1, 0], [5, 6, 5, 5], 50)
    assert (
        torch.equal(noise[0], noise[3]) and not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    )
    assert torch.equal(position_gumbel_noise(7, [1], [5], 50)[0], noise[2])
    assert not torch.equal(position_gumbel_noise(8, [0], [5], 50)[0], noise[0])


def test_keyed_gumbel_max_samples_the_softmax():
    """`argmax(log p + noise)` over many (row, position) keys is distributed as `p` (a sign flip of the noise, i.e.
    reversed Gumbel, is off by ~0.05 in total variation, below what the engine's end-to-end test resolves)."""
    from hf_accel.speculative.acceptance import position_gumbel_noise

    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20000
    noise = position_gumbel_noise(3, [k % 5 for k in range(n)], [k // 5 for k in range(n)], len(p))
    freq = torch.bincount((p.log() + noise).argmax(-1), minlength=len(p)) / n
    assert 0.5 * (freq - p).abs().sum() < 0.015, freq  # sampling noise ~0.005


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
