"""The GPU check's slice step: runs ``_gpu_capture`` over its block sets, judges exactness, plans
with the measured costs, simulates deeper pipelines, and writes the report's section.

    exactness   per block set at a short sequence, against HF in float64 (``_gpu_exactness.py``).
    attention   the Llama pair's slice attention alone, one layer, by the mask's spelling to cuDNN
                (``_gpu_attention_time.py``).
    plan        the planner's cost fit over the captured runs' per-slice samples (b = 1) and its DP
                for 2 stages, batch 1 (each stage the measured block set), granularity 64 tokens, per
                weight-gradient mode; "W per sequence" (the engine's) with the merged weight
                gradients taken out of the units and added once a step (``merged_w_apart``); the
                samples themselves kept in "unit_samples" (a plan over another mix, made later).
    simulated   K = 2, 4, 8 stages of that block set (the engine's mode, else in B), batch 1 and 4:
                TeraPipe's DP plan (sum t + (K - 1) max t) against DeepSpeed's 1F1B on whole
                sequences ((B + K - 1) x the whole sequence's time, HF eager and captured).
    engine_step a whole 1-stage training step through the engine (embedding, blocks, head, loss,
                optimizer), the blocks eager and captured (terapipe.cuda_graphs), 1 and 8 slices of the
                Llama pair at seq 8192 (``_gpu_stage.py``, one rank; a tiny Llama on a CPU).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback

import torch

import _gpu_capture as cap
from _gpu_attention_time import attention_alone, attention_alone_lines
from _gpu_exactness import exactness
from _gpu_plan import plans, simulate
from _gpu_profile import failure_text, per_slice_kernel_lines
from _gpu_stage import BLOCKS as ENGINE_BLOCKS   # the engine step's kinds of blocks, in its order

SLICE_COUNTS = (1, 2, 4, 8, 16, 32)
QUICK_COUNTS = (1, 8, 32)


def past(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.monotonic()`` value, gpu_check's --deadline; None: none) has passed."""
    return deadline is not None and time.monotonic() >= deadline


def block_sets(gpu: bool, names: str | None = None) -> dict:
    """The slice step's block sets on a GPU (``cap.SETS``) or a CPU (``cap.CPU_SETS``): those of the
    comma-separated ``names`` (``--sets``), all without; an unknown name stops with one error line."""
    sets = cap.SETS if gpu else cap.CPU_SETS
    if not names:
        return sets
    only = names.split(",")
    if set(only) - set(sets):
        raise SystemExit(f"error: --sets: unknown block set(s) {sorted(set(only) - set(sets))}; "
                         f"choose from {', '.join(sets)}")
    return {label: spec for label, spec in sets.items() if label in only}


