"""An engine's speculation: the draft it loaded for its kind, and which drafter each request gets.

An engine speculates one way (`SPECULATION_KINDS`): off, prompt lookup (no model), a draft
model or DFlash draft (`draft_model.py`, `dflash.py`: a `draft/` folder beside the target, or one a
setting names), or the target's MTP layer (`mtp.py`). A `DraftChoice` the engine composes loads that
kind's draft (`load`), says which target layers the draft reads (`taps`: the decode batch collects
them for it), and gives each generation request its drafter and depth cap, or none where the row
must decode plainly (`speculation_for`). What drafting gains a batch, step by step, is not its to
judge: that is the engine's `DraftGate` (`draft_gate.py`). It is handed the engine's speculation
settings, not its options: nothing of the speculation package imports the engine's modules above it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.speculation import dflash  # noqa: F401  # registers the DFlash draft kind
from mlxq.worker.engine.speculation.draft_model import (
    DraftMismatch,
    DraftSource,
    DraftTarget,
    draft_folder,
    load_draft,
)
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.policy import DraftPolicy, RowSpeculation
from mlxq.worker.engine.speculation.prompt_lookup import PromptLookup

log = logging.getLogger(__name__)

# Drafters a worker may decode with (`EngineOptions.speculation`): "draft_model" covers every draft
# folder kind (a causal LM, DFlash); "mtp" is the target checkpoint's own MTP layer.
SPECULATION_KINDS = ("off", "prompt_lookup", "draft_model", "mtp")


class DraftChoice:
    """An engine's speculation of `kind` (one of `SPECULATION_KINDS`; another is a `ValueError`) under
    `policy`, for `target` (its model and tokenizer, the dtype setting and prefill chunk a draft is
    loaded with); `draft_model`: the draft's folder, None for a `draft/` folder beside the target's
    files (`EngineOptions` holds all three)."""

    def __init__(self, kind: str, policy: DraftPolicy, draft_model: str | None, target: DraftTarget) -> None:
        if kind not in SPECULATION_KINDS:
            raise ValueError(f"unknown speculation kind {kind!r}: expected one of {list(SPECULATION_KINDS)}")
        self.kind = kind
        self.policy = policy
        self.draft_model = draft_model
        self.target = target
        self.draft: DraftSource | None = None  # speculation "draft_model" or "mtp": loaded by `load`

    def load(self, path: Path) -> None:
        """Load the draft this speculation kind drafts with, for the target loaded from `path` (a draft
        model or DFlash draft: `load_draft`; an MTP layer from the target's own files); nothing for
        the kinds that need none."""
        if self.kind == "draft_model":
            self.load_draft(path)
        elif self.kind == "mtp":
            target = self.target
            self.draft = MtpDraft.load(path, target.model, target.prefill_chunk, target.pad_shapes)
            log.info("MTP layer loaded path=%s", path)

    def load_draft(self, target: Path) -> None:
        """Load the draft model speculation "draft_model" drafts with: the folder the options name, else
        the `draft/` folder beside the target's files (`target`); a clear error when there is none or it
        does not fit the target."""
        folder = draft_folder(target, self.draft_model)
        if folder is None:
            raise DraftMismatch(
                f"speculation draft_model needs a draft model: a draft/ folder in {target} or a folder "
                "named by MLXQ_DRAFT_MODEL"
            )
        self.draft = load_draft(folder, self.target)
        log.info("draft model loaded path=%s kind=%s", folder, type(self.draft).__name__)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs this worker's drafters read (a DFlash draft's; `DecodeBatch`)."""
        if self.kind not in ("draft_model", "mtp") or self.draft is None:
            return ()
        return self.draft.taps

    def speculation_for(self, request: GenerateRequest, sampler: Sampler) -> RowSpeculation | None:
        """A request's drafter and its depth cap, or None where it decodes plainly: speculation off on
        this worker or for the job (`max_draft_tokens` 0), a sampler whose draws depend on the tokens
        before them through penalties (speculative sampling could not keep such a row's distribution
        exact), or a row that reports logprobs (they are taken at a step's first position only): such
        rows take plain steps. A constrained row drafts: its drafts are checked against its grammar
        (`DecodeBatch.verify_with`). Prompt lookup's cap may exceed `max_depth` (`max_run`: its drafts
        cost no forward), and so may a DFlash draft's, up to its block (a proposal costs one forward of
        the draft whatever its length); a draft model's may not; an MTP layer drafts one token."""
        kind = self.kind
        policy = self.policy
        # prompt lookup's drafts cost no forward: a copied run may grow past max_depth (DraftPolicy.max_run)
        cap = max(policy.max_depth, policy.max_run) if kind == "prompt_lookup" else policy.max_depth
        if request.max_draft_tokens is not None:
            cap = min(cap, request.max_draft_tokens)
        if kind == "off" or cap <= 0 or sampler.penalized or sampler.logprobs is not None:
            return None  # a row reporting logprobs takes plain steps: its logprobs are of position 0
        if kind == "prompt_lookup":
            return RowSpeculation(PromptLookup(), policy, cap)
        if kind in ("draft_model", "mtp"):
            if self.draft is None:
                raise ValueError(f"speculation {kind}: the engine has no draft (`load_draft`, MTP layer)")
            if self.draft.max_depth is not None:  # a DFlash block (one forward, its size), one MTP layer
                cap = min(max(policy.max_depth, policy.max_run), self.draft.max_depth)
                if request.max_draft_tokens is not None:
                    cap = min(cap, request.max_draft_tokens)
            return RowSpeculation(self.draft.drafter(), policy, cap)
        raise ValueError(f"unknown speculation kind {kind!r}: expected one of {list(SPECULATION_KINDS)}")
