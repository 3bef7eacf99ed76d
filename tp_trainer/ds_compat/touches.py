"""The catalogue: each DeepSpeed internal we rely on, what for, since when, and who uses it.

A ``Touch`` is checked by ``check.py``: the member exists on its owner (unless it is an attribute
set in ``__init__``: ``instance_attr``), its parameters start with ``params``, and the DeepSpeed
methods named in ``source`` still contain the given code (whitespace aside) - the behaviour we
depend on, not only the name. ``why`` is the touch's documentation.
"""

from __future__ import annotations

from dataclasses import dataclass

PINNED = "0.19.8"  # pyproject.toml; every touch below was checked against this release's source

PIPE_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
DS_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
PIPE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
BF16 = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
GRID = "deepspeed.runtime.pipe.topology:PipelineParallelGrid"
ZERO = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
FRAGMENT = "deepspeed.utils.tensor_fragment"
STATE = "tp_trainer/checkpoint/optimizer_state.py"
PIPE_SINCE = "0.3.0 (2020-09, the pipeline engine's first release)"


@dataclass(frozen=True)
class Touch:
    owner: str                      # "package.module:Class" or "package.module"
    member: str
    why: str
    since: str
    used_by: tuple[str, ...]
    params: tuple[str, ...] | None = None             # leading parameter names, self included
    source: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (method of owner, code it must contain)
    instance_attr: bool = False     # set in __init__, no class attribute: checked through ``source``

    @property
    def name(self) -> str:
        return f"{self.owner.rpartition(':')[2] or self.owner}.{self.member}"


OVERRIDES = (
    Touch(PIPE_ENGINE, "train_batch", "TeraPipeEngine owns the step: its train_batch runs the slice schedule, "
          "takes the loss and reports as DeepSpeed's does (the steps_per_print line, the train_loss monitor "
          "event, the train_batch timer); an upgrade that changes what DeepSpeed's reports must be followed "
          "there (ds_compat.report_step).", PIPE_SINCE,
          ("tp_trainer/engine.py", "tp_trainer/ds_compat/__init__.py", "tp_trainer/run.py"), params=("self", "data_iter"),
          source=(("train_batch", ("self.timers(TRAIN_BATCH_TIMER).start()", "'Train/Samples/train_loss'",
                                   "self.global_steps % self.steps_per_print() == 0")),)),
    Touch(PIPE_ENGINE, "eval_batch", "Evaluation slice by slice (forward-only schedule); callers pass "
          "data_iter and num_micro_batches only.", PIPE_SINCE, ("tp_trainer/engine.py", "tp_trainer/run.py"),
          params=("self", "data_iter")),
    Touch(DS_ENGINE, "clip_fp32_gradients", "Clipping by the norm of the whole pipeline, not of one stage: "
          "DeepSpeed calls it from _take_model_step for fp32 without ZeRO.", "checked 0.19.8",
          ("tp_trainer/engine.py",), params=("self",),
          source=(("_take_model_step", ("self.clip_fp32_gradients()",)),)),
    Touch(PIPE_MODULE, "_partition_layers", "Stage boundaries from our cost-balanced StageSplit; "
          "PipelineModule.__init__ calls it by name after the topology is known.", PIPE_SINCE,
          ("tp_trainer/model/stages/pipeline.py", "benchmarks/_compare_models.py"), params=("self", "method"),
          source=(("__init__", ("self._partition_layers(method=partition_method)",)),)),
    Touch(PIPE_MODULE, "_synchronize_tied_weights", "Broadcasts the tied weights from their first stage; "
          "ours runs it under torch.no_grad (no autograd warning at the first backward). __init__ and "
          "load_state_dir call it by name.", "checked 0.19.8", ("tp_trainer/model/stages/pipeline.py",), params=("self",),
          source=(("__init__", ("self._synchronize_tied_weights()",)),
                  ("load_state_dir", ("self._synchronize_tied_weights()",)))),
)

