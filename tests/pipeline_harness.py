"""Pipeline-vs-plain-HF exactness: the parts every exactness test shares.

Worker side (one rank of a ``multirank.run_ranks`` launch): ``ds_config`` and ``train_case`` train
one case through ``tp_trainer.initialize`` and return this stage's results keyed by HF parameter
names. Test side: ``merge_ranks`` joins the ranks' results, ``reference`` trains the plain HF model
in one process the same way, ``check_float64`` / ``check_float32`` measure and check the differences.

Why two checks: fp32 rounding depends on the CPU's vector kernels (ATen's
``ATEN_CPU_CAPABILITY``, MKL's GEMM dispatch), and AdamW turns the rounding of tiny gradients into
full-size updates. A fixed fp32 bound is therefore a bound on one machine's kernels, not on the
engine. So:

1. float64 end to end (model, transfers, reductions, clipping, AdamW): the pipeline must equal the
   float64 HF run to near float64's precision (``F64_TOL``: loss 1e-12, gradients and parameters
   1e-9 relative). This is the check that catches real bugs (see test_mutations.py).
2. fp32: the pipeline's distance from the float64 HF run may be at most ``NOISE_FACTOR`` times the
   fp32 HF run's own distance from it (or ``NOISE_FLOOR``, whichever is larger): "as close to the
   exact answer as fp32 itself gets", on whatever CPU runs it.

Distances: loss |a - b| / |b| per step; a tensor max |a - b| / max |b| (b = float64 reference),
except gradients that are zero in exact arithmetic (``zero_grads``, e.g. OPT's key bias: softmax
ignores a constant added to every score of a query), which are measured against the model's
largest gradient instead, since their own size is rounding noise.
"""

from __future__ import annotations

import os

import torch

LR = 1e-3
WEIGHT_DECAY = 0.01
# Adam moves an element by lr * m / (sqrt(v) + eps): with a gradient g, by about lr * g / (|g| + eps)
# a step, so a rounding error d of g moves the parameter by up to lr * d * eps / (|g| + eps)^2, at
# most lr * d / eps (g near 0). The default eps 1e-8 turns noise-size gradients (the key bias,
# which softmax ignores) into +-lr steps; eps 1e-5 still multiplies a gradient's rounding by up to
# 100 (39 at an element of 6e-6), so whichever fp32 run rounds that one element better sets the
# tensor's allowance. eps 1e-4 caps the factor at 10: a parameter's fp32 distance then follows its
# gradient's, and the check judges the engine rather than one element's luck.
ADAM_EPS = 1e-4
CLIP = 1.0  # DeepSpeed's default gradient_clipping; the global norm spans every stage

# float64 end to end. HF's eager attention takes its softmax in fp32 even in a float64 model
# (GPT-Neo also q k^T): such cases pass ``tol=F64_EAGER_TOL``.
F64_TOL = {"loss": 1e-12, "grad": 1e-9, "param": 1e-9, "eval": 1e-12}
F64_EAGER_TOL = {"loss": 1e-6, "grad": 1e-5, "param": 1e-5, "eval": 1e-6}
# fp32 against the float64 reference: at most NOISE_FACTOR x the fp32 HF run's own distance, with
# a floor of a few fp32 ulps (a tensor that the fp32 HF run happens to get almost exactly right
# must not demand the same luck from a different summation order).
NOISE_FACTOR = 10.0
NOISE_FLOOR = {"loss": 1e-7, "grad": 1e-6, "param": 1e-6, "eval": 1e-7}
# the loss that train_batch returns is DeepSpeed's fp32 broadcast of the last stage's loss
REPORTED_LOSS_TOL = 2.0 ** -23


