"""Instruction data from this machine's Python standard library: question/answer pairs from docstrings.

For every top-level function and class of the stdlib source files that has a docstring (parsed with
``ast``, nothing imported), one example:

    prompt      What does `json.decoder.JSONDecoder` do?
    completion  the first paragraph of its docstring, whitespace joined

Written as JSON lines, prompt/completion or conversational (``--format messages``: a user and an
assistant turn), split into train and validation files (every ``--every``-th example by name hash
goes to validation). Deterministic for one Python installation; nothing is committed.

    python scripts/make_docstring_qa.py --out_dir data/qa [--format messages] [--limit N]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_trainer.data.corpus import list_stdlib_files, read_source, stdlib_root  # noqa: E402

MAX_ANSWER_CHARS = 400


def module_name(path) -> str:
    parts = list(path.relative_to(stdlib_root()).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pairs():
    """(name, first docstring paragraph) of every documented top-level function and class."""
    for path in list_stdlib_files():
        try:
            tree = ast.parse(read_source(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = module_name(path)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            answer = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
            if 10 <= len(answer) <= MAX_ANSWER_CHARS:
                yield f"{module}.{node.name}", answer


def row(name: str, answer: str, fmt: str) -> dict:
    question = f"What does `{name}` do?"
    if fmt == "messages":
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    return {"prompt": question + "\n", "completion": answer}


def write(out_dir: str, fmt: str = "prompt_completion", every: int = 20, limit: int | None = None) -> dict:
    """Write ``train.jsonl`` and ``validation.jsonl`` under ``out_dir``; returns {split: rows}."""
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": 0, "validation": 0}
    with open(os.path.join(out_dir, "train.jsonl"), "w", encoding="utf-8") as train, \
            open(os.path.join(out_dir, "validation.jsonl"), "w", encoding="utf-8") as valid:
        for i, (name, answer) in enumerate(pairs()):
            if limit is not None and i >= limit:
                break
            held = int(hashlib.sha256(name.encode()).hexdigest(), 16) % every == 0
            split = "validation" if held else "train"
            (valid if held else train).write(json.dumps(row(name, answer, fmt)) + "\n")
            counts[split] += 1
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--format", choices=("prompt_completion", "messages"), default="prompt_completion")
    parser.add_argument("--every", type=int, default=20, help="every N-th example (by name hash) is validation")
    parser.add_argument("--limit", type=int, default=None, help="at most N examples")
    args = parser.parse_args(argv)
    counts = write(args.out_dir, args.format, args.every, args.limit)
    print(f"{args.out_dir}: {counts['train']} train and {counts['validation']} validation examples ({args.format})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
