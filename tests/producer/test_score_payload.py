"""A score job's wire payload: what a worker of any version reads the same."""

from __future__ import annotations

from mlxq.jobs.schema import ScoreRequest
from mlxq.producer import payload


def test_an_empty_prompt_is_spelled_out_and_token_ids_stand_alone() -> None:
    request = ScoreRequest.model_validate(
        {"rows": [{"prompt": "", "continuations": [" a"]}, {"prompt_ids": [3, 4], "prompt_logprobs": True}]}
    )
    rows = payload.wire_payload(request)["rows"]
    assert rows[0] == {"prompt": "", "continuations": [" a"]}  # older workers require `prompt`
    assert rows[1] == {"prompt_ids": [3, 4], "prompt_logprobs": True}
    assert ScoreRequest.model_validate(payload.wire_payload(request)) == request
