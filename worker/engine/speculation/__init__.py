"""Speculative decoding: drafters propose tokens, a decode batch's verify forward keeps what the target
agrees with (`decode_batch.DecodeBatch.verify_with`, `verify.py`). A drafter is behind the `Drafter`
Protocol (`drafter.py`); prompt lookup (`prompt_lookup.py`) is the one that needs no model. Draft
models, DFlash drafts and MTP layers (`draft_model.py`, `dflash.py`, `mtp.py`) plug in behind the same
Protocol."""
