"""One parameter's fp32 weight and optimizer state, whole, whatever DeepSpeed's optimizer wrapper.

Layout-free checkpoints (``layout_free.py``) store, per HF parameter, its fp32 weight and every
optimizer-state tensor of the parameter's shape (Adam: exp_avg, exp_avg_sq) plus its scalars (the
step). Where those live depends on DeepSpeed's wrapper (checked on DeepSpeed 0.19.8):

- fp32 without ZeRO: ``engine.optimizer`` is the torch optimizer itself; its ``state[param]``.
- ZeRO-1 (any precision) and bf16 without ZeRO: each parameter has ``_hp_mapping``: this rank's
  fragment of it in the flat fp32 partition of its group. ``deepspeed.utils``'
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` assemble the whole tensor by an
  all-reduce over the data-parallel group (collective: every replica of the stage calls them, in
  the same order). The partition's state lives in the base optimizer under the flat tensor
  (``single_partition_of_fp32_groups[i]`` for ZeRO, ``fp32_groups_flat_partition[i]`` for bf16) and
  is created lazily at the first step; loading before any step creates it here and writes each
  fragment through the mapping's addresses (``lp_fragment_address`` in the parameter,
  ``hp_fragment_address`` in the partition), then lets DeepSpeed re-link its fragment views.
- fp16 without ZeRO: DeepSpeed's FP16_UnfusedOptimizer keeps one fp32 copy per fp16 parameter
  (``fp32_groups[i][j]`` for ``fp16_groups[i][j]``), the fused FP16_Optimizer one flat fp32 tensor
  per group (``fp32_groups_flat[i]``, the group's parameters back to back, no padding); the base
  optimizer's state is keyed by the copy or the flat tensor (``_fp16_master``).
The fp16 loss scale (its value and the dynamic scaler's counters) is ``loss_scale_state``.
"""

from __future__ import annotations

import torch

from .. import ds_compat


def base_optimizer(engine):
    """The torch optimizer doing the update (inside DeepSpeed's ZeRO / bf16 wrapper, if any)."""
    optimizer = engine.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def _partitioned(engine) -> bool:
    return any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def supported(engine) -> bool:
    """Whether this engine's optimizer state can be read and written per parameter."""
    if _partitioned(engine):
        return _flat_partitions(engine.optimizer) is not None
    optimizer = engine.optimizer
    if _fp16_groups(optimizer) is not None:
        return True
    held = {id(p) for group in getattr(optimizer, "param_groups", []) for p in group["params"]}
    return isinstance(optimizer, torch.optim.Optimizer) and all(id(p) in held for p in engine.module.parameters()
                                                                if p.requires_grad)  # frozen: LoRA's base


def _fp16_groups(wrapper):
    """(fp16 groups, fp32 copies per parameter or None, flat fp32 per group or None) of DeepSpeed's
    fp16 optimizers without ZeRO; None for other wrappers."""
    if not hasattr(wrapper, "fp16_groups"):
        return None
    copies, flats = getattr(wrapper, "fp32_groups", None), getattr(wrapper, "fp32_groups_flat", None)
    return (wrapper.fp16_groups, copies, flats) if copies is not None or flats is not None else None


def _fp16_master(engine, param):
    """(the tensor the base optimizer keys ``param``'s state by, its group, the view of ``param``'s
    elements in it: slice start, or None for a whole per-parameter copy)."""
    groups, copies, flats = _fp16_groups(engine.optimizer)
    for i, group in enumerate(groups):
        start = 0
        for j, p in enumerate(group):
            if p is param:
                holder = copies[i][j] if copies is not None else flats[i]
                return holder, base_optimizer(engine).param_groups[i], None if copies is not None else start
            start += p.numel()
    raise KeyError("parameter not held by the fp16 optimizer")


def _view(holder: torch.Tensor, start, param) -> torch.Tensor:
    """``param``'s elements in ``holder`` (a per-parameter tensor, or a flat one from ``start``)."""
    return holder if start is None else holder.narrow(0, start, param.numel()).view(param.shape)


def _flat_partitions(wrapper):
    """(lp groups, flat fp32 partitions) of a ZeRO-1/2 or bf16 wrapper; None for others."""
    for groups, flats in (("bit16_groups", "single_partition_of_fp32_groups"),
                          ("bf16_groups", "fp32_groups_flat_partition")):
        if hasattr(wrapper, groups) and hasattr(wrapper, flats):
            return getattr(wrapper, groups), getattr(wrapper, flats)
    return None


def _state_holder(engine, param):
    """(the tensor the base optimizer keys the state of ``param`` by, its param group)."""
    optimizer = base_optimizer(engine)
    if not _partitioned(engine):
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        return param, group
    groups, flats = _flat_partitions(engine.optimizer)
    index = next(i for i, group in enumerate(groups) if any(p is param for p in group))
    return flats[index], optimizer.param_groups[index]


