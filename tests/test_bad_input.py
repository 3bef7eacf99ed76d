"""More bad input that must stop launch/train.py before any work with one clear message: a training
file that is not UTF-8, an empty (or whitespace-only) training file, a checkpoint of a model type
without a pipeline adapter."""

import logging

import pytest
from test_launch import write_config

from tp_trainer.run import RunArgs, run


def stops_with_one_error(tmp_path, monkeypatch, caplog, **extra) -> str:
    """run() exits 2 before any work, logs exactly one error and writes nothing; returns the error."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        run(RunArgs(deepspeed_config=write_config(tmp_path), output_dir=str(out), **extra))
    assert stop.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert not out.exists(), "nothing may be written on bad input"
    return errors[0]


def test_invalid_utf8_train_file(tmp_path, monkeypatch, caplog):
    train = tmp_path / "train.txt"
    # line 3 holds a Latin-1 'é' (0xe9) after 4 bytes; everything before it is valid UTF-8 ('ö' is 2 bytes)
    train.write_bytes("first line\nsecond: ö\n".encode() + b"caf\xe9 au lait\n" + b"more text\n" * 1000)
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, train_file=str(train))
    assert error.startswith(f"error: --train_file: {str(train)!r} is not valid UTF-8: byte 0xe9 at "
                            "offset 25 (line 3, byte 4 of the line"), error
    assert "re-encode the file as UTF-8" in error


def test_invalid_utf8_found_across_chunks(tmp_path):
    """The scan reads fixed-size chunks: a sequence split between chunks is fine, and the first bad
    byte is reported at the same offset and line whatever the chunk size."""
    from tp_trainer.data.corpus import DataConfigError
    from tp_trainer.data.files import _check_utf8_text
    good = "naïve ✓ 𝄞 text\n".encode() * 50
    path = tmp_path / "train.jsonl"
    path.write_bytes(good)
    messages = set()
    for chunk in (1, 2, 3, 7, 64, 1 << 20):
        _check_utf8_text("train_file", path, chunk_size=chunk)
    path.write_bytes(good + b"ok \xc3( bad\n")
    for chunk in (1, 2, 3, 7, 64, 1 << 20):
        with pytest.raises(DataConfigError) as err:
            _check_utf8_text("train_file", path, chunk_size=chunk)
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    assert f"byte 0xc3 at offset {len(good) + 3} (line 51, byte 4 of the line" in messages.pop()


@pytest.mark.parametrize("content,what", [(b"", "is empty"), (b"  \n\n\t \r\n", "holds only whitespace")],
                         ids=["empty", "whitespace"])
def test_empty_train_file(tmp_path, monkeypatch, caplog, content, what):
    train = tmp_path / "train.txt"
    train.write_bytes(content)
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, train_file=str(train))
    assert error == f"error: --train_file: file {str(train)!r} {what}; pass a file with text in it.", error


def test_validation_file_is_checked_too(tmp_path, monkeypatch, caplog):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("some text\n")
    val.write_bytes(b"\xff\xfe")
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, train_file=str(train), validation_file=str(val))
    assert "--validation_file: " in error and "byte 0xff at offset 0 (line 1, byte 1" in error, error


def test_unsupported_checkpoint_model_type(tmp_path, monkeypatch, caplog):
    from transformers import BertConfig
    ckpt = tmp_path / "bert"
    BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32).save_pretrained(ckpt)
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, model_name_or_path=str(ckpt))
    assert f"--model_name_or_path {ckpt}: " in error, error
    assert "model_type 'bert' has no pipeline adapter; supported: [" in error and "'gpt2'" in error, error
