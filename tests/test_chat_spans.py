"""Messages rows under the chat templates checkpoints ship, without {% generation %} markers
(tests/chat_templates/: Llama 3's, Qwen2's ChatML, Mistral's [INST] form): the scored tokens are each
assistant reply and its end-of-turn token, nothing of the prompts, found from the template's renderings of
the conversation's prefixes (tp_trainer/data/chat_spans.py). Each case writes the expected rendering out as
pieces (prompt / scored) and asserts the exact scored positions; where a marked form of the template is
in chat_templates/ (``*_marked.jinja``), it scores the same positions. Templates that are not
prefix-stable, or whose turns start inside a token, are refused naming the row and the fix."""

from pathlib import Path

import pytest

from tp_trainer.data import DataConfigError, get_tokenizer
from tp_trainer.data import chat_spans
from tp_trainer.data.chat_template import default_chat_template, has_generation_markers
from tp_trainer.data.scored_rows import _encode_chats

TEMPLATES = Path(__file__).with_name("chat_templates")
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
WHERE = "the train data of test"
BOS = "<|endoftext|>"  # the embedded BPE's bos and eos


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded BPE with the header and end-of-turn tokens of Llama 3 and ChatML as special tokens."""
    tokenizer = get_tokenizer(None, show_progress=False)
    tokenizer.add_tokens(SPECIAL, special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def mistral_tokenizer():
    """The embedded BPE with Mistral's bos <s> and eos </s>."""
    tokenizer = get_tokenizer(None, show_progress=False)
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return tokenizer


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def chat(*turns: str, system: str | None = None) -> list[dict]:
    """user, assistant, user, ... turns (after the system prompt, if any)."""
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


def scored(tokenizer, source: str, messages: list) -> tuple[list[int], list[int]]:
    """(token ids, positions of the scored tokens) of one messages row as the loader encodes it."""
    out = _encode_chats({"messages": [messages]}, [0], tokenizer, ["messages"], tokenizer.eos_token_id, source,
                        False, WHERE)
    return out["input_ids"][0], [i for i, flag in enumerate(out["scored"][0]) if flag]


def expected_positions(tokenizer, ids: list[int], pieces: list[tuple[str, bool]]) -> list[int]:
    """The positions of the tokens inside the scored pieces of the rendering written out as ``pieces``
    ((text, scored) in order), token edges from decoding the ids' prefixes (independent of the offsets
    the loader uses). The ids must decode to the pieces, and each scored piece start and end on token edges."""
    assert tokenizer.decode(ids) == "".join(text for text, _ in pieces)
    edges = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    spans, at = [], 0
    for text, is_scored in pieces:
        if is_scored:
            assert at in edges and at + len(text) in edges, ("a scored piece must start and end on token edges", text)
            spans.append((at, at + len(text)))
        at += len(text)
    return [k for k in range(len(ids)) if any(a <= edges[k] and edges[k + 1] <= b for a, b in spans)]


def assert_scored(tokenizer, source: str, messages: list, pieces: list[tuple[str, bool]]) -> list[int]:
    ids, positions = scored(tokenizer, source, messages)
    want = expected_positions(tokenizer, ids, pieces)
    pieces_of = [tokenizer.decode([ids[k]]) for k in positions], [tokenizer.decode([ids[k]]) for k in want]
    assert positions == want, pieces_of
    assert positions, "a case must score something"
    return positions


def prompt(text: str) -> tuple[str, bool]:
    return text, False


def answer(text: str) -> tuple[str, bool]:
    return text, True


def llama3_header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


LLAMA3_CASE = (chat("Hi?", " Hello. ", "More?", "No.", system="Be brief."),  # Llama 3 trims each content
               [prompt(BOS + llama3_header("system") + "Be brief.<|eot_id|>" + llama3_header("user") + "Hi?<|eot_id|>"
                       + llama3_header("assistant")),
                answer("Hello.<|eot_id|>"),
                prompt(llama3_header("user") + "More?<|eot_id|>" + llama3_header("assistant")),
                answer("No.<|eot_id|>")])


def test_llama3_scores_each_reply_and_its_eot(tokenizer):
    messages, pieces = LLAMA3_CASE
    positions = assert_scored(tokenizer, template("llama3"), messages, pieces)
    assert scored(tokenizer, template("llama3_marked"), messages)[1] == positions


