"""Data pipeline: text sources -> tokenizer -> packed (input_ids, labels) blocks; instruction data
(prompt/completion, messages) -> blocks of whole examples (input_ids, labels, positions).

    args = DataArgs(block_size=1024)                 # embedded stdlib corpus by default
    tok = get_tokenizer(None, cache_dir=args.cache_dir)
    train = build_lm_dataset(args, tok, "train")     # torch Dataset of (input_ids, labels)
    print(train.summary())
"""

from .corpus import (DEFAULT_VALIDATION_FRACTION, DataArgs, DataConfigError, default_cache_dir,
                     list_stdlib_files, load_text_dataset, read_source, stdlib_dataset,
                     stdlib_files, stdlib_root)
from .examples import ExampleBlocks
from .packing import PackedBlocks, build_lm_dataset, tokenize_dataset
from .tokenizer import (DEFAULT_VOCAB_SIZE, EOS_TOKEN, TOKENIZER_FILES, check_tokenizer_source,
                        default_tokenizer_path, get_tokenizer, load_or_train, train_bpe)

__all__ = [
    "DEFAULT_VALIDATION_FRACTION", "DEFAULT_VOCAB_SIZE", "EOS_TOKEN", "TOKENIZER_FILES", "DataArgs",
    "check_tokenizer_source", "DataConfigError", "ExampleBlocks", "PackedBlocks", "build_lm_dataset",
    "default_cache_dir",
    "default_tokenizer_path", "get_tokenizer", "list_stdlib_files", "load_or_train",
    "load_text_dataset", "read_source", "stdlib_dataset", "stdlib_files", "stdlib_root",
    "tokenize_dataset", "train_bpe",
]
