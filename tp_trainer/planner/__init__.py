"""Slice planner (TeraPipe's DP over a cost model measured on this machine).

    cost_model.PipelineCost / StageCost   fitted t(b, l, c) per stage + p2p + step time, JSON
    profile.profile_stage                 time a stage's real layers over a (b, l, c) grid
    dp.plan_batch -> dp.PlannedBatch      the exact DP (microbatch split + slicing per microbatch)
    predict.predict_time                  iteration time from the simulated schedule
    auto.auto_slices / auto.auto_plan     "slices": "auto" at start-up (collective over ranks)
    cli.main                              python -m tp_trainer.planner (__main__.py)
"""
