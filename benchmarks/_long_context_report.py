"""long_context.py's table, goals and figure, from the ranks' records (``_long_context_worker``).

A variant's result: {"variant", "family", "rows": [{"length", "stages": [per-stage record, ...]}],
"stop": why it stopped}. Memory of a length = its largest stage's peak RSS; the longest sequence
under the cap = the longest length measured when the next one was predicted over the cap (or the
planner found no plan under it); after any other stop it is a lower bound, written ">=".
"""

from __future__ import annotations

import statistics

GIB, MIB = 2 ** 30, 2 ** 20
NAMES = {"a": "(a) DeepSpeed stock", "a_ckpt": "(a') DeepSpeed stock + activation ckpt (non-reentrant)",
         "c": "(c) TeraPipe, DP plan", "e": "(e) TeraPipe, memory-aware plan"}
SHORT = {"a": "(a)", "a_ckpt": "(a')", "c": "(c)", "e": "(e)"}
# stops that mean "the next length does not fit under the cap": the predicted peak, the planner's
# NoPlanFits ("... no plan fits ..."), the watchdog's RSS over the cap; any other stop (time limit,
# machine memory, end of the sweep, a failure) leaves the longest length a lower bound
NO_PLAN = "no plan fits"


def cap_stop(stop: str | None) -> bool:
    """True when the next length did not fit under the cap: predicted over it, no plan fits, or the
    watchdog saw the RSS pass it (the run at that length does not count)."""
    return bool(stop) and (stop.startswith("predicted peak") or NO_PLAN in stop or "passed the cap" in stop)


def merge(rank_results: list[dict]) -> dict:
    """One variant's rows from its ranks' result files (a length counts once every rank has it)."""
    by_length: dict[int, list] = {}
    for result in rank_results:
        for record in result["records"]:
            by_length.setdefault(record["length"], []).append(record)
    ranks = len(rank_results)
    rows = [{"length": length, "stages": sorted(records, key=lambda r: r["stage"])}
            for length, records in sorted(by_length.items()) if len(records) == ranks]
    # the cause first: the planner's "no plan fits", then a watchdog's stop, before a peer's failure
    stops = sorted((r["stop"] for r in rank_results if r.get("stop")),
                   key=lambda s: (NO_PLAN not in s, "watchdog" not in s))
    return {"variant": rank_results[0]["variant"], "family": rank_results[0]["family"], "rows": rows,
            "stop": stops[0] if stops else "not finished"}


def peak(row) -> float:
    return max(s["peak_bytes"] for s in row["stages"])


def step_s(row) -> float:
    """The step time of a length: the slowest stage's median timed step (every stage waits for it)."""
    return max(statistics.median(s["step_s"]) for s in row["stages"])


def tokens_per_s(row, batch: int) -> float:
    return batch * row["length"] / step_s(row)


def longest(result: dict) -> tuple[int | None, bool]:
    """(longest length measured, True when it is only a lower bound: the sweep ended first)."""
    if not result["rows"]:
        return None, False
    return result["rows"][-1]["length"], not cap_stop(result["stop"])


def row_at(result: dict, length: int):
    return next((r for r in result["rows"] if r["length"] == length), None)


def goals(results: dict, batch: int, paired: dict | None = None) -> list[tuple[str, bool | None, str]]:
    """The goals for one model: (goal, met (None: not measurable here), figures). ``paired``:
    (a) and (c) taking turns at their longest common length (``_long_context_paired.py``), which
    then decides the (c)/(a) goal."""
    out = []
    longest_of = {v: longest(r) for v, r in results.items()}
    (e, e_lower), a2 = longest_of.get("e", (None, False)), longest_of.get("a_ckpt", (None, False))[0]
    for other, factor in (("a", 4), ("a_ckpt", 2)):
        base, base_lower = longest_of.get(other, (None, False))
        text = (f"longest under the cap: (e) {'>= ' if e_lower else ''}{e} vs {SHORT[other]} "
                f"{'>= ' if base_lower else ''}{base} tokens")
        met = None  # a lower bound (time limit, end of the sweep) decides only one way
        if e is not None and base is not None:
            if e >= factor * base and not base_lower:
                met = True
            elif e < factor * base and not e_lower:
                met = False
        out.append((f"(e) longest >= {factor}x {SHORT[other]}'s", met, text))
    both = sorted({r["length"] for r in results.get("a", {}).get("rows", [])}
                  & {r["length"] for r in results.get("c", {}).get("rows", [])})
    if both:
        at = both[-1]
        ta, tc = tokens_per_s(row_at(results["a"], at), batch), tokens_per_s(row_at(results["c"], at), batch)
        sweep = f"at {at} tokens: (c) {tc:.0f} vs (a) {ta:.0f} tokens/s = {tc / ta:.2f}x"
        if paired and paired.get("ratios"):
            ratios = paired["ratios"]
            out.append(("(c) tokens/s >= 1.7x (a)'s at their longest common length", paired["ratio"] >= 1.7,
                         f"taking turns at {paired['length']} tokens, {len(ratios)} steps each: (a)/(c) step "
                         f"{paired['ratio']:.2f}x (median; {min(ratios):.2f}-{max(ratios):.2f}); the sweeps, "
                         f"minutes apart: {sweep}"))
        else:
            out.append(("(c) tokens/s >= 1.7x (a)'s at their longest common length", tc >= 1.7 * ta,
                        sweep + (f" (the paired run failed: {paired['error']})" if paired else "")))
    else:
        out.append(("(c) tokens/s >= 1.7x (a)'s at their longest common length", None, "no common length"))
    if a2 is not None and "e" in results and row_at(results["e"], a2):
        te, t2 = (tokens_per_s(row_at(results[v], a2), batch) for v in ("e", "a_ckpt"))
        out.append(("(e) tokens/s >= (a')'s at (a')'s longest", te >= t2,
                    f"at {a2} tokens: (e) {te:.0f} vs (a') {t2:.0f} tokens/s = {te / t2:.2f}x"))
    else:
        out.append(("(e) tokens/s >= (a')'s at (a')'s longest", None, "(e) has no run at that length"))
    out += prediction_goals(results.get("e", {}).get("rows", []))
    return out


