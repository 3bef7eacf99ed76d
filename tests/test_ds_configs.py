"""Every shipped ds_configs/*.json passes the run's input checks, and its comment's arithmetic is its own.

Most of these files are not launched by any test (4-rank layouts, fp16 on a GPU, bf16, checkpointing),
so a renamed field or a stale figure would reach a user first. The GPU recipes among them are checked
by their dry runs (tests/test_dry_run.py); their comments' arithmetic here too. Each is checked here as ``launch/train.py``
checks it before any work (``checks.validate`` on the world size the file describes: its stages x its
replicas), and the ``_comment``'s products (``4 microbatches x 2 sequences x 256 tokens = 2048
tokens/step``) must multiply out and name the file's own numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from tp_trainer.checks import validate
from tp_trainer.config import ConfigError
from tp_trainer.run import RunArgs

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
# the GPU recipes (a "_dry_run" command each): their checks run in their dry run, judged for the GPU they
# name with the model they name (tests/test_dry_run.py), not on this CPU with the default preset
ON_THIS_CPU = [p for p in CONFIGS if "_dry_run" not in json.loads(p.read_text())]
sys.path.insert(0, str(REPO / "launch"))
FACTOR = r"\d+ (?:pipeline |data-parallel )?[a-z]+"
PRODUCT = re.compile(rf"((?:{FACTOR} x )+{FACTOR}) = (\d+) (tokens/step|sequences per step)")
LAYOUT = re.compile(r"(\d+) (?:pipeline )?stages x (\d+) (?:data-parallel )?replicas?")
WORDS = {"microbatch": "microbatches", "microbatches": "microbatches", "sequence": "sequences",
         "sequences": "sequences", "token": "tokens", "tokens": "tokens", "replica": "replicas",
         "replicas": "replicas", "stages": "stages"}


def layout(config: dict) -> dict:
    """The numbers a comment may name, by the word that follows them."""
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    return {"microbatches": accumulation, "sequences": micro, "tokens": config.get("terapipe", {}).get("seq_len", 1024),
            "replicas": config["train_batch_size"] // (micro * accumulation),
            "stages": config.get("pipeline", {}).get("stages", 1)}


def factors(text: str):
    """[(number, what it counts)] of ``"4 microbatches x 2 sequences x 2 data-parallel replicas"``."""
    for part in text.split(" x "):
        number, *words = part.split(" ")
        yield int(number), WORDS.get(words[-1], words[-1])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_comment_arithmetic_is_the_files_own(path):
    config = json.loads(path.read_text())
    numbers = layout(config)
    comment = config["_comment"]
    products, layouts = PRODUCT.findall(comment), LAYOUT.findall(comment)
    assert products and layouts, f"{path.name}: its _comment must show 'S stages x R replicas' and 'a x b = c'"
    for stages, replicas in layouts:
        assert (int(stages), int(replicas)) == (numbers["stages"], numbers["replicas"]), (
            f"{path.name}: '{stages} stages x {replicas} replicas' but the file makes "
            f"{numbers['stages']} x {numbers['replicas']}")
    for text, total, unit in products:
        pairs = list(factors(text))
        assert math.prod(n for n, _ in pairs) == int(total), f"{path.name}: {text} != {total}"
        for number, what in pairs:
            assert what in numbers, f"{path.name}: '{number} {what}' counts nothing this test knows"
            assert numbers[what] == number, f"{path.name}: '{number} {what}' but the file says {numbers[what]}"
        per_step = config["train_batch_size"] * (numbers["tokens"] if unit == "tokens/step" else 1)
        assert int(total) == per_step, f"{path.name}: {total} {unit}, the file makes {per_step}"
    assert config["train_batch_size"] % (config["train_micro_batch_size_per_gpu"]
                                         * config["gradient_accumulation_steps"]) == 0, path.name


@pytest.mark.parametrize("path", ON_THIS_CPU, ids=[p.stem for p in ON_THIS_CPU])
def test_passes_the_runs_checks_on_its_own_layout(path, tmp_path, monkeypatch):
    import train  # launch/train.py's parser
    config = json.loads(path.read_text())
    numbers = layout(config)
    world = numbers["stages"] * numbers["replicas"]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    args = RunArgs.from_namespace(train.parse_args(["--deepspeed_config", str(path), "--output_dir",
                                                    str(tmp_path / "run")]))
    from deepspeed.accelerator import get_accelerator
    if config.get("fp16", {}).get("enabled") and not get_accelerator().is_fp16_supported():
        assert "GPU only" in config["_comment"], path.name
        with pytest.raises(ConfigError, match=r"fp16\.enabled: .* run this config on a GPU"):
            validate(args, world)
        return
    spec = validate(args, world)
    assert spec.pipeline.stages == numbers["stages"]
    slices = spec.pipeline.terapipe.slices
    if isinstance(slices, (list, tuple)):
        assert sum(slices) == numbers["tokens"], path.name
    assert not (tmp_path / "run").exists(), "the checks write nothing"
