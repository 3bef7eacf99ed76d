"""Checks of a local data file before any work: it exists, has a supported extension, is not empty, and
reads as UTF-8 text (text / json / csv) or as parquet (its footer). Each error names the flag and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import DataConfigError

# Local file extension -> `datasets` builder name.
LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
                  ".csv": "csv", ".parquet": "parquet"}


def _check_local_file(name: str, path: Optional[str]) -> None:
    """Raise DataConfigError naming `name` unless `path` is None or an existing supported file."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise DataConfigError(f"--{name}: {str(p)!r} is a directory; pass one "
                              ".txt/.json/.jsonl/.csv/.parquet file in it.")
    if not p.is_file():
        raise DataConfigError(f"--{name}: file not found: {str(p)!r}. Pass an existing "
                              f".txt/.json/.jsonl/.csv/.parquet file, or leave out --{name} "
                              "to use the embedded stdlib corpus.")
    if p.suffix.lower() not in LOCAL_BUILDERS:
        raise DataConfigError(f"--{name}: unsupported extension {p.suffix!r} for {str(p)!r}"
                              f"; use one of {sorted(LOCAL_BUILDERS)}.")
    if p.stat().st_size == 0:
        raise DataConfigError(f"--{name}: file {str(p)!r} is empty; pass a file with "
                              "text in it.")
    if LOCAL_BUILDERS[p.suffix.lower()] == "parquet":
        _check_parquet(name, p)
    else:
        _check_utf8_text(name, p)


def _check_parquet(name: str, p: Path) -> None:
    """A parquet file's footer (schema, row groups) must read: a cheap check (no rows are read)
    that stops a corrupt or truncated file before any process group exists."""
    import pyarrow.parquet as pq
    try:
        pq.ParquetFile(p).close()
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataConfigError(f"--{name}: {str(p)!r} is not a readable parquet file "
                              f"({type(err).__name__}: {err}); write it again, e.g. with "
                              "pandas.DataFrame.to_parquet or datasets.Dataset.to_parquet.") from None


UTF8_CHUNK = 1 << 20  # bytes read at a time by _check_utf8_text


def _check_utf8_text(name: str, p: Path, chunk_size: int = UTF8_CHUNK) -> None:
    """Raise DataConfigError naming `name` if the text file `p` is not valid UTF-8 (first bad
    byte: offset, line, column) or holds only whitespace. Reads `chunk_size` bytes at a time
    through an incremental decoder, so a large file is never held in memory at once."""
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = lines = line_start = 0  # bytes before this chunk, newlines before it, start of the line
    has_text = False
    with open(p, "rb") as handle:
        while True:
            chunk = handle.read(chunk_size)
            pending = decoder.getstate()[0]  # an incomplete sequence carried from the last chunk
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                data = pending + chunk
                bad = offset - len(pending) + err.start
                before = data[:err.start]
                line = lines + before.count(b"\n") + 1
                start = offset - len(pending) + before.rfind(b"\n") + 1 if b"\n" in before else line_start
                byte = data[err.start:err.start + 1].hex()
                raise DataConfigError(
                    f"--{name}: {str(p)!r} is not valid UTF-8: byte 0x{byte} at offset {bad} "
                    f"(line {line}, byte {bad - start + 1} of the line: {err.reason}); re-encode the "
                    "file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt` for a Latin-1 "
                    "file.") from None
            if not has_text and text.strip():
                has_text = True
            if not chunk:
                break
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                line_start = offset + newline + 1
            lines += chunk.count(b"\n")
            offset += len(chunk)
    if not has_text:
        raise DataConfigError(f"--{name}: file {str(p)!r} holds only whitespace; pass a "
                              "file with text in it.")
