"""Data pipeline tests: stdlib corpus listing, tokenizer training/caching, block packing,
local files and input errors. Offline, temp caches only, small tokenizers (< 30 s total)."""

import json
import os
import pickle
import sys
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = "1"  # never reach the network
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tp_trainer.data import (  # noqa: E402
    EOS_TOKEN,
    DataArgs,
    DataConfigError,
    build_lm_dataset,
    get_tokenizer,
    list_stdlib_files,
    load_or_train,
    read_source,
    stdlib_files,
    stdlib_root,
    tokenize_dataset,
)
from tp_trainer.data.corpus import holdout_mask, load_text_dataset  # noqa: E402

UNICODE_SRC = 'def f(x):\n    """héllo wörld — ∑ 😀 日本"""\n\treturn x  +  1\r\n\n# end  \n'


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path_factory, monkeypatch):
    """Every test writes caches under a temp dir, never the repo or ~."""
    monkeypatch.setenv("TP_TRAINER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def small_files():
    """A few real stdlib files (deterministic pick) for fast training and packing."""
    files = list_stdlib_files()
    return [p for p in files if p.name in ("textwrap.py", "bisect.py", "heapq.py", "this.py",
                                           "keyword.py", "colorsys.py")]


@pytest.fixture(scope="session")
def small_tok(tmp_path_factory, small_files):
    """A 512-token byte-level BPE trained on a few stdlib files (~0.1 s)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return load_or_train(path, lambda: [read_source(p) for p in small_files], 512,
                         show_progress=False)


def _stream(tok, texts):
    """Reference token stream: each document's ids followed by eos."""
    out = []
    for t in texts:
        out += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


# ---------------------------------------------------------------- corpus

def test_stdlib_listing_real_corpus():
    root = stdlib_root()
    files = list_stdlib_files()
    assert 500 <= len(files) <= 2000
    rels = [p.relative_to(root).as_posix() for p in files]
    assert rels == sorted(rels) and len(set(rels)) == len(rels)
    assert all(r.endswith(".py") for r in rels)
    for r in rels:
        parts = set(r.split("/")[:-1])
        assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages"}, r
    assert "os.py" in rels and "json/decoder.py" in rels
    assert list_stdlib_files() == files  # deterministic


def test_validation_split_disjoint_and_deterministic():
    train, val = stdlib_files("train"), stdlib_files("validation")
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(list_stdlib_files())
    assert 5 <= len(val) <= 0.05 * len(train)
    assert stdlib_files("validation") == val
    assert holdout_mask(100, 0.02) == [i in (49, 99) for i in range(100)]
    assert not any(holdout_mask(10, 0.0))


def test_read_source_honours_coding_cookie(tmp_path):
    p = tmp_path / "latin.py"
    p.write_bytes("# -*- coding: latin-1 -*-\ns = 'café'\n".encode("latin-1"))
    assert "café" in read_source(p)


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_trains_roundtrips_and_caches(tmp_path, small_files):
    path = tmp_path / "tok" / "tokenizer.json"
    calls = []

    def texts():
        calls.append(1)
        return [read_source(p) for p in small_files]

    tok = load_or_train(path, texts, 400, show_progress=False)
    assert path.is_file() and calls == [1]
    assert [f.name for f in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left
    assert tok.eos_token == tok.bos_token == tok.unk_token == EOS_TOKEN
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == tok.eos_token_id == 0
    assert len(tok) == 400
    for text in (UNICODE_SRC, read_source(small_files[0]), "", "   \n\t\x00\x7f"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    again = load_or_train(path, texts, 400, show_progress=False)
    assert calls == [1]  # cache hit: corpus not read
    assert again.get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path / "saved")
    reloaded = get_tokenizer(str(tmp_path / "saved"))
    assert reloaded.get_vocab() == tok.get_vocab() and reloaded.eos_token == EOS_TOKEN


def test_get_tokenizer_bad_path_names_it():
    with pytest.raises(OSError, match="no/such/tokenizer_dir"):
        get_tokenizer("/no/such/tokenizer_dir")


# ---------------------------------------------------------------- packing

def _write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")


def test_packing_matches_token_stream(tmp_path, small_tok, small_files):
    texts = [read_source(p) for p in small_files] + [UNICODE_SRC]
    f = tmp_path / "train.jsonl"
    _write_jsonl(f, texts)
    args = DataArgs(train_file=str(f), block_size=64, validation_fraction=0.0,
                    cache_dir=str(tmp_path / "c"))
    ds = build_lm_dataset(args, small_tok, "train")
    stream = _stream(small_tok, texts)
    n = args.block_size + 1
    assert ds.total_tokens == len(stream)
    assert len(ds) == ds.block_count == len(stream) // n
    assert ds.token_stream().tolist() == stream
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (args.block_size,)
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == stream[i * n: i * n + n - 1]
        assert y.tolist() == stream[i * n + 1: i * n + n]
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert f"{len(texts)} documents" in ds.summary() and f"{len(ds):,} blocks" in ds.summary()
    # deterministic, cached, capped
    again = build_lm_dataset(args, small_tok, "train")
    assert all(torch.equal(again[i][1], ds[i][1]) for i in range(len(ds)))
    assert again.tokens.cache_files == ds.tokens.cache_files
    capped = build_lm_dataset(DataArgs(**{**vars(args), "max_train_blocks": 3}), small_tok)
    assert len(capped) == 3 and "capped" in capped.summary()
    assert torch.equal(capped[2][0], ds[2][0])
    clone = pickle.loads(pickle.dumps(ds))  # what DataLoader workers receive
    assert clone._chunks is None and torch.equal(clone[1][0], ds[1][0])


def test_hub_dataset_load_error_names_field(tmp_path, monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("offline")
    monkeypatch.setattr(datasets, "load_dataset", offline)  # hermetic: no hub call at all
    args = DataArgs(dataset_name="no-such-user/no-such-dataset", cache_dir=str(tmp_path))
    with pytest.raises(DataConfigError, match="dataset_name"):
        load_text_dataset(args)


def test_packing_across_arrow_chunks(small_tok):
    """Blocks that straddle Arrow chunk boundaries are read correctly."""
    import datasets

    from tp_trainer.data import PackedBlocks
    texts = [f"x = {i}\n" * (i % 5 + 1) for i in range(50)]
    parts = [datasets.Dataset.from_dict({"text": texts[i:i + 7]}) for i in range(0, 50, 7)]
    toks = datasets.concatenate_datasets([tokenize_dataset(d, small_tok) for d in parts])
    assert toks.data.column("input_ids").num_chunks > 1
    ds = PackedBlocks(toks, 10)
    stream = _stream(small_tok, texts)
    assert [t for i in range(len(ds)) for t in ds[i][0].tolist() + [ds[i][1][-1].item()]] == \
        stream[: len(ds) * 11]


def test_embedded_corpus_validation_blocks(small_tok):
    args = DataArgs(block_size=128)  # no source given: the stdlib corpus
    ds = build_lm_dataset(args, small_tok, "validation")
    texts = [read_source(p) for p in stdlib_files("validation")]
    assert ds.documents == len(texts)
    assert ds.total_tokens == len(_stream(small_tok, texts))
    assert len(ds) == ds.total_tokens // 129
    assert "stdlib" in ds.summary()
    assert load_text_dataset(args, "validation")["path"][0].endswith(".py")


# ---------------------------------------------------------------- local files and errors

def test_local_txt_and_jsonl(tmp_path, small_tok):
    txt = tmp_path / "a.txt"
    paras = [f"paragraph {i}: " + "word " * (i + 3) for i in range(40)]
    txt.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    args = DataArgs(train_file=str(txt), block_size=16, validation_fraction=0.1,
                    cache_dir=str(tmp_path / "c"))
    train, val = build_lm_dataset(args, small_tok), build_lm_dataset(args, small_tok, "validation")
    assert train.documents == 36 and val.documents == 4 and len(train) > len(val) > 0
    jl = tmp_path / "b.jsonl"
    _write_jsonl(jl, paras, key="body")
    jargs = DataArgs(train_file=str(jl), validation_file=str(jl), text_column="body",
                     block_size=16, cache_dir=str(tmp_path / "c"))
    assert build_lm_dataset(jargs, small_tok).documents == 40
    assert build_lm_dataset(jargs, small_tok, "validation").documents == 40
    with pytest.raises(DataConfigError, match="text_column='text'"):
        load_text_dataset(DataArgs(train_file=str(jl), cache_dir=str(tmp_path / "c")))


def test_missing_train_file_names_field_and_path(tmp_path):
    missing = tmp_path / "nope" / "train.txt"
    with pytest.raises(DataConfigError) as e:
        DataArgs(train_file=str(missing))
    assert "train_file" in str(e.value) and str(missing) in str(e.value)
    real = tmp_path / "train.txt"
    real.write_text("x = 1\n")
    with pytest.raises(DataConfigError, match="validation_file"):
        DataArgs(train_file=str(real), validation_file=str(missing))


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 0}, "block_size"), ({"validation_fraction": 0.7}, "validation_fraction"),
    ({"num_proc": 0}, "num_proc"), ({"max_train_blocks": 0}, "max_train_blocks"),
    ({"dataset_config_name": "x"}, "dataset_config_name"), ({"text_sample_by": "x"},
                                                             "text_sample_by"),
    ({"dataset_name": "x", "train_file": sys.executable}, "dataset_name"),
])
def test_bad_args_name_the_field(kwargs, field):
    with pytest.raises(DataConfigError, match=field):
        DataArgs(**kwargs)