def run(device, quick: bool, log, keep=None, compiled: bool = True, deadline: float | None = None,
        sets: dict | None = None) -> dict:
    """The whole slice step; every part's failure is recorded with its traceback, not raised.
    ``compiled``: also the variants with the blocks compiled around their attention. ``deadline``
    (``past``): past it no block set, variant or engine starts; what was not run is listed in "not_run".
    ``sets``: the block sets to run (``block_sets``); None: all of the device's."""
    def past_deadline() -> bool:
        return past(deadline)

    gpu = device.type == "cuda"
    sets = block_sets(gpu) if sets is None else sets
    dtype = torch.bfloat16 if gpu else torch.float32
    counts = QUICK_COUNTS if quick else SLICE_COUNTS
    if not gpu:
        counts = tuple(c for c in counts if c <= 8)
    out = {"dtype": str(dtype)[6:], "slice_cost": [], "attention_kernels": {}, "attention_bytes_per_slice": {},
           "attention_alone": {}, "fold": {}, "exactness": {}, "plan": {}, "unit_samples": {}, "simulated": {},
           "errors": {}, "not_run": []}
    for label, spec in sets.items():
        if past_deadline():
            out["not_run"].append(f"{label}: the whole set")
            continue
        try:
            exact_len = min(spec[-1], 1024)
            out["exactness"][label] = exactness(spec, device, dtype, exact_len, compiled=compiled)
            log(f"{label}: exactness at seq {exact_len}: {'passed' if out['exactness'][label]['passed'] else 'FAILED'}")
            measured = cap.measure_set(label, spec, counts, device, dtype, 5 if gpu else 3, log, compiled,
                                       past_deadline)
            out["slice_cost"] += measured["records"]
            out["not_run"] += measured["not_run"]
            out["fold"][label] = {"ms_per_slice": measured["fold_ms"], "parameters": measured["parameters"]}
            out["attention_kernels"][label] = measured["attention_kernels"]
            out["attention_bytes_per_slice"][label] = measured["attention_bytes_per_slice"]
            if spec[0] == "llama" and not past_deadline():   # its slices take the bottom-right kernel
                out["attention_alone"][label] = attention_alone(spec, device, dtype)
            out.setdefault("profiles", {})[label] = measured["profiles"]   # kept should the planning fail
            whole_captured = next((r["whole_captured_ms"] for r in measured["records"]
                                   if r["mode"] == "captured" and r["weight_grads"] == "in B" and not r["compiled"]
                                   and r["attention"] == "cudnn"), None)
            # the rows the plans are fitted on, so that a plan over another mix of them can be made later
            out["unit_samples"][label] = measured["samples"]
            chosen, engine_mode = plans(measured, spec[1], spec[-1])
            for weights, found in chosen.items():
                out["plan"][f"{label}, {weights}"] = found
                log(f"{label} ({weights}): DP plan for 2 stages, batch 1: {found['count']} slices {found['slices']}")
            if engine_mode is not None:
                weights, cost, once_s = engine_mode
                out["simulated"][label] = simulate(cost, once_s, spec[-1], measured["whole_hf_ms"], whole_captured)
                out.setdefault("simulated_weights", {})[label] = weights
            if measured["failures"]:
                out["errors"][f"{label} (variants)"] = "\n".join(measured["failures"])
        except Exception as err:  # noqa: BLE001 -- a lent GPU's minutes are not lost to one failing set
            out["errors"][label] = failure_text(err, limit=3000)
            log(f"{label}: FAILED\n{out['errors'][label]}")
        cap._free(device)
        if keep is not None:   # what was measured so far, should a later set not finish
            keep(out)
    if past_deadline():
        out["not_run"].append("the whole 1-stage engine step")
        out["engine_step"] = {"records": [], "errors": {}}
    else:
        out["engine_step"] = engine_step(gpu, log, compiled, None if deadline is None else deadline - time.monotonic())
    return out


def engine_step(gpu: bool, log, compiled: bool = True, seconds: float | None = None) -> dict:
    """``_gpu_stage.py`` on one rank: {"model", "seq_len", "dtype", "records", "errors", "not_run"}. A
    rank stops at the first engine that fails (recorded in "errors", not raised); the engines after it
    run in a fresh rank. ``seconds``: no engine starts after that many, and each rank is stopped 2
    minutes later."""
    from multirank import run_ranks

    import _gpu_stage
    path = os.path.join(tempfile.mkdtemp(prefix="gpu_check_stage_"), "stage.json")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gpu_stage.py")
    total = len(_gpu_stage.variants("llama-7b-pair" if gpu else "llama-w64", compiled))
    stop_at = None if seconds is None else time.monotonic() + seconds
    finished = {"records": [], "errors": {}, "not_run": []}
    while (done := _engines_done(finished)) < total:
        left = None if stop_at is None else max(0.0, stop_at - time.monotonic())
        args = ([path] + ([] if gpu else ["--tiny"]) + ([] if compiled else ["--no_compiled"])
                + ([] if left is None else ["--seconds", f"{left:.0f}"]) + (["--start", str(done)] if done else []))
        try:
            for line in run_ranks(worker, 1, args, timeout=1200 if left is None else left + 120)[0].splitlines():
                if line.startswith("[gpu_check] engine step"):
                    log(line.removeprefix("[gpu_check] "))
        except Exception:  # noqa: BLE001 -- the rest of the report is still written
            failure = traceback.format_exc()[-3000:]
            log(f"engine step: FAILED\n{failure[-1500:]}")
            finished = _read_stage(path, finished)
            return {**finished, "errors": {**finished.get("errors", {}), "engine step": failure}}
        finished = _read_stage(path, finished)
        if _engines_done(finished) == done:
            break   # the rank added nothing: do not start it again
    return finished


def _engines_done(stage: dict) -> int:
    """The engines ``_gpu_stage.py`` has finished with: timed, failed or not run."""
    return sum(len(stage.get(key, ())) for key in ("records", "errors", "not_run"))


