"""Measures a small Llama-style block (rotary, grouped-query attention) the way the planner's profile
does, in a process of its own: the measurements are RSS-based, and a pytest process that has run
other tests first leaves its allocator in a state that moves them by megabytes (in the full suite the
fit itself came out wrong). test_memory_measure runs this once and checks what it prints.

Usage: memory_measure_worker.py   (prints one JSON object on its last line)
{"parts": {name: PartMemory fields}, "points": {name: [[l, c, checkpointed, predicted, got], ...]}}
"""

import dataclasses
import json

import torch
from transformers import LlamaConfig

from tp_trainer.memory import leaned
from tp_trainer.planner.layer_cost import probe_parts
from tp_trainer.planner.memory_model import _checkpointed_unit, _plain_unit, measure_part
from tp_trainer.planner.profile import StageRunner

HIDDEN, HEADS, KV_HEADS, SEQ = 128, 4, 2, 16384
# points the fit does not see: a short slice late in the sequence (the context term), mid, long late
NEW_POINTS = [(256, SEQ - 256), (768, SEQ // 2), (1536, SEQ - 1536)]


def main():
    torch.set_num_threads(1)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=HIDDEN * 8 // 3, vocab_size=512,
                         max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    parts, ctx, _ = probe_parts(config)
    memory = {name: measure_part(funcs, ctx, HIDDEN, SEQ) for name, funcs in parts.items()}
    points = {}
    with leaned():
        for name in ("attn", "mlp", "suffix"):
            runner, rows = StageRunner(parts[name], ctx, HIDDEN, SEQ), []
            for l, c in NEW_POINTS:
                back = _plain_unit(runner, ctx, l, c)[2]
                ckpt = _checkpointed_unit(runner, ctx, l, c)[1]
                for got, checkpointed in ((back, False), (ckpt, True)):
                    rows.append([l, c, checkpointed, memory[name].transient(1, l, c, checkpointed), got])
            points[name] = rows
    print(json.dumps({"parts": {name: dataclasses.asdict(part) for name, part in memory.items()},
                      "points": points}))


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
