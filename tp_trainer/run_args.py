"""The options of one training run, written once: each ``RunArgs`` field is a flag of launch/train.py.

A field's default is the flag's default; its metadata holds the help text, the ``--help`` group
and, where the flag is not a plain ``--<name> VALUE``, how argparse reads it. ``add_arguments``
builds the flags from the fields (in field order); ``RunArgs.from_namespace`` reads them back.
``deepspeed_config`` is the one field whose flag DeepSpeed adds (``deepspeed.add_config_arguments``).
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field, fields

from .config import ConfigError

GROUPS = ("model", "data", "training", "lora", "dry run")


def _flag(default, help_text: str | None, group: str, **argparse_kwargs):
    """A field with its flag: the help text (None: none), its ``--help`` group (one of GROUPS) and the
    argparse keywords beyond default and type (``flag``: an option string other than ``--<name>``)."""
    return field(default=default, metadata={"help": help_text, "group": group, "argparse": argparse_kwargs})


class _OnOff(argparse.BooleanOptionalAction):
    """``--name`` / ``--no-name``, its help as written (argparse before 3.13 appends the default to it)."""

    def __init__(self, option_strings, dest, help=None, **kwargs):  # noqa: A002 (argparse's keyword)
        super().__init__(option_strings, dest, help=help, **kwargs)
        self.help = help


@dataclass
class RunArgs:
    """Options of one training run (the command line of launch/train.py)."""

    deepspeed_config: str = field(metadata={"added_by": "deepspeed.add_config_arguments"})
    # ------------------------------------------------------------------ model
    model_name_or_path: str | None = _flag(None, "HF checkpoint: hub id or local save_pretrained directory", "model")
    config_name: str = _flag("gpt2-tiny", "preset for random init (see tp_trainer/model/families/presets.py)", "model")
    tokenizer_name: str | None = _flag(None, "HF tokenizer (hub id or local dir); default: the embedded BPE", "model")
    rope_scaling: str | None = _flag(
        None, "rotary models: HF's rope_scaling as JSON, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0}' (also "
        "linear, llama3), to fine-tune at --block_size beyond the checkpoint's positions; replaces its "
        "config.json's rope_parameters", "model")
    sequence_parallel: int | None = _flag(None, "sequence ranks per stage (Ulysses over each slice); overrides "
                                          "terapipe.sequence_parallel", "model")
    # ------------------------------------------------------------------ data
    dataset_name: str | None = _flag(None, "hub dataset name", "data")
    dataset_config_name: str | None = _flag(None, "hub dataset config", "data")
    train_file: str | None = _flag(None, "local .txt/.json/.jsonl/.csv/.parquet file", "data")
    validation_file: str | None = _flag(
        None, "local validation file (same formats); also with the embedded corpus or --dataset_name, whose "
        "validation part it replaces", "data")
    text_column: str = _flag("text", "json/csv/parquet/hub column holding the text (default %(default)s)", "data")
    block_size: int | None = _flag(None, "sequence length; overrides terapipe.seq_len", "data")
    prompt_column: str | None = _flag(None, "prompt/completion data: column of the prompt (default: 'prompt' where "
                                      "the data has prompt and completion columns)", "data")
    completion_column: str | None = _flag(None, "prompt/completion data: column of the completion, the scored answer "
                                          "(default 'completion')", "data")
    messages_column: str | None = _flag(None, "chat data: column of the messages, a list of {role, content} (default: "
                                        "'messages' where the data has it)", "data")
    chat_template: str | None = _flag(None, "Jinja chat template file for messages data, e.g. the checkpoint's own "
                                      "(its assistant turns found from its rendering, or from {%% generation %%} ... "
                                      "{%% endgeneration %%} blocks where it has them; default: the tokenizer's; the "
                                      "embedded tokenizer's is tp_trainer/data/default_chat_template.jinja)", "data")
    train_on_prompt: bool = _flag(False, "score every token, prompts and user turns too (default: only completions "
                                  "and assistant turns)", "data", action="store_true")
    packing: str = _flag("auto", "stream: documents joined into one token stream (text only); examples: whole "
                         "examples per block, each attending only to itself; none: one example per block, padded; "
                         "auto (default): stream for text, examples for prompt/completion and messages", "data",
                         choices=("auto", "stream", "examples", "none"))
    long_examples: str = _flag("split", "an example longer than --block_size (packing examples / none): split into "
                               "pieces (default) or refuse (stop, naming the row)", "data", choices=("split", "refuse"))
    # ------------------------------------------------------------------ training
    max_steps: int = _flag(30, "optimizer steps to run (default %(default)s)", "training")
    eval_interval: int = _flag(10, "evaluate every N steps (and at the end)", "training")
    eval_batches: int = _flag(4, "batches per evaluation", "training")
    save_hf: bool = _flag(True, "do not write the trained model as a Hugging Face directory at the end", "training",
                          flag="--no_save_hf", action="store_false")
    save_interval: int | None = _flag(None, "DeepSpeed checkpoint every N steps and at the end", "training")
    resume: str | None = _flag(None, "continue from <output_dir>/checkpoints: '%(const)s' (default) or a tag such "
                               "as step30", "training", nargs="?", const="latest")
    reset_optimizer: bool = _flag(False, "with --resume: keep only the weights (fresh optimizer state and LR "
                                  "schedule)", "training", action="store_true")
    reset_data_position: bool = _flag(False, "with --resume: start the data from its first block (allows another "
                                      "global batch)", "training", action="store_true")
    timeline: str | None = _flag(None, "PNG: measured Gantt chart of the last step beside the simulated one",
                                 "training")
    memory_report: bool = _flag(
        False, "count the tensors autograd saves for backward (a saved-tensor hook on every one, every step) and "
        "report their peak with the memory figures at each evaluation; off by default (it costs the main job "
        "more than 1%% of a step: benchmarks/RESULTS.md), the report then says they were not tracked",
        "training", action=_OnOff)
    seed: int = _flag(1234, None, "training")
    output_dir: str = _flag("runs/latest", "where the plan and logs are written", "training")

    # ------------------------------------------------------------------ lora (tp_trainer/lora.py)
    lora_r: int | None = _flag(None, "LoRA rank: fine-tune low-rank adapters through peft, base weights frozen "
                               "(also terapipe.lora.r; the flags win)", "lora")
    lora_alpha: float | None = _flag(None, "LoRA alpha (scale alpha / r; default r)", "lora")
    lora_dropout: float | None = _flag(None, "dropout on the adapters' input (default 0)", "lora")
    lora_target_modules: str | None = _flag(
        None, "comma-separated module names to adapt (default: the family's attention and MLP projections, "
        "e.g. GPT-2's c_attn,c_proj,c_fc; Llama's q/k/v/o_proj,gate/up/down_proj)", "lora")
    modules_to_save: str | None = _flag(None, "comma-separated modules trained in full beside the adapters, "
                                        "e.g. wte,ln_f", "lora")
    adapter_name_or_path: str | None = _flag(None, "continue from this PEFT adapter directory (its r, alpha "
                                             "and targets)", "lora")
    merge_lora: bool = _flag(False, "also write the model with the adapters merged to <output_dir>/hf_model",
                             "lora", action="store_true")
    # ------------------------------------------------------------------ dry run (tp_trainer/dry_run.py)
    dry_run: bool = _flag(False, "no process group, GPU or weights: run the checks for the target GPU, print the plan "
                          "(stages, slices, order, checkpointing), each stage's memory, whether it fits and the "
                          "predicted step beside DeepSpeed's pipeline; writes <output_dir>/dry_run.json", "dry run",
                          action="store_true")
    world_size: int | None = _flag(None, "with --dry_run: the GPUs of the run (its launcher's world size)", "dry run")
    gpu: str | None = _flag(None, "with --dry_run: the GPU, h100 (default) or h200 (their calibrated cost models)",
                            "dry run")
    gpu_memory_gib: float | None = _flag(None, "with --dry_run: memory per GPU in GiB (default: the --gpu's)",
                                         "dry run")
    cost_model: str | None = _flag(None, "with --dry_run: a cost model measured on the target GPU (python -m "
                                   "tp_trainer.planner --profile --layers --device cuda ... --save_cost_model FILE) "
                                   "instead of the analytic GPU model", "dry run")

    def check(self):
        """Flag values (checked in ``run`` with the other input checks)."""
        for name in ("max_steps", "eval_interval", "eval_batches", "save_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name}: must be >= 1, got {value}")
        if not self.dry_run:
            given = [name for name in DRY_RUN_FLAGS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"--{given[0]}: only with --dry_run (a run's GPUs are its launcher's); add "
                                  f"--dry_run or drop --{given[0]}")

    @classmethod
    def from_namespace(cls, ns) -> "RunArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


DRY_RUN_FLAGS = ("world_size", "gpu", "gpu_memory_gib", "cost_model")


def flag_fields() -> list:
    """The fields whose flags ``add_arguments`` adds (all but DeepSpeed's ``deepspeed_config``)."""
    return [f for f in fields(RunArgs) if f.metadata.get("group")]


def add_arguments(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Add a flag per ``RunArgs`` field to ``parser``, in its group; returns the groups by name."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    hints = typing.get_type_hints(RunArgs)
    for f in flag_fields():
        options = dict(f.metadata["argparse"])
        flag = options.pop("flag", f"--{f.name}")
        value_type = _value_type(hints[f.name])
        if "action" not in options and value_type is not str:  # argparse reads a string by default
            options["type"] = value_type
        groups[f.metadata["group"]].add_argument(flag, dest=f.name, default=f.default, help=f.metadata["help"],
                                                 **options)
    return groups


def _value_type(hint):
    """``int`` for ``int`` and ``int | None``; likewise ``str`` (what argparse converts the value with)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint

