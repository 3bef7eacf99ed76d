"""launch/train.py: bad input stops before any work with one message; the main job trains."""

import glob
import json
import logging
import os
import re
import subprocess

import pytest
from multirank import free_port, train_ranks
from small_run import small_config

from tp_trainer.cpu_binding import cores_text, machine_cpus, share
from tp_trainer.run import RunArgs, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "ds_configs", "gpt2_tiny_cpu.json")


def write_config(tmp_path, **changes):
    config = json.load(open(TINY))
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if key:
            config.setdefault(section, {})[key] = value
        else:
            config[section] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


BAD_INPUTS = [
    ({"terapipe.slices": [100, 100]}, 2, {}, "terapipe.slices: slices [100, 100] sum to 200"),
    ({"terapipe.slices": [128, 0, 128]}, 2, {}, "terapipe.slices: every slice must be a positive integer, got [128, 0, 128]"),
    ({"terapipe.slices": [300, -44]}, 2, {}, "terapipe.slices: every slice must be a positive integer, got [300, -44]"),
    ({"terapipe.seq_len": 2048, "terapipe.slices": "uniform:4"}, 2, {},
     "terapipe.seq_len: 2048 exceeds the model's 1024 positions"),
    ({"pipeline.stages": 8}, 8, {}, "pipeline.stages: 8 stages but the model has only 4 decoder layers"),
    ({"pipeline.stages": 3}, 2, {}, "pipeline.stages: world size 2 is not divisible by 3"),
    ({"zero_optimization": {"stage": 2}}, 2, {}, "zero_optimization.stage: 2 cannot be combined"),
    ({"terapipe.schedule": "zigzag"}, 2, {}, "terapipe.schedule: unknown schedule 'zigzag'"),
    ({}, 2, {"train_file": "/nonexistent/train.txt"}, "train_file"),
    ({}, 2, {"resume": "latest"}, "--resume latest: no complete checkpoint"),
    ({}, 2, {"config_name": "gpt5"}, "--config_name: unknown preset 'gpt5'"),
    ({}, 2, {"max_steps": 0}, "--max_steps: must be >= 1, got 0"),
    ({"terapipe.slices": "auto", "terapipe.cost_model": "COST"}, 2, {},
     "terapipe.cost_model: COST was measured for 3 stages of hidden size 64, this run has 2 stages of hidden size 256"),
    ({"terapipe.slices": "auto", "terapipe.cost_model": "COST_FP32", "bf16": {"enabled": True}}, 2, {},
     "terapipe.cost_model: COST_FP32 was measured in fp32, this run computes in bf16"),
    ({"terapipe.microbatches": "auto"}, 2, {}, "terapipe.microbatches: \"auto\" needs \"slices\": \"auto\""),
    ({}, 2, {"model_name_or_path": "/nonexistent/ckpt"}, "/nonexistent/ckpt"),
    ({"terapipe.cuda_graphs": True, "zero_optimization": {"stage": 1}}, 2, {},
     "terapipe.cuda_graphs: ZeRO stage 1 hooks every parameter's gradient"),
    ({"terapipe.cuda_graphs": True}, 2, {"packing": "examples"},
     "--packing examples: several examples per row change the attention"),
    # sequence ranks: the world, the slices, the heads
    ({"terapipe.sequence_parallel": 2}, 2, {}, "pipeline.stages: world size 2 is not divisible by 2 stages x 2 "
                                               "sequence ranks; launch a multiple of 4 ranks"),
    ({"terapipe.sequence_parallel": 2, "pipeline.stages": 1, "terapipe.slices": [81, 71, 56, 48]}, 2, {},
     "terapipe.slices: with terapipe.sequence_parallel 2 every slice length must be a multiple of 2"),
    ({"terapipe.sequence_parallel": 3, "pipeline.stages": 1, "terapipe.seq_len": 255, "terapipe.slices": "uniform:5"},
     3, {}, "terapipe.sequence_parallel: 3 does not fit the model: its 4 attention heads do not split over 3"),
    ({"pipeline.stages": 1}, 2, {"sequence_parallel": 0}, "terapipe.sequence_parallel: must be a positive integer"),
]


