"""The radix tree that groups score rows by shared prefix (pure Python, no model)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxq.worker.engine.score_tree import _Node, build_tree, computed_per_row


def _paths(node: _Node, prefix: list[int], out: dict[int, list[int]]) -> None:
    here = prefix + node.span
    for row in node.rows:
        out[row] = here
    for child in node.below():
        _paths(child, here, out)


@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=20))
def test_tree_spells_every_prompt_and_shares_prefixes(prompts: list[list[int]]) -> None:
    root = build_tree(prompts)
    found: dict[int, list[int]] = {}
    _paths(root, [], found)
    assert found == dict(enumerate(prompts))
    # Each shared token is computed once: total computed == number of distinct prefixes (trie nodes).
    distinct = {tuple(p[: i + 1]) for p in prompts for i in range(len(p))}
    computed = computed_per_row(root, len(prompts))
    assert sum(computed) == len(distinct)
    assert all(0 <= c <= len(p) for c, p in zip(computed, prompts, strict=True))


def test_shared_prefix_is_paid_by_the_first_row() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9], [7]]
    assert computed_per_row(build_tree(prompts), 4) == [4, 1, 1, 1]


def test_a_prompt_that_is_a_prefix_of_another_ends_inside() -> None:
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3]]
    root = build_tree(prompts)
    (node,) = root.children.values()
    assert node.span == [1, 2, 3] and node.rows == [1]
    assert computed_per_row(root, 2) == [5, 0]


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=20),
    st.integers(2, 12),
)
def test_compaction_keeps_every_prompt_and_only_long_shared_spans(
    prompts: list[list[int]], min_shared: int
) -> None:
    root = build_tree(prompts, min_shared)
    found: dict[int, list[int]] = {}
    _paths(root, [], found)
    assert found == dict(enumerate(prompts))
    computed = computed_per_row(root, len(prompts))
    assert all(0 <= c <= len(p) for c, p in zip(computed, prompts, strict=True))
    assert sum(computed) <= sum(len(p) for p in prompts)

    def check(node: _Node) -> None:
        for child in node.children.values():
            if child.below():  # a span computed once for several rows is long, or has long spans below
                assert len(child.span) >= min_shared or any(c.below() for c in child.children.values())
            check(child)

    check(root)
