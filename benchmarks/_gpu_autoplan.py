"""The GPU check's planner step (``--steps autoplan``): what ``"slices": "auto"`` plans on this device.

The planner's own command (``python -m tp_trainer.planner --profile --layers``, run in this process:
the prefix, one block's halves and the suffix of a one-block probe of the model, profiled over a
(b, l, c) grid, then the stage split and the slices chosen together) for the Llama 7B-width pair
(2 layers, seq 8192, bf16, 2 stages, batch 1; on a CPU a 64-wide pair at 128 tokens in fp32), the
norms as the engine's default on this device, twice: the blocks eager, and the blocks replayed from
captured graphs as ``terapipe.cuda_graphs`` runs them (``profile.StageRunner.captured_run``); then the
eager costs planned again under a memory limit (``modes``: order and checkpointing chosen from the
per-layer memory the profile measured on this device). On a
GPU the eager profile's units include the host time the graphs remove, so its plan takes fewer
slices; the slice step's DP on its own captured samples (``_gpu_plan``, batch 1, 2 stages) is the
figure to compare the captured plan with. Writes autoplan.json and autoplan.md into the output
folder (and each mode's cost model, plan.json and plan.txt under autoplan/<mode>/).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

from _gpu_report import write_step

# label: (hidden, heads, KV heads, intermediate, layers, vocabulary, seq_len, granularity, dtype)
SETS = {"llama-7b-pair": (4096, 32, 8, 11008, 2, 32000, 8192, 64, "bf16"),
        "llama-w64": (64, 4, 2, 160, 2, 256, 128, 8, "fp32")}
LIMIT_GIB = {"llama-7b-pair": "24", "llama-w64": "0.05"}


def modes(folder: str, label: str) -> dict:
    """mode: (the planner's flags after the common ones, the cost model it plans from). "eager, memory
    limit" plans from the eager mode's cost model (its per-layer memory measured on this device:
    memory.transient_peak and bytes_in_use); the others profile and write their own."""
    profiled = {mode: os.path.join(folder, mode, "cost_model.json") for mode in ("eager", "captured")}
    return {"eager": (["--profile", "--save_cost_model", profiled["eager"]], profiled["eager"]),
            "captured": (["--profile", "--cuda_graphs", "--save_cost_model", profiled["captured"]],
                         profiled["captured"]),
            "eager, memory limit": (["--memory_limit_gib", LIMIT_GIB[label], "--cost_model", profiled["eager"]],
                                    profiled["eager"])}


def run(gpu: bool, out_dir: str, budget_s: float, log) -> dict:
    """Profile and plan in each mode (``modes``); returns {"model", "seq_len", "dtype", "stages", "batch",
    "records": [{"blocks", "slices", "count", "predicted_ms", "seconds", "cost_model"}], "errors"}."""
    from transformers import LlamaConfig

    from tp_trainer.planner.cli import main as planner
    label = "llama-7b-pair" if gpu else "llama-w64"
    hidden, heads, kv_heads, inter, layers, vocab, seq_len, granularity, dtype = SETS[label]
    folder = os.path.join(out_dir, "autoplan")
    LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=seq_len, bos_token_id=0,
                eos_token_id=0).save_pretrained(os.path.join(folder, "model"))
    out = {"model": label, "seq_len": seq_len, "dtype": dtype, "stages": 2, "batch": 1, "records": [], "errors": {}}
    for mode, (flags, cost_model) in modes(folder, label).items():
        where = os.path.join(folder, mode)
        args = ["--model", os.path.join(folder, "model"), "--seq_len", str(seq_len), "--batch", "1", "--stages", "2",
                "--granularity", str(granularity), "--layers", "--time_budget", str(budget_s),
                "--device", "cuda" if gpu else "cpu", "--dtype", dtype, "--save_dir", where, *flags]
        start, printed = time.perf_counter(), io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                planner(args)
        except Exception as err:  # noqa: BLE001 -- the other mode still runs
            from _gpu_profile import failure_text
            out["errors"][mode] = failure_text(err)
            log(f"blocks {mode}: FAILED\n{out['errors'][mode]}")
            continue
        with open(os.path.join(where, "plan.json"), encoding="utf-8") as handle:
            plan = json.load(handle)
        slices = [s for row in plan["slices"] for s in row]
        chosen = [line[2:].strip() for line in printed.getvalue().splitlines() if line.startswith("->")]
        out["records"].append({"blocks": mode, "slices": slices, "count": len(slices),
                               "predicted_ms": plan["predicted_time"] * 1e3, "seconds": time.perf_counter() - start,
                               "cost_model": os.path.relpath(cost_model, out_dir),
                               "memory_plan": chosen[0] if chosen else None})
        log(f"blocks {mode}: {len(slices)} slices {slices}, predicted {plan['predicted_time'] * 1e3:.2f} ms "
            f"({out['records'][-1]['seconds']:.0f} s)")
    return out


def markdown(result: dict, device_name: str) -> str:
    """The step's report."""
    lines = [f"## The planner on {device_name}: \"slices\": \"auto\", blocks eager and captured", "",
             f"`python -m tp_trainer.planner --profile --layers`, {result['model']}, seq {result['seq_len']}, "
             f"{result['dtype']}, {result['stages']} stages, batch {result['batch']}; the norms as the engine's "
             "default here. The plan's predicted time is the planner's own (its simulated step).", "",
             "| blocks | slices | plan | predicted ms | profile + plan s |", "|---|---|---|---|---|"]
    for r in result["records"]:
        lines.append(f"| {r['blocks']} | {r['count']} | {r['slices']} | {r['predicted_ms']:.2f} | {r['seconds']:.0f} |")
    for r in result["records"]:
        if r.get("memory_plan"):
            lines += ["", f"Memory-aware choice ({r['blocks']}; step s, peak GiB per stage, from the per-layer "
                          f"memory measured here): `{r['memory_plan']}`"]
    for mode, err in result["errors"].items():
        lines += ["", f"**blocks {mode} failed**:", "", "```", err.strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def write(out_dir: str, result: dict, device_name: str) -> list[str]:
    """autoplan.json and autoplan.md in ``out_dir``; returns their paths."""
    return write_step(out_dir, "autoplan", result, markdown(result, device_name))
