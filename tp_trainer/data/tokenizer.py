"""Tokenizers: a pretrained one by name/path, or the embedded default trained on the stdlib.

The embedded default is a GPT-2-style byte-level BPE (any byte sequence round-trips exactly, no
unknown tokens) trained once with `tokenizers` on the stdlib corpus train split and cached as a
single `tokenizer.json` under `<cache_dir>/tokenizers/`, keyed by vocab size and Python version.
It is returned wrapped as a `transformers.PreTrainedTokenizerFast` with eos = bos = unk =
`<|endoftext|>`, so it behaves like any HF tokenizer (`save_pretrained`, `__call__`, `decode`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .chat_template import default_chat_template
from .corpus import default_cache_dir, read_source, stdlib_files

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2,
              show_progress: bool = True, length: Optional[int] = None) -> Tokenizer:
    """Train a byte-level BPE on `texts` (one document each). Id 0 is `<|endoftext|>`, ids
    1..256 the byte alphabet, the rest merges. Cost: ~linear in text size, Rust, multi-threaded
    (about 2-3 s for the 12 MB stdlib on 2 cores, measured). `length` only sizes the progress bar."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
        special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A `tokenizers.Tokenizer` as a transformers fast tokenizer with eos/bos/unk set and
    no whitespace clean-up on decode (so decode(encode(x)) == x)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False)


def save_atomic(tok: Tokenizer, path: Path) -> None:
    """Write `tok` to `path` via a temp file in the same directory and os.replace, so readers
    see either no file or a complete one (safe for concurrent ranks and crashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_or_train(path: Path, texts: Callable[[], Iterable[str]], vocab_size: int,
                  show_progress: bool = True, length: Optional[int] = None
                  ) -> PreTrainedTokenizerFast:
    """Load the tokenizer cached at `path`, or train it on `texts()` and cache it first.
    `texts` is a callable so a cache hit reads no corpus. Cost on a hit: ~50 ms."""
    path = Path(path)
    if not path.is_file():
        save_atomic(train_bpe(texts(), vocab_size, show_progress=show_progress, length=length),
                    path)
    return wrap(Tokenizer.from_file(str(path)))


def default_tokenizer_path(cache_dir: Optional[str] = None,
                           vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Cache file of the embedded default tokenizer for this vocab size and Python version."""
    py = "{}.{}.{}".format(*sys.version_info[:3])
    root = Path(cache_dir or default_cache_dir())
    return root / "tokenizers" / f"stdlib-bytebpe-v{vocab_size}-py{py}" / "tokenizer.json"


def _stdlib_train_texts() -> Iterable[str]:
    """Texts of the stdlib train split (default validation fraction), read lazily."""
    return (read_source(p) for p in stdlib_files("train"))


def get_tokenizer(name_or_path: Optional[str] = None, cache_dir: Optional[str] = None,
                  vocab_size: int = DEFAULT_VOCAB_SIZE, show_progress: bool = True,
                  flag: str = "--tokenizer_name"):
    """The tokenizer to train with.

    name_or_path given: `AutoTokenizer.from_pretrained(name_or_path)` (hub id or local dir);
    a failure is an OSError naming `flag` (the option that gave the name) and the fix.
    Otherwise: the embedded stdlib byte-level BPE of `vocab_size`, trained once (~2-3 s) and
    cached under `cache_dir`, with the project's default chat template (`chat_template.py`). In
    multi-process runs let rank 0 call this first; the cache write is atomic either way."""
    if name_or_path is not None:
        return _pretrained(name_or_path, flag)
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 258 "
                         "(256 bytes + <|endoftext|> + 1 merge).")
    path = default_tokenizer_path(cache_dir, vocab_size)
    tokenizer = load_or_train(path, _stdlib_train_texts, vocab_size, show_progress,
                              length=len(stdlib_files("train")))
    tokenizer.chat_template = default_chat_template()
    return tokenizer


def _pretrained(name_or_path: str, flag: str):
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing files, offline, bad JSON
        where = ("a local directory whose tokenizer files do not load" if os.path.isdir(name_or_path)
                 else "not a local directory, and not in the hub cache or reachable hub")
        raise OSError(f"{flag} {name_or_path!r}: {where} ({type(e).__name__}: {e}). Pass a "
                      f"directory with tokenizer files ({', '.join(TOKENIZER_FILES)}) or a hub id "
                      "that is cached or reachable, or leave out --tokenizer_name for the "
                      "embedded tokenizer.") from e


# Files of which a tokenizer directory holds at least one (fast, BPE, SentencePiece, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


def check_tokenizer_source(name_or_path: Optional[str], flag: str) -> None:
    """Before any process group: a local directory named for the tokenizer must hold tokenizer
    files (a checkpoint saved without its tokenizer is common: say so, and how to fix it). A
    path that looks local and does not exist is refused too; hub ids are checked when loaded."""
    if name_or_path is None:
        return
    if os.path.isdir(name_or_path):
        if not any(os.path.isfile(os.path.join(name_or_path, f)) for f in TOKENIZER_FILES):
            fix = ("pass --tokenizer_name with the tokenizer it was trained with (a directory "
                   "or hub id)" if flag == "--model_name_or_path" else "pass a tokenizer directory")
            raise OSError(f"{flag} {name_or_path}: no tokenizer files (none of "
                          f"{', '.join(TOKENIZER_FILES)}); {fix}.")
    elif os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        raise OSError(f"{flag} {name_or_path!r}: directory does not exist; pass a tokenizer "
                      "directory or a hub id, or leave out --tokenizer_name for the embedded "
                      "tokenizer.")