def ds_config(stages: int, microbatches: int, micro_batch: int, seq_len: int, slices, schedule: str = "gpipe",
              zero: int = 0) -> dict:
    """The DeepSpeed config of an exactness case (AdamW, gradient clipping, terapipe section)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": microbatches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY,
                                                  "torch_adam": True}},
        "gradient_clipping": CLIP,
        "pipeline": {"stages": stages},
        "steps_per_print": 1000,
        "zero_optimization": {"stage": zero},
        "terapipe": {"seq_len": seq_len, "slices": slices, "schedule": schedule},
    }


_GROUPS: dict = {}   # ranks -> the process group made for them in this process (reuse_process_groups)


def reuse_process_groups() -> None:
    """Make ``deepspeed.comm.new_group`` return the group already made for the same ranks, in this process.

    Every ``initialize`` builds DeepSpeed's grid anew (~10 gloo groups, one per rank even for the 1-rank
    slice groups), and each gloo group keeps threads that poll (``gloo_tcp_loop``): a launch training a
    hundred cases ended with ~800 threads a rank, which took ~23% of a core per rank while the rank's own
    thread got 1-5%. A real run initializes once. Reusing the groups is safe here: every rank of a launch
    trains the same cases in the same order, so every rank asks for the same groups in the same order and
    hits (or misses) the cache alike, as ``new_group`` (collective) needs."""
    from deepspeed import comm as dist
    if getattr(dist.new_group, "reuses", False):
        return
    make = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        key = (tuple(ranks) if ranks is not None else None, args, tuple(sorted(kwargs.items())))
        if key not in _GROUPS:
            _GROUPS[key] = make(ranks, *args, **kwargs)
        return _GROUPS[key]
    new_group.reuses = True
    dist.new_group = new_group


def train_case(model, config: dict, batches, steps: int, eval_batches=None, split=None, export=None,
               inspect=None) -> dict:
    """Train ``model`` through TeraPipeEngine ``steps`` steps; ``batches(step, replica)`` gives the
    step's microbatches [(input_ids, labels), ...] of a data-parallel replica, ``eval_batches(replica)``
    those evaluated after training.

    Returns, keyed by HF parameter names: this stage's gradients of step 0 as this replica has them
    before the data-parallel reduction (after the tied-weight one, before clipping), its parameters
    after the last step, the losses train_batch returned, the last stage's own loss of each step in
    the model's dtype (``exact_losses``: DeepSpeed broadcasts the loss in fp32), the eval loss.
    ``split``: layer names per stage (``StageSplit.from_names``; default the config's split), or
    {"names": ..., "shared_after": ...} for an attention half two stages share (model/stages/shared_attention.py).
    ``export``: a directory the trained pipeline is saved to as an HF checkpoint (``save_hf_checkpoint``;
    with LoRA its PEFT adapter, ``lora_io.save_adapter``). ``inspect(engine)``: returned as "inspect".
    """
    from tp_trainer.initialize import initialize
    from tp_trainer.model.stages.pipeline import hf_named_parameters
    from tp_trainer.model.stages.split import StageSplit
    if isinstance(split, dict):
        split = StageSplit.from_names(split["names"], split["shared_after"])
    elif split is not None:
        split = StageSplit.from_names(split)

    graphs_before = dynamo_graphs()
    reuse_process_groups()
    engine, *_ = initialize(model, config, split=split)
    named = hf_named_parameters(engine.module)
    grads = {}

    def capture_before(method):
        """Step 0's gradients just before ``method``: the data-parallel reduction (ZeRO-1 moves
        gradients into its partitions there) or, with one replica (the engine skips that
        reduction), the optimizer step."""
        def run(*args, **kwargs):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
            return method(*args, **kwargs)
        return run

    engine._exec_reduce_grads = capture_before(engine._exec_reduce_grads)
    engine._exec_optimizer_step = capture_before(engine._exec_optimizer_step)
    replica = engine.grid.data_parallel_id
    losses, exact_losses = [], []
    for step in range(steps):
        losses.append(float(engine.train_batch(iter(batches(step, replica)))))
        if engine.is_last_stage():  # this replica's mean loss (train_batch averages the replicas')
            exact_losses.append(float(sum(engine.fwd_outputs) / engine.micro_batches))
    params = {n: p.detach().clone() for n, p in named.items()}
    eval_loss = float(engine.eval_batch(iter(eval_batches(replica)))) if eval_batches is not None else None
    if export is not None and getattr(engine.module, "lora_settings", None) is not None:
        from tp_trainer.lora_io import save_adapter
        save_adapter(engine, export)
    elif export is not None:
        from tp_trainer.checkpoint import save_hf_checkpoint
        save_hf_checkpoint(engine, export, model.config)
    return {"losses": losses, "exact_losses": exact_losses or None, "grads": grads, "params": params,
            "stage": engine.stage_id, "eval": eval_loss, "replica": replica,
            "sequence_rank": engine.shard.rank if engine.shard is not None else 0,
            "grads_summed": engine.grads_summed_before_reduce,   # else each sequence rank's share (ZeRO-1)
            "fused_head_loss": getattr(engine, "head_loss", None) is not None,
            "layer_types": [type(f).__name__ for f in engine.module.forward_funcs],
            "captured_units": captured_units(engine),
            "compiled_blocks": sum(getattr(f, "compiled", None) is not None for f in engine.module.forward_funcs),
            "dynamo_graphs": dynamo_graphs() - graphs_before,
            "inspect": inspect(engine) if inspect is not None else None}


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def captured_units(engine) -> int:
    """Units the stage's ``CapturedBlocks`` prepared (terapipe.cuda_graphs), 0 without them."""
    graphs = getattr(getattr(engine, "captured", None), "graphs", None)
    return len(graphs.order) if graphs is not None else 0


