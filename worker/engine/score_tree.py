"""The radix tree that groups score rows by shared prefix: which spans the scorer computes once.

Each node holds a span of tokens; the rows whose model input ends at a node's last token are listed on
it. `compact` folds short shared spans back into plain leaves, where recomputing them inside one padded
batch is cheaper than a forward of their own. Pure Python: no model, no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxq.worker.engine.cache.token_match import common_length


@dataclass
class _Node:
    span: list[int]
    children: dict[int, _Node] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # rows whose prompt ends at this node's last token
    flat: list[_Node] = field(default_factory=list)  # leaves of subtrees not worth sharing (`compact`)

    def below(self) -> list[_Node]:
        return [*self.children.values(), *self.flat]


def _insert(root: _Node, tokens: list[int], row: int) -> None:
    node, i = root, 0
    while i < len(tokens):
        child = node.children.get(tokens[i])
        if child is None:
            node.children[tokens[i]] = _Node(span=tokens[i:], rows=[row])
            return
        span = child.span
        k = common_length(span, tokens, i)
        if k < len(span):  # split the child at the first difference
            tail = _Node(span=span[k:], children=child.children, rows=child.rows)
            child.span, child.children, child.rows = span[:k], {span[k]: tail}, []
        node, i = child, i + k
    node.rows.append(row)


def build_tree(prompts: Sequence[list[int]], min_shared: int = 0) -> _Node:
    """Radix tree of prompts; identical prompts share one node. See `compact` for `min_shared`."""
    root = _Node(span=[])
    for row, tokens in enumerate(prompts):
        _insert(root, tokens, row)
    if min_shared > 1:
        compact(root, min_shared)
    return root


def _flatten(node: _Node, prefix: list[int]) -> list[_Node]:
    here = prefix + node.span
    out = [_Node(span=here, rows=list(node.rows))] if node.rows else []
    for child in node.below():
        out.extend(_flatten(child, here))
    return out


def compact(node: _Node, min_shared: int) -> None:
    """Fold subtrees whose shared spans are all shorter than `min_shared` into plain leaves.

    A shared span costs a batch-1 forward of its own and splits its rows into separate batches; a few
    tokens common to some rows (a first word, a space) are cheaper to recompute inside one padded batch.
    """
    for key, child in list(node.children.items()):
        compact(child, min_shared)
        if (
            child.below()
            and len(child.span) < min_shared
            and not any(c.below() for c in child.children.values())
        ):
            del node.children[key]
            node.flat.extend(_flatten(child, []))


def computed_per_row(root: _Node, n_rows: int, reused: dict[int, int] | None = None) -> list[int]:
    """Prompt tokens each row computed itself: a shared span counts for the first row under it.

    `reused` maps id(node) to how many of its tokens came from the prefix cache (computed by no row).
    """
    computed = [0] * n_rows
    reused = reused or {}

    def first_row(node: _Node) -> int:
        firsts = [first_row(c) for c in node.below()] + node.rows
        first = min(firsts)
        computed[first] += len(node.span) - reused.get(id(node), 0)
        return first

    for child in root.below():
        first_row(child)
    return computed
