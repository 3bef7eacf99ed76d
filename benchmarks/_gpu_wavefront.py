"""The GPU check's wavefront probe (``--steps wavefront``): would a block set's slices gain from running
side by side?

Slice j + 1's block i waits only for its own block i - 1 and for slice j's K/V of block i, so the
block-slices (j, i) with the same j + i can run at once: a wavefront over the set's blocks. On one
stream a slice's kernels run one after another, and a 256-token slice of GPT-2 medium launches ~54 per
block, most of them latency-bound (benchmarks/RESULTS.md: 1.6 us per bf16 add, 8 us per matrix product
on 64 x 32 tiles). This probe measures what side by side would buy before anything is built on it.

Forward only, no gradients (the backward's wavefront runs the other way, with the same kernels'
sizes): one sequence of each block set (``_gpu_capture.SETS``) in S uniform slices, S in ``COUNTS``,
every slice through every block, captured as one CUDA graph twice and replayed:
  in order   slice by slice on one stream (what the captured units run);
  wavefront  slice j's blocks on stream j mod B (B = min(blocks, S)), block i of slice j after an event
             recorded by block i of slice j - 1 (``forward_all``).
Device time of a replay, median of ``REPEATS``; the two orders' outputs must agree (``max_diff``). On a
CPU both orders run eagerly, without streams, and the outputs must be equal: the dependency the
wavefront relies on, checked by the tests. Writes wavefront.json and wavefront.md.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from _gpu_capture import CPU_SETS, SETS, _free, build_model, wrap
from _gpu_cost import uniform_offsets
from _gpu_profile import failure_text
from _gpu_report import write_step

COUNTS = (1, 8, 32)
REPEATS = 10


def in_order(slices: int, blocks: int) -> list[tuple[int, int]]:
    """(slice, block) units slice by slice: what one stream runs now."""
    return [(j, i) for j in range(slices) for i in range(blocks)]


def wavefront(slices: int, blocks: int) -> list[tuple[int, int]]:
    """(slice, block) units by wave j + i, earlier slices first within a wave."""
    return sorted(in_order(slices, blocks), key=lambda unit: (unit[0] + unit[1], unit[0]))


def order_error(order, slices: int, blocks: int) -> str | None:
    """Why ``order`` cannot run every slice through every block (None: it can): a unit missing or
    repeated, or one before (j, i - 1) or (j - 1, i), which it waits for."""
    if sorted(order) != in_order(slices, blocks):
        return f"not every (slice, block) unit of {slices} x {blocks} exactly once"
    seen = set()
    for j, i in order:
        for needed in ((j, i - 1), (j - 1, i)):
            if min(needed) >= 0 and needed not in seen:
                return f"unit {(j, i)} runs before {needed}, which it waits for"
        seen.add((j, i))
    return None


def forward_all(layers, ctx, kv, offsets, inputs, order, streams=None) -> list[torch.Tensor]:
    """Every slice's input through every block in ``order``; the outputs, one per slice. With
    ``streams`` (CUDA): slice j on ``streams[j % len(streams)]``, block i of slice j waiting for the
    event block i of slice j - 1 recorded (its K/V written). Each slice's context state (``ctx.begin``
    at its first block) is put back before each of its blocks."""
    hidden, states, done = list(inputs), {}, {}
    for j, i in order:
        stream = None if streams is None else streams[j % len(streams)]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and j > 0:
                stream.wait_event(done[(j - 1, i)])
            if j in states:
                ctx.restore(states[j])
            else:
                ctx.begin(kv, *offsets[j])
                states[j] = ctx.state()
            hidden[j] = layers[i](hidden[j])
            if stream is not None:
                done[(j, i)] = torch.cuda.Event()
                done[(j, i)].record(stream)
    return hidden


def _forked(run, streams):
    """``run()`` with ``streams`` forked from the current stream and joined back into it."""
    main = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(main)
    out = run()
    for stream in streams:
        main.wait_stream(stream)
    return out


def _replay_ms(run, repeats: int) -> tuple[float, list[torch.Tensor]]:
    """(median device ms of a replay of ``run()`` captured as one CUDA graph, its outputs)."""
    for _ in range(2):   # warm-up: cuBLAS workspaces per stream, lazily built plans
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times), outs


def probe_set(spec, device, dtype, counts=COUNTS, repeats: int = REPEATS) -> list[dict]:
    """One record per slice count: {"slices", "streams", "in_order_ms", "wavefront_ms", "max_diff"};
    on a CPU the times are None (the orders run eagerly) and max_diff must be 0."""
    from tp_trainer.model.slices.slice_cache import SequenceKV
    seq_len, blocks = spec[-1], spec[-2]
    layers, ctx, _ = wrap(build_model(*spec, device, dtype))
    x = torch.randn(1, seq_len, spec[1], device=device, dtype=dtype)
    records = []
    for slices in counts:
        offsets = uniform_offsets(seq_len, slices)
        inputs = [x[:, a:a + l] for a, l in offsets]
        streams = [torch.cuda.Stream() for _ in range(min(blocks, slices))] if device.type == "cuda" else None
        outs, ms = {}, {}
        for name, order, on in (("in_order", in_order(slices, blocks), None),
                                ("wavefront", wavefront(slices, blocks), streams)):
            kv = SequenceKV(seq_len)

            def run(order=order, on=on, kv=kv):
                return forward_all(layers, ctx, kv, offsets, inputs, order, on)
            with torch.no_grad():
                if device.type != "cuda":
                    ms[name], outs[name] = None, run()
                else:
                    ms[name], outs[name] = _replay_ms((lambda: _forked(run, on)) if on else run, repeats)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["in_order"], outs["wavefront"]))
        records.append({"slices": slices, "streams": len(streams) if streams else 0, "in_order_ms": ms["in_order"],
                        "wavefront_ms": ms["wavefront"], "max_diff": diff})
    return records


def run(device, log, sets=None) -> dict:
    """{"dtype", "sets": {label: records}, "errors": {label: text}}; a set's failure is kept, not raised."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    sets = (SETS if gpu else CPU_SETS) if sets is None else sets
    out = {"dtype": str(dtype)[6:], "sets": {}, "errors": {}}
    for label, spec in sets.items():
        try:
            out["sets"][label] = probe_set(spec, device, dtype, COUNTS if gpu else (1, 4), REPEATS if gpu else 1)
            for r in out["sets"][label]:
                log(f"{label}, {r['slices']} slices: in order {r['in_order_ms']} ms, wavefront {r['wavefront_ms']} ms "
                    f"on {r['streams']} streams, max diff {r['max_diff']:.3g}")
        except Exception as err:  # noqa: BLE001 -- a lent GPU's minutes are not lost to one failing set
            out["errors"][label] = failure_text(err, limit=3000)
            log(f"{label}: FAILED\n{out['errors'][label]}")
        _free(device)
    return out


