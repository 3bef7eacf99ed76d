"""Resume in bf16 and fp16 (tp_trainer/resume.py, the layout-free form), inside precision_worker's
2-rank launch: a 2-stage run saves at step SAVED and trains on to STEPS; the same global batches
then continue from its checkpoint on another layout (1 stage x 2 replicas, ZeRO 0 <-> 1) and, for
bf16 without ZeRO (whose DeepSpeed files DeepSpeed cannot load), on its own layout.

Per run: the losses of the steps after SAVED, and for fp16 the loss scale after loading.
"""

from __future__ import annotations

import os

import exactness_cases as ec

SAVED, STEPS = 2, 5
# name: (precision, the saving run's ZeRO stage, the resumed runs: (stages, ZeRO stage) each, torch's
# AdamW or DeepSpeed's FusedAdam). bf16 takes torch's: on its own layout the steps must be equal bit
# for bit, and DeepSpeed's FusedAdam on the CPU continues a reloaded state only to ~1e-6 of the loss.
# fp16 takes FusedAdam: DeepSpeed's fused FP16_Optimizer (flat fp32 groups); the exactness cases
# with torch's AdamW run its FP16_UnfusedOptimizer (per-parameter fp32 copies).
RESUMES = {"bf16": ("bf16", 0, ((1, 1), (2, 0)), True),
           "fp16": ("fp16", 0, ((1, 0), (1, 1)), False),
           "fp16-unfused": ("fp16", 0, ((1, 1),), True)}


def _case(stages: int) -> dict:
    """The same global batch (4 sequences) on either layout: 2 stages x 1 replica x 2 microbatches
    of 2, or 1 stage x 2 replicas x 1 microbatch of 2 (``ec.batches`` draws both alike)."""
    return ec._case(stages, 2 if stages == 2 else 1, "uneven", True, "1f1b", replicas=1 if stages == 2 else 2)


def _config(name: str, stages: int, zero: int) -> dict:
    import precision_cases as pc
    precision, torch_adam = RESUMES[name][0], RESUMES[name][3]
    config = ec.ds_config(_case(stages))
    config["optimizer"]["params"]["torch_adam"] = torch_adam
    config["zero_optimization"] = {"stage": zero}
    config[precision] = pc.FP16 if precision == "fp16" else {"enabled": True}
    return config


def _train(name: str, stages: int, zero: int, out: str, steps: range, save_at: int | None = None,
           resume: bool = False, cuda_graphs: bool = False) -> dict:
    from deepspeed import comm as dist

    import pipeline_harness

    from tp_trainer import resume as tp_resume
    from tp_trainer.checkpoint import optimizer_state
    from tp_trainer.initialize import initialize
    from tp_trainer.resume_checks import check_resume
    model = ec.tiny_model(True)
    config = _config(name, stages, zero)
    config["terapipe"]["cuda_graphs"] = cuda_graphs
    engine, *_ = initialize(model, config)
    case, replica = _case(stages), engine.grid.data_parallel_id
    result = {"losses": {}, "same_layout": None, "optimizer": type(engine.optimizer).__name__}
    if resume:
        point = check_resume(out, "latest", config, lambda vocab: model.config, dist.get_world_size())
        result["same_layout"] = tp_resume.load(engine, point)[2]
        result["loss_scale"] = optimizer_state.loss_scale_state(engine)
    # what reaches the parameters when the blocks are captured, after the load
    at_capture = pipeline_harness.count_at_capture(engine) if cuda_graphs else None
    for step in steps:
        batches = ec.batches(case, step, replica if stages == 1 else None)
        result["losses"][step] = float(engine.train_batch(iter(batches)))
        if step + 1 == save_at:
            tp_resume.save(engine, tp_resume.checkpoint_dir(out), save_at, save_at * engine.train_batch_size(),
                           model.config)
            result["saved_loss_scale"] = optimizer_state.loss_scale_state(engine)
    if at_capture is not None:
        result["graphs_reaching_params"] = at_capture["count"]
    return result


def resume_runs(out_dir: str) -> dict:
    """{"<precision>/unbroken" | "<precision>/<stages>x<zero>": run} (module docstring)."""
    results = {}
    for name, (_, zero, resumed, _) in RESUMES.items():
        out = os.path.join(out_dir, f"resume-{name}")
        results[f"{name}/unbroken"] = _train(name, 2, zero, out, range(STEPS), save_at=SAVED)
        for stages, resumed_zero in resumed:
            results[f"{name}/{stages}x{resumed_zero}"] = _train(name, stages, resumed_zero, out,
                                                                  range(SAVED, STEPS), resume=True)
    # terapipe.cuda_graphs after a load (its units run eagerly on a CPU)
    results["bf16/2x0 captured"] = _train("bf16", 2, 0, os.path.join(out_dir, "resume-bf16"), range(SAVED, STEPS),
                                          resume=True, cuda_graphs=True)
    return results
