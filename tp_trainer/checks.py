"""Every check of a run's input, in one place, before any process group: ``validate`` returns a
``RunSpec`` that the run hands on (the pipeline part, ``PipelineSpec``, goes to ``initialize``).

The refused combinations of settings (precision, ZeRO, captured or compiled blocks, checkpointing,
LoRA, packing, ...) are one table, ``choices.RULES``, checked by ``check_pipeline`` as it makes the
run's ``RunChoices``.

Why one place: each check then runs once, the cost model is read once, and what a later phase
receives is already known to be valid. Checks that need data only a started run has (the
tokenizer's vocabulary against a checkpoint, the validation set against ``--eval_batches``) are
here too, and run inside ``failures.together`` so every rank stops at once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from .choices import Machine, RunChoices, RunInputs
from .config import ConfigError, TeraPipeConfig, check_zero_stage, load_ds_config, pipeline_stages
from .data import DataArgs, check_tokenizer_source
from .model.families.adapters import adapter_for, apply_rope_scaling, check_positions, parse_rope_scaling


@dataclass(frozen=True)
class PipelineSpec:
    """What ``initialize`` needs, checked: the DeepSpeed config, its terapipe section, the number of
    stages, what the run computes (``choices.RunChoices``) and, with ``"slices": "auto"`` and a
    cost-model file, that cost model (read once)."""

    ds_config: dict
    terapipe: TeraPipeConfig
    stages: int
    choices: RunChoices
    cost: object | None = None


@dataclass(frozen=True)
class RunSpec:
    """A training run whose input passed every check before the process group."""

    pipeline: PipelineSpec
    data: DataArgs
    config_name: str
    checkpoint: str | None = None  # the local directory of --model_name_or_path (hub ids resolved)
    checkpoint_config: object = None
    tokenizer_source: tuple[str | None, str] = (None, "--tokenizer_name")  # (name or path, its flag)
    resume_from: object = None

    def model_config(self, vocab_size: int):
        """The HF config to train: the checkpoint's, or the preset with this vocabulary."""
        if self.checkpoint_config is not None:
            return self.checkpoint_config
        return preset(self.config_name, vocab_size)


def validate(args, world_size: int, machine: Machine | None = None, weights: bool = True) -> RunSpec:
    """All input checks of a training run (``args``: ``run.RunArgs``); raises ConfigError (or OSError) naming the input and the fix.
    ``machine``: the accelerator the run is judged for (default: this machine's, ``choices.this_machine``;
    the dry run passes its target GPU's); ``weights`` false: the checkpoint's weights and tokenizer are
    not looked for (a dry run plans from its config.json alone)."""
    args.check()
    ds_config = load_ds_config(args.deepspeed_config)
    section = ds_config.setdefault("terapipe", {})
    if args.block_size is not None:
        section["seq_len"] = args.block_size
    if args.sequence_parallel is not None:
        section["sequence_parallel"] = args.sequence_parallel
    keep_cost_model(section, args.output_dir, args.resume)
    merge_lora_flags(section, args)
    seq_len = section.get("seq_len", 1024)
    data = DataArgs(dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                    train_file=args.train_file, validation_file=args.validation_file, text_column=args.text_column,
                    block_size=seq_len if isinstance(seq_len, int) else 1024, **instruction_fields(args))
    checkpoint, checkpoint_config = _checkpoint(args, weights)
    tokenizer_source = ((args.tokenizer_name, "--tokenizer_name") if args.tokenizer_name
                        else (checkpoint, "--model_name_or_path"))
    if weights:
        check_tokenizer_source(*tokenizer_source)
    checked = checkpoint_config if checkpoint_config is not None else preset(args.config_name, vocab_size=1)
    apply_rope_scaling(checked, parse_rope_scaling(args.rope_scaling))  # before the meta model is built
    # the vocabulary does not matter here
    pipeline = check_pipeline(ds_config, checked, world_size, packing=args.packing, merge_lora=args.merge_lora,
                              machine=machine)
    check_lora(pipeline.terapipe, checked)
    spec = RunSpec(pipeline, data, args.config_name, checkpoint, checkpoint_config, tokenizer_source)
    if args.resume:
        from .resume_checks import check_resume
        resume_from = check_resume(args.output_dir, args.resume, ds_config, spec.model_config, world_size,
                                   args.reset_optimizer, args.reset_data_position)
        spec = RunSpec(**{**spec.__dict__, "resume_from": resume_from})
    return spec


def instruction_fields(args) -> dict:
    """The ``DataArgs`` fields of instruction data (formats, chat template, packing) from the run's flags."""
    names = ("prompt_column", "completion_column", "messages_column", "chat_template", "train_on_prompt", "packing",
             "long_examples")
    return {name: getattr(args, name) for name in names}


def merge_lora_flags(section: dict, args) -> None:
    """The LoRA flags (``--lora_r``, ``--lora_alpha``, ...) into ``terapipe.lora`` (they win over the
    config's values)."""
    from .lora import merge_flags
    merge_flags(section, args)