TOUCHES = (
    # ------------------------------------------------------------------ PipelineEngine: step protocol
    Touch(PIPE_ENGINE, "data_iterator", "LOAD takes each microbatch as DeepSpeed's _next_batch does: "
          "next(data_iterator), through batch_fn where one is set (set_dataiterator / set_batch_fn).",
          PIPE_SINCE, ("tp_trainer/engine.py",), instance_attr=True,
          source=(("_next_batch", ("batch = next(self.data_iterator)", "if self.batch_fn:")),)),
    Touch(PIPE_ENGINE, "_exec_reduce_grads", "Data-parallel reduction at a forced accumulation boundary "
          "(ds_compat.reduce_grads); tests wrap it to capture gradients.", PIPE_SINCE,
          ("tp_trainer/ds_compat/__init__.py", "tests/pipeline_harness.py"), params=("self",),
          source=(("_exec_reduce_grads", ("self._force_grad_boundary = True",)),)),
    Touch(PIPE_ENGINE, "_exec_optimizer_step", "Optimizer step at a forced accumulation boundary "
          "(ds_compat.optimizer_step); tests wrap it on the instance.", PIPE_SINCE,
          ("tp_trainer/ds_compat/__init__.py", "tests/pipeline_harness.py"),
          params=("self", "lr_kwargs"), source=(("_exec_optimizer_step", ("self._take_model_step(lr_kwargs)",)),)),
    Touch(PIPE_MODULE, "get_tied_weights_and_groups", "ds_compat.reduce_tied_grads sums each (weight, group) "
          "as DeepSpeed's _exec_reduce_tied_grads does.", PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",),
          params=("self",)),
    Touch(PIPE_ENGINE, "_exec_reduce_tied_grads", "ds_compat.reduce_tied_grads mirrors it (ZeRO <= 1), with "
          "DeepSpeed's shared-memory all-reduce on one CPU machine; if DeepSpeed changes what it sums, the "
          "mirror must follow.", PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",), params=("self",),
          source=(("_exec_reduce_tied_grads", ("grad = weight._hp_grad if self.using_bf16_optimizer else weight.grad",
                                               "dist.all_reduce(grad, group=group)")),)),
    Touch("deepspeed.comm.torch:TorchBackend", "inference_all_reduce", "reduce_tied_grads sums a tied gradient "
          "(fp32; bf16 / fp16 on CPUs with AVX-512BW, which their code needs) with DeepSpeed's CPU shared-memory "
          "kernel (ds_compat.shared_memory_reduce), which reduces over every rank whatever the group: used "
          "only where the group is the whole world. Its C++ side "
          "(shm_interface.cpp: buffers mapped only where LOCAL_SIZE equals the world size; dtypes other than "
          "fp32 / bf16 / fp16 left unreduced) cannot be read from Python: the guard encodes it.",
          "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",), params=("self", "tensor", "op"),
          source=(("inference_all_reduce", ("return torch.ops.deepspeed.inference_all_reduce_(tensor)",)),)),
    Touch(BF16, "_hp_grad", "reduce_tied_grads sums a tied weight's gradient buffer under the bf16 optimizer, as "
          "_exec_reduce_tied_grads does.", "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",),
          instance_attr=True, source=(("_update_hp_grad", ("lp._hp_grad = hp_grad",)),)),
    Touch(PIPE_ENGINE, "using_bf16_optimizer", "Set in __init__ when DeepSpeed wrapped the optimizer in "
          "BF16_Optimizer (ds_compat.uses_bf16_optimizer).", "0.6.x (BF16_Optimizer), checked 0.19.8",
          ("tp_trainer/ds_compat/__init__.py", "tp_trainer/ds_compat/grad_fold.py", "tests/precision_worker.py"),
          instance_attr=True, source=(("__init__", ("self.using_bf16_optimizer = type(self.optimizer) == BF16_Optimizer",)),)),
    Touch(PIPE_ENGINE, "_exec_backward_pass", "ds_compat.inner_stage_backward mirrors its inner-stage "
          "branch, less the bf16 optimizer's clear_lp_grads / update_hp_grads around the backward (both "
          "passes over every parameter; with immediate_grad_update the second is already skipped and "
          "every .grad is None, grad_fold.py); if DeepSpeed changes that protocol, the mirror must follow.",
          "0.18.x (PR #7787 added _running_engine_backward; PR #5605 the immediate_grad_update guard)",
          ("tp_trainer/ds_compat/__init__.py",), params=("self", "buffer_id"),
          source=(("_exec_backward_pass", ("self.optimizer.clear_lp_grads()", "self._running_engine_backward = True",
                                           "if not self._config.bfloat16_config.immediate_grad_update:",
                                           "self.optimizer.update_hp_grads(clear_lp_grads=False)",
                                           "self._running_engine_backward = False")),)),
    Touch(PIPE_ENGINE, "pipeline topology attributes", "micro_batches, micro_batch_size, grid, stage_id, "
          "num_stages, is_pipe_parallel, is_data_parallel are set in PipelineEngine.__init__.", PIPE_SINCE,
          ("tp_trainer/engine.py", "tp_trainer/run.py"), instance_attr=True,
          source=(("__init__", ("self.micro_batch_size = self.train_micro_batch_size_per_gpu()",
                                "self.micro_batches = self.gradient_accumulation_steps()",
                                "self.grid = self.module._grid", "self.stage_id = self.grid.get_stage_id()",
                                "self.num_stages = self.grid.pipe_parallel_size",
                                "self.is_pipe_parallel =", "self.is_data_parallel =")),)),
    # ------------------------------------------------------------------ DeepSpeedEngine
    Touch(DS_ENGINE, "forward", "Called unbound on the PipelineEngine (whose forward raises) for one "
          "slice (ds_compat.stage_forward).", PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",),
          params=("self", "inputs")),
    Touch(DS_ENGINE, "backward", "Called unbound on the last stage's slice loss (ds_compat.loss_backward). "
          "It scales the loss only for a ZeROOptimizer (or torch autocast's scaler): fp16 at ZeRO 0 gets an "
          "unscaled backward and a step that unscales (PR #8393), so ds_compat.fp16_loss_scale scales first. "
          "When an upgrade scales there too, this source check fails: drop fp16_loss_scale then.",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",), params=("self", "loss"),
          source=(("backward", ("if isinstance(self.optimizer, ZeROOptimizer):",
                                "loss = self.optimizer.scale_if_loss(loss)",
                                "elif self.torch_autocast_z0_gradscaler:")),)),
    Touch("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer", "backward", "What "
          "ds_compat.fp16_loss_scale mirrors (external scale, else cur_scale under use_grad_scaling); its step "
          "divides by cur_scale.", "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",),
          params=("self", "loss"),
          source=(("backward", ("scaled_loss = self.external_loss_scale * loss",
                                "elif self.loss_scale_config.use_grad_scaling:",
                                "scaled_loss = (loss.float()) * self.loss_scale_config.cur_scale")),
                  ("unscale_and_clip_grads", ("combined_scale = self.loss_scale_config.cur_scale",)),
                  # ds_compat.mark_replicated_grads / optimizer_step: the norm of the scaled grads
                  ("step", ("grads_for_norm, _ = split_params_grads_into_shared_and_expert_params(group)",
                            "norm_group_value = get_weight_norm(grads_for_norm, mpu=self.mpu)",
                            "self._global_grad_norm = get_global_norm(norm_list=norm_groups)")))),
    Touch("deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer", "backward", "The same scaling as the "
          "unfused optimizer's (ds_compat.fp16_loss_scale), for FusedAdam.", "checked 0.19.8",
          ("tp_trainer/ds_compat/__init__.py",), params=("self", "loss"),
          source=(("backward", ("scaled_loss = self.external_loss_scale * loss",
                                "scaled_loss = (loss.float()) * self.loss_scale_config.cur_scale")),)),
    Touch(DS_ENGINE, "_running_engine_backward", "Flag that DeepSpeed's post-backward hook reads to tell "
          "the engine's backward from a user's tensor.backward() (ds_compat.inner_stage_backward).",
          "0.18.x (PR #7787, 2026-01)", ("tp_trainer/ds_compat/__init__.py",), instance_attr=True,
          source=(("__init__", ("self._running_engine_backward = False",)),
                  ("_backward_post_hook", ("if not self._running_engine_backward:",)))),
    Touch(DS_ENGINE, "_config", "The engine's DeepSpeedConfig; we read bfloat16_config.immediate_grad_update.",
          "checked 0.19.8", ("tp_trainer/ds_compat/grad_fold.py",), instance_attr=True,
          source=(("__init__", ("self._config = config_class",)),)),
    Touch("deepspeed.runtime.precision_config:DeepSpeedBF16Config", "immediate_grad_update", "initialize turns "
          "it on with bf16 (grad_fold.bf16_fold_config): the bf16 optimizer then folds each gradient into its "
          "buffer in a hook as autograd makes it and drops .grad, and update_hp_grads returns at once; "
          "grad_fold.fold_as_made refuses an engine without it.",
          "0.14.x (PR #5605), checked 0.19.8", ("tp_trainer/ds_compat/grad_fold.py", "tp_trainer/initialize.py"),
          ),
    Touch(BF16, "accumulate_hp_grads_and_remove_lp", "What the immediate_grad_update hook does: fold one "
          "parameter's .grad into its buffer, then drop .grad (so nothing is left to clear before the next "
          "backward, grad_fold.fold_as_made).", "checked 0.19.8", ("tp_trainer/ds_compat/grad_fold.py",),
          params=("self", "lp_param", "group_idx", "param_idx"),
          source=(("accumulate_hp_grads_and_remove_lp", ("self._update_hp_grad(lp_param, group_idx, param_idx, "
                                                         "clear_lp_grads=False)", "lp_param.grad = None")),
                  ("update_hp_grads", ("if self.immediate_grad_update:", "return")))),
    Touch(BF16, "_grad_acc_hooks", "The immediate_grad_update hooks, one per trainable parameter in bf16_groups "
          "order; grad_fold.MasterGrads.hold_in_grad removes those of parameters whose gradients the W's make or "
          "whose buffer is in their own dtype (their .grad is then folded once per step, fold_held).",
          "checked 0.19.8", ("tp_trainer/ds_compat/grad_fold.py",), instance_attr=True,
          source=(("create_grad_acc_hooks", ("for i, param_group in enumerate(self.bf16_groups):",
                                             "for j, param in enumerate(param_group):", "if param.requires_grad:",
                                             "self._grad_acc_hooks.append(register_grad_hook(param, "
                                             "accumulate_hp_grads_and_remove_lp))")),)),
    Touch(DS_ENGINE, "_global_grad_norm", "What get_global_grad_norm reports; set after our whole-pipeline "
          "clipping (ds_compat.set_global_grad_norm).", "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",),
          instance_attr=True, source=(("get_global_grad_norm", ("return self._global_grad_norm",)),)),
    Touch(DS_ENGINE, "tput_timer", "Throughput timer, started once per schedule as DeepSpeed's forward "
          "pass does; its config copied with synchronized off (no device sync per slice).", "checked 0.19.8",
          ("tp_trainer/engine.py", "tp_trainer/ds_compat/__init__.py"), instance_attr=True,
          source=(("__init__", ("self.tput_timer = ThroughputTimer(",)),)),
    Touch(DS_ENGINE, "__init__", "initialize.py builds the engine with these keywords (model, optimizer, "
          "model_parameters, training_data, lr_scheduler, mpu, dist_init_required, collate_fn, config, "
          "config_class).", "checked 0.19.8", ("tp_trainer/initialize.py",),
          params=("self", "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                  "mpu", "dist_init_required", "collate_fn", "config", "config_class")),
    # ------------------------------------------------------------------ BF16_Optimizer
    Touch(BF16, "backward_prologue", "Replaced on the optimizer instance by a no-op (grad_fold.fold_as_made): "
          "DeepSpeed's backward hooks call it before every backward, here every slice, and it loops over "
          "every parameter (clear_lp_grads) to zero gradients that immediate_grad_update has already dropped.",
          "checked 0.19.8", ("tp_trainer/ds_compat/grad_fold.py",), params=("self",),
          source=(("backward_prologue", ("self.clear_lp_grads()",)),)),
    Touch(BF16, "fp32_groups_gradients", "A parameter's gradient buffer (grad_acc_dtype), indexed like "
          "bf16_groups; a scheduled W adds into it and marks fp32_groups_has_gradients and _hp_grad as "
          "_update_hp_grad does (grad_fold.MasterGrads.buffer).", "checked 0.19.8",
          ("tp_trainer/ds_compat/grad_fold.py",), instance_attr=True,
          source=(("_update_hp_grad", ("hp_grad = self.fp32_groups_gradients[group_idx][param_idx]",
                                       "lp._hp_grad = hp_grad",
                                       "self.fp32_groups_has_gradients[group_idx][param_idx] = True")),
                  ("get_grads_for_norm", ("if not self.fp32_groups_has_gradients[i][j]:",)),
                  ("__init__", ("self.bf16_groups = []",)))),
    Touch(BF16, "_load_legacy_checkpoint", "It fails on DeepSpeed's own save of bf16 without ZeRO (KeyError: 0), "
          "so such a run saves and resumes only the layout-free form (resume.deepspeed_resumes); lift that "
          "once an upgrade loads them.", "checked 0.19.8", ("tp_trainer/resume.py", "tp_trainer/resume_checks.py")),
    Touch("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer", "fp32_groups", "fp16 without ZeRO: "
          "the fp32 copy of fp16_groups[i][j] is fp32_groups[i][j], the base optimizer's state key "
          "(checkpoint/optimizer_state._fp16_master).", "checked 0.19.8", (STATE,), instance_attr=True,
          source=(("__init__", ("self.fp16_groups.append(trainable)",
                                "fp32_group = [p.clone().float().detach() for p in self.fp16_groups[i]]",
                                "param_group['params'] = self.fp32_groups[i]")),)),
    Touch("deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer", "fp32_groups_flat", "fp16 without ZeRO "
          "(fused): group i's fp32 master weights back to back, in fp16_groups[i]'s order with no padding, "
          "the base optimizer's state key (checkpoint/optimizer_state._fp16_master).", "checked 0.19.8",
          (STATE,), instance_attr=True,
          source=(("__init__", ("self.fp16_groups.append(trainable)",
                                "self.fp16_groups_flat.append(_flatten_dense_tensors([p.clone().detach() for p in "
                                "self.fp16_groups[i]]))",
                                "self.fp32_groups_flat.append(self.fp16_groups_flat[i].clone().float().detach())",
                                "param_group['params'] = [self.fp32_groups_flat[i]]")),)),
    Touch("deepspeed.runtime.fp16.loss_scaler:LossScaleConfig", "cur_scale", "fp16's dynamic loss scale and its "
          "counters (cur_iter, last_overflow_iter, cur_hysteresis where the scaler has it): saved in the "
          "layout-free index and restored (optimizer_state.loss_scale_state); the fp16 optimizers hold it as "
          "loss_scale_config, ZeRO as loss_scaler (ds_compat.loss_scaler).", "checked 0.19.8", (STATE,),
          instance_attr=True, source=(("__init__", ("self.cur_iter = 0", "self.last_overflow_iter = None")),)),
    # ------------------------------------------------------------------ PipelineModule
    Touch(PIPE_MODULE, "_topo", "Process topology, set before _partition_layers (ds_compat.stage_of_rank).",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py", "benchmarks/_compare_models.py"), instance_attr=True,
          source=(("__init__", ("self._topo = topology",
                                "self.global_rank = dist.get_rank(group=self.world_group)")),)),
    Touch(PIPE_MODULE, "_set_bounds", "The layer range [start, stop) of this rank (ds_compat.set_layer_bounds).",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py", "benchmarks/_compare_models.py"),
          params=("self", "start", "stop")),
    Touch(PIPE_MODULE, "tied_comms", "Per tie key: ranks, weight_attr, module (ds_compat.tied_duplicate_weights).",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",), instance_attr=True,
          source=(("__init__", ("self.tied_comms = self._index_tied_modules()",)),
                  ("_index_tied_modules", ("'ranks': tied_ranks", "'weight_attr': self.tied_weight_attrs[key]",
                                           "'module': self.tied_modules[key]")))),
    Touch(PIPE_MODULE, "_recursive_getattr", "Resolves a tied weight attribute such as 'inner.weight'.",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py",), params=("module", "attr_name")),
    Touch(PIPE_MODULE, "forward_funcs", "This stage's built layers in order (deferred weight gradients, "
          "profiling).", PIPE_SINCE, ("tp_trainer/stage_compute.py", "tp_trainer/planner/profile.py"), instance_attr=True,
          source=(("_build", ("self.forward_funcs.append(",)),)),
    Touch(PIPE_MODULE, "_precompute_checkpointable_values", "Caches, per checkpoint interval, which layer "
          "groups forward() checkpoints; ds_compat.recheck_checkpointable clears the cache key and calls it "
          "again after the fused head loss replaced the head's entry.", "checked 0.19.8",
          ("tp_trainer/ds_compat/__init__.py",), params=("self",),
          source=(("_precompute_checkpointable_values", (
              "self.is_checkpointable_results_interval != self.activation_checkpoint_interval",
              "self.is_checkpointable_results.append(self._is_checkpointable(funcs))")),
                  ("forward", ("self.is_checkpointable_results",)))),
    Touch(PIPE_MODULE, "ckpt_layer_path", "Checkpoint files are layer_{idx:02d}[-rank]-model_states.pt; "
          "export.layer_file reads them by that name.", "checked 0.19.8", ("tp_trainer/export.py",),
          source=(("ckpt_layer_path", ("f'layer_{idx:02d}'", "'-model_states.pt'")),)),
    Touch(PIPE_MODULE, "__init__", "TeraPipeModule passes layers, num_stages, partition_method.", PIPE_SINCE,
          ("tp_trainer/model/stages/pipeline.py",), params=("self", "layers", "num_stages")),
    # ------------------------------------------------------------------ layout-free optimizer state
    Touch(ZERO, "_lazy_init_hp_params_optimizer_state", "Links each parameter's fragment views of the flat "
          "fp32 partition's optimizer state (bit16_groups[i], single_partition_of_fp32_groups[i]) once, "
          "until _hp_optimizer_states_linked is cleared (ds_compat.link_optimizer_state).", "checked 0.19.8",
          (STATE,), params=("self",), source=(("_lazy_init_hp_params_optimizer_state", (
              "if not self._hp_optimizer_states_linked:", "self._hp_optimizer_states_linked = True",
              "self.bit16_groups[i], self.single_partition_of_fp32_groups[i]")),)),
    Touch(BF16, "_lazy_init_hp_params_optimizer_state", "As for ZeRO, over bf16_groups[i] and "
          "fp32_groups_flat_partition[i] (ds_compat.link_optimizer_state).", "checked 0.19.8", (STATE,),
          params=("self",), source=(("_lazy_init_hp_params_optimizer_state", (
              "if not self._hp_optimizer_states_linked:", "self._hp_optimizer_states_linked = True",
              "self.bf16_groups[i], self.fp32_groups_flat_partition[i]")),)),
    Touch(ZERO, "_hp_optimizer_states_linked", "Cleared after writing the partition's state so the next "
          "link rebuilds the views (ds_compat.relink_optimizer_state).", "checked 0.19.8", (STATE,),
          instance_attr=True,
          source=(("_lazy_init_hp_params_optimizer_state", ("if not self._hp_optimizer_states_linked:",)),)),
    Touch("deepspeed.utils.mixed_precision_linkage", "_hp_mapping", "Per parameter: its fragment of the flat "
          "fp32 partition, or None on ranks without one (ds_compat.hp_mapping).", "checked 0.19.8", (STATE,),
          instance_attr=True, source=(("link_hp_params", ("lp_param._hp_mapping = get_hp_fragment_mapping(",)),
                                      ("_init_lp_to_hp_mapping", ("lp_param._hp_mapping = None",)))),
    Touch(f"{FRAGMENT}:tensor_fragment", "lp_fragment_address", "Where the fragment lies in the parameter.",
          "checked 0.19.8", (STATE,)),
    Touch(f"{FRAGMENT}:tensor_fragment", "hp_fragment_address", "Where the fragment lies in the partition.",
          "checked 0.19.8", (STATE,)),
    Touch(f"{FRAGMENT}:tensor_fragment", "lp_fragment", "The parameter's slice of the bf16 optimizer's flat "
          "tensor; taken with autograd on, so it holds the flattening's graph until ds_compat.detach_flat_copies "
          "replaces it by its detach().", "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",)),
    Touch(BF16, "bf16_groups_flat", "The parameters concatenated into one tensor per group, with autograd on "
          "(a CatBackward0 over every parameter's gradient accumulator, made on the default stream, kept for "
          "the run); it and its partitions are cut from that graph before a CUDA graph capture "
          "(ds_compat.detach_flat_copies).", "checked 0.19.8", ("tp_trainer/ds_compat/__init__.py",),
          instance_attr=True, source=(("_setup_for_real_optimizer", (
              "self.bf16_groups_flat.append(", "self._flatten_dense_tensors_aligned(self.bf16_groups[i],",
              "self.bf16_groups_flat[i].narrow(0, dp_index * partition_size, partition_size)")),)),
    Touch(f"{FRAGMENT}:fragment_address", "start", "Offset of a fragment address (with numel).",
          "checked 0.19.8", (STATE,)),
    Touch(f"{FRAGMENT}:fragment_address", "numel", "Length of a fragment address (with start).",
          "checked 0.19.8", (STATE,)),
    Touch("deepspeed.utils", "safe_get_full_fp32_param", "Whole fp32 weight of a partitioned parameter "
          "(collective).", "checked 0.19.8", (STATE,), params=("param",)),
    Touch("deepspeed.utils", "safe_set_full_fp32_param", "Writes a whole fp32 weight into its fragments.",
          "checked 0.19.8", (STATE,), params=("param", "value")),
    Touch("deepspeed.utils", "safe_get_full_optimizer_state", "Whole optimizer-state tensor of a partitioned "
          "parameter (collective).", "checked 0.19.8", (STATE,), params=("param", "optim_state_key")),
    # ------------------------------------------------------------------ topology, comm, config
    Touch(GRID, "stage_to_global", "Global rank of a stage in this replica, keyword stage_id.", PIPE_SINCE,
          ("tp_trainer/engine.py",), params=("self", "stage_id")),
    Touch(GRID, "data_parallel_id", "This rank's replica index (data sharding, the writer of saved stages).",
          PIPE_SINCE, ("tp_trainer/run.py", "tp_trainer/engine.py", "tests/pipeline_harness.py"), instance_attr=True,
          source=(("__init__", ("self.data_parallel_id = self.get_data_parallel_id()",)),)),
    Touch("deepspeed.runtime.pipe.topology:PipeDataParallelTopology", "__init__", "The stage of a rank before "
          "any module exists (checkpoint.hf_load).", PIPE_SINCE, ("tp_trainer/checkpoint/hf_load.py",),
          params=("self", "num_pp", "num_dp")),
    Touch("deepspeed.runtime.pipe.topology:ProcessTopology", "get_coord", "rank -> coordinate with .pipe.",
          PIPE_SINCE, ("tp_trainer/ds_compat/__init__.py", "tp_trainer/checkpoint/hf_load.py"),
          params=("self", "rank")),
    # ------------------------------------------------------------------ sequence ranks (terapipe.sequence_parallel)
    Touch("deepspeed.runtime.pipe.topology:PipeModelDataParallelTopology", "__init__", "Stages x replicas x "
          "sequence ranks, the sequence ranks on DeepSpeed's 'model' axis (ds_compat.pipeline_topology).",
          PIPE_SINCE, ("tp_trainer/ds_compat/sequence.py",), params=("self", "num_pp", "num_mp", "num_dp")),
    Touch(GRID, "get_slice_parallel_group", "The sequence group: the grid's group over the 'model' axis.",
          PIPE_SINCE, ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch(GRID, "get_tensor_model_parallel_rank", "Sequence ranks: 0 for the optimizers' norms "
          "(ds_compat.optimizers_see_one_sequence_rank overrides it).", "checked 0.19.8",
          ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch(GRID, "get_model_parallel_group", "Sequence ranks: the pipe group for the optimizers' norms "
          "(ds_compat.optimizers_see_one_sequence_rank overrides it).", PIPE_SINCE,
          ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch(GRID, "pp_proc_group", "The pipe group, what the overridden get_model_parallel_group returns.",
          PIPE_SINCE, ("tp_trainer/ds_compat/sequence.py",), instance_attr=True,
          source=(("__init__", ("self.pp_proc_group = proc_group",)),)),
    Touch("deepspeed.utils.groups", "_get_sequence_data_parallel_group", "Reads the grid's "
          "get_sequence_data_parallel_group: ZeRO-1's and the bf16 optimizer's partition group.", "checked 0.19.8",
          ("tp_trainer/ds_compat/sequence.py",),
          source=(("_get_sequence_data_parallel_group", ("mpu.get_sequence_data_parallel_group()",)),)),
    Touch("deepspeed.utils.groups", "_get_sequence_parallel_world_size", "Reads the grid's "
          "get_sequence_parallel_world_size: ZeRO-1 divides its sum by the group's size over it.", "checked 0.19.8",
          ("tp_trainer/ds_compat/sequence.py",),
          source=(("_get_sequence_parallel_world_size", ("mpu.get_sequence_parallel_world_size()",)),)),
    Touch("deepspeed.runtime.pipe.topology:ProcessTopology", "filter_match", "The ranks of a stage (its "
          "sequence x data group).", PIPE_SINCE, ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch(GRID, "get_slice_parallel_rank", "This rank's place in its sequence group.", PIPE_SINCE,
          ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch("deepspeed.sequence.layer:_SeqAllToAll", "forward", "Ulysses' all-to-all with its autograd "
          "(ds_compat.sequence_all_to_all), batch first.", "checked 0.19.8", ("tp_trainer/ds_compat/sequence.py",),
          params=("ctx", "group", "input", "scatter_idx", "gather_idx", "batch_dim_idx")),
    Touch(DS_ENGINE, "_get_gradients_for_reduction", "The gradients DeepSpeed's reduction takes (no bf16 "
          "optimizer), summed over the sequence group first.", "checked 0.19.8",
          ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch(BF16, "get_grads_for_reduction", "The bf16 optimizer's fp32 gradient buffers, summed over the "
          "sequence group first.", "checked 0.19.8", ("tp_trainer/ds_compat/sequence.py",), params=("self",)),
    Touch("deepspeed", "set_optimizer_flags", "deepspeed.initialize's own step before building the engine, "
          "which initialize.py repeats since it builds the engine itself.", "checked 0.19.8",
          ("tp_trainer/initialize.py",), params=("config_class", "model")),
    Touch("deepspeed.runtime.config:DeepSpeedConfig", "__init__", "Built from the dict and the module's mpu.",
          "checked 0.19.8", ("tp_trainer/initialize.py",), params=("self", "config", "mpu")),
    Touch("deepspeed.comm", "isend", "Non-blocking send returning a work handle (p2p.Transfers).",
          "checked 0.19.8", ("tp_trainer/p2p.py",), params=("tensor", "dst")),
    Touch("deepspeed.comm", "irecv", "Non-blocking receive posted ahead (p2p.Transfers).", "checked 0.19.8",
          ("tp_trainer/p2p.py",), params=("tensor", "src")),
    Touch("deepspeed.runtime.pipe.p2p", "send", "Blocking stage-to-stage send in a test's forward.", PIPE_SINCE,
          ("tests/checkpoint_worker.py",), params=("tensor", "dest_stage")),
    Touch("deepspeed.runtime.pipe.p2p", "recv", "Blocking stage-to-stage receive in a test's forward.",
          PIPE_SINCE, ("tests/checkpoint_worker.py",), params=("tensor", "src_stage")),
)
