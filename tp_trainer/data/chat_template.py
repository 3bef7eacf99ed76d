"""Which chat template renders messages data, and how its assistant turns are found.

The template: ``--chat_template FILE``, else the tokenizer's own, else none (an error naming the fix).
The embedded BPE carries the project's default (``default_chat_template.jinja``, set by
``tokenizer.get_tokenizer``): a role line per turn, the assistant's reply inside {% generation %} ...
{% endgeneration %} and closed by the eos token.

A template with ``{% generation %}`` tags (``has_generation_markers``: Jinja block tags, not the word
in a comment, a string or ``add_generation_prompt``) is scored by its markers:
``apply_chat_template(..., return_assistant_tokens_mask=True)``. One without (what most checkpoints
ship: Llama 3's, Qwen2's ChatML, Mistral's) is scored from its own rendering (``chat_spans.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import jinja2

from .errors import DataConfigError

DEFAULT_TEMPLATE_FILE = Path(__file__).with_name("default_chat_template.jinja")
MARKER_TAG = "generation"


def default_chat_template() -> str:
    """The project's default template (Jinja source)."""
    return DEFAULT_TEMPLATE_FILE.read_text(encoding="utf-8")


def resolve_chat_template(tokenizer, path: Optional[str]) -> str:
    """The template for messages data: the file ``path`` (``--chat_template``), else the tokenizer's
    ``chat_template``. Refused without either, or when its Jinja source does not lex."""
    if path is not None:
        template = Path(path).read_text(encoding="utf-8")
    else:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: HF uses "default"
            template = template.get("default")
    if not template:
        raise DataConfigError(
            f"messages data: the tokenizer {type(tokenizer).__name__} has no chat template; pass "
            f"--chat_template FILE (a Jinja template, e.g. {DEFAULT_TEMPLATE_FILE}, or your checkpoint's).")
    has_generation_markers(template)  # a template that does not lex is refused here, before any row
    return template


def has_generation_markers(template: str) -> bool:
    """Whether the Jinja source holds a ``{% generation %}`` block tag (``{%- generation -%}`` too)."""
    try:
        tokens = [(kind, value) for _, kind, value in jinja2.Environment().lex(template) if kind != "whitespace"]
    except jinja2.TemplateSyntaxError as err:
        raise DataConfigError(f"--chat_template / the tokenizer's chat template is not valid Jinja ({err}, line "
                              f"{err.lineno}); fix the template or pass another with --chat_template.") from None
    return any(kind == "block_begin" and following == ("name", MARKER_TAG)
               for (kind, _), following in zip(tokens, tokens[1:]))


@contextmanager
def template_errors(row: int, where: str):
    """A template that fails on a row (its own ``raise_exception``: roles that do not alternate, a role
    it does not take) -> the error naming the row."""
    try:
        yield
    except jinja2.TemplateError as err:
        raise DataConfigError(f"row {row} of {where}: the chat template failed on this row ({type(err).__name__}: "
                              f"{err}); fix the row (or drop it), or pass a template that takes it "
                              "(--chat_template).") from None


def render(tokenizer, template: str, messages: list, add_generation_prompt: bool, row: int, where: str) -> str:
    """The template's text of ``messages`` (the tokenizer's special tokens as its variables)."""
    with template_errors(row, where):
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
