"""gpu_check.py's outputs: the paper-scale table with the measured preset, the markdown, the JSON
and the cost-curve PNG. Every figure carries the name of the device it was measured on."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

PAPER_KEY = ("GPT3-175B", 2048, 2, 8, 48)


def paper_table(measured, granularity: int = 16, only_175b: bool = False) -> dict:
    """paper_sim's settings under the V100 preset and under ``measured``: {"rows", "text", "175b"}.

    About 3 s per preset here (the DP over 2048 tokens at 16-token granularity per setting);
    ``only_175b``: the two GPT3-175B settings."""
    import paper_sim as ps
    rows = []
    for setting in (s for s in ps.SETTINGS if not only_175b or s[0] == "GPT3-175B"):
        v100 = ps.run_setting(*setting, granularity=granularity, device=ps.V100_P3_16XLARGE)
        mine = ps.run_setting(*setting, granularity=granularity, device=measured)
        rows.append({"setting": list(setting), "v100": _brief(v100), "measured": _brief(mine),
                     "paper_speedup": v100["paper_speedup"]})
    key = next(r for r in rows if tuple(r["setting"][:5]) == PAPER_KEY)
    lines = [f"Paper-scale simulation (benchmarks/paper_sim.py settings, DP granularity {granularity} tokens): "
             f"V100 preset vs **{measured.name}** (compute terms fitted in step 5; NVLink, network, nodes and "
             f"optimizer bytes kept at the p3.16xlarge preset's, since one machine cannot measure a cluster).", "",
             "| model | seq | B | mp | K | V100 unsliced s | V100 sliced s | V100 speedup | measured unsliced s | "
             "measured sliced s | measured speedup | paper |", "|---" * 12 + "|"]
    for r in rows:
        model, seq, batch, mp, stages, _ = r["setting"]
        v, m = r["v100"], r["measured"]
        paper = f"{r['paper_speedup']:.1f}x" if r["paper_speedup"] else ""
        lines.append(f"| {model} | {seq} | {batch} | {mp} | {stages} | {v['unsliced_s']:.3f} | {v['sliced_s']:.3f} | "
                     f"{v['speedup']:.2f}x | {m['unsliced_s']:.3g} | {m['sliced_s']:.3g} | **{m['speedup']:.2f}x** | "
                     f"{paper} |")
    v, m = key["v100"], key["measured"]
    verdict = (f"GPT3-175B (B 2, mp 8, K 48): {m['speedup']:.2f}x with the measured preset ({m['sliced_plan']}), "
               f"against {v['speedup']:.2f}x with the V100 preset ({v['sliced_plan']}) and the paper's 5.0x.")
    lines += ["", verdict]
    return {"rows": rows, "text": "\n".join(lines), "175b": {"measured": m, "v100": v, "text": verdict}}


def _brief(row: dict) -> dict:
    return {k: row[k] for k in ("unsliced_s", "sliced_s", "speedup", "unsliced_plan", "sliced_plan")}


def steps_table(steps: list[dict]) -> str:
    lines = ["| step | status | detail |", "|---|---|---|"]
    for step in steps:
        detail = step.get("why") or _detail(step)
        lines.append(f"| {step['name']} | **{step['status']}** | {detail} |")
    return "\n".join(lines)


def _detail(step: dict) -> str:
    if "cases" in step:
        bad = [c for c in step["cases"] if not c["passed"]]
        return (f"{len(step['cases']) - len(bad)}/{len(step['cases'])} cases pass ({step['criteria']})"
                + "".join(f"; {c['case']}: {c['error'][:150]}" for c in bad[:3]))
    if "checks" in step:
        over = step["overflow"]
        scale = "" if over["scale_before"] is None else f", scale {over['scale_before']:g} -> {over['scale_after']:g}"
        return (f"on {step['device']}: final loss {step['final_loss']:.4f} vs fp32 {step['fp32_final_loss']:.4f} "
                f"({100 * step['relative_difference']:.2f}%); forced overflow: applied {over['step_applied']}{scale}; "
                + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in step["checks"].items()))
    return step.get("result", "")


def slicing_table(calib: dict) -> str:
    """Per block set: sliced-sequence seconds and overhead against the plain HF blocks, by N."""
    lines = []
    for s in calib["sets"]:
        sl = s["slicing"]
        counts = list(sl["sliced_s"])
        lines += [f"{s['label']}: {s['blocks']} GPT-2 blocks of width {s['hidden']} ({s['heads']} heads), "
                  f"{s['dtype'][6:]}, seq {calib['seq_len']}, batch 1, forward + backward; whole sequence through the "
                  f"plain HF blocks: {sl['whole_hf_s'] * 1e3:.1f} ms.", "",
                  "| variant | " + " | ".join(f"{n} slices" for n in counts) + " |", "|---" * (len(counts) + 1) + "|",
                  "| eager, ms | " + " | ".join(f"{sl['sliced_s'][n] * 1e3:.1f}" for n in counts) + " |",
                  "| eager, vs whole | " + " | ".join(f"{100 * sl['overhead'][n]:+.0f}%" for n in counts) + " |"]
        for c in s["compiled"]:
            if c["status"] == "ran":
                lines.append(f"| compiled ({c['mode']}), ms | " + " | ".join(
                    f"{c['sliced_s'][n] * 1e3:.1f}" for n in counts) + " |")
            else:
                lines.append(f"| compiled ({c['mode']}) | failed: {c['error'][:200]} |")
        if s["compile_skipped"]:
            lines.append(f"\nCompiled blocks: skipped ({s['compile_skipped']}).")
        lines += ["", f"Grid: {len(s['samples'])} points (b, l, c), the planner's own profile; its 9-term fit's "
                  f"held-out error mean {100 * s['planner_heldout'].get('mean', float('nan')):.1f}%, max "
                  f"{100 * s['planner_heldout'].get('max', float('nan')):.1f}%. Backward / forward time "
                  f"{s['backward_over_forward']:.2f} (the analytic model assumes 2.0).", ""]
    return "\n".join(lines)


def step5_text(calib: dict) -> str:
    import _gpu_fit as gf
    best = "; ".join(f"width {h}: {r['flops'] / 1e12:.3g} TFLOP/s at {r['tokens']} tokens"
                     for h, r in calib.get("best_gemm_rates", {}).items())
    best = f" Highest dense GEMM rate reached in the sweep: {best}." if best else ""
    if calib["spec"] is None:
        return f"**Not resolved**: {calib['fit_failed']}.{best} Peak: {calib['peak_source']}."
    return gf.describe(calib["spec"], calib["fit"]) + f"{best} Peak: {calib['peak_source']}."


def markdown(env: dict, steps: list[dict], calib: dict, paper: dict, multi: list[dict], seconds: float,
             slices: dict | None = None) -> str:
    import _gpu_slices
    device = env["device_name"]
    slice_text = _gpu_slices.markdown(slices, device) if slices else "## Slices: skipped (not in --steps)\n"
    if "skipped" in calib:
        return "\n".join([
            f"# GPU check on {device}", "", versions(env), "",
            "## Steps 1-3 and 2+ GPUs (GPU only)", "", steps_table(steps + multi), "", slice_text,
            f"## Steps 4-5: skipped ({calib['skipped']})", "", f"Whole check: {seconds:.1f} s.", ""])
    return "\n".join([
        f"# GPU check on {device}", "", versions(env), "",
        "## Steps 1-3 and 2+ GPUs (GPU only)", "", steps_table(steps + multi), "", slice_text,
        f"## Step 4: per-slice cost on {calib['device']} ({device})", "", slicing_table(calib),
        f"## Step 5: analytic device model fitted on {device}", "", step5_text(calib), "", paper["text"], "",
        f"Whole check: {seconds:.1f} s. Cost curves: cost_curve.png.", ""])


def versions(env: dict) -> str:
    return (f"Accelerator `{env['accelerator']}`, GPUs {env['gpus']}, driver {env['driver']}, torch {env['torch']} "
            f"(CUDA {env['torch_cuda']}, NCCL {env['nccl']}), DeepSpeed {env['deepspeed']}, transformers "
            f"{env['transformers']}, Python {env['python']}; CPU {env['cpu']} x {env['cpu_count']}.")


def plot(path: str, calib: dict, device_name: str) -> None:
    """Left: per-block forward + backward time against slice length at a few contexts, measured
    (points) and the fitted analytic model (lines). Right: one sequence's time by slice count,
    relative to the plain HF blocks on the whole sequence."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import _gpu_fit as gf
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    seq = calib["seq_len"]
    for g, s in zip(calib["groups"], calib["sets"]):
        samples, times = np.asarray(g["samples"]), np.asarray(g["times"])
        for context, marker in ((0, "o"), (seq // 2, "s")):
            pick = samples[:, 2] == context
            if pick.any() and calib["spec"] is None:
                left.scatter(samples[pick, 1], 1e3 * times[pick], marker=marker,
                             label=f"{s['label']}, context {context}")
            elif pick.any():
                lengths = np.unique(samples[pick, 1])
                line = left.plot(lengths, 1e3 * gf.predict(calib["spec"], np.stack(
                    [np.ones_like(lengths), lengths, np.full_like(lengths, context)], 1), g["hidden"], g["heads"]))[0]
                left.scatter(samples[pick, 1], 1e3 * times[pick], marker=marker, color=line.get_color(),
                             label=f"{s['label']}, context {context}")
        right.plot(list(s["slicing"]["sliced_s"]), [t / s["slicing"]["whole_hf_s"] for t in s["slicing"]["sliced_s"].values()],
                   marker="o", label=f"{s['label']} eager")
        for c in s["compiled"]:
            if c["status"] == "ran":
                right.plot(list(c["sliced_s"]), [t / s["slicing"]["whole_hf_s"] for t in c["sliced_s"].values()],
                           marker="^", label=f"{s['label']} compiled ({c['mode']})")
    left.set(xscale="log", yscale="log", xlabel="slice length l (tokens)", ylabel="ms per block, forward + backward",
             title=f"t(l, c) on {device_name}: measured (points), " + ("fitted analytic model (lines)" if calib["spec"]
                                                                      else "no model (step 5 not resolved)"))
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="uniform slices per sequence", ylabel="time / whole sequence (plain HF)",
              title=f"slicing overhead, seq {seq}, on {device_name}")
    for ax in (left, right):
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
        ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: str, env, steps, calib, paper, multi, seconds: float, slices: dict | None = None) -> dict:
    """gpu_check.md, gpu_check.json and (with steps 4-5) cost_curve.png in ``out_dir``; returns the
    JSON's content (the slice step's keys at its top level: ``slice_cost``, ``attention_kernels``, ...)."""
    text = markdown(env, steps, calib, paper, multi, seconds, slices)
    files = [os.path.join(out_dir, name) for name in ("gpu_check.md", "gpu_check.json", "cost_curve.png")]
    if "skipped" in calib:
        files = files[:2]
    else:
        plot(files[2], calib, env["device_name"])
    report = {**(slices or {}), "environment": env, "steps": steps, "multi_gpu": multi, "seconds": seconds,
              "files": files,
              "calibration": {**{k: v for k, v in calib.items() if k != "spec"},
                              "spec": None if calib["spec"] is None else dataclasses.asdict(calib["spec"])},
              "paper_table": {k: v for k, v in paper.items() if k != "text"},
              "skipped": [s["name"] + ": " + s["why"] for s in steps + multi if s["status"] == "skipped"]}
    with open(files[0], "w", encoding="utf-8") as handle:
        handle.write(text)
    with open(files[1], "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, default=str)
    print("\n" + text)
    return report


def write_step(out_dir: str, stem: str, result: dict, text: str) -> list[str]:
    """A step's own report in ``out_dir``: STEM.json (``result``) and STEM.md (``text``); their paths."""
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md")]
    with open(paths[0], "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    with open(paths[1], "w", encoding="utf-8") as handle:
        handle.write(text)
    return paths
