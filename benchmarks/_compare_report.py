"""compare.py's figures: one run's summary, and the median over runs with their spread and goals.

A *run* is one process pair that trains every variant in turn (compare.py's worker). The figure to
steer by is (c)/(a) throughput: (a) does the same work as (c) with no overlap, so
(c)/(a) = K x (c)'s efficiency against (a)/K, and its limit is K. Beside it, (c)'s efficiency is
given against three ideals, each noisy in its own way: (a)/K, (d)/K (one process, the whole model)
and the stage probe (each stage's units of (c)'s plan, timed with all stages computing at once, as
in the step). Every figure is the median over runs; the spread is min-max over runs.
"""

from __future__ import annotations

import os
import statistics

A, C, D = "(a) DeepSpeed 1F1B", "(c) TeraPipe DP", "(d) 1 process"
WHOLE = "(c') TeraPipe DP, whole blocks"  # --whole_blocks: (c)'s cost model, no block cut
C_IN_B = "(c W in B) TeraPipe DP, weight gradients in B"  # --w_in_b: (c)'s plan, no W's scheduled


def ratio_goal(args) -> float:
    """The (c)/(a) goal for this case: 1.8; 1.85 for 8 x 512; 1.3 with batch >= 4; 1.9 at 8k tokens."""
    if args.goal is not None:
        return args.goal
    if args.seq_len >= 8192:
        return 1.9
    if args.batch >= 4:
        return 1.3
    if args.n_layer == 8 and args.n_embd == 512:
        return 1.85
    return 1.8


def step_times(args, res: dict) -> dict:
    """Per variant, the timed steps: a pipelined step lasts until its slowest rank is done; (d) is rank 0's."""
    ranks = res["ranks"]
    return {n: [max(r["wall"][n][i] for r in ranks) if n != D else ranks[0]["wall"][n][i]
                for i in range(args.steps)] for n in res["names"]}


def summarize_run(args, res: dict) -> dict:
    """One run's figures."""
    k, steps = args.stages, step_times(args, res)
    med = {n: statistics.median(v) for n, v in steps.items()}
    probe = [r["probe"] for r in sorted(res["ranks"], key=lambda r: r["stage"])]
    probe_ideal = max(p["together"] for p in probe)  # the busiest stage's units, all stages computing
    # the same in (c)'s schedule order (a probe of an older result file has no such figure)
    order_ideal = max(p.get("order_together", float("nan")) for p in probe)
    best_b = min((n for n in res["names"] if n.startswith("(b)")), key=med.get, default=None)
    return {"median_s": med, "min_s": {n: min(v) for n, v in steps.items()}, "step_s": steps,
            "c_over_a": med[A] / med[C],
            "c_over_a_paired": statistics.median(a / c for a, c in zip(steps[A], steps[C], strict=True)),
            "eff_vs_a": med[A] / k / med[C], "eff_vs_d": med[D] / k / med[C],
            "eff_vs_d_min": min(steps[D]) / k / min(steps[C]), "eff_vs_probe": probe_ideal / med[C],
            "eff_vs_probe_order": order_ideal / med[C], "ceiling": med[A] / probe_ideal,
            "reach_d": med[A] / (med[D] / k),
            "best_b": best_b, "probe": probe, "load": statistics.median(res["load_1min"]),
            "load_max": max(res["load_1min"]), "timeline": res["timeline"], "simulated": res.get("simulated"),
            "profile_load": res.get("profile_load"), "splits": res.get("splits", {}),
            "predicted_s": res["predicted_s"], "slices": res["slices"],
            "first_loss": {n: res["losses"][n][0] for n in res["names"]},
            "whole_over_cut_paired": statistics.median(w / c for w, c in zip(steps[WHOLE], steps[C], strict=True))
            if WHOLE in steps else None,
            "in_b_over_w_paired": statistics.median(b / c for b, c in zip(steps[C_IN_B], steps[C], strict=True))
            if C_IN_B in steps else None, "c_over_a_by_turn": _by_turn(steps, res["ranks"][0].get("follows"))}


