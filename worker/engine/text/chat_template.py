"""Chat templates rendered the way `transformers` renders them, with jinja2 in a sandbox.

A model's template comes from `chat_template.jinja` (newer checkpoints) or `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates). The environment matches transformers': trim and
lstrip blocks, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, loop controls and
a no-op `{% generation %}` block, and the special tokens (`bos_token`, ...) as variables. Templates are
untrusted code from the Hub, so they run in jinja2's immutable sandbox and see only plain JSON-like data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxq.jobs.errors import InvalidRequest

# The named special tokens transformers passes to every template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_JINJA_FILE = "chat_template.jinja"
_EXTRA_TEMPLATES_DIR = "additional_chat_templates"


class ChatTemplateError(InvalidRequest):
    """A chat template that is missing, does not compile, or refuses the messages (`raise_exception`)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's own `tojson`, which escapes HTML characters and takes no options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training): renders its body."""

    tags = frozenset({"generation"})  # type: ignore[assignment]  # jinja2 says set[str]; it only iterates

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template does not compile: {e.message} (template line {e.lineno})"
        ) from e


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types; anything else becomes an inert `<TypeName>` string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, numpy scalars) carry extra methods: strip them back to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict[str, Any]:
    plain = _plain(message)
    if not isinstance(plain, dict):
        raise ChatTemplateError(
            f"a chat message must be a mapping with `role` and `content`, got {message!r}"
        )
    # Templates handle a missing key but render `None` literally; transformers drops None values too.
    return {k: v for k, v in plain.items() if v is not None}


class ChatTemplate:
    """One model's chat template(s) plus the special-token variables they are rendered with."""

    def __init__(
        self, source: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None
    ) -> None:
        self.source = source if isinstance(source, str) else dict(source)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        tokenizer_config: Mapping[str, Any],
        special_tokens: Mapping[str, str] | None = None,
    ) -> ChatTemplate | None:
        """The template of the model folder `path`, or None when it has none."""
        source = load_template_source(path, tokenizer_config)
        return None if source is None else cls(source, special_tokens)

    def pick(self, tools: Sequence[Any] | None = None) -> str:
        """The template source to use: the only one, else `tool_use` when tools are given, else `default`."""
        if isinstance(self.source, str):
            return self.source
        if tools is not None and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ChatTemplateError(
            f"the model has several chat templates and none is `default`: {sorted(self.source)}"
        )

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (dicts or pydantic models) to the prompt text; extra kwargs become variables."""
        template = _compile(self.pick(tools))
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be JSON schema objects (dicts)")
        variables = _plain({**self.special_tokens, **kwargs})
        try:
            return template.render(
                messages=[_message(m) for m in messages],
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
            raise ChatTemplateError(
                f"the chat template failed on the messages: {type(e).__name__}: {e}"
            ) from e


def load_template_source(
    path: str | Path, tokenizer_config: Mapping[str, Any]
) -> str | dict[str, str] | None:
    """Read the chat template(s) of a model folder as transformers does.

    `chat_template.jinja` (and `additional_chat_templates/*.jinja`) win over `tokenizer_config.json`;
    a list of `{name, template}` becomes a dict by name. None when the model has no template.
    """
    folder = Path(path)
    files: dict[str, str] = {}
    if (folder / _JINJA_FILE).is_file():
        files["default"] = (folder / _JINJA_FILE).read_text(encoding="utf-8")
    extra = folder / _EXTRA_TEMPLATES_DIR
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            files[f.stem] = f.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    source = tokenizer_config.get("chat_template")
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, list):
        try:
            return {str(t["name"]): str(t["template"]) for t in source}
        except (KeyError, TypeError) as e:
            raise ChatTemplateError(
                f"chat_template list entries need `name` and `template`: {source!r:.200}"
            ) from e
    raise ChatTemplateError(
        f"chat_template must be a string or a list of named templates, got {type(source).__name__}"
    )
