"""Tokenizer and chat templates against transformers' AutoTokenizer on tiny tokenizer folders.

Besides the tiny ChatML tokenizer, three folders imitate real model families: Llama 3 (BOS from the
tokenizer.json post-processor, header tokens, `raise_exception`, `strftime_now`), Mistral ([INST], BOS from
an explicit `add_bos_token`, templates as a named list) and SmolLM2/Qwen (default system message and
tools with `tojson`, in a chat_template.jinja file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from mlxq.worker.engine.text.chat_template import ChatTemplate, ChatTemplateError
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.tiny_model import build_tokenizer, write_random_checkpoint

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, roles must alternate user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

MISTRAL_TOOL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]" + MISTRAL_TEMPLATE

SMOL_TEMPLATE = """{% for message in messages %}
{% if loop.first and messages[0]['role'] != 'system' %}
{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}
{% endif %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if tools %}
{{ '<|im_start|>tools\\n' }}{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ '<|im_end|>\\n' }}
{% endif %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
{% endif %}"""

MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "東京はどこ? 🙂"},
        {"role": "assistant", "content": "日本です。 café naïve"},
        {"role": "user", "content": "  e\u0301 combining, then   spaces  "},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": ""},
    ],
]

TEXTS = ["hello world", " leading space", "東京 🙂 café 👍🏽", "a\n\nb", "", "<|im_start|>user\nhi<|im_end|>"]


def _variant(
    folder: Path, specials: list[str], config: dict[str, Any], bos_post_processor: str | None = None
) -> Path:
    """A tiny tokenizer folder with extra special tokens and its own tokenizer_config.json."""
    build_tokenizer(folder)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if bos_post_processor is not None:
        bos_id = backend.token_to_id(bos_post_processor)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_post_processor}:0 $A:0",
            pair=f"{bos_post_processor}:0 $A:0 {bos_post_processor}:1 $B:1",
            special_tokens=[(bos_post_processor, bos_id)],
        )
    backend.save(str(folder / "tokenizer.json"))
    full = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(full))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    chatml = write_random_checkpoint(root / "chatml")
    llama3 = _variant(
        root / "llama3",
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
        bos_post_processor="<|begin_of_text|>",
    )
    (llama3 / "generation_config.json").write_text(json.dumps({"eos_token_id": [385, 384]}))
    (llama3 / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    mistral = _variant(
        root / "mistral",
        ["<s>", "</s>", "[INST]", "[/INST]"],
        {
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": [
                {"name": "default", "template": MISTRAL_TEMPLATE},
                {"name": "tool_use", "template": MISTRAL_TOOL_TEMPLATE},
            ],
        },
        bos_post_processor="<s>",
    )
    smol = _variant(root / "smol", [], {"eos_token": "<|im_end|>", "add_bos_token": False})
    (smol / "chat_template.jinja").write_text(SMOL_TEMPLATE)
    return {"chatml": chatml, "llama3": llama3, "mistral": mistral, "smol": smol}


@pytest.fixture(scope="module")
def hf(folders: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(path)) for name, path in folders.items()}


@pytest.fixture(scope="module")
def ours(folders: dict[str, Path]) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_dir(path) for name, path in folders.items()}


NAMES = ["chatml", "llama3", "mistral", "smol"]


# --- encode / decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_clone_encodes_as_the_original_and_shares_no_state_with_it(name: str, ours: dict) -> None:
    """`clone` (a tokenizer for another thread): the same ids for every text, special tokens read as
    control tokens or split, with and without BOS/EOS; flipping the clone's special-token switch or
    filling its memories leaves the original as it was."""
    tok: Tokenizer = ours[name]
    twin = tok.clone()
    assert twin.backend is not tok.backend and twin.shared_encoder is not tok.shared_encoder
    long = "A shared document, the same for every row. " * 40
    texts = [*TEXTS, *(t + special for t in TEXTS for special in tok.special_texts[:2]), long + "end one"]
    for special in (True, False):
        for split in (True, False):
            want = [tok.encode(t, add_special_tokens=special, split_special=split) for t in texts]
            assert [twin.encode(t, add_special_tokens=special, split_special=split) for t in texts] == want
    assert twin.encode_short_many(texts) == tok.encode_short_many(texts)
    assert (twin.eos_ids, twin.bos_id, twin.special_ids) == (tok.eos_ids, tok.bos_id, tok.special_ids)
    twin.backend.encode_special_tokens = True
    twin.encode(long + "end two")
    marked = f"x{tok.special_texts[0]}y"
    assert tok.encode(marked, add_special_tokens=False) != twin.encode(marked, add_special_tokens=False)
    assert not tok.backend.encode_special_tokens
    assert all(r.text != long + "end two" for r in tok.shared_encoder._recent)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(name: str, add_special_tokens: bool, ours: dict, hf: dict) -> None:
    for text in TEXTS:
        want = hf[name].encode(text, add_special_tokens=add_special_tokens)
        assert ours[name].encode(text, add_special_tokens=add_special_tokens) == want, text


@pytest.mark.parametrize("name", NAMES)
def test_encode_short_remembers_exactly_what_encode_gives(
    name: str, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`encode_short` (scoring's prompt tails with each candidate) is `encode` without special tokens,
    remembered for short texts with the least recently used forgotten first; long texts pass through."""
    import mlxq.worker.engine.text.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_SHORT_TEXTS", 3)
    tok = Tokenizer.from_dir(folders[name])
    texts = [" Answer: yes", " Answer: no", "\nAnswer:", " Answer: yes", "x" * 300, " la", " Answer: no"]
    for text in texts:
        assert tok.encode_short(text) == tok.encode(text, add_special_tokens=False), text
    assert list(tok._short) == [" Answer: yes", " la", " Answer: no"]  # 3 kept, the long one never
    got = tok.encode_short(" la")
    got.append(-1)  # a caller's list is its own
    assert tok.encode_short(" la") == tok.encode(" la", add_special_tokens=False)


@pytest.mark.parametrize("name", NAMES)
def test_encode_short_many_is_encode_short_in_one_call(
    name: str, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Texts not remembered go to the tokenizer in one batch call (from `_BATCH_FROM` of them): the
    same ids as one call each, duplicates and long texts included; the memory stays bounded."""
    import mlxq.worker.engine.text.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_SHORT_TEXTS", 16)
    tok = Tokenizer.from_dir(folders[name])
    texts = [f" row {i} ends: Answer:{c}" for i in range(12) for c in [" A", " B"]]
    texts += [texts[3], "x" * 300, "東京 🙂", texts[0], ""]
    tok.encode_short(texts[5])  # one of them remembered already
    got = tok.encode_short_many(texts)
    assert got == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert len(tok._short) == 16 and "" in tok._short and "x" * 300 not in tok._short  # the newest kept
    assert tok.encode_short_many(texts[:3]) == got[:3]
    assert tok.decode_many([ids for ids in got if ids]) == [tok.decode(ids) for ids in got if ids]


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(name: str, ours: dict, hf: dict) -> None:
    for text in TEXTS:
        ids = hf[name].encode(text)
        for skip in (False, True):
            assert ours[name].decode(ids, skip_special_tokens=skip) == hf[name].decode(
                ids, skip_special_tokens=skip
            )


def test_bos_is_added_as_the_model_says(ours: dict) -> None:
    llama3, mistral = ours["llama3"], ours["mistral"]
    assert llama3.encode("hi")[0] == llama3.bos_id  # from tokenizer.json's post-processor
    assert mistral.encode("hi")[0] == mistral.bos_id
    assert mistral.encode("hi", add_special_tokens=False)[0] != mistral.bos_id
    assert ours["chatml"].bos_id is None and ours["smol"].bos_id is None


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_text_starting_with_bos_gets_no_second_one(name: str, ours: dict, hf: dict) -> None:
    tok = ours[name]
    text = tok.bos_token + "hello"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    assert hf[name].encode(text)[:2] == [tok.bos_id, tok.bos_id]  # transformers doubles it
    assert tok.encode(text, add_special_tokens=False) == ids


def test_flags_apply_only_without_a_post_processor(tmp_path: Path, ours: dict) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}
    folder = _variant(tmp_path / "flags", ["<s>", "</s>"], config)
    spec = json.loads((folder / "tokenizer.json").read_text())
    byte_level = spec["post_processor"]
    spec["post_processor"] = None  # as a converter might write it
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_dir(folder)
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_id and ids[-1] == tok.backend.token_to_id("</s>")
    assert tok.encode("hi", add_special_tokens=False) == ids[1:-1]
    # With a post-processor in tokenizer.json the flags are ignored, as in transformers 5.
    (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": byte_level}))
    assert Tokenizer.from_dir(folder).encode("hi") == ids[1:-1]


def test_special_ids_eos_ids_and_vocab(ours: dict, hf: dict) -> None:
    chatml, llama3 = ours["chatml"], ours["llama3"]
    assert chatml.eos_ids == {
        chatml.backend.token_to_id("<|im_end|>"),
        chatml.backend.token_to_id("<|endoftext|>"),
    }
    # tokenizer_config's eos + generation_config's list + config.json's int
    assert llama3.eos_ids == {llama3.backend.token_to_id("<|eot_id|>"), 384, 385, 0}
    for name in NAMES:
        want = {i for i, t in hf[name].added_tokens_decoder.items() if t.special}
        assert ours[name].special_ids == want
    for name in NAMES:
        assert ours[name].vocab_size == len(hf[name])
        assert ours[name].has_chat_template
        assert ours[name].byte_level


def test_missing_tokenizer_json_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_token_bytes_cover_the_vocab(ours: dict) -> None:
    tok = ours["chatml"]
    table = tok.token_bytes
    assert len(table) == tok.vocab_size
    ids = tok.encode("東京 🙂 café")
    assert b"".join(table[i] for i in ids).decode() == "東京 🙂 café"


# --- chat templates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    name: str, messages: list[dict], add_generation_prompt: bool, ours: dict, hf: dict
) -> None:
    if name == "mistral" and messages[0]["role"] == "system" and len(messages) > 2:
        messages = [messages[0], *messages[-1:]]  # keep the strict alternation valid
    want = hf[name].apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours[name].apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want


def test_chat_template_with_tools_and_extra_variables(ours: dict, hf: dict) -> None:
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "東京"}}}]
    messages = MESSAGES[0]
    for name in ("smol", "mistral"):
        want = hf[name].apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours[name].apply_chat_template(messages, tools=tools) == want
    assert "東京" in ours["smol"].apply_chat_template(messages, tools=tools)  # tojson keeps unicode
    want = hf["llama3"].apply_chat_template(messages, tokenize=False, date_string="01 Jan 2030")
    assert (
        ours["llama3"].apply_chat_template(messages, add_generation_prompt=False, date_string="01 Jan 2030")
        == want
    )


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_bad_role_order_is_a_chat_template_error(name: str, ours: dict) -> None:
    bad = [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "hm"}]
    with pytest.raises(ChatTemplateError, match="alternate") as err:
        ours[name].apply_chat_template(bad)
    assert isinstance(err.value, ValueError)


def test_model_without_template(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MESSAGES[0])


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{{ messages[0].content + 1 }}", "failed"),
        ("{{ messages.append(1) }}", "refused"),  # the sandbox keeps messages immutable
        ("{% set ns = namespace(_x=1) %}", "underscore"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused"),
    ],
)
def test_template_errors_and_sandbox(source: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source).render(MESSAGES[0])


def test_named_templates_without_default() -> None:
    template = ChatTemplate({"rag": "x", "tool_use": "y"})
    assert template.render(MESSAGES[0], tools=[{"name": "f"}]) == "y"
    with pytest.raises(ChatTemplateError, match="default"):
        template.render(MESSAGES[0])


def test_generation_block_and_loop_controls() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source).render(MESSAGES[2]) == "one"


def test_pydantic_messages_and_none_fields() -> None:
    from mlxq.jobs.schema import ChatMessage

    source = "{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.name is defined }};{% endfor %}"
    messages = [ChatMessage(role="user", content="hi"), {"role": "assistant", "content": "yo", "name": None}]
    assert ChatTemplate(source).render(messages) == "user:hi:False;assistant:yo:False;"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_split_special_encodes_special_token_text_as_transformers_split_special_tokens(
    name: str, add_special_tokens: bool, ours: dict, hf: dict
) -> None:
    tok = ours[name]
    texts = [*TEXTS, "".join(tok.special_texts) + " then text", f"a{tok.special_texts[-1]}b"]
    for text in texts:
        want = hf[name].encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        assert tok.encode(text, add_special_tokens, split_special=True) == want, text
    many = tok.encode_many(texts, [add_special_tokens] * len(texts), [True, False] * (len(texts) // 2))
    assert many == [tok.encode(t, add_special_tokens, split_special=i % 2 == 0) for i, t in enumerate(texts)]
    # Split, no id of a special token is left but those the post-processor adds (BOS/EOS).
    plain = set(tok.encode("x", add_special_tokens)) - set(tok.encode("x", False))
    for text in texts:
        ids = tok.encode(text, add_special_tokens, split_special=True)
        assert not (set(ids) & tok.special_ids) - plain, text


@pytest.mark.parametrize("name", NAMES)
def test_special_token_text_is_found_wherever_a_substring_test_finds_it(name: str, ours: dict) -> None:
    """`has_special_text` (one pattern search) says what testing each special token's text as a
    substring says: in the middle, at either end, cut short, overlapping, or none."""
    tok: Tokenizer = ours[name]
    specials = tok.special_texts
    texts = [*TEXTS, *(f"a{s}b" for s in specials), *(s[:-1] for s in specials), specials[-1] + specials[0]]
    texts += ["<|im_start", "|>", "<s", "</s>x", "[INST]", "<" + specials[0]]
    found = [tok.has_special_text(t) for t in texts]
    assert found == [any(s in t for s in specials) for t in texts]
    assert any(found) and not all(found)
