"""gpu_check's engine step: a whole 1-stage training step through TeraPipeEngine (embedding, decoder
blocks, head, loss, DeepSpeed's optimizer step) per slice count, the blocks eager against captured
(``terapipe.cuda_graphs``, ``tp_trainer/model/cuda/captured_blocks.py``) and captured with each block
compiled around its attention (``terapipe.compile_blocks``: ``_gpu_capture.compile_backend``), and captured with
the RMSNorms fused (``terapipe.fused_rms_norm``). One rank, started by
``tests/multirank.run_ranks`` from ``_gpu_slices.engine_step``:

    _gpu_stage.py OUT_JSON [--tiny] [--no_compiled] [--seconds S] [--start K]

On a GPU: the Llama 7B-width pair (2 layers, width 4096, 32 heads, 8 KV heads, MLP 11008, vocabulary
32000, ~0.62 B parameters) at seq 8192, batch 1, bf16 (DeepSpeed's bf16 optimizer, ZeRO 0, torch's
AdamW), gpipe, 1 and 8 uniform slices. ``--tiny`` (a CPU, in the tests): a Llama of width 64 at seq
128, fp32, 1 and 4 slices; the captured blocks then run eagerly through the same object. Each variant
is a fresh engine from the same seed; ``ms`` is the median wall time of ``train_batch`` (the device
synchronized before and after) over REPEATS steps after WARMUP, ``loss`` the last step's loss.
OUT_JSON is rewritten after each engine (a rank stopped midway leaves what it finished); ``--seconds``:
no engine starts after that many seconds (those are listed in "not_run"). The rank stops at the first
engine that fails (its error: ``_gpu_profile.failure_text``); ``--start K`` runs ``variants()[K:]`` in a
fresh process, adding to OUT_JSON.
Weight gradients as the engine runs them by default (``defer_weight_grads``): scheduled W's with the
blocks eager; with them captured, the blocks' once per sequence inside their graphs (``weight_grads``
says which). Writes {"model", "seq_len", "dtype", "records": [{"slices", "blocks", "ms", "loss",
"weight_grads", "peak_mib"}], "errors", "not_run"}; "peak_mib": the most memory the engine held, from
its start to its last step (``_gpu_attention_memory.variant_peak``).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
WARMUP, REPEATS = 2, 5
# label: (hidden, heads, KV heads, intermediate, layers, vocabulary, seq_len, slice counts, precision)
SETS = {"llama-7b-pair": (4096, 32, 8, 11008, 2, 32000, 8192, (1, 8), "bf16"),
        "llama-w64": (64, 4, 2, 160, 2, 256, 128, (1, 4), "fp32")}


# blocks: (terapipe.cuda_graphs, compiled, terapipe.fused_rms_norm), the compiled one last (its compile
# should not cost the others). fused_rms_norm is set either way: false keeps HF's norms, which the
# engine's default ("auto") fuses on CUDA, so "captured" against "captured, fused norm" is that choice.
BLOCKS = {"eager": (False, False, False), "captured": (True, False, False),
          "captured, fused norm": (True, False, True), "captured, compiled": (True, True, False)}


def ds_config(seq_len: int, slices: int, captured: bool, precision: str, compiled: str | None = None,
              fused_norm: bool = False) -> dict:
    # 1 microbatch x 1 sequence x seq_len tokens a step, one rank
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
              "pipeline": {"stages": 1},
              "terapipe": {"seq_len": seq_len, "slices": f"uniform:{slices}", "schedule": "gpipe",
                           "cuda_graphs": captured, "compile_blocks": compiled, "fused_rms_norm": fused_norm,
                           "bind_cores": False}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def batches(vocab: int, seq_len: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One microbatch (input ids, labels) of random tokens."""
    tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(step))
    return [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]


def timed_steps(engine, vocab: int, seq_len: int) -> tuple[float, float]:
    """(median ms of a train_batch, the last loss)."""
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    times, loss = [], None
    for step in range(WARMUP + REPEATS):
        data = iter(batches(vocab, seq_len, step))
        accel.synchronize()
        start = time.perf_counter()
        loss = float(engine.train_batch(data))
        accel.synchronize()
        if step >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), loss


def variants(label: str, compiled: bool = True) -> list[tuple[str, int, str]]:
    """(name, slices, blocks) of each engine the step times, in order: blocks eager, captured, then
    (``compiled``) captured and compiled, the compiled last (its compile should not cost the others)."""
    return [(f"{slices} slices, {blocks}", slices, blocks) for blocks, (_, compile_them, _) in BLOCKS.items()
            if compiled or not compile_them for slices in SETS[label][7]]


def measure(label: str, path: str, compiled: bool = True, seconds: float | None = None, start: int = 0) -> dict:
    """Time ``variants(label, compiled)[start:]``, adding to what ``path`` holds when ``start`` > 0.
    Stops at the first engine that fails: a failed capture can leave the process's device unusable
    (its random generator still in capture mode), so ``_gpu_slices.engine_step`` starts the rest in a
    fresh process."""
    from transformers import LlamaConfig

    from _gpu_attention_memory import variant_peak
    from _gpu_capture import compile_backend
    from _gpu_profile import failure_text
    from tp_trainer.checkpoint import meta_model
    from tp_trainer.initialize import initialize
    hidden, heads, kv_heads, inter, layers, vocab, seq_len, _, precision = SETS[label]
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                         max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    out = {"model": label, "seq_len": seq_len, "dtype": precision, "records": [], "errors": {}, "not_run": []}
    if start:
        with open(path, encoding="utf-8") as handle:
            out = json.load(handle)
    stop_at = None if seconds is None else time.monotonic() + seconds
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = compile_backend(device)
    for name, slices, blocks in variants(label, compiled)[start:]:
        captured, compile_them, fused_norm = BLOCKS[blocks]
        if stop_at is not None and time.monotonic() >= stop_at:
            out["not_run"].append(f"engine step, {name}")
            continue
        try:
            ds = ds_config(seq_len, slices, captured, precision, backend if compile_them else None, fused_norm)
            with variant_peak(device) as peak:   # the engine's weights, optimizer state and graph pools too
                engine, *_ = initialize(meta_model(config), ds, seed=1)
                ms, loss = timed_steps(engine, vocab, seq_len)
            out["records"].append({"slices": slices, "blocks": blocks, "ms": ms, "loss": loss,
                                   "weight_grads": engine.weight_grads_mode,
                                   "compile_backend": backend if compile_them else None, "peak_mib": peak["mib"]})
            print(f"[gpu_check] engine step, {label} seq {seq_len}, {name}: {ms:.2f} ms (loss {loss:.4f})",
                  flush=True)
        except Exception as err:  # noqa: BLE001 -- the other variants still run (in a fresh process)
            out["errors"][name] = failure_text(err)
            print(f"[gpu_check] engine step, {name}: FAILED\n{out['errors'][name]}", flush=True)
            break
        engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _write(out, path)   # what is finished, should the rank be stopped
    _write(out, path)
    return out


def _write(out: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(out, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_json")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no_compiled", action="store_true")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--start", type=int, default=0, help="the first of variants() to run; OUT_JSON holds the earlier")
    args = parser.parse_args()
    measure("llama-w64" if args.tiny else "llama-7b-pair", args.out_json, not args.no_compiled, args.seconds,
            args.start)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors
