"""The scored tokens of a messages row under a chat template without {% generation %} markers, found
from the template's own rendering.

For the assistant message ``i`` the template renders
    prompt_i = messages[:i], add_generation_prompt=True   (the turns before it, then the assistant header)
    turn_i   = messages[:i + 1]                            (... then the reply and what closes it)
and the whole conversation once. Where prompt_i starts turn_i and turn_i starts the whole rendering (the
template is prefix-stable: it renders a turn alike whatever follows), the turn's text is
``whole[len(prompt_i):len(turn_i)]``: the reply and what the template writes after it before the next
turn. The whole rendering is tokenized once, with offsets. A turn's scored tokens start at
``len(prompt_i)``, which must be a token boundary, and end with its end-of-turn token: the first special
token (the eos, or a token the tokenizer marks special: ChatML's ``<|im_end|>``, Llama 3's
``<|eot_id|>``, Mistral's ``</s>``) after the reply's text; what the turn holds after it (ChatML's
newline) is not scored. A turn with no special token after its reply is scored to its end (which must
then be a token boundary). Nothing of the prompts is scored.

Refused naming the row, the reason and the fix (generation markers in --chat_template, or
--train_on_prompt): a template that is not prefix-stable (one that moves the system prompt onto the
last user turn, drops earlier replies' reasoning, or closes only the conversation's last turn), a
generation prompt that is not how the template starts an assistant turn, a turn edge inside a token, a
conversation that opens with an assistant turn.
"""

from __future__ import annotations

import os
from bisect import bisect_left

from .chat_template import render
from .errors import DataConfigError


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The ids that can close a turn: the tokenizer's special tokens (eos among them) and every added
    token it marks special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


def scored_chat(tokenizer, template: str, messages: list, row: int, where: str,
                ends: frozenset[int]) -> tuple[list[int], list[int]]:
    """(token ids of the whole rendering, 1 where a token is scored) for one conversation. ``ends``:
    ``end_of_turn_ids(tokenizer)``."""
    whole = render(tokenizer, template, messages, False, row, where)
    turns = [_turn(tokenizer, template, messages, i, whole, row, where)
             for i, message in enumerate(messages) if message["role"] == "assistant"]
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False, verbose=False)
    ids, offsets = list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]
    starts = [start for start, _ in offsets]
    scored = [0] * len(ids)
    for i, (begin, reply_end, end) in turns:
        first = _token_at(offsets, starts, begin)
        if first is None:
            raise refusal(row, where, f"the assistant turn messages[{i}] starts inside a token (character {begin})")
        after = bisect_left(starts, end)
        close = next((t for t in range(first, after) if ids[t] in ends and offsets[t][0] >= reply_end), None)
        if close is None and _token_at(offsets, starts, end) is None:
            raise refusal(row, where, f"the assistant turn messages[{i}] ends inside a token (character {end}) "
                                      "and no end-of-turn token closes it")
        last = after if close is None else close + 1
        scored[first:last] = [1] * (last - first)
    return ids, scored


def _turn(tokenizer, template: str, messages: list, i: int, whole: str, row: int, where: str):
    """(i, where the turn's text starts, where its reply's text ends, where the turn ends) in ``whole``."""
    if i == 0:
        raise refusal(row, where, "the conversation opens with the assistant turn messages[0], so no prompt "
                                  "before it can be rendered")
    prompt = render(tokenizer, template, messages[:i], True, row, where)
    turn = render(tokenizer, template, messages[:i + 1], False, row, where)
    if not turn.startswith(prompt):
        raise refusal(row, where, f"its generation prompt (the rendering of messages[:{i}] with "
                                  f"add_generation_prompt) is not how it starts the assistant turn messages[{i}] "
                                  f"(they differ from character {_differ(prompt, turn)})")
    if not whole.startswith(turn):
        raise refusal(row, where, f"it is not prefix-stable: its rendering of messages[:{i + 1}] is not the start of "
                                  f"its rendering of the whole conversation (they differ from character "
                                  f"{_differ(turn, whole)}): it rewrites earlier turns (a system prompt moved onto "
                                  "the last user turn, earlier replies cut, a turn closed only at the end)")
    content = messages[i]["content"].strip()
    found = turn.find(content, len(prompt)) if content else -1
    if content and len(turn) == len(prompt):
        raise refusal(row, where, f"it renders nothing of the assistant turn messages[{i}]")
    return i, (len(prompt), found + len(content) if found >= 0 else len(prompt), len(turn))


def _token_at(offsets: list[tuple[int, int]], starts: list[int], char: int):
    """The index of the first token at or after character ``char`` (len(offsets) past the last), or
    None where ``char`` falls inside a token."""
    t = bisect_left(starts, char)
    return None if t > 0 and offsets[t - 1][1] > char else t


def _differ(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def refusal(row: int, where: str, reason: str) -> DataConfigError:
    return DataConfigError(
        f"row {row} of {where}: the chat template has no {{% generation %}} markers, and its assistant turns "
        f"cannot be found from its rendering: {reason}. Wrap each assistant reply and its end-of-turn in "
        "{% generation %} ... {% endgeneration %} (--chat_template), or pass --train_on_prompt to score every "
        "token.")
