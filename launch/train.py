"""Train a GPT-2-style causal LM with TeraPipe token-slice pipelining inside DeepSpeed.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/gpt2_tiny_cpu.json

Defaults: a randomly initialised "gpt2-tiny" on the embedded corpus (the Python standard library
of the running interpreter, tokenized with a BPE tokenizer trained on it once and cached).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402

from tp_trainer.failures import leave, setup_logging, stop_before_start  # noqa: E402
from tp_trainer.run_args import RunArgs, add_arguments  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse whose errors end as the run's other bad input does: one ``error:`` line, written by
    each host's local rank 0 only (argparse's own would print on every rank), exit 2 on every rank."""

    def error(self, message):
        setup_logging()
        stop_before_start(ValueError(f"{message}; see {self.prog} --help"))


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``RunArgs`` (tp_trainer/run_args.py: names, defaults, help), the launcher's
    --local_rank and DeepSpeed's own (--deepspeed_config among them)."""
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = add_arguments(parser)
    groups["training"].add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return deepspeed.add_config_arguments(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.deepspeed_config:
        setup_logging()
        stop_before_start(ValueError("--deepspeed_config is required (e.g. ds_configs/gpt2_tiny_cpu.json)"))
    run_args = RunArgs.from_namespace(args)
    if run_args.dry_run:   # what fits and how fast on the GPUs named, without them (tp_trainer/dry_run.py)
        from tp_trainer.dry_run import dry_run
        return dry_run(run_args)
    from tp_trainer.run import run   # imported after the command line is judged: ~7 s of a rank's start
    losses = run(run_args)
    return 0 if losses else 1


def exit_code(stop: SystemExit) -> int:
    """The exit code a ``SystemExit`` carries (a message instead of a code is printed: exit 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as stop:  # a run stopped on every rank (RunStopped), bad input, argparse: the
        code = exit_code(stop)  # same exit code, without the process group's destructors either
    except BaseException:  # a bug: its traceback, then out the same way
        import traceback
        traceback.print_exc()
        code = 1
    leave(code)