def _read_stage(path: str, default: dict) -> dict:
    """What ``_gpu_stage.py`` wrote to ``path`` (the engines it finished), else ``default``."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return default


def _cell(value, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def fold_lines(result: dict) -> list[str]:
    """The per-slice cost with DeepSpeed's per-backward fold (its two passes timed alone, S of them a
    step) and without it (what tp_trainer runs): weight gradients in B, captured where the step
    captured (a GPU), else eager, the first kernel recorded."""
    lines = []
    for label, fold in result.get("fold", {}).items():
        recs = [r for r in result["slice_cost"]
                if r["model"] == label and r["weight_grads"] == "in B" and not r.get("compiled")]
        mode = "captured" if any(r["mode"] == "captured" for r in recs) else "eager"
        recs = sorted((r for r in recs if r["mode"] == mode), key=lambda r: r["slices"])
        recs = [r for r in recs if r["attention"] == recs[0]["attention"]] if recs else []
        lines += [f"DeepSpeed's per-backward clear + fold, {label} ({fold['parameters'] / 1e6:.1f} M parameters): "
                  f"{fold['ms_per_slice']:.3f} ms a slice. {mode.capitalize()}, weight gradients in B"
                  + (f", {recs[0]['attention']}" if recs else "") + ": ms a step without it (tp_trainer) / "
                  "with it (+ S passes):", ""]
        lines += [f"- S = {r['slices']}: {r['ms']:.2f} / {r['ms'] + r['slices'] * fold['ms_per_slice']:.2f} "
                  f"(+{100 * r['slices'] * fold['ms_per_slice'] / r['ms']:.0f}%)" for r in recs]
        lines.append("")
    return lines


def engine_step_lines(step: dict) -> list[str]:
    """The whole 1-stage engine step per slice count, blocks eager / captured / captured and compiled,
    and / the same on 1 slice."""
    recs = step.get("records", [])
    if not recs and not step.get("errors"):
        return []
    lines = [f"Whole 1-stage engine step (embedding, blocks, head, loss, optimizer; `_gpu_stage.py`), "
             f"{step.get('model')}, seq {step.get('seq_len')}, {step.get('dtype')}: ms a step (wall, median), "
             "then / the same blocks mode on 1 slice, then the engine's peak memory (MiB, as the slice step's).", "",
             "| slices | " + " | ".join(f"blocks {mode}" for mode in ENGINE_BLOCKS) + " |",
             "|---|" + "---|" * len(ENGINE_BLOCKS)]
    whole = {r["blocks"]: r["ms"] for r in recs if r["slices"] == 1}
    for s in sorted({r["slices"] for r in recs}):
        cells = []
        for mode in ENGINE_BLOCKS:
            r = next((r for r in recs if r["slices"] == s and r["blocks"] == mode), None)
            cells.append("-" if r is None else f"{r['ms']:.2f} / {_cell(whole.get(mode) and r['ms'] / whole[mode])}"
                         f" / {_cell(r.get('peak_mib'), '{:.0f}')}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- weight gradients, blocks {mode}: {next(r['weight_grads'] for r in recs if r['blocks'] == mode)}"
                     for mode in ENGINE_BLOCKS if any(r["blocks"] == mode for r in recs)]
    for name, err in step.get("errors", {}).items():
        lines += ["", f"**engine step, {name} failed**:", "", "```", err.strip()[-3000:], "```"]
    return lines + [""]


def _variant_name(record: dict) -> str:
    return f"{record['weight_grads']}, {record['attention']}" + cap.flags_label(
        record.get("compiled", False), record.get("fused_norm", False))


def peak_lines(by: dict, variants: list) -> list[str]:
    """The table of each variant's peak memory (``variant_peak``) by slice count; none without figures."""
    if not any(r.get("peak_mib") is not None for r in by.values()):
        return []
    counts = sorted({s for _, _, s in by})
    lines = ["Peak memory of each variant above the block set's weights and inputs, MiB (CUDA: reserved by the "
             "caching allocator, the captures' graph pools included; CPU: resident set):", "",
             "| slices | " + " | ".join(f"{m} ({w})" for m, w in variants) + " |", "|---|" + "---|" * len(variants)]
    for s in counts:
        lines.append(f"| {s} | " + " | ".join(_cell((by.get((m, w, s)) or {}).get("peak_mib"), "{:.0f}")
                                              for m, w in variants) + " |")
    return lines + [""]


