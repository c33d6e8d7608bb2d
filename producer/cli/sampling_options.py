"""The sampling and output-constraint flags that `generate` and `generate-file` share, and reading them
back into a request's parameters."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags and the mutually exclusive output constraints (`response_format`)."""
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        help="speculative decoding: at most this many draft tokens a step (0: off) [the worker's policy]",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="report each generated token's log-probability with its K likeliest alternatives (0..20) "
        "in the result and the stream",
    )
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        default=None,
        help="encode special-token text in a raw prompt as control tokens (default: as plain text)",
    )
    shape = p.add_mutually_exclusive_group()  # a request carries one constraint (`response_format`)
    shape.add_argument(
        "--json-schema",
        dest="response_format",
        type=_json_schema_file,
        metavar="FILE",
        help="constrain the output to JSON valid under this JSON Schema file (or an OpenAI "
        "response_format object of type json_schema)",
    )
    shape.add_argument(
        "--json-object",
        dest="response_format",
        action="store_const",
        const={"type": "json_object"},
        help="constrain the output to a JSON object",
    )
    shape.add_argument(
        "--regex",
        dest="response_format",
        type=lambda r: {"type": "regex", "regex": r},
        metavar="REGEX",
        help="constrain the output to text matching REGEX whole",
    )
    shape.add_argument(
        "--grammar",
        dest="response_format",
        type=_grammar_file,
        metavar="FILE",
        help="constrain the output to this Lark grammar (llguidance's dialect; rule `start`)",
    )


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from e


def _json_schema_file(path: str) -> dict[str, Any]:
    """A `response_format` from a JSON Schema file (wrapped, named after the file) or from a file
    holding a whole `{"type": "json_schema", "json_schema": {...}}` object."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{path} holds no JSON Schema object")
    if value.get("type") == "json_schema":
        return value
    return {
        "type": "json_schema",
        "json_schema": {"name": Path(path).stem[:64] or "response", "schema": value},
    }


def _grammar_file(path: str) -> dict[str, Any]:
    return {"type": "grammar", "grammar": _read_text(path)}


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The request parameters that the flags of `add_sampling_arguments` set (a flag not given: not sent)."""
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "max_draft_tokens": args.max_draft_tokens,
        "logprobs": args.logprobs,
        "allow_special_tokens": args.allow_special_tokens,
        "response_format": args.response_format,
    }
    return {k: v for k, v in given.items() if v is not None}