@pytest.mark.parametrize("changes,world,extra,message", BAD_INPUTS, ids=[m[:30] for *_, m in BAD_INPUTS])
def test_bad_input_stops_before_work(tmp_path, monkeypatch, caplog, changes, world, extra, message):
    if changes.get("terapipe.cost_model") == "COST":  # a real cost model, of another model
        from tp_trainer.planner.cost_model import PipelineCost, StageCost
        cost_file = str(tmp_path / "cost.json")
        PipelineCost([StageCost([0.0] * 4, [0.0] * 4, hidden=64) for _ in range(3)]).save(cost_file)
        changes = {**changes, "terapipe.cost_model": cost_file}
        message = message.replace("COST", cost_file)
    if changes.get("terapipe.cost_model") == "COST_FP32":  # this model's, profiled in fp32 (no "dtype")
        from tp_trainer.planner.cost_model import PipelineCost, StageCost
        cost_file = str(tmp_path / "cost.json")
        PipelineCost([StageCost([0.0] * 4, [0.0] * 4, hidden=256) for _ in range(2)]).save(cost_file)
        changes = {**changes, "terapipe.cost_model": cost_file}
        message = message.replace("COST_FP32", cost_file)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        run(RunArgs(deepspeed_config=write_config(tmp_path, **changes), output_dir=str(out), **extra))
    assert stop.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists(), "nothing may be written on bad input"


@pytest.mark.skipif(bool(__import__("deepspeed").accelerator.get_accelerator().is_fp16_supported()),
                    reason="this machine computes in fp16")
def test_fp16_refused_where_unsupported(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    args = RunArgs(deepspeed_config=write_config(tmp_path, fp16={"enabled": True}), output_dir=str(out))
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit):
        run(args)
    assert "fp16.enabled: the cpu accelerator of this machine does not support fp16" in caplog.text
    assert not out.exists()


def test_invalid_json_config(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RANK", "0")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit):
        run(RunArgs(deepspeed_config=str(bad), output_dir=str(tmp_path / "run")))
    assert "--deepspeed_config: " in caplog.text and "is not valid JSON" in caplog.text
    assert not (tmp_path / "run").exists()


def launch(tmp_path, *flags, config=TINY, env=None):
    """Run the README's launcher command (2 CPU ranks) with extra flags; return rank 0's log (conftest
    removes the CPU all-reduce buffers DeepSpeed leaves in /dev/shm, tp_trainer/ds_compat/shm.py)."""
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
           "--deepspeed_config", config, *flags]
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log


def logged(log: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(r"\[rank 0\] [\d:]+ " + pattern, log)]


needs_launcher = pytest.mark.requires_command("deepspeed")  # conftest: a failure under CI=true


# The project files one steady-state training step runs, outside the model's layers (tp_trainer/model/):
# the loop, the engine, the transfers, the DeepSpeed seam and the data (the memory hooks only under
# --memory_report, off by default). At most 6; docs/ARCHITECTURE.md lists them.
STEP_FILES = {"tp_trainer/run.py", "tp_trainer/engine.py", "tp_trainer/p2p.py", "tp_trainer/ds_compat/__init__.py",
              "tp_trainer/data/packing.py"}


