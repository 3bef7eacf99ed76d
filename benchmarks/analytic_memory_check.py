"""The dry run's analytic memory model (``planner/analytic_memory.py``) against a real CPU run's peaks, per stage
(goal: every stage's prediction within 15% of the measured peak).

    python benchmarks/analytic_memory_check.py [--runs main,llama_lora_4k,1f1b_ckpt,seq_2x2] [--steps 3]
                                               [--no_lean] [--out benchmarks/results/analytic_memory_check]

Runs (each a short real run: launch/train.py's ``main`` on CPU ranks, gloo, 1 thread each, the embedded
corpus, ``--memory_report``, one evaluation batch at the end):

- ``main``: the main job, ds_configs/gpt2_tiny_cpu.json on 2 ranks (gpt2-tiny, 4 x 2 sequences of 256 tokens, gpipe);
- ``llama_lora_4k``: the 4 x 256 Llama of long_context.py (4 heads, 2 K/V heads, untied head, vocabulary of
  the embedded tokenizer; a seeded checkpoint written first) at 4096 tokens, ``--lora_r 8``, 2 microbatches
  of 1 sequence in 8 slices of 512, gpipe, 2 ranks;
- ``1f1b_ckpt``: ds_configs/gpt2_1f1b_ckpt.json (1f1b, ``activation_checkpoint_interval`` 1) on 2 ranks;
- ``seq_2x2``: the same Llama at 2048 tokens, 2 stages x 2 sequence ranks (``terapipe.sequence_parallel`` 2,
  8 even slices of 256), 2 microbatches, gpipe, 4 ranks.

Predicted: the dry run's own path (``checks.validate``, ``dry_run_plan.plan_run``, ``run_shape``,
``stage_memories``) judged for this CPU (``choices.Machine("cpu")``: fp32), the stage total, its
CPU-only ``host`` term included (code pages, DeepSpeed's shared-memory all-reduce buffers; 0 on a GPU);
the CUDA context and libraries' ``RESERVED_GIB`` is not in it (``fits`` adds it on a GPU only). Measured
(``_analytic_memory_worker.py``): the peak RSS over the steps (VmHWM, window started after the build)
above the rank's RSS just before the model was built (Python, torch, DeepSpeed, the process group and the
data already there), with the heap leaned (``memory.lean_heap``: freed tensors go back to the OS, so RSS
follows the bytes in use, which is what the model counts). Beside it: the tracker's peak saved activations
(outside checkpoints) against the model's activations + K/V + logits, and the build's own peak.
Figures: benchmarks/RESULTS.md. On a GPU the model stays unvalidated until a GPU run measures it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, launch, write_results  # noqa: E402

MIB = 2 ** 20
GOAL = 0.15
RUNS = ("main", "llama_lora_4k", "1f1b_ckpt", "seq_2x2")
LLAMA = {"family": "llama", "n_layer": 4, "n_embd": 256, "n_head": 4, "n_kv_head": 2, "seq_len": 4096}


def llama_checkpoint(work: str) -> str:
    """A seeded Llama checkpoint (LLAMA's shape, the embedded tokenizer's vocabulary) with its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    import _compare_models as cm
    from argparse import Namespace
    from tp_trainer.data import get_tokenizer
    path = os.path.join(work, "llama_4x256")
    tokenizer = get_tokenizer(None, show_progress=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cm.model_config(Namespace(**LLAMA, vocab_size=len(tokenizer)))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def llama_ds(seq_len: int, slices: int, sequence_parallel: int = 1) -> dict:
    terapipe = {"seq_len": seq_len, "slices": [seq_len // slices] * slices, "schedule": "gpipe"}
    if sequence_parallel > 1:
        terapipe["sequence_parallel"] = sequence_parallel
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 2}, "terapipe": terapipe}


def run_specs(work: str, names) -> list[dict]:
    """(name, ranks, train.py flags) of each run asked for; the Llama's checkpoint and configs written."""
    specs, llama = [], None
    for name in names:
        if name in ("main", "1f1b_ckpt"):
            config = "gpt2_tiny_cpu.json" if name == "main" else "gpt2_1f1b_ckpt.json"
            specs.append({"name": name, "ranks": 2, "flags": ["--deepspeed_config", os.path.join(ROOT, "ds_configs", config)]})
            continue
        llama = llama or llama_checkpoint(work)
        ds, ranks, extra = ((llama_ds(4096, 8), 2, ["--lora_r", "8"]) if name == "llama_lora_4k"
                            else (llama_ds(2048, 8, 2), 4, []))
        path = os.path.join(work, f"{name}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(ds, handle)
        specs.append({"name": name, "ranks": ranks,
                      "flags": ["--deepspeed_config", path, "--model_name_or_path", llama, *extra]})
    return specs


def train_flags(spec: dict, steps: int, work: str) -> list[str]:
    return [*spec["flags"], "--max_steps", str(steps), "--eval_interval", str(10 ** 6), "--eval_batches", "1",
            "--no_save_hf", "--memory_report", "--output_dir", os.path.join(work, spec["name"])]


def predict(argv: list[str], world_size: int) -> list[dict]:
    """Each stage's analytic memory (bytes per ``KEYS`` entry and total) as the dry run computes it, judged
    for this CPU: ``dry_run``'s steps with ``choices.Machine("cpu")`` instead of the target GPU's."""
    from _analytic_memory_worker import train_module
    from tp_trainer.checks import validate
    from tp_trainer.choices import Machine
    from tp_trainer.dry_run import DEFAULT_GPU, _vocab
    from tp_trainer.dry_run_plan import Target, plan_run, run_shape, stage_memories
    from tp_trainer.planner import analytic_memory as am
    from tp_trainer.planner.gpu_model import calibrate
    from tp_trainer.run_args import RunArgs
    args = RunArgs.from_namespace(train_module().parse_args(argv))
    spec = validate(args, world_size, Machine("cpu", frozenset(), world_size), weights=False)
    config = spec.model_config(_vocab(args))
    shape = am.model_shape(config, spec.pipeline.terapipe.lora)
    gpu = calibrate(DEFAULT_GPU)   # the plan's costs only (explicit slices: no effect on the memory)
    planned = plan_run(spec, config, shape, Target(world_size, gpu, gpu.memory_gib))
    memories = stage_memories(shape, planned.split, run_shape(spec, planned), planned.ckpt)
    return [{"layers": list(names), "checkpointed": planned.ckpt[s], "precision": spec.pipeline.choices.precision,
             **memories[s]} for s, names in enumerate(planned.split.names)]


def measure(spec: dict, argv: list[str], args, work: str) -> list[dict]:
    """The run's rank records (``_analytic_memory_worker.py``)."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_analytic_memory_worker.py")
    settings = {"argv": argv, "work": work, "tag": spec["name"], "lean": not args.no_lean}
    print(f"[analytic_memory_check] {spec['name']}: {spec['ranks']} ranks, {args.steps} steps", flush=True)
    launch(worker, spec["ranks"], [json.dumps(settings)], timeout=args.timeout)
    return [json.load(open(f, encoding="utf-8")) for f in sorted(glob.glob(os.path.join(work, f"{spec['name']}.rank*.json")))]


def compare(name: str, predicted: list[dict], records: list[dict]) -> list[dict]:
    """One row per stage: prediction, the highest measured peak of the stage's ranks, error, goal."""
    rows = []
    for stage, p in enumerate(predicted):
        mine = [r for r in records if r["stage"] == stage]
        worst = max(mine, key=lambda r: r["peak_mb"])
        total, measured = p["total"] / MIB, worst["peak_mb"]
        error = total / measured - 1.0
        saved = (p["activations"] + p["kv"] + p["logits"]) / MIB
        rows.append({"run": name, "stage": stage, "ranks": len(mine), "predicted_mb": total,
                     "static_mb": (p["weights"] + p["gradients"] + p["optimizer"]) / MIB, "saved_predicted_mb": saved,
                     "host_mb": p["host"] / MIB,
                     "measured_mb": measured, "error": error, "met": abs(error) <= GOAL,
                     "tracked_mb": worst["tracked_mb"], "built_mb": worst["built_mb"], "base_mb": worst["base_mb"],
                     "prediction": p, "records": mine})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | stage | predicted MiB (weights+grads+optimizer / saved / host) | measured MiB | error "
             "| within 15% | tracked saved MiB | build peak MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['stage']} | {r['predicted_mb']:.1f} ({r['static_mb']:.1f} / "
                     f"{r['saved_predicted_mb']:.1f} / {r['host_mb']:.1f}) | {r['measured_mb']:.1f} | "
                     f"{r['error'] * 100:+.1f}% | "
                     f"{'met' if r['met'] else 'NOT met'} | {r['tracked_mb']:.1f} | {r['built_mb']:.1f} |")
    met = sum(r["met"] for r in rows)
    lines.append(f"\n{met} of {len(rows)} stages within 15% (goal: all). Measured: peak RSS over the steps above the "
                 "RSS before the model was built (heap leaned); predicted: the dry run's stage total on CPU (fp32, its "
                 "host term included), no CUDA reserve. On a GPU the model stays unvalidated until a GPU run "
                 "measures it.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (the first allocates AdamW's state)")
    parser.add_argument("--no_lean", action="store_true", help="leave glibc's heap as a run has it")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "analytic_memory_check"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    began, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="analytic_memory_") as work:
        for spec in run_specs(work, args.runs.split(",")):
            flags = train_flags(spec, args.steps, work)
            predicted = predict(flags, spec["ranks"])
            rows.extend(compare(spec["name"], predicted, measure(spec, flags, args, work)))
    text = table(rows)
    report = {"settings": vars(args), "seconds": time.perf_counter() - began, "load_avg_1min": os.getloadavg()[0],
              "goal": GOAL, "all_met": all(r["met"] for r in rows), "rows": rows}
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
