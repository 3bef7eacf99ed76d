"""Tokenize documents with `datasets.map` and pack the token stream into LM blocks (``--packing
stream``; examples kept apart, ``--packing examples`` / ``none``: ``examples.py``), and the batches.

Layout: every document is tokenized and followed by the eos token; the documents of a split,
in order, form one token stream. Block i is stream[i*(B+1) : (i+1)*(B+1)] for B = block_size;
its item is (input_ids, labels) = (block[:-1], block[1:]), two int64 tensors of shape (B,).
The shift is done at the block level, so labels are never padded or masked and a pipeline slice
boundary inside a block needs no special case. The tail of the stream shorter than B+1 tokens
is dropped: blocks = floor(total_tokens / (B + 1)).

Why not HF run_clm's `group_texts` via `map(batched=True)`: it drops the remainder of every
map batch (up to B tokens per 1000 documents), so the block count would depend on the batch
size. Here blocks are views into the tokenized Arrow column (memory-mapped from the `datasets`
cache, zero copy), so packing is exact, costs nothing up front and scales to corpora that do
not fit in RAM.

Batches (``step_batches``): endless, resumable, and their order does not depend on the layout.

Blocks are numbered by a global sample index. Step s (0-based) uses global blocks
[s * G, (s + 1) * G), G = the global batch (sequences per optimizer step over all replicas), so
the k-th block of a step is the same for any stages x replicas x microbatch split: replica r
takes the contiguous sub-range [s*G + r*B, s*G + (r+1)*B) (B = G / replicas), and its
microbatch m the blocks [m*b, (m+1)*b) of that (b = microbatch size). Index i reads block
i mod len(dataset) (the dataset repeats). Resuming is starting at the global index of the first
step not yet trained, whatever the layout was when the checkpoint was written.

Blocks of examples (``ExampleBlocks``) come with their position ids, and every microbatch with the
step's loss divisor: (input_ids, labels, positions, divisor), where divisor = the scored labels of the
step's whole global batch (every replica's blocks; the data gives it, so nothing is communicated)
divided by replicas x microbatches. A slice's loss is its summed cross-entropy / divisor, so the
step's loss is the mean over the global batch's scored tokens, as for stream blocks (whose divisor
is the fixed microbatch_size x seq_len).

(Before layout-free checkpoints, replica r's k-th sample was block k * replicas + r: the same
blocks per step, interleaved. A checkpoint of that rule records samples per replica; times the
replicas it is the global index, and the next steps read the same blocks.)
"""

from __future__ import annotations

import hashlib
from typing import Optional

import datasets
import numpy as np
import torch
from datasets.fingerprint import Hasher

from .corpus import DataArgs, DataConfigError, data_format_checked, load_text_dataset
from .examples import ExampleBlocks
from .scored_rows import tokenize_examples

TOKENS_FEATURES = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
_FORMAT_VERSION = "tp_trainer-tokenize-v1"  # bump when the tokenized layout changes


def _tokenizer_key(tokenizer) -> str:
    """A stable identity for the tokenizer: the hash of its full JSON for fast tokenizers
    (datasets' own hash of tokenizer objects can change after first use), else datasets'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    return Hasher.hash(tokenizer)


def _encode_batch(batch: dict, tokenizer, text_column: str, eos_id: int) -> dict:
    """map() function: texts -> lists of token ids, each followed by eos."""
    ids = tokenizer(batch[text_column], add_special_tokens=False,
                    return_attention_mask=False, verbose=False)["input_ids"]
    return {"input_ids": [x + [eos_id] for x in ids]}


def tokenize_dataset(ds: datasets.Dataset, tokenizer, text_column: str = "text",
                     num_proc: Optional[int] = None) -> datasets.Dataset:
    """Dataset with one int32 list column `input_ids` (one row per document, eos appended).
    Uses `datasets.map(batched=True)`, so the result is cached next to the source Arrow files
    under a fingerprint of (source, tokenizer, text column): a second call is a cache hit.
    Cost on a miss: ~5-7 s for the 12 MB stdlib on 2 cores (measured)."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataConfigError(f"tokenizer {type(tokenizer).__name__} has no eos token; "
                              "documents are joined with eos. Use a tokenizer that has one.")
    fingerprint = Hasher.hash([ds._fingerprint, _tokenizer_key(tokenizer), text_column,
                               int(eos_id), _FORMAT_VERSION])
    return ds.map(
        _encode_batch, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "eos_id": int(eos_id)},
        features=TOKENS_FEATURES, new_fingerprint=fingerprint, desc="Tokenizing")


