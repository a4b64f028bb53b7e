"""Offline simulation of greedy drafting over recorded target outputs (no model needed).

Greedy speculative decoding of a prompt reproduces the target's greedy output `y`, so recorded outputs tell exactly
what each draft would have got accepted: at committed length `t` the drafter sees `prompt + y[:t]`, the longest
path of its tree that matches `y[t:]` is accepted, and `t` advances by that plus the bonus token. The time of a pass
is taken from the drafter's verification-cost model, in units of a one-token pass, so the estimated speedup is
`tokens / sum(pass costs)` (the prefill is common to both and left out).
"""

from dataclasses import dataclass

import numpy as np

from ..cost import interpolate_cost
from .infinigram import choose_tree_width, node_depths


@dataclass
class SimulationResult:
    tokens: int = 0
    passes: int = 0
    cost: float = 0.0
    draft_nodes: int = 0

    @property
    def mean_accepted(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def estimated_speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0


def accepted_length(tokens: list[int], parents: list[int], target: list[int]) -> int:
    """Draft tokens accepted under greedy verification when the target continues with `target` (one row)."""
    depth_of, accepted = {}, 0
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        depth = 0 if parent < 0 else depth_of.get(parent, -(10**9)) + 1
        if depth >= 0 and depth < len(target) and token == target[depth]:
            depth_of[node] = depth
            accepted = max(accepted, depth + 1)
    return accepted


def accepted_nodes(tokens: list[int], parents: list[int], target: list[int]) -> set[int]:
    """Nodes on the accepted path (one row, drafter numbering)."""
    depth_of, best = {}, -1
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        depth = 0 if parent < 0 else depth_of.get(parent, -(10**9)) + 1
        if 0 <= depth < len(target) and token == target[depth]:
            depth_of[node] = depth
            if best < 0 or depth > depth_of[best]:
                best = node
    path = set()
    while best >= 0:
        path.add(best)
        best = parents[best]
    return path


def simulate_greedy(drafter, cases, max_depth: int = 16) -> SimulationResult:
    """Simulates batch-1 greedy decoding of each `(prompt_ids, output_ids)` case with `drafter` (an Infinigram one).

    The first output token comes from the prefill and is not counted; every later token is.
    """
    cfg = drafter.config
    result = SimulationResult()
    for prompt, output in cases:
        sequence = np.asarray(list(prompt) + list(output), dtype=np.int64)
        t = 1
        while t < len(output):
            context = sequence[: len(prompt) + t]
            depth = min(max_depth, len(output) - t - 1)
            tokens, parents, scores = drafter.draft_row(context, depth, cfg.max_nodes) if depth > 0 else ([], [], [])
            width = choose_tree_width([drafter._calibrated(scores, parents)], drafter.cost_model, cfg.max_nodes)
            accepted = accepted_length(tokens[:width], parents[:width], list(output[t : t + depth]))
            if drafter.calibrator is not None and width:
                on_path = accepted_nodes(tokens[:width], parents[:width], list(output[t : t + depth]))
                drafter.calibrator.observe(
                    scores[:width], [n in on_path for n in range(width)], node_depths(parents[:width])
                )
            result.passes += 1
            result.tokens += accepted + 1
            result.cost += interpolate_cost(width + 1, cfg.verify_cost)
            result.draft_nodes += width
            t += accepted + 1
    return result
