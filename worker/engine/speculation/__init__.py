"""Speculative decoding: drafters propose tokens, a decode batch's verify forward keeps what the target
agrees with (`decode_batch.DecodeBatch.verify_with`, `verify_step.py`). A drafter is behind the
`Drafter` Protocol (`drafter.py`); prompt lookup (`prompt_lookup.py`) is the one that needs no model.
Draft models, DFlash drafts and MTP layers (`draft_model.py`, `dflash.py`, `mtp.py`) plug in behind
the same Protocol. Which of them an engine drafts with, and which of its requests draft, is the
engine's `DraftChoice` (`draft_choice.py`)."""