def markdown(result: dict, device_name: str) -> str:
    lines = [f"# Wavefront probe on {device_name}", "",
             f"Forward only, no gradients, {result['dtype']}: every slice through every block as one CUDA graph, in "
             "order on one stream against a wavefront over the blocks on several streams (`benchmarks/"
             "_gpu_wavefront.py`). Device ms a replay (median); per further slice: (ms at S - ms at 1) / (S - 1).", ""]
    if result["dtype"] == "float32":
        lines += ["On a CPU: both orders run eagerly, untimed; the outputs must agree exactly.", ""]
    for label, records in result["sets"].items():
        lines += [f"**{label}**", "", "| slices | streams | in order ms | wavefront ms | wavefront / in order | "
                  "max diff |", "|---|---|---|---|---|---|"]
        for r in records:
            ratio = (f"{r['wavefront_ms'] / r['in_order_ms']:.2f}" if r["in_order_ms"] and r["wavefront_ms"] else "-")
            times = [f"{ms:.2f}" if ms is not None else "-" for ms in (r["in_order_ms"], r["wavefront_ms"])]
            lines.append(f"| {r['slices']} | {r['streams']} | {times[0]} | {times[1]} | {ratio} | {r['max_diff']:.3g} |")
        first = records[0]
        for r in records[1:]:
            if first["in_order_ms"] and r["in_order_ms"] and r["wavefront_ms"]:
                lines.append(f"\nPer further slice at {r['slices']}: in order "
                             f"{(r['in_order_ms'] - first['in_order_ms']) / (r['slices'] - 1):.3f} ms, wavefront "
                             f"{(r['wavefront_ms'] - first['wavefront_ms']) / (r['slices'] - 1):.3f} ms.")
        lines.append("")
    lines += [f"{label}: FAILED\n\n```\n{text}\n```\n" for label, text in result["errors"].items()]
    return "\n".join(lines) + "\n"


def write(out_dir: str, result: dict, device_name: str) -> list[str]:
    """wavefront.json and wavefront.md in ``out_dir``; returns their paths."""
    return write_step(out_dir, "wavefront", result, markdown(result, device_name))
