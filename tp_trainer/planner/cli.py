"""``python -m tp_trainer.planner``: plan token slices for a model, sequence length, batch and stages.

    python -m tp_trainer.planner --model tiny --seq_len 512 --batch 1 --stages 2 --profile \
        --save_cost_model runs/cost.json
    python -m tp_trainer.planner --seq_len 2048 --batch 8 --stages 4 --cost_model runs/cost.json

``--model``: a HF checkpoint directory or config.json (only the config is read: timing needs the
shapes, not the weights), or a preset of tp_trainer/model/families/presets.py (``tiny`` = ``gpt2-tiny``).
``--profile`` measures every stage here, one after the other, in this process (GPT-2 family); with
``--layers`` (any family) the prefix, one block and the suffix instead, and the stages are placed by
measured cost (as ``"slices": "auto"`` does), on ``--device`` in ``--dtype``, the norms and blocks as
``--fused_rms_norm`` and ``--cuda_graphs`` say (the run's settings: a cost model records them, and
a run that computes otherwise refuses it); ``--memory_limit_gib`` also picks order and checkpointing
under a per-rank limit.

    python -m tp_trainer.planner --model ckpt/ --seq_len 8192 --stages 2 --profile --layers \
        --device cuda --dtype bf16 --cuda_graphs --save_cost_model runs/cost.json
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

from ..config import ATTENTION_KERNELS
from .auto import TORCH_DTYPES, save_plan
from .cost_model import PipelineCost
from .profile import profile_stage, time_copy
from .report import make_plan, report


def model_config(spec: str):
    """The model's config: a preset name (tp_trainer/model/families/presets.py; "tiny" = gpt2-tiny with the
    embedded tokenizer's 8192 tokens, GPT-2 presets with GPT-2's 50257), or a checkpoint directory or
    config.json path of any family (its own config class, by ``model_type``)."""
    from transformers import AutoConfig

    from ..model.families.presets import PRESETS, preset_config
    name = "gpt2-tiny" if spec == "tiny" else spec
    if name in PRESETS:
        return preset_config(name, vocab_size=8192 if name == "gpt2-tiny" else 50257)
    path = spec if os.path.isfile(spec) else os.path.join(spec, "config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"--model: {spec!r} is neither a preset ({', '.join(PRESETS)}), a config.json nor a "
                         f"checkpoint directory holding config.json")
    return AutoConfig.from_pretrained(path)


def stage_layers(model, stages: int):
    """([callables of stage s] for each stage, SliceContext) without DeepSpeed's process group."""
    from deepspeed.pipe import TiedLayerSpec

    from ..model.stages.layers import SliceContext
    from ..model.stages.split import split_for_config
    try:  # model families by adapter (newer layout); GPT-2 module functions otherwise
        from ..model.families.adapters import adapter_for
        family = adapter_for(model.config)
    except ImportError:
        from ..model.families import gpt2 as family
    make_specs = getattr(family, "layer_specs", None) or getattr(family, "gpt2_layer_specs")
    ctx = SliceContext(model.config._attn_implementation or "sdpa")
    specs = make_specs(model, ctx)
    split = split_for_config(model.config, stages, family.PREFIX, family.SUFFIX)
    tied, out = {}, []
    for s in range(stages):
        funcs = []
        for spec in specs[split.parts[s]:split.parts[s + 1]]:
            if isinstance(spec, TiedLayerSpec):
                module = tied.setdefault(spec.key, spec.build())
                funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                funcs.append(spec.build())
        out.append(funcs)
    return out, ctx


def profile_model(config, seq_len: int, stages: int, batch_sizes, granularity: int,
                  time_budget_s: float) -> PipelineCost:
    """Measure every stage of a randomly initialised model of ``config`` in this process."""
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    layers, ctx = stage_layers(model, stages)
    costs = [profile_stage(funcs, ctx, config.n_embd, seq_len, batch_sizes, granularity, time_budget_s / stages,
                           desc=f"profile stage {s}") for s, funcs in enumerate(layers)]
    latency, per_byte = time_copy(config.n_embd, seq_len)
    meta = {"seq_len": seq_len, "batch_sizes": list(batch_sizes), "granularity": granularity,
            "torch_threads": torch.get_num_threads(), "world_size": 1}
    return PipelineCost(costs, latency, per_byte, meta)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tp_trainer.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | gpt2 | checkpoint dir | config.json")
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--batch", type=int, default=1, help="sequences per iteration (per data-parallel replica)")
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--granularity", type=int, default=8)
    p.add_argument("--microbatch_size", type=int, default=None, help="fix b (default: the DP chooses)")
    p.add_argument("--any_split", action="store_true", help="allow unequal microbatch sizes")
    p.add_argument("--schedule", default="gpipe")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", action="store_true", help="measure the stages here")
    src.add_argument("--cost_model", help="a cost model JSON written by --profile or a run")
    p.add_argument("--save_cost_model", help="with --profile: write the measured cost model here")
    p.add_argument("--time_budget", type=float, default=60.0, help="seconds of profiling, all stages")
    p.add_argument("--threads", type=int, default=None, help="torch threads while profiling")
    p.add_argument("--save_dir", help="write plan.json and plan.txt into this directory")
    p.add_argument("--layers", action="store_true",
                   help="with --profile: measure the prefix, one block (GPT-2 / Llama family: its attention and "
                        "MLP halves) and the suffix and place the stages by measured cost, a block cut where that "
                        "balances better (what \"slices\": \"auto\" runs); a cost model with per-layer costs is "
                        "always planned that way")
    p.add_argument("--memory_limit_gib", type=float, default=None,
                   help="also choose order and checkpointing under this per-rank limit (needs per-layer costs)")
    run = p.add_argument_group("the run's settings, with --profile --layers (a cost model records them)")
    run.add_argument("--device", default="cpu", help="where to profile: cpu, cuda, cuda:1, ...")
    run.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default="fp32", help="the run's compute dtype")
    run.add_argument("--fused_rms_norm", choices=("auto", "true", "false"), default="auto",
                     help="as terapipe.fused_rms_norm: auto fuses Llama-style RMSNorms on CUDA")
    run.add_argument("--cuda_graphs", action="store_true",
                     help="as terapipe.cuda_graphs: time the blocks replayed from captured graphs")
    run.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto",
                     help="as terapipe.attention: the slices' attention kernel on CUDA in fp16 / bf16")
    return p.parse_args(argv)