def full_weight(engine, param) -> torch.Tensor:
    """The whole fp32 weight of ``param`` (collective over the data-parallel group under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param
    if hasattr(param, "_hp_mapping"):
        return safe_get_full_fp32_param(param).detach().float().cpu()
    if _fp16_groups(engine.optimizer) is not None:
        holder, _, start = _fp16_master(engine, param)
        return _view(holder, start, param).detach().float().cpu()
    return param.detach().float().cpu()


def full_state(engine, param) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(state tensors of the parameter's shape, scalars such as 'step') of ``param``; collective
    under ZeRO. Empty before the first optimizer step."""
    from deepspeed.utils import safe_get_full_optimizer_state
    if _fp16_groups(engine.optimizer) is not None:
        holder, _, start = _fp16_master(engine, param)
        state, shaped, scalars = _split_state(engine, holder)
        return {k: _view(state[k], start, param).detach().float().cpu() for k in shaped}, scalars
    holder, _ = _state_holder(engine, param)
    if holder is not param:
        ds_compat.link_optimizer_state(engine.optimizer)  # the fragment views (idempotent)
    state, shaped, scalars = _split_state(engine, holder)
    if holder is param:
        tensors = {k: state[k].detach().float().cpu() for k in shaped}
    else:
        tensors = {k: safe_get_full_optimizer_state(param, k).detach().float().cpu() for k in shaped}
    return tensors, scalars


def _split_state(engine, holder: torch.Tensor) -> tuple[dict, list[str], dict]:
    """(the base optimizer's state of ``holder``, its keys of ``holder``'s shape, its scalars)."""
    state = base_optimizer(engine).state.get(holder, {})
    shaped = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == holder.shape and v.dim())
    scalars = {k: v for k, v in state.items() if k not in shaped and (not torch.is_tensor(v) or v.dim() == 0)}
    return state, shaped, scalars


def set_weight(engine, param, value: torch.Tensor) -> None:
    """Set ``param`` (and its fp32 master fragment or copy, if any) to the whole fp32 ``value``."""
    from deepspeed.utils import safe_set_full_fp32_param
    with torch.no_grad():
        param.copy_(value.to(param.device, param.dtype))
        if hasattr(param, "_hp_mapping"):
            safe_set_full_fp32_param(param, value.to(param.device, torch.float32))
        elif _fp16_groups(engine.optimizer) is not None:
            holder, _, start = _fp16_master(engine, param)
            _view(holder, start, param).copy_(value.to(holder.device, holder.dtype))


def set_state(engine, param, tensors: dict[str, torch.Tensor], scalars: dict[str, object]) -> None:
    """Give ``param`` the optimizer state ``tensors`` (whole, its shape) and ``scalars``."""
    start = None
    if _fp16_groups(engine.optimizer) is not None:
        holder, group, start = _fp16_master(engine, param)
    else:
        holder, group = _state_holder(engine, param)
    state = base_optimizer(engine).state.setdefault(holder, {})
    for key in tensors:
        if key not in state:
            state[key] = torch.zeros_like(holder, dtype=torch.float32)
    for key, value in scalars.items():
        state[key] = _scalar(value, holder.device, group)
    with torch.no_grad():
        if holder is param or _fp16_groups(engine.optimizer) is not None:
            for key, value in tensors.items():
                _view(state[key], start, param).copy_(value.to(holder.device))
            return
        mapping = ds_compat.hp_mapping(param)
        if mapping is not None:  # this rank holds a fragment of ``param``
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, value in tensors.items():
                fragment = value.to(holder.device).flatten().narrow(0, lp.start, lp.numel)
                state[key].narrow(0, hp.start, hp.numel).copy_(fragment)
    ds_compat.relink_optimizer_state(engine.optimizer)  # the next step re-links DeepSpeed's views


LOSS_SCALE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scale_state(engine) -> dict | None:
    """fp16: the dynamic loss scale and its scaler's counters (None without fp16)."""
    scaler = ds_compat.loss_scaler(engine)
    if scaler is None:
        return None
    return {key: float(getattr(scaler, key)) if key == "cur_scale" else getattr(scaler, key)
            for key in LOSS_SCALE_KEYS if hasattr(scaler, key)}


def set_loss_scale_state(engine, state: dict | None) -> None:
    """Restore ``loss_scale_state`` (a checkpoint without one, or a run without fp16: nothing)."""
    scaler = ds_compat.loss_scaler(engine)
    if scaler is None or not state:
        return
    for key, value in state.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value)


def _scalar(value, device, group):
    """A scalar state entry as the optimizer keeps it: torch's Adam holds ``step`` as a 0-d float32
    tensor on the CPU, or on the parameter's device when capturable or fused."""
    if not torch.is_tensor(value):
        return value
    on_device = group.get("capturable") or group.get("fused")
    return value.detach().clone().to(device if on_device else "cpu")


def hyperparameters(engine) -> list[dict]:
    """The param groups' settings (lr, betas, eps, weight_decay ...), JSON-ready."""
    groups = []
    for group in base_optimizer(engine).param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))})
    return groups


def set_hyperparameters(engine, groups: list[dict]) -> None:
    """Restore the saved settings into the current groups (keys both know; pairwise when the
    counts agree, else the first saved group's everywhere)."""
    current = base_optimizer(engine).param_groups
    for index, group in enumerate(current):
        saved = groups[index] if len(groups) == len(current) else groups[0]
        for key, value in saved.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
