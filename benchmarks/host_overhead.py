"""Host time per block and slice: the default eager slice path against the fused op compiled by inductor.

    python benchmarks/host_overhead.py [--slices 16] [--reps 5] [--steps 40] [--json FILE]

Model: a tiny GPT-2 (width 32, 2 layers, 4 heads, seq 256, vocab 256, dropout 0), 1 thread. Its
compute is negligible, so what a step costs is dispatch: Python, autograd and ATen's per-op
overhead, i.e. the host time a GPU step would spend per slice while its kernels are short.

One "step" runs the 2 decoder blocks (the pipeline's ``DecoderBlock``s around HF's ``GPT2Block``) on
one sequence of 256 tokens in S uniform slices, as the engine runs a stage: ``SliceContext.begin`` and
the blocks for every slice in order, then each slice's backward in reverse order (from a fixed
output gradient). T_S = thread CPU time (``time.thread_time``) of one step, averaged over ``--steps``
steps; per block and slice: (T_S - T_1) / (S - 1) / 2, the cost of one more slice beyond the whole
sequence (T_1: one slice of 256 tokens through the same path). Both T_1 and T_S are measured in each
of ``--reps`` rounds; the figures are the median over rounds and their min-max.

    hf_us_per_block               HF's GPT2Block on the whole sequence, forward + backward, per block
    eager_us_per_block_slice      the default path (``_AppendKV`` + ``_SliceAttention``), per block and slice
    compiled_us_per_block_slice   ``block_runs(blocks, "inductor")`` (compiled_slices/): both blocks as one
                                  ``BlockRun``, one region under ``torch.compile(fullgraph=True)`` per slice, the
                                  K/V append and attention in ``slice_op``'s fused op (graphs compiled before timing)
    compiled_per_block_us_per_block_slice   the same with each HF block compiled on its own
                                  (``fuse(block, torch.compile(block.inner))``): a region per block
    compiled_blocks_us_per_block_slice   the default path with each HF block compiled around its K/V append
                                  and attention (``model.compiled_blocks``, inductor; terapipe.compile_blocks)
    kernels_per_block_slice       {"eager", "compiled_blocks"}: compute ops per block and slice, forward +
                                  backward (ATen ops that launch work, views and allocations left out, plus
                                  inductor's fused kernels): what a GPU would launch per slice
    eager_ops_per_block_slice     ATen ops per block and slice on the default path, forward + backward
                                  (a ``TorchDispatchMode`` counting every op over one step: (N_S - N_1) / (S - 1) / 2)
    graph_breaks                  ``torch._dynamo.explain`` of the ``BlockRun`` region on a middle slice
    aten_us_per_block_slice       {"eager", "compiled"}: the ATen ops' own time in it (torch.profiler's self
                                  CPU time of every ``aten::`` op over 10 steps at 1 and S slices, the same
                                  difference): the floor that no host-side change removes
    generated_us_per_block_slice  {"generated", "compiled"}: of the compiled path's time per block and slice, the
                                  part inside inductor's compiled graphs (forward and backward: their generated
                                  code with its C++ kernels, extern matmuls, the fused op's calls, allocations),
                                  and the compiled path's total in the same pass (a timer around each graph
                                  call, ``CompiledFxGraph.__call__``): what is left when every runtime layer of
                                  torch.compile (guards, AOTAutograd's wrappers, autograd's engine) costs nothing
    compiled_to_eager             compiled / eager per round (the two take turns in each round), median and min-max
Goal: compiled per-slice overhead at most a third of the eager one. Runs in ~2 min on 2 cores (compiling).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compiled_slices import BlockRun, block_runs, fuse  # noqa: E402
from compiled_slices.block_run import _run_blocks  # noqa: E402
from tp_trainer.model.cuda.compiled_blocks import compile_blocks  # noqa: E402
from tp_trainer.model.stages.layers import DecoderBlock, SliceContext  # noqa: E402
from tp_trainer.model.slices.slice_cache import SequenceKV  # noqa: E402

WIDTH, LAYERS, HEADS, SEQ, VOCAB = 32, 2, 4, 256, 256


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=SEQ, vocab_size=VOCAB,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def pipeline_blocks(net):
    """(DecoderBlocks over the model's HF blocks, their SliceContext)."""
    ctx = SliceContext("sdpa")
    return [DecoderBlock(block, f"transformer.h.{i}", ctx) for i, block in enumerate(net.transformer.h)], ctx


def sliced_step(blocks, ctx, x, grad, slices: int) -> None:
    """Forward every slice through the blocks, then the backwards in reverse slice order."""
    l = SEQ // slices
    kv, outs = SequenceKV(SEQ), []
    for j in range(slices):
        ctx.begin(kv, j * l, l)
        hidden = x[:, j * l:(j + 1) * l].clone().requires_grad_()   # a received activation: offset 0
        for block in blocks:
            hidden = block(hidden)
        outs.append(hidden)
    for j in reversed(range(slices)):
        ctx.begin(kv, j * l, l)
        outs[j].backward(grad[:, j * l:(j + 1) * l])


def whole_step(net, x, grad) -> None:
    """HF's blocks on the whole sequence, no cache, forward and backward."""
    hidden = x.detach().requires_grad_()
    for block in net.transformer.h:
        out = block(hidden)
        hidden = out[0] if isinstance(out, tuple) else out
    hidden.backward(grad)


def step_time(step, steps: int) -> float:
    """Thread CPU seconds of one call of ``step``, averaged over ``steps`` calls (garbage collector off:
    its pauses land on whichever path allocates more Python objects)."""
    gc.collect()
    gc.disable()
    try:
        begin = time.thread_time()
        for _ in range(steps):
            step()
        return (time.thread_time() - begin) / steps
    finally:
        gc.enable()


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def op_count(step) -> int:
    with _OpCount() as counter:
        step()
    return counter.ops


def graph_breaks(run: BlockRun, ctx) -> int:
    """Graph breaks of the ``BlockRun`` region on a middle slice (traced, not compiled)."""
    ctx.begin(SequenceKV(SEQ), SEQ // 2, SEQ // 4)
    return torch._dynamo.explain(_run_blocks)(*run.region_args(torch.randn(1, SEQ // 4, WIDTH))).graph_break_count


def aten_seconds(step, steps: int = 10) -> float:
    """Seconds of one ``step`` spent in ATen ops themselves (profiler self time of ``aten::`` events)."""
    from torch.profiler import profile
    with profile() as prof:
        for _ in range(steps):
            step()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / steps / 1e6


# ATen ops that launch no kernel of their own (views, allocation, metadata)
NO_KERNEL = {"view", "reshape", "transpose", "t", "permute", "expand", "as_strided", "slice", "select", "unsqueeze",
             "squeeze", "split", "narrow", "_unsafe_view", "alias", "detach", "empty", "empty_like", "empty_strided",
             "set_", "lift_fresh", "resolve_conj", "resolve_neg", "_reshape_alias", "unbind", "chunk",
             "split_with_sizes", "contiguous", "to", "item", "_local_scalar_dense", "unflatten", "flatten",
             "view_as", "expand_as", "new_empty", "new_empty_strided", "zeros", "zero_"}


def generated_seconds(step, steps: int) -> tuple[float, float] | None:
    """(thread CPU seconds of one ``step``, the part of them inside inductor's compiled graphs), averaged
    over ``steps`` steps; None where this torch has no ``CompiledFxGraph`` to time."""
    from torch._inductor import output_code
    graph = getattr(output_code, "CompiledFxGraph", None)
    if graph is None:
        return None
    inside, call = [0.0], graph.__call__

    def timed(self, inputs):
        begin = time.thread_time()
        try:
            return call(self, inputs)
        finally:
            inside[0] += time.thread_time() - begin
    graph.__call__ = timed
    try:
        total = step_time(step, steps)
    finally:
        graph.__call__ = call
    return total, inside[0] / steps


def kernels(step) -> int:
    """Compute ops of one ``step``: leaf ATen ops outside NO_KERNEL and inductor's C++ kernels
    (``cpp.enable_kernel_profile`` names them in the profile), after a warm-up step."""
    from torch.profiler import profile
    step()
    with profile() as prof:
        step()
    count = 0
    for event in prof.events():
        if event.name.startswith("aten::") and event.name[6:] not in NO_KERNEL:
            count += not any(child.name.startswith("aten::") for child in event.cpu_children)
        elif "cpp_fused" in event.name:
            count += 1
    return count


def per_slice(times: dict, slices: int) -> float:
    return (times[slices] - times[1]) / (slices - 1) / LAYERS * 1e6


def summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def kernel_counts(x, grad, slices: int) -> dict:
    """``kernels_per_block_slice`` of the eager path and of the blocks compiled around the attention,
    compiled here with inductor's kernels named in the profile (which costs time: the timed graphs are
    compiled afresh after ``torch._dynamo.reset``)."""
    import torch._inductor.config as inductor_config
    eager, eager_ctx = pipeline_blocks(model())
    around, around_ctx = pipeline_blocks(model())
    compile_blocks(around, "inductor")
    runs = {"eager": lambda s: sliced_step(eager, eager_ctx, x, grad, s),
            "compiled_blocks": lambda s: sliced_step(around, around_ctx, x, grad, s)}
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        counts = {name: (kernels(lambda: run(slices)) - kernels(lambda: run(1))) / (slices - 1) / LAYERS
                  for name, run in runs.items()}
    torch._dynamo.reset()
    return counts


def measure(args) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(1, SEQ, WIDTH, generator=gen), torch.randn(1, SEQ, WIDTH, generator=gen)
    launched = kernel_counts(x, grad, args.slices)   # first: its graphs are dropped before the timed ones compile
    eager_net = model()
    eager, eager_ctx = pipeline_blocks(eager_net)
    run_blocks, run_ctx = pipeline_blocks(model())
    (run,) = block_runs(run_blocks, "inductor")
    per_block, per_block_ctx = pipeline_blocks(model())
    per_block = [fuse(block, torch.compile(block.inner, fullgraph=True)) for block in per_block]
    around, around_ctx = pipeline_blocks(model())
    compile_blocks(around, "inductor")
    S = args.slices
    runs = {"eager": lambda s: sliced_step(eager, eager_ctx, x, grad, s),
            "compiled": lambda s: sliced_step([run], run_ctx, x, grad, s),
            "compiled_per_block": lambda s: sliced_step(per_block, per_block_ctx, x, grad, s),
            "compiled_blocks": lambda s: sliced_step(around, around_ctx, x, grad, s)}
    began = time.perf_counter()
    for step in runs.values():   # compiles the graphs (start 0 of 256 and of S tokens, later starts), warms up
        for s in (1, S, 1, S):
            step(s)
    compile_s = time.perf_counter() - began
    ops = {s: op_count(lambda: runs["eager"](s)) for s in (1, S)}
    rounds = {"hf": [], **{name: [] for name in runs}}
    for _ in range(args.reps):
        rounds["hf"].append(step_time(lambda: whole_step(eager_net, x, grad), args.steps) / LAYERS * 1e6)
        for name, step in runs.items():
            times = {s: step_time(lambda: step(s), args.steps) for s in (1, S)}
            rounds[name].append(per_slice(times, S))
        # (compiled step's seconds, of them inside its graphs) per slice count; None: this torch cannot time them
        timed = {s: generated_seconds(lambda: runs["compiled"](s), args.steps) for s in (1, S)}
        if None not in timed.values():
            for key, part in (("compiled_timed", 0), ("inside_graphs", 1)):
                rounds.setdefault(key, []).append(per_slice({s: timed[s][part] for s in (1, S)}, S))
    generated = {"generated": statistics.median(rounds["inside_graphs"]),
                 "compiled": statistics.median(rounds["compiled_timed"])} if "inside_graphs" in rounds else None
    # before graph_breaks: torch._dynamo.explain leaves the region to compile again
    aten = {name: per_slice({s: aten_seconds(lambda: runs[name](s)) for s in (1, S)}, S) for name in ("eager", "compiled")}
    out = {"hf_us_per_block": statistics.median(rounds["hf"]),
           "eager_us_per_block_slice": statistics.median(rounds["eager"]),
           "compiled_us_per_block_slice": statistics.median(rounds["compiled"]),
           "compiled_per_block_us_per_block_slice": statistics.median(rounds["compiled_per_block"]),
           "compiled_blocks_us_per_block_slice": statistics.median(rounds["compiled_blocks"]),
           "kernels_per_block_slice": launched,
           "eager_ops_per_block_slice": (ops[S] - ops[1]) / (S - 1) / LAYERS,
           "graph_breaks": graph_breaks(run, run_ctx), "aten_us_per_block_slice": aten,
           "generated_us_per_block_slice": generated}
    out["compiled_to_eager"] = summary([c / e for c, e in zip(rounds["compiled"], rounds["eager"])])  # paired per round
    out["spread"] = {name: summary(values) for name, values in rounds.items()}
    out["settings"] = {"slices": S, "reps": args.reps, "steps": args.steps, "compile_s": round(compile_s, 1),
                       "load": os.getloadavg()[0], "torch": torch.__version__}
    return out


def generated_line(generated: dict | None) -> str:
    if generated is None:
        return ""
    return (f"inside the compiled graphs {generated['generated']:.0f} us of the compiled path's "
            f"{generated['compiled']:.0f} us per block and slice; ")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if SEQ % args.slices or args.slices < 2:
        parser.error(f"--slices must divide {SEQ} and be at least 2")
    out = measure(args)
    eager, compiled = out["eager_us_per_block_slice"], out["compiled_us_per_block_slice"]
    print(f"HF block, whole sequence: {out['hf_us_per_block']:.0f} us; per block and slice: eager {eager:.1f} us "
          f"({out['eager_ops_per_block_slice']:.0f} ATen ops), compiled {compiled:.1f} us ({compiled / eager:.2f}x; "
          f"goal <= 0.33x), a region per block {out['compiled_per_block_us_per_block_slice']:.1f} us, blocks "
          f"compiled around the attention {out['compiled_blocks_us_per_block_slice']:.1f} us; compute ops per block "
          f"and slice: eager {out['kernels_per_block_slice']['eager']:.1f}, blocks compiled around the attention "
          f"{out['kernels_per_block_slice']['compiled_blocks']:.1f}; "
          f"paired ratio {out['compiled_to_eager']['median']:.2f}; graph breaks {out['graph_breaks']}; "
          f"ATen ops' own time per block and slice: eager {out['aten_us_per_block_slice']['eager']:.0f} us, "
          f"compiled {out['aten_us_per_block_slice']['compiled']:.0f} us; "
          f"{generated_line(out['generated_us_per_block_slice'])}load {out['settings']['load']:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)
    return out


if __name__ == "__main__":
    main()