class PackedBlocks(torch.utils.data.Dataset):
    """Blocks of block_size + 1 consecutive tokens of a tokenized split, as (input_ids, labels).

    tokens: output of `tokenize_dataset`. max_blocks: keep only the first N blocks (the cap is
    explicit; nothing else is truncated besides the < block_size + 1 tail). documents: the
    number of source documents, for `summary()`. Item cost: one slice + int64 copy of B+1 ids.
    Pickles without the token arrays (they are re-mapped from the Arrow cache on first use),
    so DataLoader workers are cheap to start."""

    def __init__(self, tokens: datasets.Dataset, block_size: int,
                 max_blocks: Optional[int] = None, documents: Optional[int] = None,
                 name: str = ""):
        if getattr(tokens, "_indices", None) is not None:
            tokens = tokens.flatten_indices()
        self.tokens = tokens
        self.block_size = int(block_size)
        self.documents = len(tokens) if documents is None else int(documents)
        self.name = name
        self._chunks: Optional[list[np.ndarray]] = None
        self._starts = self._chunk_starts()
        self.total_tokens = int(self._starts[-1])
        self.available_blocks = self.total_tokens // (self.block_size + 1)
        cap = self.available_blocks if max_blocks is None else min(max_blocks,
                                                                     self.available_blocks)
        self.block_count = int(cap)

    def _chunk_arrays(self) -> list[np.ndarray]:
        """Zero-copy numpy views (int32) of the flattened `input_ids` column, one per chunk."""
        if self._chunks is None:
            col = self.tokens.data.column("input_ids")
            self._chunks = [c.flatten().to_numpy(zero_copy_only=True) for c in col.chunks]
        return self._chunks

    def _chunk_starts(self) -> np.ndarray:
        """Stream offsets where each chunk starts, plus the total at the end (int64)."""
        sizes = [len(a) for a in self._chunk_arrays()]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def tokens_span(self, start: int, stop: int) -> np.ndarray:
        """stream[start:stop] as a fresh int64 array (crosses Arrow chunk boundaries)."""
        chunks, starts = self._chunk_arrays(), self._starts
        first = int(np.searchsorted(starts, start, side="right")) - 1
        parts, pos, i = [], start, first
        while pos < stop:
            lo, hi = pos - starts[i], min(stop, starts[i + 1]) - starts[i]
            parts.append(chunks[i][lo:hi])
            pos, i = starts[i] + hi, i + 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def token_stream(self) -> np.ndarray:
        """The whole concatenated token stream (int64 copy; for tests and inspection)."""
        return self.tokens_span(0, self.total_tokens)

    def __len__(self) -> int:
        return self.block_count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), int64, shape (block_size,) each; labels = input_ids shifted."""
        if i < 0:
            i += self.block_count
        if not 0 <= i < self.block_count:
            raise IndexError(f"block {i} out of range [0, {self.block_count})")
        n = self.block_size + 1
        block = torch.from_numpy(self.tokens_span(i * n, (i + 1) * n))
        return block[:-1], block[1:]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_chunks"] = None
        return state

    def summary(self) -> str:
        """One log line: documents, tokens, blocks and what was left out."""
        n = self.block_size + 1
        unused = self.total_tokens - self.block_count * n
        capped = (f", capped at {self.block_count:,} of {self.available_blocks:,} blocks"
                  if self.block_count < self.available_blocks else "")
        return (f"{self.name or 'data'}: {self.documents:,} documents, {self.total_tokens:,} "
                f"tokens -> {self.block_count:,} blocks of {n} tokens (block_size "
                f"{self.block_size}); {unused:,} tokens unused{capped}")


def build_lm_dataset(args: DataArgs, tokenizer, split: str = "train") -> PackedBlocks | ExampleBlocks:
    """The packed LM dataset of one split: load the rows (corpus.load_text_dataset), tokenize
    (cached datasets.map), view as blocks: a token stream (``PackedBlocks``) or whole examples
    (``ExampleBlocks``), by ``args.packing_for`` the data's format. Same args and tokenizer -> same
    blocks. `args.max_train_blocks` caps the train split only. Raises DataConfigError if the split
    has no block (stream: fewer than block_size + 1 tokens) or a bad row."""
    text = load_text_dataset(args, split)
    data_format = data_format_checked(text, args)
    cap = args.max_train_blocks if split == "train" else None
    name = f"{split} [{args.split_source(split)}]"
    if args.packing_for(data_format) != "stream":
        examples = tokenize_examples(text, tokenizer, args, data_format, split, _tokenizer_key(tokenizer))
        blocks = ExampleBlocks(examples, args.block_size, args.packing_for(data_format), args.long_examples,
                               tokenizer.eos_token_id, where=f"the {split} data of {args.split_source(split)}",
                               max_blocks=cap, name=name)
        if len(blocks) == 0:
            raise DataConfigError(f"The {split} split of {args.split_source(split)} has no example; add data.")
        return blocks
    tokens = tokenize_dataset(text, tokenizer, args.text_column, args.num_proc)
    blocks = PackedBlocks(tokens, args.block_size, max_blocks=cap, documents=len(text), name=name)
    if len(blocks) == 0:
        raise DataConfigError(
            f"The {split} split of {args.split_source(split)} has {blocks.total_tokens} tokens, "
            f"fewer than one block of block_size + 1 = {args.block_size + 1}: lower --block_size "
            "(terapipe.seq_len) or add data.")
    return blocks


# ---------------------------------------------------------------- batches by global sample index
def step_batches(dataset, micro_batch_size: int, micro_batches: int, replica: int, replicas: int,
                 start: int = 0):
    """Yield this replica's (input_ids, labels) microbatches, each (micro_batch_size, seq_len),
    ``micro_batches`` per step, from global sample index ``start`` (a multiple of the global batch).
    Blocks of examples (a dataset with ``scored_tokens``): (input_ids, labels, positions, divisor),
    divisor (float) = the step's scored labels over every replica / (replicas x micro_batches)."""
    per_replica = micro_batch_size * micro_batches
    global_batch = per_replica * replicas
    if len(dataset) < 1:
        raise ValueError("an empty dataset cannot feed training")
    if start % global_batch:
        raise ValueError(f"start {start} is not a multiple of the global batch {global_batch}")
    counted = getattr(dataset, "scored_tokens", None)
    for index in _replica_indices(start, global_batch, per_replica, replica, micro_batch_size):
        items = [dataset[i % len(dataset)] for i in index]
        batch = tuple(torch.stack(column) for column in zip(*items))
        if counted is None:
            yield batch
            continue
        first = index.start - index.start % global_batch
        scored = sum(counted(i % len(dataset)) for i in range(first, first + global_batch))
        yield (*batch, max(scored, 1) / (replicas * micro_batches))


def _replica_indices(start: int, global_batch: int, per_replica: int, replica: int, micro_batch_size: int):
    """Global sample indices of each of this replica's microbatches, step after step."""
    step_start = start
    while True:
        first = step_start + replica * per_replica
        for offset in range(0, per_replica, micro_batch_size):
            yield range(first + offset, first + offset + micro_batch_size)
        step_start += global_batch
