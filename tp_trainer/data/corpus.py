"""Text sources: the embedded stdlib corpus, local files and hub datasets, behind one `DataArgs`.

Every source ends as a `datasets.Dataset` with one text column, one row per document, for a
named split ("train" or "validation"). Nothing here tokenizes; see `packing.py`.

The embedded default corpus is the Python standard library source of the running interpreter
(~730 `.py` files, ~12 MB on CPython 3.11): always present, needs no network, and is a real
code corpus. Every file is one document. A deterministic, evenly spread subset of files is held
out as the validation split.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import datasets

from .errors import DataConfigError
from .files import LOCAL_BUILDERS, _check_local_file

SPLITS = ("train", "validation")
DEFAULT_VALIDATION_FRACTION = 0.02  # every 50th stdlib file
# Directory names never walked into when listing the stdlib corpus.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# What one row of the source is (``data_format``) and how examples become blocks (``DataArgs.packing``).
FORMATS = ("text", "prompt_completion", "messages")
PACKINGS = ("auto", "stream", "examples", "none")
LONG_EXAMPLES = ("split", "refuse")


def default_cache_dir() -> str:
    """Where tokenizers and `datasets` caches go: $TP_TRAINER_CACHE if set; else
    `<repo>/.cache/tp_trainer` when running from a source checkout (the directory holding this
    package has a pyproject.toml; `.cache/` is git-ignored); else `~/.cache/tp_trainer`."""
    env = os.environ.get("TP_TRAINER_CACHE")
    if env:
        return env
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and os.access(repo, os.W_OK):
        return str(repo / ".cache" / "tp_trainer")
    return str(Path.home() / ".cache" / "tp_trainer")


@dataclass
class DataArgs:
    """Which text to train on and how to cut it. Neither `dataset_name` nor `train_file` set means
    the embedded stdlib corpus."""

    dataset_name: Optional[str] = None
    """Hub dataset id for `datasets.load_dataset(name, config)`, e.g. "wikitext"."""
    dataset_config_name: Optional[str] = None
    """Hub dataset config, e.g. "wikitext-103-raw-v1". Only with `dataset_name`."""
    train_file: Optional[str] = None
    """Local training file: .txt/.text (text), .json/.jsonl (json lines), .csv or .parquet."""
    validation_file: Optional[str] = None
    """Local validation file (same formats), with any training source (a file, a hub dataset or the
    embedded corpus). Unset: `validation_fraction` of train is held out."""
    text_column: str = "text"
    """Column holding the document text (json/csv/parquet/hub)."""
    prompt_column: Optional[str] = None
    """Column of the prompt of prompt/completion data. None: "prompt" where the data has a "prompt" and
    a "completion" column (and no messages column)."""
    completion_column: Optional[str] = None
    """Column of the completion (the scored answer) of prompt/completion data. None: "completion"."""
    messages_column: Optional[str] = None
    """Column of conversational data: a list of {"role", "content"} per row, rendered with the chat
    template. None: "messages" where the data has that column."""
    chat_template: Optional[str] = None
    """Jinja chat template file for messages data (else the tokenizer's own, else the project's
    default, ``data/default_chat_template.jinja``). Its {% generation %} ... {% endgeneration %}
    blocks mark the scored tokens where it has them; else each assistant turn is found from its
    rendering (``chat_spans.py``)."""
    train_on_prompt: bool = False
    """Score every token of an example, prompts and user turns too (default: only the completion or
    the assistant turns are scored, labels -100 elsewhere)."""
    packing: str = "auto"
    """How examples become blocks: "stream" (documents joined with eos into one token stream that
    blocks cut anywhere, attending across documents; text only), "examples" (several whole examples
    per block, each attending only to itself with positions from 0), "none" (one example per block,
    padded). "auto": stream for text, examples for prompt/completion and messages."""
    long_examples: str = "split"
    """An example longer than block_size with packing examples / none: "split" into pieces of
    block_size tokens (each its own example), or "refuse" (stop, naming the row)."""
    text_sample_by: str = "paragraph"
    """How a .txt file is cut into documents: "line", "paragraph" (blank-line separated) or
    "document" (whole file). Documents are joined with the eos token."""
    block_size: int = 1024
    """Sequence length. One block holds block_size + 1 tokens: inputs = block[:-1],
    labels = block[1:]."""
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    """Share of documents held out for validation when the source has no validation split.
    Chosen by index (evenly spread, no shuffling), so it is deterministic. 0 disables."""
    num_proc: Optional[int] = None
    """Worker processes for `datasets.map` tokenization. None: one process (the Rust tokenizer
    already uses several threads per batch)."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Root of all caches: trained tokenizers and `datasets` Arrow files (see default_cache_dir)."""
    max_train_blocks: Optional[int] = None
    """Cap on the number of train blocks (the first N, in order). None: all. Validation is never
    capped."""

    def __post_init__(self) -> None:
        """Check every field before any work; each error names the field and the fix."""
        self._check_source()
        self._check_numbers()
        self.cache_dir = str(self.cache_dir)

    def _check_source(self) -> None:
        if self.dataset_name and self.train_file:
            raise DataConfigError("--dataset_name and --train_file: set one of them, not both.")
        if self.dataset_config_name and not self.dataset_name:
            raise DataConfigError("--dataset_config_name is set but --dataset_name is not; "
                                  "set --dataset_name or drop --dataset_config_name.")
        for name in ("train_file", "validation_file"):
            _check_local_file(name, getattr(self, name))
        if self.packing not in PACKINGS:
            raise DataConfigError(f"--packing {self.packing!r}: use one of {', '.join(PACKINGS)}.")
        if self.long_examples not in LONG_EXAMPLES:
            raise DataConfigError(f"--long_examples {self.long_examples!r}: use 'split' or 'refuse'.")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise DataConfigError(f"--chat_template: file not found: {self.chat_template!r}; pass a Jinja "
                                  "template file, or leave the flag out to use the tokenizer's own template or "
                                  "the project's default.")
        if self.text_sample_by not in ("line", "paragraph", "document"):
            raise DataConfigError(f"DataArgs.text_sample_by={self.text_sample_by!r}: use "
                                  "'line', 'paragraph' or 'document'.")

    def _check_numbers(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise DataConfigError(f"--block_size {self.block_size!r}: use an int >= 1.")
        if not 0.0 <= self.validation_fraction < 0.5:
            raise DataConfigError(f"DataArgs.validation_fraction={self.validation_fraction!r}: "
                                  "use a value in [0, 0.5).")
        if self.num_proc is not None and self.num_proc < 1:
            raise DataConfigError(f"DataArgs.num_proc={self.num_proc!r}: use None or an int >= 1.")
        if self.max_train_blocks is not None and self.max_train_blocks < 1:
            raise DataConfigError(f"DataArgs.max_train_blocks={self.max_train_blocks!r}: "
                                  "use None (all blocks) or an int >= 1.")

    @property
    def source(self) -> str:
        """Short human description of the text source, for logs."""
        if self.dataset_name:
            return f"hub:{self.dataset_name}" + (f"/{self.dataset_config_name}"
                                                 if self.dataset_config_name else "")
        if self.train_file:
            return f"file:{self.train_file}"
        return f"stdlib:python{sys.version_info.major}.{sys.version_info.minor}"

    def packing_for(self, data_format: str) -> str:
        """The packing of a source of ``data_format`` (resolves "auto")."""
        if self.packing != "auto":
            return self.packing
        return "stream" if data_format == "text" else "examples"

    def split_source(self, split: str) -> str:
        """`source`, or the validation file where the validation split comes from one."""
        return f"file:{self.validation_file}" if split == "validation" and self.validation_file else self.source


# ---------------------------------------------------------------- embedded stdlib corpus

def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """All `*.py` files under the stdlib, minus test trees and installed packages, sorted by
    relative POSIX path (deterministic across runs and machines with the same Python)."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def holdout_mask(n: int, fraction: float) -> list[bool]:
    """True for the validation items among n: item i is held out when floor((i+1)*f) exceeds
    floor(i*f), i.e. about n*f items evenly spread (f=0.02: items 49, 99, ...). No RNG."""
    return [int((i + 1) * fraction) > int(i * fraction) for i in range(n)]


def split_items(items: list, fraction: float, split: str) -> list:
    """The `split` ("train"/"validation") part of `items` under `holdout_mask`."""
    _check_split(split)
    want = split == "validation"
    return [x for x, held in zip(items, holdout_mask(len(items), fraction)) if held == want]


def stdlib_files(split: str = "train",
                 validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> list[Path]:
    """The stdlib files of one split (train and validation are disjoint and cover all files)."""
    return split_items(list_stdlib_files(), validation_fraction, split)


def read_source(path: Path) -> str:
    """A Python file's text, decoded by its PEP 263 coding cookie (default UTF-8)."""
    with tokenize.open(path) as f:
        return f.read()


def _stdlib_rows(paths: list[str], stamp: str):
    """Generator for `Dataset.from_generator`; `stamp` only feeds the cache fingerprint."""
    root = stdlib_root()
    for p in paths:
        yield {"text": read_source(Path(p)), "path": Path(p).relative_to(root).as_posix()}


def _files_stamp(paths: list[Path]) -> str:
    """Cheap content key for a file list: Python version, paths, sizes and mtimes."""
    h = hashlib.sha256(sys.version.encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def stdlib_dataset(split: str = "train", cache_dir: Optional[str] = None,
                   validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> datasets.Dataset:
    """The stdlib corpus split as a Dataset with columns `text` and `path`, one row per file.
    Written once to Arrow under cache_dir/datasets (~1 s), memory-mapped afterwards, so later
    `map` calls on it are cached by `datasets` too."""
    paths = stdlib_files(split, validation_fraction)
    return datasets.Dataset.from_generator(
        _stdlib_rows, cache_dir=_hf_cache(cache_dir),
        gen_kwargs={"paths": [str(p) for p in paths], "stamp": _files_stamp(paths)})


# ---------------------------------------------------------------- any source

def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataConfigError(f"split={split!r}: use one of {SPLITS}.")


def _hf_cache(cache_dir: Optional[str]) -> str:
    return str(Path(cache_dir or default_cache_dir()) / "datasets")


def _holdout(ds: datasets.Dataset, fraction: float, split: str) -> datasets.Dataset:
    """Index-based train/validation split of a single-split dataset (no shuffle)."""
    return ds.select(split_items(list(range(len(ds))), fraction, split))


def _load_local(args: DataArgs, name: str, split: str) -> datasets.Dataset:
    """Load the file of field `name` (train_file / validation_file) with the builder its
    extension names; the train file's `split` part is carved out by `_holdout`. A file
    `datasets` cannot parse raises DataConfigError naming the flag and path."""
    path = getattr(args, name)
    builder = LOCAL_BUILDERS[Path(path).suffix.lower()]
    kwargs = {"sample_by": args.text_sample_by} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files={"train": str(path)}, split="train",
                                   cache_dir=_hf_cache(args.cache_dir), **kwargs)
    except Exception as e:  # datasets raises many types (ArrowInvalid, StopIteration, ...)
        raise DataConfigError(f"--{name}: could not read {str(path)!r} as {builder} "
                              f"({type(e).__name__}: {e}); check the file format.") from e
    return ds if name == "validation_file" else _holdout(ds, args.validation_fraction, split)


def _load_hub(args: DataArgs, split: str) -> datasets.Dataset:
    """Load a hub dataset; use its own validation split if it has one, else hold one out."""
    try:
        dd = datasets.load_dataset(args.dataset_name, args.dataset_config_name,
                                   cache_dir=_hf_cache(args.cache_dir))
    except Exception as e:  # not found, no network, bad config: many exception types
        raise DataConfigError(
            f"--dataset_name {args.dataset_name!r} (--dataset_config_name "
            f"{args.dataset_config_name!r}) could not be loaded ({type(e).__name__}: {e}). "
            "Check the name and config, the network / HF_DATASETS_OFFLINE, or use "
            "--train_file.") from e
    if split == "validation" and "validation" in dd:
        return dd["validation"]
    if "train" not in dd:
        raise DataConfigError(f"--dataset_name {args.dataset_name!r} has no 'train' "
                              f"split (has {list(dd)}); choose another dataset/config.")
    return _holdout(dd["train"], args.validation_fraction, split)


def load_text_dataset(args: DataArgs, split: str = "train") -> datasets.Dataset:
    """One split of the configured source as a Dataset with (at least) `args.text_column`.
    A validation file, when given, is the validation split whatever the training source (the
    embedded corpus, a hub dataset or a train file). Raises DataConfigError on an empty split
    or a missing text column."""
    _check_split(split)
    if split == "validation" and args.validation_fraction == 0 and not args.validation_file:
        has_own = bool(args.dataset_name)  # a hub dataset may bring its own validation split
        if not has_own:
            raise DataConfigError("No validation split: set DataArgs.validation_fraction > 0 "
                                  "or --validation_file.")
    if split == "validation" and args.validation_file:
        ds = _load_local(args, "validation_file", split)
    elif args.dataset_name:
        ds = _load_hub(args, split)
    elif args.train_file:
        ds = _load_local(args, "train_file", split)
    else:
        ds = stdlib_dataset(split, args.cache_dir, args.validation_fraction)
    _check_columns(ds, args, split)
    if len(ds) == 0:
        fix = ("pass --validation_file, or a source with more documents (every "
               f"{round(1 / args.validation_fraction)}th is held out)" if split == "validation"
               and args.validation_fraction else "add data")
        raise DataConfigError(f"The {split} split of {args.split_source(split)} is empty; {fix}.")
    return ds


def data_format(ds: datasets.Dataset, args: DataArgs) -> str:
    """What a row of ``ds`` is: "messages" (a messages column, named or called "messages"),
    "prompt_completion" (prompt and completion columns, named or so called) or "text"."""
    columns = set(ds.column_names)
    if args.messages_column or (not args.prompt_column and not args.completion_column and "messages" in columns):
        return "messages"
    if args.prompt_column or args.completion_column or {"prompt", "completion"} <= columns:
        return "prompt_completion"
    return "text"


def format_columns(data_format: str, args: DataArgs) -> tuple[tuple[str, str], ...]:
    """The (column, flag) pairs a format reads."""
    if data_format == "messages":
        return ((args.messages_column or "messages", "--messages_column"),)
    if data_format == "prompt_completion":
        return ((args.prompt_column or "prompt", "--prompt_column"),
                (args.completion_column or "completion", "--completion_column"))
    return ((args.text_column, "--text_column"),)


def _check_columns(ds: datasets.Dataset, args: DataArgs, split: str) -> None:
    """The columns of the data's format must exist (text: and hold strings); each message names its flag."""
    data_format = data_format_checked(ds, args)
    if data_format == "text":
        _check_text_column(ds, args, split)
        return
    for column, flag in format_columns(data_format, args):
        if column not in ds.column_names:
            raise DataConfigError(f"{flag}={column!r}: no such column in the {split} data of "
                                  f"{args.split_source(split)} (columns {ds.column_names}); pass {flag} with the "
                                  "column that holds it.")


def data_format_checked(ds: datasets.Dataset, args: DataArgs) -> str:
    """``data_format``, refusing packing "stream" for prompt/completion and messages data."""
    found = data_format(ds, args)
    if found != "text" and args.packing == "stream":
        raise DataConfigError(f"--packing stream joins documents into one stream scored everywhere; {found} data "
                              "is packed by example: use --packing examples (the default) or none.")
    return found


def _check_text_column(ds: datasets.Dataset, args: DataArgs, split: str) -> None:
    """The text column must exist and hold strings; the message lists the string columns."""
    feature = ds.features.get(args.text_column)
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    fix = (f"pass --text_column with one of {strings}" if strings else
           "it has no text (string) column; give a file with one")
    what = "not a text column" if feature is not None else "no such column"
    raise DataConfigError(f"--text_column={args.text_column!r}: {what} in the {split} data of "
                          f"{args.split_source(split)} (columns {ds.column_names}); {fix}.")
