"""Slice planner (TeraPipe's DP over a cost model measured on this machine).

    cost_model.PipelineCost / StageCost   fitted t(b, l, c) per stage + p2p + step time, JSON
    profile.profile_stage                 time a stage's real layers over a (b, l, c) grid
    dp.plan_batch -> dp.PlannedBatch      the exact DP (microbatch split + slicing per microbatch)
    predict.predict_time                  iteration time from the simulated schedule
    layer_cost.plan_layout                the stage split and the slices together, from per-layer costs
                                          (prefix, one block, suffix of a probe model, profiled)
    refine.refine_slices                  the chosen slices moved while the simulated step falls
    memory_model / memory_plan            predicted peak per stage; the fastest plan (slices, order,
                                          checkpointing per stage) under terapipe.memory_limit_gib
    analytic / gpu_model                  FLOP / byte costs without measurement: the paper-scale DeviceSpec,
                                          a model's parts on an H100 / H200 calibrated on the committed figures
    analytic_memory                       each stage's memory from the model's shape (the dry run's)
    auto.measured_layout                  "slices": "auto" before the model is built (collective)
    cli.main                              python -m tp_trainer.planner (__main__.py)
"""
