"""launch/train.py's flags are RunArgs' fields (tp_trainer/run_args.py): same names, defaults and
help, each field a flag and each flag a field (DeepSpeed's own and the launcher's --local_rank aside)."""

import argparse
import os
import sys
from dataclasses import MISSING, fields

import deepspeed
import pytest

from tp_trainer.run import RunArgs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
import train  # noqa: E402

LAUNCHER_ONLY = {"help", "local_rank"}


def actions(parser) -> dict:
    return {action.dest: action for action in parser._actions}


def test_every_field_is_a_flag_with_its_default_and_help():
    flags = actions(train.build_parser())
    for f in fields(RunArgs):
        assert f.name in flags, f"RunArgs.{f.name} has no flag"
        if f.name == "deepspeed_config":  # DeepSpeed's flag, its default and help
            continue
        assert f.default is not MISSING and flags[f.name].default == f.default, f.name
        assert flags[f.name].help == f.metadata["help"], f.name


def test_every_flag_is_a_field():
    deepspeed_own = set(actions(deepspeed.add_config_arguments(argparse.ArgumentParser())))
    names = {f.name for f in fields(RunArgs)}
    ours = set(actions(train.build_parser())) - deepspeed_own - LAUNCHER_ONLY
    assert ours == names - {"deepspeed_config"}


def test_defaults_parse_to_the_dataclass_defaults():
    args = RunArgs.from_namespace(train.parse_args(["--deepspeed_config", "ds.json"]))
    assert args == RunArgs(deepspeed_config="ds.json")
    assert (args.max_steps, args.eval_interval, args.text_column, args.save_hf) == (30, 10, "text", True)


def test_special_flags(monkeypatch):
    args = train.parse_args(["--deepspeed_config", "ds.json", "--no_save_hf", "--resume", "--max_steps", "5",
                             "--block_size", "64", "--reset_optimizer"])
    assert (args.save_hf, args.resume, args.max_steps, args.block_size, args.reset_optimizer) == \
        (False, "latest", 5, 64, True)
    assert train.parse_args(["--resume", "step3"]).resume == "step3"
    assert train.parse_args(["--no-memory_report"]).memory_report is False   # --memory_report: on (the default)
    assert train.parse_args(["--no-memory_report", "--memory_report"]).memory_report is True
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert train.parse_args([]).local_rank == 1
    with pytest.raises(SystemExit):
        train.parse_args(["--max_steps", "many"])


def test_help_expands_the_defaults(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps to run (default 30)" in text and "holding the text (default text)" in text
    assert "checkpoints: 'latest' (default) or a tag" in text and "--no_save_hf" in text