def graphs_reaching(params) -> int:
    """Live tensors whose autograd graph reaches one of ``params`` (its gradient accumulator): each
    keeps those accumulators alive, with the stream they were made on, into a later CUDA graph
    capture (``ds_compat.detach_flat_copies``)."""
    import gc
    wanted = {id(p) for p in params}
    found = 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.grad_fn is None:
            continue
        stack, seen = [obj.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if id(getattr(node, "variable", None)) in wanted:
                found += 1
                break
            stack += [child for child, _ in node.next_functions]
    return found


def count_at_capture(engine) -> dict:
    """{"count": ``graphs_reaching`` the engine's parameters when its ``CapturedBlocks`` prepare their
    units (filled at the first training forward), or -1 while they have not}."""
    found = {"count": -1}
    prepare = engine.captured.prepare

    def counted(*args, **kwargs):
        found["count"] = graphs_reaching(engine.module.parameters())
        return prepare(*args, **kwargs)
    engine.captured.prepare = counted
    return found


def save_rank(results: dict, out_dir: str) -> None:
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


def merge_ranks(out_dir, world: int, only: str | None = None) -> dict:
    """{case name: {"losses", "eval", "grads", "params"}} merged over the ranks' ``save_rank`` files.

    Every rank must report the same losses; a parameter held by two ranks (tied weights,
    data-parallel replicas, sequence ranks) must agree across them. Gradients are averaged over the
    replicas (what DeepSpeed's data-parallel reduction computes; sequence ranks hold their sum already);
    ``losses`` are the last stages' own losses, summed over sequence ranks and averaged over the
    replicas, after checking what train_batch reported against them.
    """
    merged = {}
    for rank in range(world):
        for name, result in torch.load(os.path.join(out_dir, f"rank{rank}.pt")).items():
            if only is not None and name != only:  # merge that case alone
                continue
            entry = merged.setdefault(name, {"reported": result["losses"], "eval": result["eval"], "exact": {},
                                             "grads": {}, "params": {}, "fused_head_loss": False,
                                             "layer_types": set(), "captured_units": 0,
                                             "compiled_blocks": 0, "dynamo_graphs": 0, "sequence_ranks": set()})
            entry["sequence_ranks"].add(result.get("sequence_rank", 0))
            entry.setdefault("inspected", []).append(result.get("inspect"))   # each rank's, in rank order
            entry["fused_head_loss"] |= bool(result.get("fused_head_loss"))
            entry["layer_types"] |= set(result.get("layer_types", ()))
            for key in ("captured_units", "compiled_blocks", "dynamo_graphs"):
                entry[key] += result.get(key, 0)
            # the last stage returns its own loss, the others DeepSpeed's fp32 broadcast of it
            assert all(abs(a - b) <= REPORTED_LOSS_TOL * abs(b) for a, b in
                       zip(result["losses"], entry["reported"], strict=True)), f"{name}: stages disagree on the loss"
            assert entry["eval"] == result["eval"], f"{name}: stages disagree on the eval loss"
            if result["exact_losses"] is not None:   # sequence ranks: each its own tokens' share of the loss
                entry["exact"].setdefault(result["replica"], {})[result.get("sequence_rank", 0)] = result["exact_losses"]
            for hf_name, tensor in result["params"].items():
                if hf_name in entry["params"]:
                    assert relative(tensor, entry["params"][hf_name]) <= 1e-6, f"{name}: copies of {hf_name}"
                entry["params"][hf_name] = tensor
            for hf_name, tensor in result["grads"].items():   # ZeRO-1 over sequence ranks: each its share
                shares = entry["grads"].setdefault(hf_name, {}).setdefault(result["replica"], {})
                shares[result.get("sequence_rank", 0) if not result.get("grads_summed", True) else 0] = tensor
    return {name: _finish_merge(name, entry) for name, entry in merged.items()}


def _finish_merge(name: str, entry: dict) -> dict:
    shares = [torch.tensor(list(ranks.values()), dtype=torch.float64).sum(0) for ranks in entry.pop("exact").values()]
    exact = torch.stack(shares).mean(0).tolist()
    for step, (reported, mine) in enumerate(zip(entry.pop("reported"), exact, strict=True)):
        assert abs(reported - mine) <= REPORTED_LOSS_TOL * abs(mine), (
            f"{name} step {step}: train_batch returned {reported}, the last stage computed {mine}")
    entry["losses"] = exact
    entry["grads"] = {n: torch.stack([sum(shares.values()) for shares in r.values()]).mean(0)
                      for n, r in entry["grads"].items()}
    return entry


def hf_loss(model, micro_batches) -> torch.Tensor:
    """Mean next-token loss of the plain HF model over all microbatches of a step."""
    input_ids = torch.cat([ids for ids, _ in micro_batches])
    labels = torch.cat([lab for _, lab in micro_batches])
    return torch.nn.functional.cross_entropy(model(input_ids).logits.flatten(0, 1), labels.flatten())


def reference(model, batches, steps: int, eval_batches=None) -> dict:
    """The plain HF model trained like the pipeline: AdamW, clip_grad_norm_, one process.

    ``batches(step)`` gives the step's microbatches of the whole global batch.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    losses, grads = [], None
    for step in range(steps):
        loss = hf_loss(model, batches(step))
        optimizer.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    eval_loss = None
    if eval_batches is not None:
        with torch.no_grad():
            eval_loss = hf_loss(model, eval_batches).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "eval": eval_loss}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (computed in float64)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def distances(got: dict, exact: dict, zero_grads: tuple[str, ...] = ()) -> dict:
    """{kind: {key: distance}} of a result from the float64 reference ``exact`` (module docstring).

    Also checks the structure: the same steps, every HF parameter covered once.
    """
    assert len(got["losses"]) == len(exact["losses"]), f"{len(got['losses'])} losses, expected {len(exact['losses'])}"
    assert set(got["grads"]) == set(exact["grads"]), (
        f"pipeline stages must cover every HF parameter once: missing {set(exact['grads']) - set(got['grads'])}, "
        f"extra {set(got['grads']) - set(exact['grads'])}")
    out = {"loss": {step: abs(mine - theirs) / abs(theirs)
                    for step, (mine, theirs) in enumerate(zip(got["losses"], exact["losses"], strict=True))},
           "grad": {}, "param": {}, "eval": {}}
    scale = max(float(g.abs().max()) for g in exact["grads"].values())
    for name, theirs in exact["grads"].items():
        mine = got["grads"][name].double()
        if name.endswith(zero_grads):
            assert float(theirs.abs().max()) <= 1e-9 * scale, f"{name}: expected a zero gradient"
            out["grad"][name] = float((mine - theirs).abs().max()) / scale
        else:
            out["grad"][name] = relative(mine, theirs)
    out["param"] = {name: relative(got["params"][name], theirs) for name, theirs in exact["params"].items()}
    if exact["eval"] is not None:
        out["eval"]["eval"] = abs(got["eval"] - exact["eval"]) / abs(exact["eval"])
    return out


def _describe(kind: str, key) -> str:
    return {"loss": f"loss of step {key}", "grad": f"gradient of {key}", "param": f"parameter {key} after the steps",
            "eval": "eval loss"}[kind]


def check_float64(got: dict, exact: dict, zero_grads: tuple[str, ...] = (), tol: dict = F64_TOL) -> dict:
    """A float64 pipeline run against the float64 HF run: every distance within ``tol``.
    Returns the largest distance of each kind."""
    worst = {}
    for kind, values in distances(got, exact, zero_grads).items():
        for key, value in values.items():
            assert value <= tol[kind], f"float64: {_describe(kind, key)} differs by {value:.3g} > {tol[kind]:.0e}"
        worst[kind] = max(values.values(), default=0.0)
    return worst


def check_float32(got: dict, fp32_hf: dict, exact: dict, zero_grads: tuple[str, ...] = ()) -> dict:
    """An fp32 pipeline run against the float64 HF run ``exact``, allowing what fp32 itself gets
    wrong: distance <= NOISE_FACTOR x max(the fp32 HF run's distance, NOISE_FLOOR).
    Returns the largest ratio distance / allowance of each kind (<= 1 passes)."""
    mine, baseline = distances(got, exact, zero_grads), distances(fp32_hf, exact, zero_grads)
    worst = {}
    for kind, values in mine.items():
        ratios = {}
        for key, value in values.items():
            allowed = NOISE_FACTOR * max(baseline[kind][key], NOISE_FLOOR[kind])
            assert value <= allowed, (f"fp32: {_describe(kind, key)} is {value:.3g} from the float64 HF run; "
                                      f"the fp32 HF run is {baseline[kind][key]:.3g} from it (allowed {allowed:.3g})")
            ratios[key] = value / allowed
        worst[kind] = max(ratios.values(), default=0.0)
    return worst