def chatml(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def test_chatml_inserts_its_default_system_prompt_and_scores_the_replies(tokenizer):
    """Qwen2's template puts its default system prompt first where the row has none."""
    messages = chat("Hi?", "Hello.", "More?", "No.")
    pieces = [prompt(chatml("system", "You are a helpful assistant.") + chatml("user", "Hi?")
                     + "<|im_start|>assistant\n"),
              answer("Hello.<|im_end|>"),
              prompt("\n" + chatml("user", "More?") + "<|im_start|>assistant\n"),
              answer("No.<|im_end|>"), prompt("\n")]
    positions = assert_scored(tokenizer, template("qwen2_chatml"), messages, pieces)
    assert scored(tokenizer, template("qwen2_chatml_marked"), messages)[1] == positions


def test_chatml_keeps_the_rows_system_prompt_in_place(tokenizer):
    messages = chat("Hi?", "Hello.", "More?", "No.", "Why?", "Because.", system="Be brief.")
    pieces = [prompt(chatml("system", "Be brief.") + chatml("user", "Hi?") + "<|im_start|>assistant\n"),
              answer("Hello.<|im_end|>"), prompt("\n" + chatml("user", "More?") + "<|im_start|>assistant\n"),
              answer("No.<|im_end|>"), prompt("\n" + chatml("user", "Why?") + "<|im_start|>assistant\n"),
              answer("Because.<|im_end|>"), prompt("\n")]
    positions = assert_scored(tokenizer, template("qwen2_chatml"), messages, pieces)
    assert scored(tokenizer, template("qwen2_chatml_marked"), messages)[1] == positions


def test_mistral_inst_scores_the_replies_and_eos(mistral_tokenizer):
    """Mistral's [INST] form: the system prompt on the first user turn, each reply closed by </s>."""
    messages = chat("Hi?", "Hello.", "More?", "No.", system="Be brief.")
    pieces = [prompt("<s> [INST] Be brief.\n\nHi? [/INST]"), answer(" Hello.</s>"),
              prompt(" [INST] More? [/INST]"), answer(" No.</s>")]
    positions = assert_scored(mistral_tokenizer, template("mistral_inst"), messages, pieces)
    assert scored(mistral_tokenizer, template("mistral_inst_marked"), messages)[1] == positions


def test_default_template_without_its_markers_scores_the_same(tokenizer):
    messages = chat("Hi?", "Hello.", "More?", "No.", system="Be brief.")
    marked = default_chat_template()
    unmarked = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert has_generation_markers(marked) and not has_generation_markers(unmarked)
    pieces = [prompt("<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\n"), answer("Hello.<|endoftext|>"),
              prompt("<|user|>\nMore?\n<|assistant|>\n"), answer("No.<|endoftext|>")]
    positions = assert_scored(tokenizer, unmarked, messages, pieces)
    assert scored(tokenizer, marked, messages)[1] == positions


def test_a_turn_without_end_of_turn_token_is_scored_to_its_end(tokenizer):
    """A template that closes no turn with a special token: the reply alone is scored."""
    source = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert_scored(tokenizer, source, chat("Hi", "Yo", "And?", "Done"),
                  [prompt("[user]Hi[assistant]"), answer("Yo"), prompt("[user]And?[assistant]"), answer("Done")])


def test_a_shifted_span_fails_the_position_check(tokenizer, monkeypatch):
    """Mutation: spans that start one token late (the turn's first token left out) fail assert_scored."""
    messages, pieces = LLAMA3_CASE
    token_at = chat_spans._token_at
    monkeypatch.setattr(chat_spans, "_token_at", lambda offsets, starts, char: token_at(offsets, starts, char) + 1
                        if token_at(offsets, starts, char) is not None else None)
    with pytest.raises(AssertionError):
        assert_scored(tokenizer, template("llama3"), messages, pieces)


def test_not_prefix_stable_template_is_refused(mistral_tokenizer):
    """Mistral's later form moves the system prompt onto the last user turn: the prefixes render it where
    the whole conversation does not. Without a system prompt the same template is prefix-stable."""
    source = template("mistral_system_last")
    with pytest.raises(DataConfigError, match=(
            r"^row 0 of the train data of test: the chat template has no \{% generation %\} markers, and its "
            r"assistant turns cannot be found from its rendering: it is not prefix-stable: its rendering of "
            r"messages\[:3\] is not the start of its rendering of the whole conversation .*Wrap each assistant "
            r"reply and its end-of-turn in \{% generation %\} \.\.\. \{% endgeneration %\} \(--chat_template\), "
            r"or pass --train_on_prompt to score every token\.$")):
        scored(mistral_tokenizer, source, chat("Hi?", "Hello.", "More?", "No.", system="Be brief."))
    assert_scored(mistral_tokenizer, source, chat("Hi?", "Hello.", "More?", "No."),
                  [prompt("<s>[INST] Hi?[/INST]"), answer(" Hello.</s>"), prompt("[INST] More?[/INST]"),
                   answer(" No.</s>")])


def test_turn_starting_inside_a_token_is_refused(tokenizer):
    """A generation prompt that ends with a space: the BPE joins it to the reply's first word."""
    source = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataConfigError, match=r"row 0 of .*: the assistant turn messages\[1\] starts inside a token "
                                              r"\(character 21\)\. Wrap .*or pass --train_on_prompt"):
        scored(tokenizer, source, chat("Hi?", "Hello."))


def test_turn_ending_inside_a_token_is_refused(tokenizer):
    """No end-of-turn token, and the next turn's text joins the reply's last word."""
    source = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}{{ '\\n' }}{% endif %}{% endfor %}"
    with pytest.raises(DataConfigError, match=r"row 0 of .*: the assistant turn messages\[1\] ends inside a token "
                                              r"\(character 5\) and no end-of-turn token closes it\. Wrap"):
        scored(tokenizer, source, chat("Hi", "Yo", "ur"))


def test_conversation_opening_with_the_assistant_is_refused(tokenizer):
    with pytest.raises(DataConfigError, match=r"row 0 of .*: the conversation opens with the assistant turn "
                                              r"messages\[0\], so no prompt before it can be rendered\. Wrap"):
        scored(tokenizer, template("qwen2_chatml"), [{"role": "assistant", "content": "Hi"}, *chat("Yo")])


def test_template_that_fails_on_a_row_names_the_row(mistral_tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(DataConfigError, match=r"row 0 of the train data of test: the chat template failed on this "
                                              r"row \(TemplateError: After the optional system message, conversation "
                                              r"roles must alternate.*fix the row \(or drop it\)"):
        scored(mistral_tokenizer, template("mistral_inst"), messages)


@pytest.mark.parametrize("source, marked", [
    ("{% generation %}x{% endgeneration %}", True),
    ("{%- generation -%}x{%- endgeneration -%}", True),
    ("{% if add_generation_prompt %}<|assistant|>{% endif %}", False),
    ("{# wrap replies in {% generation %} #}{{ 'generation' }}", False),
    ("{{ '{% generation %}' }}", False)])
def test_generation_markers_are_jinja_tags(source, marked):
    assert has_generation_markers(source) is marked