@needs_launcher
def test_launcher_trains_two_stages(tmp_path):
    """The main job: it trains, writes its plan, its log and DeepSpeed's CSV monitor events, each rank says
    where it runs; its step 5 (steady state) runs code from at most 6 project files outside the layers."""
    from small_run import fault_env
    out, files = tmp_path / "run", tmp_path / "files"
    files.mkdir()
    config = json.load(open(TINY))
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = fault_env(dict(os.environ, TP_TEST_STEP_FILES=str(files)), "step_files:5")
    log = launch(tmp_path, "--max_steps", "8", "--eval_interval", "8", "--eval_batches", "1",
                 "--output_dir", str(out), "--no_save_hf", config=str(tmp_path / "ds.json"), env=env)
    losses = logged(log, r"step \d+ loss ([\d.]+)")
    assert len(losses) == 8, log[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert json.loads((out / "plan.json").read_text())["slices"] == [80, 72, 56, 48]
    assert re.search(r"\[rank 0\] [\d:]+ plan: .*, schedule gpipe, 2 stages, weight gradients: W, slice attention "
                     r"auto \(every slice: the CPU flash kernel\)\n", log), log[-3000:]
    assert json.loads((out / "plan.json").read_text())["attention"] == {
        "kernel": "auto", "kinds": {"every slice": "the CPU flash kernel"}}   # no fallback: none recorded
    assert not (out / "hf_model").exists()
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9)) and all(r["step_s"] > 0 for r in records), records
    for rank in (0, 1):  # terapipe.bind_cores (on by default): every rank says where it runs
        cores, why = share(sorted(os.sched_getaffinity(0)), machine_cpus(), rank, 2)
        said = f"local rank {rank} of 2 bound to cores {cores_text(cores)}" if cores else why
        assert re.search(rf"\[rank {rank}\] [\d:]+ cpu: .*{re.escape(said)}", log), log[-3000:]
    csv = {name: (tmp_path / "csv" / "tiny" / f"{name}.csv").read_text().splitlines()
           for name in ("Train_Samples_train_loss", "Train_Samples_lr", "Validation_loss")}
    rows = [line.split(",") for line in csv["Train_Samples_train_loss"][1:]]
    assert [int(r[0]) for r in rows] == [8 * k for k in range(1, 9)], csv   # global samples after each step
    assert [round(float(r[1]), 4) for r in rows] == [round(x, 4) for x in losses], (rows, losses)
    assert len(csv["Train_Samples_lr"]) == 9 and len(csv["Validation_loss"]) == 3, csv
    for rank in (0, 1):
        ran = {os.path.relpath(f, REPO) for f in (files / f"rank{rank}.txt").read_text().split()
               if os.path.abspath(f).startswith(os.path.join(REPO, "tp_trainer") + os.sep)}
        outside = {f for f in ran if not f.startswith("tp_trainer/model/")}
        assert outside <= STEP_FILES and len(STEP_FILES) <= 6, (rank, sorted(outside - STEP_FILES))


def stdlib_text(*packages: str) -> str:
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for p in packages for f in glob.glob(os.path.join(root, p, "*.py")))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def test_local_files_validation_and_checkpoint_round_trip(tmp_path):
    """--train_file/--validation_file: validation perplexity falls; the exported HF directory
    resumes with --model_name_or_path at exactly the perplexity the first run ended with."""
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text(stdlib_text("json", "email", "asyncio"))
    val.write_text(stdlib_text("http"))
    files = ["--train_file", str(train), "--validation_file", str(val), "--eval_batches", "2"]
    # ranks started directly: the launcher is test_launcher_trains_two_stages'
    first, config = tmp_path / "first", small_config(tmp_path)
    log = train_ranks(2, ["--deepspeed_config", config, *files, "--max_steps", "6", "--eval_interval", "3",
                          "--output_dir", str(first)])
    ppl = logged(log, r"step \d+ validation loss [\d.]+ perplexity ([\d.]+)")
    assert len(ppl) == 3 and ppl[0] > ppl[1] > ppl[2], ppl
    hf_dir = first / "hf_model"
    assert (hf_dir / "config.json").exists() and (hf_dir / "model.safetensors.index.json").exists()
    log = train_ranks(2, ["--deepspeed_config", config, *files, "--model_name_or_path", str(hf_dir), "--max_steps", "3",
                          "--eval_interval", "3", "--output_dir", str(tmp_path / "second"), "--no_save_hf"])
    resumed = logged(log, r"step \d+ validation loss [\d.]+ perplexity ([\d.]+)")
    assert resumed[0] == pytest.approx(ppl[-1], rel=1e-4), (resumed, ppl)
    assert resumed[-1] < resumed[0], resumed