def check_lora(terapipe: TeraPipeConfig, config) -> None:
    """LoRA's targets against the model (one ``error:`` line listing its modules), before any work;
    the checked settings (with an adapter's own r / targets) replace the section's."""
    from .lora import check
    terapipe.lora = check(terapipe.lora, config)


COST_MODEL_FILE = "cost_model.json"


def keep_cost_model(section: dict, output_dir: str, resume: str | None) -> None:
    """``"slices": "auto"`` without ``terapipe.cost_model``: the run's profile is kept in
    ``output_dir/cost_model.json``, and a ``--resume`` of that run plans from it. Profiling again
    could place the layers on other stages (the split is measured), and DeepSpeed's per-stage files
    would then not fit the stages; planning from the same file gives the same split and slices.
    A fresh run never reads an earlier run's file (it profiles, and keeps its own only where none is)."""
    if section.get("slices") != "auto" or section.get("cost_model"):
        return
    path = os.path.join(output_dir, COST_MODEL_FILE)
    if resume or not os.path.exists(path):
        section["cost_model"] = path


def _checkpoint(args, weights: bool = True):
    """(local directory, HF config) of ``--model_name_or_path``, or (None, None); ``weights``: its
    safetensors files must be there."""
    if not args.model_name_or_path:
        return None, None
    from .checkpoint import checkpoint_config, resolve_checkpoint
    directory = resolve_checkpoint(args.model_name_or_path)
    return directory, checkpoint_config(directory, need_weights=weights)


def preset(name: str, vocab_size: int):
    """A preset's HF config (dropout off; <|endoftext|> is id 0 in the embedded tokenizer)."""
    from .model.families.presets import preset_config
    try:
        return preset_config(name, vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def model_config(args, vocab_size: int):
    """The HF config of ``args`` (``model_name_or_path`` or ``config_name``); no weights are read."""
    if args.model_name_or_path:
        from .checkpoint import checkpoint_config
        return checkpoint_config(args.model_name_or_path)
    return preset(args.config_name, vocab_size)


# ---------------------------------------------------------------- the pipeline (also for initialize)

def model_depth(config) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def check_pipeline(ds_config: dict, model_config, world_size: int, packing: str = "none",
                   merge_lora: bool = False, machine: Machine | None = None) -> PipelineSpec:
    """The checks of a pipeline of ``model_config`` under ``ds_config`` on ``world_size`` ranks, and
    what it computes (``RunChoices``, the refused combinations ``choices.RULES`` checked there);
    ``packing``, ``merge_lora``: the run's flags (a library caller's run: none); ``machine``: the
    accelerator judged for (default: this machine's)."""
    check_zero_stage(ds_config)
    try:
        adapter_for(model_config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    terapipe = TeraPipeConfig.from_section(ds_config.get("terapipe"))
    warning = check_positions(terapipe.seq_len, model_config)  # learned positions: raises when too short
    if warning and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("tp_trainer").warning("%s", warning)
    machine = machine or Machine.here()
    choices = RunChoices.decide(RunInputs(terapipe, ds_config, machine.device_type, machine.supported, model_config,
                                          packing, merge_lora))
    stages = pipeline_stages(ds_config, world_size, terapipe.sequence_parallel)
    check_sequence_ranks(terapipe, model_config, machine.local_ranks)
    depth = model_depth(model_config)
    if stages > depth:
        raise ConfigError(f"pipeline.stages: {stages} stages but the model has only {depth} decoder layers; "
                          f"use at most {depth} stages")
    cost = read_cost_model(terapipe, stages, model_config, choices)
    return PipelineSpec(ds_config, terapipe, stages, choices, cost)


def check_sequence_ranks(terapipe: TeraPipeConfig, model_config, local_ranks: int | None = None) -> None:
    """``terapipe.sequence_parallel`` N against the slices and the model's heads (the world size:
    ``pipeline_stages``); ``local_ranks``: ranks per node (None: this node's, LOCAL_WORLD_SIZE)."""
    size = terapipe.sequence_parallel
    if size == 1:
        return
    from .model.slices.sequence_ranks import head_problem
    uneven = [length for length in terapipe.slice_lengths or () if length % size]
    if uneven:
        raise ConfigError(f"terapipe.slices: with terapipe.sequence_parallel {size} every slice length must be a "
                          f"multiple of {size} (each rank takes l/{size} tokens), got {uneven[:4]}; change the "
                          f"slices or sequence_parallel")
    if terapipe.seq_len % size:
        raise ConfigError(f"terapipe.seq_len: {terapipe.seq_len} is not a multiple of terapipe.sequence_parallel "
                          f"{size}; change one of them")
    local = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local % size:
        raise ConfigError(f"terapipe.sequence_parallel: {size} sequence ranks would span nodes: this node runs "
                          f"{local} ranks (LOCAL_WORLD_SIZE), and a sequence group is {size} consecutive ranks of "
                          f"one node (its all-to-alls need the node's links); give every node a multiple of {size} "
                          f"slots in the hostfile, or change sequence_parallel")
    heads = getattr(model_config, "num_attention_heads", None) or model_config.n_head
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    problem = head_problem(heads, kv_heads, size)
    if problem:
        raise ConfigError(f"terapipe.sequence_parallel: {size} does not fit the model: {problem}; use a "
                          f"sequence_parallel that divides {heads} (and divides or is a multiple of {kv_heads})")


def read_cost_model(terapipe: TeraPipeConfig, stages: int, model_config, choices: RunChoices):
    """With "auto", a cost-model file that exists is read here, once, and must describe this model's
    stages measured as this run computes (``choices``: device, dtype, fused norms, captured blocks, slice attention:
    ``planner.auto.measured_settings``);
    returns it (None: none given, or not written yet: the run profiles)."""
    if not (terapipe.auto and terapipe.cost_model and os.path.isfile(terapipe.cost_model)):
        return None
    from .model.cuda.attention_cuda import AttentionChoice
    from .planner.auto import measured_settings
    from .planner.cost_model import PipelineCost
    try:
        cost = PipelineCost.load(terapipe.cost_model)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} is not a cost model ({err}); "
                          f"delete it to profile again") from None
    hidden = getattr(model_config, "hidden_size", 0)
    measured = (len(cost.stages), max(s.hidden for s in cost.stages))
    if measured != (stages, hidden):
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} was measured for {measured[0]} stages of "
                          f"hidden size {measured[1]}, this run has {stages} stages of hidden size {hidden}; "
                          f"delete it to profile again, or point to the model's own cost model")
    run = measured_settings(choices.device_type, choices.precision, choices.fused_norms, model_config,
                            choices.cuda_graphs, AttentionChoice(choices.attention), terapipe.sequence_parallel)
    written = {key: cost.meta.get(key, UNRECORDED_SETTINGS[key]) for key in run}
    differ = [key for key in run if written[key] != run[key]]
    if differ:
        then, now = (" and ".join(_setting_words(key, values[key]) for key in differ) for values in (written, run))
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} was measured {then}, this run computes "
                          f"{now}; delete it to profile again, or point to a cost model measured {now}")
    if "layers" not in cost.meta:
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} holds per-stage costs only (written by an "
                          f"older tp_trainer); the planner now places layers by their measured costs: delete it "
                          f"to profile again")
    return cost


