"""Which chat template renders messages data: ``--chat_template FILE``, else the tokenizer's own, else
none (an error naming the fix). The embedded BPE carries the project's default
(``default_chat_template.jinja``, set by ``tokenizer.get_tokenizer``): a role line per turn, the
assistant's reply inside {% generation %} ... {% endgeneration %} and closed by the eos token, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` tells which tokens are scored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import DataConfigError

DEFAULT_TEMPLATE_FILE = Path(__file__).with_name("default_chat_template.jinja")


def default_chat_template() -> str:
    """The project's default template (Jinja source)."""
    return DEFAULT_TEMPLATE_FILE.read_text(encoding="utf-8")


def resolve_chat_template(tokenizer, path: Optional[str], markers: bool = True) -> str:
    """The template for messages data: the file ``path`` (``--chat_template``), else the tokenizer's
    ``chat_template``. Refused without either, or (``markers``: the assistant turns alone are scored)
    when the template marks no assistant tokens."""
    if path is not None:
        template = Path(path).read_text(encoding="utf-8")
    else:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: HF uses "default"
            template = template.get("default")
    if not template:
        raise DataConfigError(
            f"messages data: the tokenizer {type(tokenizer).__name__} has no chat template; pass "
            f"--chat_template FILE (a Jinja template that wraps each assistant reply in a generation block, "
            f"as {DEFAULT_TEMPLATE_FILE} does).")
    if markers and "generation" not in template:
        raise DataConfigError(
            "--chat_template / the tokenizer's chat template has no {% generation %} markers, so the "
            "assistant tokens to score cannot be found; wrap each assistant reply (and its end-of-turn token) "
            "in {% generation %} ... {% endgeneration %}, or pass --train_on_prompt to score every token.")
    return template