def markdown(result: dict, device_name: str) -> str:
    """The report's section for the slice step."""
    lines = [f"## Slices on {device_name}: eager against captured ({result['dtype']})", "",
             "Forward + backward of the block set on one sequence cut into S uniform slices (batch 1), device "
             "time per step (median). whole HF: HF's blocks on the whole sequence, eager (what DeepSpeed's "
             "pipeline runs); whole captured: the same sequence as one slice through the same capture.", ""]
    for label in dict.fromkeys(r["model"] for r in result["slice_cost"]):
        recs = [r for r in result["slice_cost"] if r["model"] == label]
        by = {(r["mode"], _variant_name(r), r["slices"]): r for r in recs}
        variants = list(dict.fromkeys((r["mode"], _variant_name(r)) for r in recs))
        lines += [f"**{label}**, seq {recs[0]['seq_len']}: whole HF {recs[0]['whole_hf_ms']:.2f} ms. Each cell: ms, "
                  "then / the same variant on the whole sequence (1 slice), then / whole HF.", "",
                  "| slices | " + " | ".join(f"{m} ({w})" for m, w in variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for s in sorted({r["slices"] for r in recs}):
            cells = []
            for m, w in variants:
                r = by.get((m, w, s))
                cells.append("-" if r is None else f"{r['ms']:.2f} / {_cell(r['whole_captured_ms'] and r['ms'] / r['whole_captured_ms'])} / {r['ms'] / r['whole_hf_ms']:.2f}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines += [""] + peak_lines(by, variants)
    lines += fold_lines(result) + engine_step_lines(result.get("engine_step") or {}) + attention_alone_lines(result)
    for label, kernels in result["attention_kernels"].items():
        lines.append(f"Attention kernels, {label}: {kernels}")
    for label, mem in result["attention_bytes_per_slice"].items():
        if not mem:
            continue
        lines += ["", f"Attention memory of one layer, {label}, slice of {mem['slice_tokens']} tokens (MiB kept "
                  "for backward / transient peak):", "",
                  "| context | slice path (default kernel) | slice path (flash) | SDPA with the slice's mask |",
                  "|---|---|---|---|"]
        for c, *cells in zip(mem["contexts"], mem["slice_path"], mem["slice_path_flash"], mem["mask_path"]):
            lines.append(f"| {c} | " + " | ".join(f"{a['kept'] / 2**20:.1f} / {a['peak'] / 2**20:.1f}"
                                                  for a in cells) + " |")
    for label, ex in result["exactness"].items():
        lines += ["", f"Exactness, {label}, seq {ex['seq_len']}, against HF in float64 (relative error; passes at "
                  f"most 2x HF's own): **{'passed' if ex['passed'] else 'FAILED'}**", "",
                  "| dtype | variant | output | input grad | weight grads | passed |", "|---|---|---|---|---|---|"]
        for r in ex["rows"]:
            lines.append(f"| {r['dtype']} | {r['variant']} | {r['output']:.2e} | {r['input_grad']:.2e} | "
                         f"{r['weight_grads']:.2e} | {r['passed']} |")
    for label, prof in result.get("profiles", {}).items():
        lines += per_slice_kernel_lines(label, prof)
        for name, found in prof.items():
            if found and "error" in found:
                lines += ["", f"Kernels, {label}, {name}: failed", "", "```", found["error"].strip(), "```"]
            elif found:
                lines += ["", f"Kernels, {label}, {name}: {found['calls']} launches, {found['device_ms']:.2f} ms of "
                          "device time; the longest (device ms, calls):", ""]
                lines += [f"- {ms:.2f} ms x{n}: `{k[:110]}`" for k, ms, n in found["top"][:8]]
    for label, p in result["plan"].items():
        once = (f"; weight gradients once per sequence {p['once_ms']:.2f} ms, in the prediction: the engine's "
                "mode" if p.get("once_ms") else "")
        lines += ["", f"DP on the captured costs, {label}: {p['count']} slices {p['slices']} for {p['stages']} stages, "
                  f"batch 1, predicted {p['predicted_ms']:.2f} ms ({p['points']} samples, held-out error mean "
                  f"{p['fit_heldout'].get('mean', float('nan')):.1%}{once})."]
    for label, rows in result["simulated"].items():
        weights = result.get("simulated_weights", {}).get(label, "in B")
        lines += ["", f"Simulated (from the measured costs, not run), {label}: each stage this block set, its units "
                      f"captured, weight gradients: {weights}.", "",
                  "| stages | batch | TeraPipe ms (slices) | 1F1B whole HF ms | 1F1B whole captured ms | speed-up vs 1F1B HF |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['stages']} | {r['batch']} | {r['terapipe_ms']:.2f} ({r['terapipe_slices']}) | "
                         f"{r['1f1b_hf_ms']:.2f} | {_cell(r['1f1b_captured_ms'])} | {r['speedup_vs_1f1b_hf']:.2f} |")
    for label, err in result["errors"].items():
        lines += ["", f"**{label} failed**:", "", "```", err.strip(), "```"]
    not_run = result.get("not_run", []) + result.get("engine_step", {}).get("not_run", [])
    if not_run:
        lines += ["", "Not run (past --deadline):", ""] + [f"- {what}" for what in not_run]
    return "\n".join(lines) + "\n"