def prediction_goals(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """Predicted peak within 10% and step within 15% of measured, for the plans (e)'s planner picked
    (the peak of the training steps: the model predicts those), and the whole run's peak (the
    planner's profiling included) under the memory limit it was given."""
    peaks, steps, over = [], [], []
    for row in rows:
        for stage in row["stages"]:  # each stage's predicted peak above its baseline, against measured
            plan = stage.get("plan") or {}
            if plan.get("predicted_peak_gib") is not None:
                measured = (stage.get("steps_peak_bytes", stage["peak_bytes"]) - stage["base_bytes"]) / GIB
                peaks.append((f"{row['length']} s{stage['stage']}", plan["predicted_peak_gib"], measured))
                if plan.get("limit_gib"):
                    whole = (stage["peak_bytes"] - stage["base_bytes"]) / GIB
                    over.append((f"{row['length']} s{stage['stage']}", whole, plan["limit_gib"]))
        plan = row["stages"][0].get("plan") or {}
        if plan.get("predicted_step_s") is not None:
            steps.append((str(row["length"]), plan["predicted_step_s"], step_s(row)))
    out = []
    for name, pairs, bound in (("peak memory", peaks, 0.10), ("step time", steps, 0.15)):
        if not pairs:
            out.append((f"(e) predicted {name} within {bound:.0%}", None, "the planner exposes no prediction"))
            continue
        errors = [abs(p - m) / m for _, p, m in pairs]
        text = ", ".join(f"{length}: {p:.2f} vs {m:.2f}" for length, p, m in pairs)
        out.append((f"(e) predicted {name} within {bound:.0%}", max(errors) <= bound,
                    f"worst {max(errors):.0%} (predicted vs measured: {text})"))
    if over:
        worst = max(over, key=lambda o: o[1] / o[2])
        out.append(("(e) peak RSS above the baseline (profiling included) <= memory_limit_gib",
                    all(peak <= limit for _, peak, limit in over),
                    f"highest share of the limit {worst[1] / worst[2]:.0%} ({worst[0]}: {worst[1]:.2f} of "
                    f"{worst[2]:.2f} GiB)"))
    return out


def table(model: str, results: dict, batch: int, cap_gib: float, paired: dict | None = None) -> str:
    lines = [f"### {model}", "",
             "| variant | tokens | peak RSS per stage (GiB) | above baseline (GiB) | saved activations (MiB) "
             "| step (s) | tokens/s | plan |", "|---|---|---|---|---|---|---|---|"]
    for variant, result in results.items():
        for row in result["rows"]:
            stages = row["stages"]
            plan = stages[0].get("plan") or {}
            plan_text = plan.get("chosen") or (f"{len(plan['slices'])} slices, {plan.get('schedule')}"
                                               if plan.get("slices") else "")
            if plan.get("split"):   # its "|" between stages escaped: the table's cells are split at "|"
                plan_text += "; split " + plan["split"].replace("|", "\\|")
            lines.append(f"| {SHORT[variant]} | {row['length']} | "
                         + " / ".join(f"{s['peak_bytes'] / GIB:.2f}" for s in stages) + " | "
                         + " / ".join(f"{(s['peak_bytes'] - s['base_bytes']) / GIB:.2f}" for s in stages) + " | "
                         + " / ".join(f"{s['activations_bytes'] / MIB:.0f}" for s in stages)
                         + f" | {step_s(row):.2f} | {tokens_per_s(row, batch):.0f} | {plan_text} |")
    lines += ["", f"Longest sequence under the {cap_gib:g} GiB cap per rank:", ""]
    for variant, result in results.items():
        length, lower = longest(result)
        shown = "none" if length is None else (">= " if lower else "") + str(length)
        lines.append(f"- {NAMES[variant]}: {shown} tokens (stopped: {result['stop']})")
    lines += ["", "Goals:", ""]
    for goal, met, text in goals(results, batch, paired):
        verdict = "not measured" if met is None else "met" if met else "NOT met"
        lines.append(f"- {goal}: **{verdict}** ({text})")
    return "\n".join(lines)


def draw(all_results: dict, batch: int, cap_gib: float, path: str) -> None:
    """Two panels: largest stage peak RSS vs length, tokens/s vs length (log 2 length axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"a": "tab:red", "a_ckpt": "tab:orange", "c": "tab:blue", "e": "tab:green"}
    styles = ["-", "--", ":", "-."]
    for i, (model, results) in enumerate(all_results.items()):
        for variant, result in results.items():
            if not result["rows"]:
                continue
            lengths = [r["length"] for r in result["rows"]]
            label = f"{model} {SHORT[variant]}"
            mem.plot(lengths, [peak(r) / GIB for r in result["rows"]], styles[i % 4], marker="o",
                     color=colors[variant], label=label)
            speed.plot(lengths, [tokens_per_s(r, batch) for r in result["rows"]], styles[i % 4], marker="o",
                       color=colors[variant], label=label)
    mem.axhline(cap_gib, color="black", linewidth=0.8, linestyle="--", label=f"cap {cap_gib:g} GiB")
    for axis, ylabel in ((mem, "peak RSS, largest stage (GiB)"), (speed, "tokens / s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    mem.legend(fontsize=7)
    mem.set_title("memory against sequence length")
    speed.set_title("throughput against sequence length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