def _by_turn(steps: dict, follows: dict | None) -> dict | None:
    """(c)/(a) over the steps that came right after another variant's ("after_switch") and over those
    that followed a step of their own ("back_to_back"; a training run's steps), with compare.py
    --turn > 1; None otherwise."""
    if not follows or not any(follows[A]):
        return None
    out = {}
    for key, wanted in (("after_switch", False), ("back_to_back", True)):
        a, c = ([t for t, f in zip(steps[n], follows[n], strict=True) if f == wanted] for n in (A, C))
        out[key] = {"a_s": statistics.median(a), "c_s": statistics.median(c),
                    "c_over_a": statistics.median(a) / statistics.median(c), "steps": len(a)}
    return out


def _spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def render(args, names: list, runs: list[dict], wall_s: float, load_before: float, plan_report: str):
    """(report dict, markdown text) over all runs."""
    k, tokens = args.stages, args.batch * args.seq_len
    med = {n: statistics.median(r["median_s"][n] for r in runs) for n in names}
    mins = {n: min(r["min_s"][n] for r in runs) for n in names}
    ratio = [r["c_over_a"] for r in runs]
    goal = ratio_goal(args)
    best_b = min((n for n in names if n.startswith("(b)")), key=med.get, default=None)
    goals = {f"c_over_a_median_ge_{goal}": statistics.median(ratio) >= goal,
             "c_not_slower_than_any_b": best_b is None or med[C] <= med[best_b],
             "c_predicted_within_10pct": _prediction_goal(runs)}
    yes = {True: "met", False: "NOT met"}
    bound = "each rank on its own core" if getattr(args, "bind_cores", True) else "ranks not bound to cores"
    lines = [(f"GPT-2 {args.n_layer} x {args.n_embd} ({args.n_head} heads, vocab {args.vocab_size}, dropout 0), "
              f"{k} stages, batch {args.batch} x seq {args.seq_len} = {tokens} tokens/step, microbatch size 1, "
              f"1 thread/rank, {bound}, random tokens, AdamW, {getattr(args, 'dtype', 'fp32')}; {len(runs)} runs (fresh process pairs) x ({args.warmup} "
              f"warm-up + {args.steps} timed steps per variant), variants taking turns step by step"), "",
             ("| variant | slices | tokens/s | step s (median of run medians) | fastest step s | ratio to (a) "
              "| efficiency vs (d)/K | predicted s | first-step loss |"), "|---|---|---|---|---|---|---|---|---|"]
    last = runs[-1]
    for n in names:
        s = last["slices"].get(n)
        shown = "-" if s is None else (str(s) if len(s) <= 6 else f"{len(s)} x ~{round(statistics.mean(s))}")
        pred = last["predicted_s"].get(n)
        lines.append(f"| {n} | {shown} | {tokens / med[n]:.0f} | {med[n]:.3f} | {mins[n]:.3f} | "
                     f"{med[A] / med[n]:.2f} | {med[D] / k / med[n]:.2f} | "
                     f"{'-' if pred is None else f'{pred:.3f}'} | {last['first_loss'][n]:.6f} |")
    lines += ["", "| run | load 1 min (median / max) | (a) s | (c) s | (c)/(a) | (c)/(a) paired | eff vs (a)/K "
                  "| eff vs (d)/K (median / fastest) | eff vs stage probe |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['load']:.2f} / {r['load_max']:.2f} | {r['median_s'][A]:.3f} | "
                     f"{r['median_s'][C]:.3f} | {r['c_over_a']:.2f} | {r['c_over_a_paired']:.2f} | "
                     f"{r['eff_vs_a']:.2f} | {r['eff_vs_d']:.2f} / {r['eff_vs_d_min']:.2f} | {r['eff_vs_probe']:.2f} |")
    lines += ["", (f"(c)/(a) throughput, median (min-max) over {len(runs)} runs: {_spread(ratio)}; "
                   f"efficiency of (c) vs (a)/K {_spread([r['eff_vs_a'] for r in runs])}, vs (d)/K "
                   f"{_spread([r['eff_vs_d'] for r in runs])}, vs the stage probe "
                   f"{_spread([r['eff_vs_probe'] for r in runs])}, vs the stage probe in step order "
                   f"{_spread([r.get('eff_vs_probe_order', float('nan')) for r in runs])}; the most (c)/(a) "
                   f"that (c)'s stages allow with no bubble, messages or tail ((a) / the busiest stage's probe): "
                   f"{_spread([r.get('ceiling', float('nan')) for r in runs])}"),
              *([f"(c') whole blocks over (c) (a block cut where it balances better), paired per-step ratio: "
                 f"{_spread([r['whole_over_cut_paired'] for r in runs])} (median (min-max) over runs; > 1: the cut "
                 f"is faster); splits: {last['splits'][C]} vs {last['splits'][WHOLE]}"]
                if last.get("whole_over_cut_paired") else []),
              *([f"{C_IN_B} over (c), paired per-step ratio: {_spread([r['in_b_over_w_paired'] for r in runs])} "
                 f"(median (min-max) over runs; > 1: scheduling the W's is faster)"]
                if last.get("in_b_over_w_paired") else []),
              *_turn_lines(runs), _probe_line(last), _timeline_line(last), _prediction_line(last),
              (f"load average (1 min) before: {load_before:.2f}; during runs (median per run): "
               f"{', '.join(format(r['load'], '.2f') for r in runs)} on {os.cpu_count()} cores "
               f"(this benchmark itself keeps ~{k} busy); wall time {wall_s:.0f} s"
               + "".join(f"; around the profile the cost model was fitted on (run {i}): {r['profile_load'][0]:.2f} -> "
                         f"{r['profile_load'][1]:.2f}" for i, r in enumerate(runs, 1) if r.get("profile_load"))),
              (f"goals: (c)/(a) >= {goal} (median of runs): {yes[goals[f'c_over_a_median_ge_{goal}']]} "
               f"({statistics.median(ratio):.2f}); (c) not slower than any (b): "
               f"{yes[goals['c_not_slower_than_any_b']]} ({med[C]:.3f} vs "
               f"{med[best_b] if best_b else float('nan'):.3f} s of {best_b}); predicted (c) step within 10%: "
               f"{yes[goals['c_predicted_within_10pct']]} ({_prediction_errors(runs)})"),
              *_reach_lines(goal, runs)]
    report = {"setup": {a: getattr(args, a) for a in ("stages", "batch", "seq_len", "n_layer", "n_embd", "n_head",
                                                       "vocab_size", "uniform", "steps", "warmup", "budget", "seed")},
              "runs": runs, "median_s": med, "c_over_a": ratio, "goal": goal, "goals": goals,
              "load_1min_before": load_before, "wall_s": wall_s, "plan_report": plan_report}
    return report, "\n".join(lines)


