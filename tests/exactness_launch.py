"""The exactness launches (one of ``exactness_worker.py`` per world size), shared by every test module
of a session: test_exactness.py checks each case against plain HF, test_lora.py the LoRA cases'
adapters, base weights and optimizer state, test_nccl_model.py the deepspeed.comm calls recorded at
their end. A world is launched on first use, so a module that needs only some worlds (test_lora.py:
2, 3 and 4 ranks) starts only those.
"""

from __future__ import annotations

import os

import exactness_cases as ec
import packed_cases
import pipeline_harness as harness
import sequence_cases
from multirank import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "exactness_worker.py")
WORLDS = (1, 2, 3, 4)
WORLD_OF = {case["name"]: world for world in WORLDS
            for case in ec.cases(world) + packed_cases.cases(world) + sequence_cases.cases(world)
            + sequence_cases.packed(world) + sequence_cases.bf16_cases(world) + sequence_cases.auto_cases(world)}


class ExactnessRuns:
    """{"<case name>@f64" / "@f32": results merged over the ranks of its launch}; ``dirs``: the
    launches' output directories (exports and per-rank files); "_dirs" as a key, the same."""

    def __init__(self, tmp_path_factory):
        self.factory, self.results, self.dirs, self.world_dirs = tmp_path_factory, {}, [], {}

    def launch(self, world: int) -> str:
        """The output directory of ``world``'s launch (run now if it has not been)."""
        if world not in self.world_dirs:
            out_dir = self.factory.mktemp(f"world{world}")
            run_ranks(WORKER, world, [str(world), str(out_dir)], timeout=600)
            self.results.update(harness.merge_ranks(out_dir, world))
            self.dirs.append(out_dir)
            self.world_dirs[world] = out_dir
        return self.world_dirs[world]

    def __getitem__(self, key: str):
        if key == "_dirs":
            return self.dirs
        self.launch(WORLD_OF[key.split("@")[0]])
        return self.results[key]
