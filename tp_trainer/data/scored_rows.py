"""Rows -> examples: token ids and which of them the loss scores, for every data format.

One example per row, as two int lists of the same length (``EXAMPLE_FEATURES``):
    input_ids  the example's tokens, ending with eos (or the template's end of the last turn)
    scored     1 where the token is a target of the loss, 0 where it is only context
Formats (``corpus.data_format``):
    text               the text + eos, every token scored
    prompt_completion  prompt and completion tokenized separately and joined (the boundary is exact:
                       no token spans both), then eos; the completion and eos are scored
    messages           the chat template's rendering (``chat_template.resolve_chat_template``); each
                       assistant reply and its end-of-turn token are scored: the tokens inside the
                       template's {% generation %} spans where it has them (``apply_chat_template(...,
                       return_assistant_tokens_mask=True)``), else each assistant turn as the
                       template's renderings of the conversation's prefixes place it (``chat_spans``)
``train_on_prompt``: every token scored, in every format. Row checks run here, on every row, before
any training: a messages row with an unknown role or a message without content, a row without its
completion; the error names the row and shows it.

Tokenized through ``datasets.map`` and cached under a fingerprint of (source, tokenizer, format,
columns, template, train_on_prompt), as plain text is (``packing.tokenize_dataset``).
"""

from __future__ import annotations

import datasets
from datasets.fingerprint import Hasher

from .chat_spans import end_of_turn_ids, scored_chat
from .chat_template import has_generation_markers, resolve_chat_template, template_errors
from .corpus import DataArgs, format_columns
from .errors import DataConfigError

EXAMPLE_FEATURES = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                      "scored": datasets.Sequence(datasets.Value("int8"))})
ROLES = ("system", "user", "assistant", "tool")
_FORMAT_VERSION = "tp_trainer-examples-v1"   # bump when the tokenized layout changes


def tokenize_examples(ds: datasets.Dataset, tokenizer, args: DataArgs, data_format: str, split: str,
                      tokenizer_key: str) -> datasets.Dataset:
    """``ds`` (one row per example) -> a Dataset of ``EXAMPLE_FEATURES``, cached by ``datasets``.
    Raises DataConfigError naming the row for a bad one. Cost on a miss: the tokenizer's, plus one
    Jinja rendering per messages row (a template without generation markers: 1 + 2 per assistant turn)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataConfigError(f"tokenizer {type(tokenizer).__name__} has no eos token; every example ends with "
                              "one. Use a tokenizer that has one.")
    columns = [column for column, _ in format_columns(data_format, args)]
    template = resolve_chat_template(tokenizer, args.chat_template) if data_format == "messages" else None
    where = f"the {split} data of {args.split_source(split)}"
    fingerprint = Hasher.hash([ds._fingerprint, tokenizer_key, data_format, columns, template,
                               args.train_on_prompt, int(eos), _FORMAT_VERSION])
    encode = {"text": _encode_texts, "prompt_completion": _encode_pairs, "messages": _encode_chats}[data_format]
    return ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names,
                  fn_kwargs={"tokenizer": tokenizer, "columns": columns, "eos": int(eos), "template": template,
                             "all_scored": args.train_on_prompt, "where": where},
                  features=EXAMPLE_FEATURES, new_fingerprint=fingerprint, desc="Tokenizing examples")


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def _encode_texts(batch, indices, tokenizer, columns, eos, template, all_scored, where) -> dict:
    """text + eos, all scored."""
    ids = [x + [eos] for x in _ids(tokenizer, batch[columns[0]])]
    return {"input_ids": ids, "scored": [[1] * len(x) for x in ids]}


def _encode_pairs(batch, indices, tokenizer, columns, eos, template, all_scored, where) -> dict:
    """prompt + completion + eos; the completion and eos scored."""
    prompt_col, completion_col = columns
    for row, prompt, completion in zip(indices, batch[prompt_col], batch[completion_col]):
        for column, value, flag in ((prompt_col, prompt, "--prompt_column"),
                                    (completion_col, completion, "--completion_column")):
            if not isinstance(value, str) or (column == completion_col and not value):
                raise DataConfigError(f"row {row} of {where}: {column!r} is {value!r}, not a non-empty string; give "
                                      f"every row its {column} (or name the column with {flag}).")
    prompts, completions = _ids(tokenizer, batch[prompt_col]), _ids(tokenizer, batch[completion_col])
    ids = [p + c + [eos] for p, c in zip(prompts, completions)]
    scored = [[int(all_scored)] * len(p) + [1] * (len(c) + 1) for p, c in zip(prompts, completions)]
    return {"input_ids": ids, "scored": scored}


def _encode_chats(batch, indices, tokenizer, columns, eos, template, all_scored, where) -> dict:
    """The chat template's rendering; the assistant turns scored (by its generation markers, or found
    from its renderings of the conversation's prefixes where it has none)."""
    ids, scored = [], []
    ends = None if all_scored or has_generation_markers(template) else end_of_turn_ids(tokenizer)
    for row, messages in zip(indices, batch[columns[0]]):
        check_messages(messages, row, where, columns[0])
        tokens, mask = (scored_chat(tokenizer, template, messages, row, where, ends) if ends is not None
                        else _marked_chat(tokenizer, template, messages, row, where, all_scored))
        ids.append(tokens)
        scored.append(mask)
    return {"input_ids": ids, "scored": scored}


def _marked_chat(tokenizer, template, messages, row, where, all_scored) -> tuple[list[int], list[int]]:
    """(tokens, scored) of a template's rendering: every token (``all_scored``), or its generation spans."""
    with template_errors(row, where):
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=not all_scored)
    tokens = list(out["input_ids"])
    mask = [1] * len(tokens) if all_scored else [int(bool(m)) for m in out["assistant_masks"]]
    if not all_scored and not any(mask) and any(m["role"] == "assistant" for m in messages):
        raise DataConfigError(f"row {row} of {where}: the chat template's {{% generation %}} blocks marked none of "
                              "its assistant tokens; wrap each assistant reply in {% generation %} ... "
                              "{% endgeneration %} (--chat_template), or pass --train_on_prompt.")
    return tokens, mask


def check_messages(messages, row: int, where: str, column: str = "messages") -> None:
    """A messages value must be a non-empty list of {"role": one of ROLES, "content": str}."""
    def bad(what: str) -> DataConfigError:
        return DataConfigError(f"row {row} of {where}: {column}{what}; every message needs a role (one of "
                               f"{', '.join(ROLES)}) and a string content (fix the row, or drop it).")
    if not isinstance(messages, list) or not messages:
        raise bad(f" is {messages!r}, not a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"[{i}] is {message!r}, not a {{role, content}} object")
        if message.get("role") not in ROLES:
            raise bad(f"[{i}] has role {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise bad(f"[{i}] ({message['role']}) has no content" if message.get("content") is None
                      else f"[{i}] ({message['role']}) has content {message['content']!r}")