def test_auto_slices_config(tmp_path):
    """ds_configs/gpt2_auto_cpu.json: profile, plan, print the plan and its prediction, train. Its
    profile shortened from 15 to 3 s a stage (the test checks the path, not the plan's quality); the
    ranks started directly (multirank.train_ranks: the launcher is test_launcher_trains_two_stages')."""
    with open(os.path.join(REPO, "ds_configs", "gpt2_auto_cpu.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    config["terapipe"]["profile_seconds"] = 3
    (tmp_path / "auto.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    log = train_ranks(2, ["--deepspeed_config", str(tmp_path / "auto.json"), "--max_steps", "1", "--eval_interval",
                          "100", "--eval_batches", "1", "--no_save_hf", "--output_dir", str(out)])
    assert 'slice planner (terapipe.slices "auto")' in log and "predicted iteration" in log
    plan = json.loads((out / "plan.json").read_text())
    assert sum(plan["slices"]) == 1024 and all(s % 8 == 0 for s in plan["slices"])
    assert "uniform:" in (out / "plan.txt").read_text()
    meta = json.loads((out / "cost_model.json").read_text())["meta"]  # a --resume plans from it
    assert {k: meta[k] for k in ("device", "dtype", "fused_norm")} == {"device": "cpu", "dtype": "fp32",
                                                                       "fused_norm": False}, meta


def test_auto_slices_with_captured_blocks(tmp_path):
    """"slices": "auto" with cuda_graphs: the blocks profiled as they run (captured units; eagerly unit by
    unit on a CPU), the plan may cut a block or share a half between the stages, and the captured
    run trains on it (the halves run inside the captured units)."""
    with open(os.path.join(REPO, "ds_configs", "gpt2_auto_cpu.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    config["terapipe"].update(profile_seconds=3, cuda_graphs=True)
    (tmp_path / "auto.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    log = train_ranks(2, ["--deepspeed_config", str(tmp_path / "auto.json"), "--max_steps", "2", "--eval_interval",
                          "2", "--eval_batches", "1", "--no_save_hf", "--output_dir", str(out)])
    assert "inside their captured graphs" in log and "step 2 validation loss" in log
    meta = json.loads((out / "cost_model.json").read_text())["meta"]
    assert meta["cuda_graphs"] is True and sum(json.loads((out / "plan.json").read_text())["slices"]) == 1024


def test_auto_run_keeps_its_cost_model(tmp_path):
    """A fresh "auto" run writes its profile into the output dir (never reading an older one there);
    its --resume reads it; an explicit terapipe.cost_model always wins."""
    from tp_trainer.checks import keep_cost_model
    out = tmp_path / "run"
    fresh = {"slices": "auto"}
    keep_cost_model(fresh, str(out), None)
    assert fresh["cost_model"] == str(out / "cost_model.json")
    out.mkdir()
    (out / "cost_model.json").write_text("{}")
    again, resumed, explicit, fixed = {"slices": "auto"}, {"slices": "auto"}, {"slices": "auto", "cost_model": "c.json"}, {
        "slices": "uniform:4"}
    keep_cost_model(again, str(out), None)
    keep_cost_model(resumed, str(out), "latest")
    keep_cost_model(explicit, str(out), "latest")
    keep_cost_model(fixed, str(out), "latest")
    assert "cost_model" not in again and resumed["cost_model"] == str(out / "cost_model.json")
    assert explicit["cost_model"] == "c.json" and "cost_model" not in fixed
