"""The tables, the goals and the 4 x 1 comparison of sequence_memory.py, from its report's figures."""

from __future__ import annotations

MIB, GIB = 2 ** 20, 2 ** 30
ACTIVATION_RATIO = 0.6   # 2 x 2 keeps at most this share of 2 x 1's peak saved activations + K/V per rank
MODEL_ERROR = 0.15       # predicted per-rank peaks within this of the measured
LONGEST_RATIO = 1.8      # the longest context under the limit on 2 x 2 against 2 x 1


def _key(run: dict) -> str:
    return f"{run['stages']}x{run['ranks']}"


def _done(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if r.get("stop") == "done"), key=lambda r: r["rank"])


def _measured(record: dict, what: str) -> float:
    """The measured step's figure (the last step: after the warm-up allocated AdamW's moments)."""
    return max(s[what] for s in record["steps"] if not s["warmup"]) if any(
        not s["warmup"] for s in record["steps"]) else max(s[what] for s in record["steps"])


def runs_table(runs: list) -> str:
    lines = ["| layout | tokens | rank (stage, seq. rank) | saved act. + K/V MiB | peak RSS MiB | above baseline MiB "
             "| predicted MiB | error | step s |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        done = _done(run)
        if not done:
            lines.append(f"| {_key(run)} | {run['length']} | failed: {run['error'] or 'no records'} | | | | | | |")
            continue
        for r in done:
            step = _measured(r, "step_s")
            predicted = r.get("predicted_above_bytes")
            lines.append(f"| {_key(run)} | {run['length']} | {r['rank']} ({r['stage']}, {r['sequence_rank']}) | "
                         f"{_measured(r, 'activations_bytes') / MIB:.0f} | {_measured(r, 'peak_bytes') / MIB:.0f} | "
                         f"{r['measured_above_bytes'] / MIB:.0f} | "
                         + (f"{predicted / MIB:.0f} | {r['error']:+.1%}" if predicted is not None else "- | -")
                         + f" | {step:.1f} |")
    return "\n".join(lines)


def worst(runs: list, key: str, length: int, what: str) -> float | None:
    for run in runs:
        if _key(run) == key and run["length"] == length and _done(run):
            return max(_measured(r, what) for r in _done(run))
    return None


def goals(args, report: dict) -> list[tuple[str, bool | None, str]]:
    """(goal, met (None: not measured), figures)."""
    runs, out = report["runs"], []
    for length in sorted({run["length"] for run in runs}):
        ours, base = worst(runs, "2x2", length, "activations_bytes"), worst(runs, "2x1", length, "activations_bytes")
        if ours is None or base is None:
            out.append((f"{length} tokens: 2 x 2 at most {ACTIVATION_RATIO}x 2 x 1's peak saved activations + K/V "
                        f"per rank", None, "not measured"))
            continue
        ratio = ours / base
        out.append((f"{length} tokens: 2 x 2 at most {ACTIVATION_RATIO}x 2 x 1's peak saved activations + K/V per rank",
                    ratio <= ACTIVATION_RATIO, f"{ours / MIB:.0f} / {base / MIB:.0f} MiB = {ratio:.2f}x (highest rank "
                                               f"of each)"))
    errors = [(r["error"], _key(run), run["length"], r["rank"]) for run in runs for r in _done(run) if "error" in r]
    if errors:
        far = max(errors, key=lambda e: abs(e[0]))
        out.append((f"the model's predicted per-rank peaks within {MODEL_ERROR:.0%} of the measured (above the "
                    f"baseline)", abs(far[0]) <= MODEL_ERROR,
                    f"{len(errors)} ranks, errors {min(e[0] for e in errors):+.1%} to {max(e[0] for e in errors):+.1%}"
                    f" (farthest: {far[1]} at {far[2]}, rank {far[3]})"))
    longest = report["longest"]
    if "2x2" in longest and "2x1" in longest and longest["2x1"]["length"]:
        ratio = longest["2x2"]["length"] / longest["2x1"]["length"]
        out.append((f"predicted longest context under {args.limit_gib:g} GiB per rank: 2 x 2 at least "
                    f"{LONGEST_RATIO}x 2 x 1", ratio >= LONGEST_RATIO,
                    f"{longest['2x2']['length']} / {longest['2x1']['length']} tokens = {ratio:.2f}x"))
    return out


def longest_table(args, longest: dict) -> str:
    lines = [f"Predicted (memory model only, no run): the longest context (a multiple of 2048) whose predicted peak "
             f"stays under {args.limit_gib:g} GiB on every rank; uniform slices of at least 512 tokens (the count "
             f"with the least peak), gpipe, "
             f"no checkpointing; each rank's baseline and overhead as measured at the first length.", "",
             "| layout | longest context | slices | predicted peak GiB | baseline + overhead MiB |",
             "|---|---|---|---|---|"]
    for key, row in longest.items():
        if not row["length"]:
            lines.append(f"| {key} | none fits | | | {row['fixed_bytes'] / MIB:.0f} |")
            continue
        lines.append(f"| {key} | {row['length']} | {row['slices']} | {row['peak_bytes'] / GIB:.2f} | "
                     f"{row['fixed_bytes'] / MIB:.0f} |")
    return "\n".join(lines)


def exchanges(args, record: dict, stages: int, ranks: int, length: int) -> float:
    """Bytes the rank of ``record`` sends per step: the Ulysses all-to-alls (forward and backward: (N - 1)/N
    of its q, k, v and output shards per attention layer, K/V heads repeated to N where g < N), the
    gradient sum over its sequence group (a ring all-reduce of its parameters: 2 (N - 1)/N of their
    bytes), its activations to the next stage and its input's gradients to the one before."""
    head_dim, tokens = args.n_embd // args.n_head, length // ranks
    layers = sum(name.startswith("h.") for name in record["names"])
    a2a = 0.0 if ranks == 1 else (ranks - 1) / ranks * tokens * head_dim * (2 * args.n_head + 2 * max(
        args.n_kv_head, ranks)) * 2 * 4.0 * layers
    reduce = 2 * (ranks - 1) / ranks * record["params_bytes"]
    neighbours = (record["stage"] < stages - 1) + (record["stage"] > 0)
    return a2a + reduce + neighbours * tokens * args.n_embd * 4.0


def beside_4x1(args, runs: list) -> list[str]:
    """One line each: what differs between 2 x 2 and 4 x 1 (logits, embeddings, the bubble, the exchanges)."""
    length = max(run["length"] for run in runs)
    by = {_key(run): run for run in runs if run["length"] == length and _done(run)}
    if not {"2x2", "4x1"} <= set(by):
        return ["(4 x 1 against 2 x 2: not both measured)"]
    vocab_bytes = args.vocab_size * 4.0

    def last(key):
        return [r for r in _done(by[key]) if r["stage"] == by[key]["stages"] - 1]

    def params(key):
        return max(r["params_bytes"] for r in _done(by[key])) / MIB

    def steps(key):
        return max(_measured(r, "step_s") for r in _done(by[key]))

    def bubble(p):
        return (p - 1) / (args.slices + p - 1)

    sent = {}
    for key in ("2x2", "4x1"):
        run = by[key]
        sent[key] = max(exchanges(args, r, run["stages"], run["ranks"], length) for r in _done(run))
    return [
        f"- logits: at {length} tokens a last-stage rank of 2 x 2 keeps the log-softmax of its {length // 2} tokens "
        f"({length // 2 * vocab_bytes / MIB:.0f} MiB), 4 x 1's last stage that of all {length} "
        f"({length * vocab_bytes / MIB:.0f} MiB): more stages do not cut the head's share (its ranks' saved "
        f"activations + K/V: {max(_measured(r, 'activations_bytes') for r in last('2x2')) / MIB:.0f} against "
        f"{max(_measured(r, 'activations_bytes') for r in last('4x1')) / MIB:.0f} MiB).",
        f"- embeddings: 2 x 2 replicates each stage's parameters on both sequence ranks (the most a rank holds: "
        f"{params('2x2'):.1f} MiB, x4 with gradients and AdamW), 4 x 1 partitions them (the most: "
        f"{params('4x1'):.1f} MiB, the embedding's or the head's stage).",
        f"- the bubble: gpipe over {args.slices} slices idles (p - 1)/(S + p - 1) of a step: "
        f"{bubble(2):.0%} with 2 stages, {bubble(4):.0%} with 4 (measured step: {steps('2x2'):.0f} s against "
        f"{steps('4x1'):.0f} s, 2 cores shared by the 4 ranks).",
        f"- the exchanges: a 2 x 2 rank sends up to {sent['2x2'] / MIB:.0f} MiB a step (4 all-to-alls per layer and "
        f"slice, forward and backward; the gradient sum over its sequence group; its shard to the next stage), "
        f"a 4 x 1 rank up to {sent['4x1'] / MIB:.0f} MiB (an activation and a gradient per slice, to its "
        f"neighbours).",
    ]


def ulysses_table(runs: list, ours: list) -> str:
    lines = ["DeepSpeed's own Ulysses (``UlyssesSPAttentionHF``, HF Llama of the same shape, ZeRO-1, 4 sequence "
             "ranks, no pipeline) beside ours (2 x 2, the highest rank):", "",
             "| tokens | DeepSpeed Ulysses: saved act. + K/V MiB | peak RSS MiB | above baseline MiB | step s | "
             "ours 2 x 2: saved act. + K/V | peak RSS | above baseline |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        done = [r for r in run["records"] if r.get("stop") == "done"]
        mine = next((o for o in ours if _key(o) == "2x2" and o["length"] == run["length"] and _done(o)), None)
        theirs = ("did not run: " + str(run["error"]) + " | | | |") if run["error"] or not done else (
            f"{max(_measured(r, 'activations_bytes') for r in done) / MIB:.0f} | "
            f"{max(_measured(r, 'peak_bytes') for r in done) / MIB:.0f} | "
            f"{max(_measured(r, 'peak_bytes') - r['base_bytes'] for r in done) / MIB:.0f} | "
            f"{max(_measured(r, 'step_s') for r in done):.0f}")
        us = " | | " if mine is None else (
            f"{max(_measured(r, 'activations_bytes') for r in _done(mine)) / MIB:.0f} | "
            f"{max(_measured(r, 'peak_bytes') for r in _done(mine)) / MIB:.0f} | "
            f"{max(r['measured_above_bytes'] for r in _done(mine)) / MIB:.0f}")
        lines.append(f"| {run['length']} | {theirs} | {us} |")
    return "\n".join(lines)


def report_text(args, report: dict) -> str:
    load = report["load_avg_1min"]
    head = (f"# Sequence ranks: memory per rank\n\nLlama-style {args.n_layer} x {args.n_embd}, {args.n_head} heads, "
            f"{args.n_kv_head} K/V heads, vocabulary {args.vocab_size}, batch 1, fp32, gpipe, {args.slices} uniform "
            f"slices, no checkpointing, gloo CPU ranks (1 thread each); {args.warmup} warm-up + {args.steps} measured "
            f"step(s) per layout and length; load average (1 min) {min(load):.1f}-{max(load):.1f}; "
            f"{report['seconds'] / 60:.1f} min.\n"
            "Saved act. + K/V: the ActivationTracker's peak (the last stage's loss included). Peak RSS: VmHWM of "
            "the measured step; above baseline: less the RSS before the engine was built. Predicted: the memory "
            "model per sequence rank, above the same baseline.")
    parts = [head, runs_table(report["runs"]), "Goals:"]
    parts.append("\n".join(f"- {g}: {'met' if m else ('not met' if m is not None else 'not measured')} ({t})"
                           for g, m, t in goals(args, report)))
    parts += ["2 x 2 against 4 x 1 (the same 4 ranks):", "\n".join(beside_4x1(args, report["runs"])),
              longest_table(args, report["longest"])]
    if report["ulysses"]:
        parts.append(ulysses_table(report["ulysses"], report["runs"]))
    return "\n\n".join(parts)