def test_unsupported_extension_and_empty_and_short(tmp_path, small_tok):
    bad = tmp_path / "x.docx"
    bad.write_text("hi")
    with pytest.raises(DataConfigError, match="unsupported extension"):
        DataArgs(train_file=str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataConfigError, match="train_file.*empty"):
        DataArgs(train_file=str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(DataConfigError, match="train_file.*broken.jsonl"):
        load_text_dataset(DataArgs(train_file=str(broken), cache_dir=str(tmp_path)))
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "a"}\n')
    with pytest.raises(DataConfigError, match="validation split .* is empty"):
        load_text_dataset(DataArgs(train_file=str(blank), cache_dir=str(tmp_path)), "validation")
    short = tmp_path / "short.txt"
    short.write_text("a b\n")
    with pytest.raises(DataConfigError, match="block_size"):
        build_lm_dataset(DataArgs(train_file=str(short), validation_fraction=0,
                                  cache_dir=str(tmp_path)), small_tok)
    with pytest.raises(DataConfigError, match="validation_fraction"):
        load_text_dataset(DataArgs(train_file=str(short), validation_fraction=0), "validation")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TP_TRAINER_CACHE", str(tmp_path / "cc"))
    assert DataArgs().cache_dir == str(tmp_path / "cc")
    assert Path(DataArgs(cache_dir=tmp_path).cache_dir) == tmp_path