def _reach_lines(goal: float, runs: list[dict]) -> list[str]:
    """How far the (c)/(a) goal lies from what this machine allows: (a) / ((d)/K), the ratio of a
    K-stage step that ran at exactly one process's step / K (its work split perfectly, no bubble,
    messages, tail or second core computing at once), and (a) / the busiest stage's probe ((c)'s own
    units, all stages computing at once). Neither is a strict bound: (d) pays costs of its own (page
    faults), so (c) has run above (d)/K's speed (at 1.02 of it); [] for result files older than
    these figures."""
    reach = [r["reach_d"] for r in runs if "reach_d" in r]
    if not reach:
        return []
    ceiling = statistics.median(r.get("ceiling", float("nan")) for r in runs)
    above = [name for name, value in (("(a) / ((d)/K)", statistics.median(reach)),
                                      ("(a) / the busiest stage's probe", ceiling)) if goal > value]
    verdict = ("below both" if not above else f"above {above[0]}" if len(above) == 1
               else "above both: (c) would have to beat one process's speed x K and its own stages' probe")
    return [f"reach: (c)/(a) of a step at exactly (d)/K ((a) / ((d)/K)) {_spread(reach)}, (a) / the busiest "
            f"stage's probe {ceiling:.2f}; the goal {goal} lies {verdict}; it needs (c) at "
            f"{goal / statistics.median(reach):.3f} of (d)/K's speed"]


def _turn_lines(runs: list[dict]) -> list[str]:
    """With --turn > 1: (c)/(a) right after a switch of variant and with steps back to back."""
    by_turn = [r["c_over_a_by_turn"] for r in runs if r.get("c_over_a_by_turn")]
    if not by_turn:
        return []
    parts = []
    for key, what in (("after_switch", "steps right after another variant's"),
                      ("back_to_back", "steps that followed one of their own (as in training)")):
        parts.append(f"{what}: (a) {statistics.median(b[key]['a_s'] for b in by_turn):.3f} s, (c) "
                     f"{statistics.median(b[key]['c_s'] for b in by_turn):.3f} s, (c)/(a) "
                     f"{_spread([b[key]['c_over_a'] for b in by_turn])} ({by_turn[0][key]['steps']} steps per run)")
    return ["(c)/(a) by a step's place in its turn, median (min-max) over runs: " + "; ".join(parts)]


