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

from tp_trainer.failures import leave  # noqa: E402
from tp_trainer.run import RunArgs, run  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", help="HF checkpoint: hub id or local save_pretrained directory")
    model.add_argument("--config_name", default="gpt2-tiny", help="preset for random init (see tp_trainer/model/presets.py)")
    model.add_argument("--tokenizer_name", help="HF tokenizer (hub id or local dir); default: the embedded BPE")
    model.add_argument("--rope_scaling", help="rotary models: HF's rope_scaling as JSON, e.g. "
                       "'{\"rope_type\": \"yarn\", \"factor\": 4.0}' (also linear, llama3), to fine-tune at "
                       "--block_size beyond the checkpoint's positions; replaces its config.json's rope_parameters")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="hub dataset name")
    data.add_argument("--dataset_config_name", help="hub dataset config")
    data.add_argument("--train_file", help="local .txt/.json/.jsonl/.csv/.parquet file")
    data.add_argument("--validation_file", help="local validation file (same formats); also with the embedded "
                      "corpus or --dataset_name, whose validation part it replaces")
    data.add_argument("--text_column", default="text", help="json/csv/parquet/hub column holding the text (default text)")
    data.add_argument("--block_size", type=int, help="sequence length; overrides terapipe.seq_len")
    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, default=30, help="optimizer steps to run (default 30)")
    train.add_argument("--eval_interval", type=int, default=10, help="evaluate every N steps (and at the end)")
    train.add_argument("--eval_batches", type=int, default=4, help="batches per evaluation")
    train.add_argument("--no_save_hf", dest="save_hf", action="store_false",
                       help="do not write the trained model as a Hugging Face directory at the end")
    train.add_argument("--save_interval", type=int, help="DeepSpeed checkpoint every N steps and at the end")
    train.add_argument("--resume", nargs="?", const="latest",
                       help="continue from <output_dir>/checkpoints: 'latest' (default) or a tag such as step30")
    train.add_argument("--reset_optimizer", action="store_true",
                       help="with --resume: keep only the weights (fresh optimizer state and LR schedule)")
    train.add_argument("--reset_data_position", action="store_true",
                       help="with --resume: start the data from its first block (allows another global batch)")
    train.add_argument("--timeline", help="PNG: measured Gantt chart of the last step beside the simulated one")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--output_dir", default="runs/latest", help="where the plan and logs are written")
    train.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.deepspeed_config:
        print("error: --deepspeed_config is required (e.g. ds_configs/gpt2_tiny_cpu.json)", file=sys.stderr)
        return 2
    run_args = RunArgs.from_namespace(args)
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
