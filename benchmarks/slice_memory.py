"""Memory of the slice path against sequence length, before and after.

    python benchmarks/slice_memory.py [--baseline REV] [--lengths 4096,8192,16384] [--slices 16]
                                      [--models gpt2,llama] [--json FILE]

Models (random weights, dropout 0, fp32, SDPA): GPT-2 4 x 256 (4 heads, positions = the longest
length) and a Llama-style model 4 x 256 (8 query heads, 2 K/V heads: grouped-query attention,
rotary), vocab 8192, each split into its 2 stages as the engine splits it. One sequence per step,
``--slices`` uniform slices, run as the engine's gpipe order runs a microbatch: every slice's
forward (K/V kept in the sequence's buffers), then the backwards in reverse order.

Per model, stage and length: peak saved activations (``tp_trainer.memory.ActivationTracker``:
every tensor autograd saves, once per storage, parameters excluded; the K/V buffers included) and
the process's peak RSS. One process per (version, model, stage) runs the lengths in increasing
order, so the RSS high-water mark after each length is that length's peak. Printed: a table and the
growth factor per doubling of the length (linear memory: 2.0).
``--baseline REV``: also the tp_trainer of that git revision (``git archive``), in processes of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import extract_package  # noqa: E402
BASELINE = "2352d8e"  # the slice path with HF's masked SDPA per slice (before model/slices/attention.py)


def model(name: str, positions: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=positions,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config).train()
    config = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=positions,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).train()


def stage_functions(net, stage: int):
    """(callables of ``stage`` of 2, SliceContext, first layer is the token embedding)."""
    from deepspeed.pipe import TiedLayerSpec

    from tp_trainer.model.families.adapters import adapter_for
    from tp_trainer.model.stages.layers import SliceContext
    from tp_trainer.model.stages.split import split_for_config
    family = adapter_for(net.config)
    ctx = SliceContext(net.config._attn_implementation or "sdpa")
    specs = family.layer_specs(net, ctx)
    split = split_for_config(net.config, 2, family.PREFIX, family.SUFFIX)
    funcs = []
    for spec in specs[split.parts[stage]:split.parts[stage + 1]]:
        if isinstance(spec, TiedLayerSpec):
            module = spec.build()
            funcs.append((lambda m, f: lambda x: f(m, x))(module, spec.forward_fn) if spec.forward_fn else module)
        else:
            funcs.append(spec.build())
    return funcs, ctx


def worker(args) -> None:
    """One model and stage, every length in increasing order; prints one JSON line."""
    import torch

    from tp_trainer.memory import ActivationTracker, peak_rss_mb
    from tp_trainer.model.slices.slice_cache import SequenceKV
    torch.set_num_threads(1)
    net = model(args.model, max(args.lengths))
    funcs, ctx = stage_functions(net, args.stage)
    hidden = net.config.hidden_size
    params = list(net.parameters())
    rows = {"rss_before_mb": peak_rss_mb()}
    for L in sorted(args.lengths):
        tracker = ActivationTracker(params)
        l = L // args.slices
        kv, outs = SequenceKV(L), []
        with tracker.track():
            for j in range(args.slices):
                ctx.begin(kv, j * l, l)
                x = (torch.randint(0, 8192, (1, l)) if args.stage == 0
                     else torch.randn(1, l, hidden).requires_grad_())
                for func in funcs:
                    x = func(x)
                if args.stage == 1:
                    x = torch.nn.functional.cross_entropy(x.flatten(0, 1), torch.randint(0, 8192, (l,)),
                                                          reduction="sum") / L
                outs.append(x)
        for j in reversed(range(args.slices)):
            ctx.begin(kv, j * l, l)
            outs[j].backward(None if args.stage == 1 else torch.randn_like(outs[j]))
            outs[j] = None
        net.zero_grad(set_to_none=True)
        del kv
        rows[L] = {"saved_mib": tracker.peak / 2 ** 20, "peak_rss_mib": peak_rss_mb()}
    print("RESULT " + json.dumps(rows), flush=True)


def run(args, path: str, model_name: str, stage: int) -> dict:
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model_name, "--stage", str(stage),
           "--lengths", ",".join(map(str, args.lengths)), "--slices", str(args.slices)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"worker {model_name} stage {stage} ({path}) failed:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return {k if k == "rss_before_mb" else int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def table(results: dict, lengths) -> str:
    lines = ["| model | stage | version | " + " | ".join(f"{L}: saved / peak RSS (MiB)" for L in lengths)
             + " | saved x per doubling | RSS growth x per doubling |",
             "|---|---|---|" + "---|" * (len(lengths) + 2)]
    for (model_name, stage, version), rows in results.items():
        cells = " | ".join(f"{rows[L]['saved_mib']:.0f} / {rows[L]['peak_rss_mib']:.0f}" for L in lengths)
        base = rows["rss_before_mb"]
        saved = [f"{rows[b]['saved_mib'] / rows[a]['saved_mib']:.2f}" for a, b in zip(lengths, lengths[1:])]
        rss = [f"{(rows[b]['peak_rss_mib'] - base) / (rows[a]['peak_rss_mib'] - base):.2f}"
               for a, b in zip(lengths, lengths[1:])]
        lines.append(f"| {model_name} | {stage} | {version} | {cells} | {', '.join(saved)} | {', '.join(rss)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare with ('' for none)")
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--slices", type=int, default=16)
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.lengths = sorted(int(x) for x in args.lengths.split(","))
    if args.worker:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="slice_memory_") as tmp:
        versions = {"after": ROOT}
        if args.baseline:
            versions = {f"before ({args.baseline})": extract_package(args.baseline, tmp), **versions}
        for model_name in args.models.split(","):
            for stage in (0, 1):
                for version, path in versions.items():
                    results[(model_name, stage, version)] = run(args, path, model_name, stage)
                    print(f"{model_name} stage {stage} {version}: {results[(model_name, stage, version)]}",
                          flush=True)
    load = os.getloadavg()
    print(f"\n{args.slices} uniform slices, 1 sequence, fp32, SDPA, 1 thread; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(table(results, args.lengths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "results": {" / ".join(map(str, k)): v for k, v in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