def _predicted_error(run: dict, name: str):
    """The run's prediction of ``name``'s step (the cost model's) against its measured median, as a
    fraction (None without one)."""
    pred = run.get("predicted_s", {}).get(name)
    return None if pred is None else pred / run["median_s"][name] - 1


def _prediction_goal(runs: list[dict]) -> bool:
    """Each run's (c) prediction against that run's measured median step: the median of these errors
    within 10%, as every goal takes the median of runs."""
    errors = [_predicted_error(r, C) for r in runs]
    return None not in errors and abs(statistics.median(errors)) <= 0.10


def _prediction_errors(runs: list[dict]) -> str:
    """Each run's prediction error against the run's median."""
    def pct(e):
        return "n/a" if e is None else f"{100 * e:+.1f}%"
    errors = [_predicted_error(r, C) for r in runs]
    median = "" if None in errors else f"median {100 * statistics.median(errors):+.1f}%; "
    return f"{median}per run: " + ", ".join(pct(e) for e in errors)


def _probe_line(run: dict) -> str:
    probe = run["probe"]
    parts = ", ".join(f"stage {i} {p['together']:.3f} s (fastest {p['together_min']:.3f}, alone "
                      f"{p['alone']:.3f})" for i, p in enumerate(probe))
    order = ", ".join(f"stage {i} {p['order_together']:.3f} s (fastest {p['order_together_min']:.3f}, alone "
                      f"{p['order_alone']:.3f})" for i, p in enumerate(probe) if "order_together" in p)
    return (f"stage probe (last run; each stage's units of (c)'s plan, fwd + bwd + weight gradients, all stages "
            f"at once, median of {probe[0]['rounds']}): per unit (as the planner profiles) {parts}"
            + (f"; in (c)'s schedule order, messages left out (every activation and K/V held until its "
               f"backward, as in the step) {order}" if order else ""))


def _prediction_line(run: dict) -> str:
    """Where the predicted (c) step parts from the measured one (last run): the simulated compute per
    stage and kind against the drawn step's; the tail; the drawn step's time outside its instructions
    (barrier, ``train_batch`` around the schedule); the timed steps' median against the drawn step."""
    sim, tl = run.get("simulated"), run["timeline"]
    if not sim or "wall_s" not in tl:
        return "prediction breakdown: n/a (older result)"
    parts = []
    for stage, busy in sim["busy_s"].items():
        got = tl["busy_s"].get(stage, {})
        kinds = ", ".join(f"{kind[0]} {busy[kind]:.3f}/{got.get(kind, 0.0):.3f}" for kind in sorted(busy))
        parts.append(f"stage {stage} {kinds}, its compute ends {sim['compute_end_s'][stage]:.3f}/"
                     f"{tl['compute_end_s'][stage]:.3f}")
    median = run["median_s"][C]
    drift = ", ".join(f"stage {i} {sum(sim['busy_s'][str(i)].values()):.3f}/{p['together']:.3f}"
                      for i, p in enumerate(run["probe"]) if str(i) in sim["busy_s"])
    return (f"prediction vs measurement (predicted/measured s, last run): {'; '.join(parts)}; "
            f"the cost model's F+B+W of (c)'s units against the same units timed in this run (stage probe, "
            f"together): {drift} (the profile's machine state against the run's); "
            f"step: predicted {sim['step_s']:.3f}, drawn step's instructions end {tl['end_s']:.3f} "
            f"(compute {tl['step_s']:.3f} + tail), its wall {tl['wall_s']:.3f} "
            f"(outside the instructions {tl['wall_s'] - tl['end_s']:+.3f}), timed steps' median {median:.3f} "
            f"({median - tl['wall_s']:+.3f} against the drawn step: load and step-to-step spread)")


def _timeline_line(run: dict) -> str:
    tl = run["timeline"]
    per_stage = []
    for stage, busy in tl["busy_s"].items():
        work = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in sorted(busy.items()))
        per_stage.append(f"stage {stage}: {work}; idle or other {tl['step_s'] - sum(busy.values()):.3f} s, "
                         f"tail after its last compute {tl['tail_s'][stage]:.3f} s")
    return f"timeline step of (c) (median of 3, last run) {tl['step_s']:.3f} s: " + "; ".join(per_stage)
