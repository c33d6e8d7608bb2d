"""Scoring: the next-token distributions many rows need, every prefix they share computed once.

Rows (from one job or many, of every kind) go into one radix tree over their model inputs
(`score_tree`). Walking it depth-first with one batch-1 KV cache, each shared span is computed once
(extend the cache, recurse, trim back); where a node's children are rows with nothing more in common,
their suffixes run as one right-padded batch on top of the node's cache, which the rows read in place
(`cache/shared_prefix.py`: no copy of it per row). Right padding needs no mask of its own: a real
token never attends to a pad that sits after it.

What a row reads of the positions it runs through belongs to its head (`ScoreHead`, the seam): the
candidates head here keeps the logits after a prompt's last token (`candidate_scores`); the token head
(`token_scoring`) keeps each token's log-probability after the tokens before it (continuations, rolling
windows, prompt logprobs). Only positions some row needs go through the LM head, at most `head_chunk` at
a time (a long prompt never holds a [T, vocab] float32 block), and a position several rows need (a
question's last context token, before each of its continuations) goes through it once.

This module re-exports the scoring API from the modules that own it: `prefix_scorer` (`PrefixScorer`,
its budgets and phases), `score_head` (the `ScoreHead` seam and `Pick`), `candidate_head`
(`CandidateHead`, `candidate_scores`) and `candidate_tokens` (candidate rows' text as tokens,
`candidate_token_ids`).
"""

from __future__ import annotations

from mlxq.worker.engine.candidate_head import CandidateHead, candidate_scores
from mlxq.worker.engine.candidate_tokens import TAIL_TOKENS, RowText, RowTokens, candidate_token_ids
from mlxq.worker.engine.prefix_scorer import SCORE_ENGINE_PHASES, PrefixScorer, score_kv_by_default
from mlxq.worker.engine.score_head import Pick, ScoreHead

__all__ = [
    "SCORE_ENGINE_PHASES",
    "TAIL_TOKENS",
    "CandidateHead",
    "Pick",
    "PrefixScorer",
    "RowText",
    "RowTokens",
    "ScoreHead",
    "candidate_scores",
    "candidate_token_ids",
    "score_kv_by_default",
]
