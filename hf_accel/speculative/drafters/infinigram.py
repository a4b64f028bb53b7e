"""Infinigram drafter: suffix matches in an on-disk index and in the current context, drafted as a tree.

Spec: `specs/000_care_infinigram.md`, Part B. One `propose` call per step and row does:

1. **Matches.** The longest suffix of the row's context (prompt + generated tokens) found in the index
   ([`InfinigramIndex.longest_suffix`], the ∞-gram's `c_s`, Eq. 4.1; if every occurrence of it ends a document, the
   longest shorter suffix that is continued somewhere) and every earlier occurrence of a suffix of the context
   inside the context itself ([`context_matches`]), so the drafter works with no index at all.
2. **`inf_nkt` continuations.** The next `max_depth` tokens after each occurrence (index occurrences subsampled to
   `max_support`, B.3), cut at document ends.
3. **Trie and scores.** Occurrences form groups: the index's longest match, and the context's occurrences by match
   length. Group `g` (match length `l_g`, `n_g` occurrences) votes `V_g = exp(alpha * min(l_g, match_cap)) *
   n_g / (n_g + support_prior)` (times `context_weight` for the context), split evenly among its occurrences, and
   the continuations are merged into a trie. A node's score is `S = votes through it / (sum_g V_g + prior)`: with
   one group and no prior it is the ∞-gram's empirical probability of the whole path, the fraction of the
   occurrences whose continuation starts with it. That is B.4's `P_0 * ... * P_j` except where documents end inside
   the draft: B.4 drops an ended continuation from `|A_j|`, here it stays in the denominator (the document's end, the
   answer's EOS, is an outcome the draft does not match). The prior turns short, rare matches into low confidence
   (acceptance rises with match length and frequency, Fig. 4.1).
   Longer matches dominate, shorter ones still add alternatives (issue 6: trees over several matches beat the
   single longest-match chain).
4. **Confidence-sized tree.** Candidate nodes are those with `S >= threshold` (the spec's confidence truncation,
   B.11 item 5, applied per node to the path's probability `S`, not to B.5's per-position `P_j`: a chain of `P_j`
   0.8, 0.6 stops after one token at `threshold=0.5`, where B.5 drafts both), by decreasing score, at most
   `max_nodes` (`tree=False` keeps only the majority path: the spec's chain, its tokens B.4's `inf_nkt` ones). How many are drafted is chosen per pass by [`choose_tree_width`]: the width that
   maximises expected tokens (1 + the sum of the nodes' acceptance probabilities, from an online
   [`AcceptanceCalibrator`] of the scores) per unit of pass cost ([`PassCostModel`]: issue 6's CPU costs, refined
   by the measured time of every pass). Width 0 means no draft: a plain decoding pass, which on CPU is ~30%
   cheaper than verifying even one draft token (issue 6's measured costs).

Ambiguities (B.11) resolved here: the context fed to the lookup is prompt + response (item 3/B.6); no minimum
match length at run time beyond `min_match` (default 1, best in the issue's simulation; item 6); majority ties go to
the smallest token id (B.4); the confidence is the drafter's own empirical probability, not the target's (item 5).
"""

import math
import threading
from dataclasses import dataclass

import numpy as np

from ..cost import DEFAULT_VERIFY_COST, AcceptanceCalibrator, PassCostModel
from ..tree import DraftTree
from .index import InfinigramIndex