# What a cost model without the key was measured with: files written before a setting was recorded
# came from runs that had only this value (fp32 before precision, HF's norms before fused ones, eager
# profiles before captured ones, CPUs, the split or flash slice attention before the bottom-right one, one
# rank per stage's slices before sequence ranks could plan).
UNRECORDED_SETTINGS = {"device": "cpu", "dtype": "fp32", "fused_norm": False, "cuda_graphs": False,
                       "attention": "auto", "sequence_ranks": 1}


def _setting_words(key: str, value) -> str:
    """A measured setting as the error message says it: "on cuda", "in bf16", "with fused RMSNorms", ..."""
    if key == "fused_norm":
        return "with fused RMSNorms (terapipe.fused_rms_norm)" if value else "with HF's RMSNorms"
    if key == "cuda_graphs":
        return "with captured blocks (terapipe.cuda_graphs)" if value else "with eager blocks"
    if key == "attention":
        return f"with slice attention {value} (terapipe.attention)"
    if key == "sequence_ranks":
        return f"with {value} sequence rank{'s' if value != 1 else ''} per stage (terapipe.sequence_parallel)"
    return f"{'on' if key == 'device' else 'in'} {value}"


# ---------------------------------------------------------------- checks that need the started run

def check_vocabulary(tokenizer, config, spec: RunSpec) -> None:
    """Every token id must index a row of the checkpoint's embedding."""
    rows, tokens = getattr(config, "vocab_size", None), len(tokenizer)
    if spec.checkpoint_config is None or rows is None or tokens <= rows:
        return
    name, flag = spec.tokenizer_source
    raise ConfigError(f"{flag} {name}: the tokenizer has {tokens} tokens, but the checkpoint "
                      f"{spec.checkpoint} has vocab_size {rows} (embedding rows): ids >= {rows} would index "
                      f"past the embedding; pass --tokenizer_name with the tokenizer the checkpoint was "
                      f"trained with")


def check_validation_size(engine, dataset, eval_batches: int) -> None:
    """The validation set must fill ``--eval_batches`` pipeline batches on every replica."""
    needed = engine.micro_batches * eval_batches * engine.micro_batch_size * engine.dp_world_size
    if len(dataset) < needed:
        raise ConfigError(f"--eval_batches {eval_batches}: needs {needed} validation blocks, the validation "
                          f"set has {len(dataset)}; lower --eval_batches or give a larger --validation_file")