def plan_layers(args, config, cost) -> None:
    """Plan from per-layer costs (profiled here with --layers, or a cost model's meta["layers"]) and
    print the layout, the memory-aware choice (--memory_limit_gib) and the report."""
    from ..choices import fuses_norms
    from ..model.cuda.attention_cuda import AttentionChoice
    from ..model.families.adapters import adapter_for
    from ..model.stages.split import split_for_config
    from .auto import _plan, measured_settings
    from .layer_cost import LayerCosts, measure_layers
    if cost is None:
        sizes = [args.microbatch_size] if args.microbatch_size else [b for b in range(1, args.batch + 1)
                                                                      if args.batch % b == 0]
        device = torch.device(args.device)
        fused = fuses_norms({"true": True, "false": False}.get(args.fused_rms_norm, "auto"), device.type)
        attention = AttentionChoice(args.attention)
        parts, prefix, suffix = measure_layers(config, args.seq_len, sizes, args.granularity, args.time_budget,
                                               device, dtype=TORCH_DTYPES[args.dtype], fused_norm=fused,
                                               captured=args.cuda_graphs, attention=attention)
        layers = LayerCosts.from_parts(parts, config.num_hidden_layers, prefix, suffix)
        latency, per_byte = time_copy(config.hidden_size, args.seq_len, layers.block.bytes_per_element, device)
        meta = {"seq_len": args.seq_len, **measured_settings(device.type, args.dtype, fused, config, args.cuda_graphs,
                                                             attention)}
    else:
        layers, latency, per_byte, meta = (LayerCosts.from_dict(cost.meta["layers"]), cost.p2p_latency,
                                           cost.p2p_per_byte, cost.meta)
    adapter = adapter_for(config)
    analytic = split_for_config(config, args.stages, adapter.PREFIX, adapter.SUFFIX)
    limit = None if args.memory_limit_gib is None else args.memory_limit_gib * 2 ** 30
    layout, text = _plan(layers, args.seq_len, args.batch, args.stages, analytic, args.microbatch_size,
                         args.granularity, args.schedule, latency, per_byte, meta, limit)
    print(text)
    if args.save_cost_model:
        layout.cost.save(args.save_cost_model)
    if args.save_dir:
        save_plan(args.save_dir, layout.plan, text)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.model)
    if args.layers or args.memory_limit_gib is not None or (args.cost_model and "layers" in
                                                             PipelineCost.load(args.cost_model).meta):
        plan_layers(args, config, None if args.profile else PipelineCost.load(args.cost_model))
        sys.stdout.flush()
        return
    if args.profile:
        if config.model_type != "gpt2":
            raise SystemExit(f"--profile: whole stages are profiled for GPT-2 models only, --model {args.model} is "
                             f"{config.model_type!r}; add --layers (any family)")
        if args.seq_len > config.n_positions:
            raise SystemExit(f"--seq_len {args.seq_len} exceeds the model's {config.n_positions} positions")
        sizes = [args.microbatch_size] if args.microbatch_size else range(1, args.batch + 1)
        sizes = [b for b in sizes if args.any_split or args.batch % b == 0]
        cost = profile_model(config, args.seq_len, args.stages, sizes, args.granularity, args.time_budget)
        if args.save_cost_model:
            cost.save(args.save_cost_model)
    else:
        cost = PipelineCost.load(args.cost_model)
    print(cost.describe())
    plan, seconds = make_plan(cost, args.seq_len, args.batch, args.stages, args.granularity,
                              args.microbatch_size, not args.any_split)
    print(report(plan, cost, args.stages, args.schedule, seconds))
    if args.save_dir:
        save_plan(args.save_dir, plan, report(plan, cost, args.stages, args.schedule))
    sys.stdout.flush()