@dataclass
class InfinigramConfig:
    """Knobs of the Infinigram drafter (defaults chosen with the issue's CPU cost model; see `propose`).

    Args:
        max_depth (`int`): deepest draft node (the spec's 16-token lookahead).
        max_nodes (`int`): draft nodes per row at batch size 1 (a 16-node tree is nearly free on CPU).
        threshold (`float`): minimum node score (confidence: the probability of the node's whole path, see the
            module docstring) for a node to be considered at all.
        verify_cost (`tuple`): `(tokens in the pass, relative cost)` points of the target's pass cost, linearly
            interpolated (and extrapolated past the last point). Defaults: issue 6's CPU measurements of the
            default model (n = 1: 63 ms; 2-16: 82-92 ms; 32: 126 ms; 64: 259 ms).
        adaptive_cost (`bool`): refine the cost curve with the measured time of every pass ([`PassCostModel`]).
        calibrate (`bool`): size trees with the observed acceptance rate of nodes of similar score
            ([`AcceptanceCalibrator`]) instead of the raw score.
        alpha (`float`): log-weight per matched token of an occurrence.
        match_cap (`int`): match lengths above this weigh the same.
        context_weight (`float`): extra weight of occurrences in the row's own context.
        prior (`float`): pseudo-vote in the denominator of every score (a length-3 match votes `e^3` ~ 20).
        support_prior (`float`): a group of `n` occurrences votes in proportion to `n / (n + support_prior)`.
        max_support (`int`): index occurrences read per query (B.3 `max_support`).
        max_match (`int`): longest suffix looked up.
        min_match (`int`): shortest match that may draft.
        max_context_occurrences (`int`): context occurrences used per step: the longest matches, then the most recent.
        tree (`bool`): draft a tree of alternatives (`False`: the majority chain only).
        use_context (`bool`): also match inside the row's own context.
    """

    max_depth: int = 16
    max_nodes: int = 16
    threshold: float = 0.02
    verify_cost: tuple = DEFAULT_VERIFY_COST
    adaptive_cost: bool = True
    calibrate: bool = True
    alpha: float = 1.0
    match_cap: int = 8
    context_weight: float = 8.0
    prior: float = 20.0
    support_prior: float = 1.0
    max_support: int = 1000
    max_match: int = 64
    min_match: int = 1
    max_context_occurrences: int = 32
    tree: bool = True
    use_context: bool = True

    def __post_init__(self):
        counts = ("max_depth", "max_nodes", "match_cap", "max_support", "max_match", "min_match")
        for name in counts + ("max_context_occurrences",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InfinigramConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_match < self.min_match:
            raise ValueError(f"InfinigramConfig.max_match {self.max_match} is below min_match {self.min_match}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"InfinigramConfig.threshold must be in [0, 1], got {self.threshold!r}")
        for name in ("alpha", "prior", "support_prior", "context_weight"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "context_weight" and value == 0):
                bound = "positive" if name == "context_weight" else "non-negative"
                raise ValueError(f"InfinigramConfig.{name} must be finite and {bound}, got {value!r}")


def context_matches(context: np.ndarray, max_match: int = 64, min_match: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Earlier occurrences of suffixes of `context` inside `context` itself.

    Args:
        context (`np.ndarray` of shape `(L,)`): token ids.
        max_match (`int`): longest match measured.
        min_match (`int`): shortest match returned.

    Returns:
        `tuple`: `ends` (positions `i < L - 1` such that `context[i - l + 1 : i + 1] == context[L - l :]`) and
        `lengths` (the largest such `l`, capped at `max_match`), both `int64[k]`, only for `l >= min_match`.
    """
    length = len(context)
    if length < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends = np.nonzero(context[:-1] == context[-1])[0]
    lengths = np.ones(len(ends), dtype=np.int64)
    active = np.arange(len(ends))
    for k in range(1, max_match):
        if len(active) == 0 or k >= length:
            break
        previous = ends[active] - k
        ok = previous >= 0
        ok[ok] = context[previous[ok]] == context[length - 1 - k]
        active = active[ok]
        lengths[active] += 1
    keep = lengths >= min_match
    return ends[keep], lengths[keep]


def build_weighted_trie(continuations: np.ndarray, weights: np.ndarray, min_weight: float = 0.0):
    """Merges weighted token sequences into a trie, level by level (vectorised).

    Args:
        continuations (`np.ndarray` of shape `(n, depth)`): token ids, `-1` after a sequence's end.
        weights (`np.ndarray` of shape `(n,)`): weight of each sequence.
        min_weight (`float`): nodes lighter than this are pruned with their subtrees (they could not be drafted).

    Returns:
        `tuple`: `tokens`, `parents` (drafter-facing numbering, `-1` = root) and `node_weights` lists, parents before
        children; a node's weight is the sum of the weights of the sequences through it.
    """
    tokens, parents, node_weights = [], [], []
    node_of_row = np.full(len(continuations), -1, dtype=np.int64)  # current trie node of each sequence
    alive = np.arange(len(continuations))
    for j in range(continuations.shape[1] if continuations.ndim == 2 else 0):
        alive = alive[continuations[alive, j] >= 0]
        if len(alive) == 0:
            break
        keys = (node_of_row[alive] + 1) << 32 | continuations[alive, j]  # (parent, token) as one int64
        unique, inverse = np.unique(keys, return_inverse=True)
        inverse = inverse.reshape(-1)
        mass = np.bincount(inverse, weights=weights[alive], minlength=len(unique))
        keep = mass >= min_weight
        new_ids = np.full(len(unique), -1, dtype=np.int64)
        new_ids[keep] = len(tokens) + np.arange(int(keep.sum()))
        tokens += (unique[keep] & 0xFFFFFFFF).tolist()
        parents += ((unique[keep] >> 32) - 1).tolist()
        node_weights += mass[keep].tolist()
        node_of_row[alive] = new_ids[inverse]
        alive = alive[new_ids[inverse] >= 0]
    return tokens, parents, node_weights


def select_tree_nodes(parents: list[int], scores: list[float], max_nodes: int, threshold: float, chain: bool):
    """Nodes to draft: by decreasing score, `>= threshold`, at most `max_nodes`, closed under parents.

    A child's score never exceeds its parent's (votes through a child pass through its parent), and ties are broken
    by node order (parents first), so the selection is always a subtree. With `chain=True`, only the best child of
    each selected node is followed (the majority path).
    """
    if chain:
        best_child = {}
        for node, (p, s) in enumerate(zip(parents, scores)):
            if p not in best_child or s > scores[best_child[p]]:
                best_child[p] = node
        chosen, node = [], -1
        while node in best_child and len(chosen) < max_nodes and scores[best_child[node]] >= threshold:
            node = best_child[node]
            chosen.append(node)
        return chosen
    order = sorted(range(len(scores)), key=lambda n: (-scores[n], n))
    chosen = [n for n in order[:max_nodes] if scores[n] >= threshold]
    return sorted(chosen)  # node order keeps parents before children


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the root has depth 1); parents come before children."""
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def choose_tree_width(row_scores: list[list[float]], cost_model: PassCostModel, max_nodes: int) -> int:
    """Draft nodes per row `w` maximising expected tokens per unit of target time.

    Rows of a batch are padded to the same width, so a pass costs `cost(batch_size * (w + 1))` whatever the rows
    hold, and yields `sum_b (1 + sum of row b's w best scores)` tokens if scores are acceptance probabilities
    (expected accepted length = sum over nodes of P(node's path accepted), plus the bonus token).
    """
    batch_size = len(row_scores)
    best_width, best_rate = 0, batch_size / cost_model.cost(batch_size)
    gains = [0.0] * batch_size
    for width in range(1, max_nodes + 1):
        for b, scores in enumerate(row_scores):
            if width <= len(scores):
                gains[b] += scores[width - 1]
        rate = (batch_size + sum(gains)) / cost_model.cost(batch_size * (width + 1))
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width


class InfinigramDrafter:
    """Drafts from an Infinigram index (optional) and the row's own context.

    Args:
        index (`InfinigramIndex` or `str`, *optional*): the index, or its directory. `None` drafts from the context
            only.
        tokenizer (*optional*): the model's tokenizer, checked against the index's header: an index built with another
            tokenizer is refused. Without it nothing is checked (the output stays lossless, but a foreign index's
            drafts are rejected).
        config (`InfinigramConfig`, *optional*): drafting knobs.

    Example:

    ```python
    >>> drafter = InfinigramDrafter("/path/to/index", tokenizer=tokenizer)
    >>> model.generate(**inputs, custom_generate=custom_generate, drafter=drafter, max_new_tokens=128)
    ```
    """

    requires_hidden_states = ()
    provides_draft_probs = False

    def __init__(self, index=None, tokenizer=None, config: InfinigramConfig | None = None):
        if isinstance(index, (str, bytes)) or hasattr(index, "__fspath__"):
            index = InfinigramIndex(index)
        if index is not None and tokenizer is not None:
            index.check_tokenizer(tokenizer)
        self.index = index
        self.config = config or InfinigramConfig()
        self.cost_model = PassCostModel(self.config.verify_cost, adaptive=self.config.adaptive_cost)
        self.calibrator = AcceptanceCalibrator() if self.config.calibrate else None
        # per thread (one drafter may serve `generate` calls in several threads, as the Hub loader's cached one does):
        # original row -> (parents, scores) of the nodes proposed in that thread's pending pass
        self._proposed = {}
        self.last_stats = None  # set by `custom_generate`: see its docstring

    def propose(self, request) -> DraftTree | None:
        batch_size = len(request.rows)
        cfg = self.config
        drafts = []
        for b in range(batch_size):
            context = request.context(b).cpu().numpy().astype(np.int64)
            depth = int(min(cfg.max_depth, int(request.max_depth[b])))
            drafts.append(self.draft_row(context, depth, cfg.max_nodes) if depth > 0 else ([], [], []))
        probabilities = [self._calibrated(scores, parents) for _, parents, scores in drafts]
        width = choose_tree_width(probabilities, self.cost_model, cfg.max_nodes)
        proposed = self._proposed[threading.get_ident()] = {}
        if width == 0 or self.cost_model.needs_anchor(batch_size):
            return None  # no draft worth its cost, or the cost of a plain pass was never measured: measure it
        # Each row's nodes are in decreasing-score order, closed under parents: a prefix is a subtree.
        trees = [(tokens[:width], parents[:width]) for tokens, parents, _ in drafts]
        for b, (_, parents, scores) in enumerate(drafts):
            proposed[int(request.rows[b])] = (parents[:width], scores[:width])
        return DraftTree.from_parent_lists(trees, device=request.sequences.device)

    def _calibrated(self, scores: list[float], parents: list[int]) -> list[float]:
        if self.calibrator is None:
            return scores
        return [self.calibrator.probability(s, d) for s, d in zip(scores, node_depths(parents))]

    def update(self, result) -> None:
        """Learns the pass cost (engine timing) and the acceptance rate by score (accepted nodes) of each pass."""
        # this thread's pending proposal, removed: a thread that ends leaves nothing behind
        proposed = self._proposed.pop(threading.get_ident(), {})
        if result.is_prefill:
            return
        self.cost_model.observe(result.num_input_tokens, result.pass_seconds)
        if self.calibrator is None:
            return
        for b, row in enumerate(result.rows.tolist()):
            if row not in proposed:
                continue
            parents, scores = proposed[row]
            on_path, node = set(), int(result.best_node[b])
            while node >= 0:  # the accepted nodes are the best node's ancestors
                on_path.add(node)
                node = parents[node]
            self.calibrator.observe(scores, [n in on_path for n in range(len(scores))], node_depths(parents))

    def draft_row(self, context: np.ndarray, depth: int, max_nodes: int) -> tuple[list[int], list[int], list[float]]:
        """`(tokens, parents, scores)` of one row's candidate nodes, by decreasing score (drafter numbering)."""
        groups = self._match_groups(context, depth)
        if not groups:
            return [], [], []
        cfg = self.config
        weights = []
        for length, is_context, conts in groups:
            # Group vote: longer matches and more occurrences weigh more; split evenly among the occurrences.
            vote = math.exp(cfg.alpha * min(length, cfg.match_cap)) * len(conts) / (len(conts) + cfg.support_prior)
            vote *= cfg.context_weight if is_context else 1.0
            weights.append(np.full(len(conts), vote / len(conts)))
        weights = np.concatenate(weights)
        # The shares added back up as the trie adds a node's (`np.bincount`, in row order), not the votes: `n` shares
        # of `v / n` do not always add up to `v`, and with no prior a node that every occurrence passes through must
        # score exactly 1 (the ∞-gram's certainty), or `threshold=1` drafts nothing.
        total = cfg.prior + float(np.bincount(np.zeros(len(weights), np.int64), weights=weights)[0])
        # Other nodes add up to a hair off their share too (3 shares of `v / 6` to 0.49999999999999994 of the total):
        # a node exactly at the threshold (B.5 drafts `P_j >= tau`) is kept with that much slack.
        threshold = cfg.threshold * (1 - 1e-9)
        continuations = np.concatenate([conts for _, _, conts in groups])
        tokens, parents, node_weights = build_weighted_trie(continuations, weights, min_weight=threshold * total)
        scores = [w / total for w in node_weights]
        chosen = select_tree_nodes(parents, scores, max_nodes, threshold, chain=not cfg.tree)
        # By decreasing score, parents first (a child never scores higher); a chain is already in that order.
        chosen = sorted(chosen, key=lambda n: (-scores[n], n)) if cfg.tree else chosen
        position = {node: i for i, node in enumerate(chosen)}
        return (
            [tokens[n] for n in chosen],
            [position.get(parents[n], -1) for n in chosen],
            [scores[n] for n in chosen],
        )

    def _match_groups(self, context: np.ndarray, depth: int) -> list[tuple[int, bool, np.ndarray]]:
        """`(match_length, from_context, continuations [n, depth])` groups: the index's longest match, and the
        context's occurrences grouped by match length (`-1` after a document end or the context's end)."""
        cfg = self.config
        groups = []
        if self.index is not None:
            # The longest suffix that has a continuation: where every occurrence of the longest match ends a document,
            # the next shorter suffix (its occurrences include those) is looked up.
            max_match = cfg.max_match
            while max_match >= cfg.min_match:
                length, lo, hi = self.index.longest_suffix(context, max_match)
                if length < cfg.min_match:
                    break
                conts = self.index.continuations(lo, hi, depth, cfg.max_support)
                conts = conts[conts[:, 0] >= 0]
                if len(conts):
                    groups.append((length, False, conts))
                    break
                max_match = length - 1
        if cfg.use_context:
            ends, lengths = context_matches(context, cfg.max_match, cfg.min_match)
            order = np.lexsort((-ends, -lengths))[: cfg.max_context_occurrences]  # longest, then most recent
            ends, lengths = ends[order], lengths[order]
            index = ends[:, None] + 1 + np.arange(depth)[None, :]
            conts = np.where(index < len(context), context[np.clip(index, 0, len(context) - 1)], -1)
            # an occurrence ends before the context's last token, so its first continuation token is always known
            for length in np.unique(lengths):
                groups.append((int(length), True, conts[lengths == length]))
        return groups
