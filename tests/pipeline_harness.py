"""Pipeline-vs-plain-HF exactness: the parts every exactness test shares.

Worker side (one rank of a ``multirank.run_ranks`` launch): ``ds_config`` and ``train_case`` train
one case through ``tp_trainer.initialize`` and return this stage's results keyed by HF parameter
names. Test side: ``merge_ranks`` joins the ranks' results, ``reference`` trains the plain HF model
in one process the same way, ``compare`` measures and checks the differences.

Bounds (fp32, dropout 0): loss 1e-6 relative; every gradient (before clipping, step 0) and every
parameter after the last step within 1e-5 of max |reference| of that tensor; the eval loss 1e-5.
"""

from __future__ import annotations

import os

import torch

LR = 1e-3
WEIGHT_DECAY = 0.01
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (e.g. the key bias:
# softmax ignores a constant added to every key) is float noise of ~1e-9 in both runs, and with a
# tiny eps its update is +-lr whatever the noise (measured: eps 1e-8 -> params differ by 0.2 lr).
# The update of such an element is ~lr * noise / eps; eps = 1e-5 keeps it 10x under the 1e-5 bound
# (measured 1.1e-5 relative with eps 1e-6 on the zero-initialised c_attn bias).
ADAM_EPS = 1e-5
CLIP = 1.0  # DeepSpeed's default gradient_clipping; the global norm spans every stage

LOSS_TOL, GRAD_TOL, PARAM_TOL, EVAL_TOL = 1e-6, 1e-5, 1e-5, 1e-5


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


def train_case(model, config: dict, batches, steps: int, eval_batches=None) -> dict:
    """Train ``model`` through TeraPipeEngine ``steps`` steps; ``batches(step)`` gives the step's
    microbatches [(input_ids, labels), ...] of this replica.

    Returns the losses of each step, this stage's gradients of step 0 (captured just before the
    optimizer step, i.e. after the tied / data-parallel reductions, before clipping), its
    parameters after the last step and the eval loss of ``eval_batches`` (if given), all keyed by
    HF parameter names.
    """
    from tp_trainer.initialize import initialize
    from tp_trainer.model.pipeline import hf_named_parameters

    engine, *_ = initialize(model, config)
    named = hf_named_parameters(engine.module)
    grads = {}
    step_fn = engine._exec_optimizer_step

    def capture_then_step(*args, **kwargs):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
        step_fn(*args, **kwargs)

    engine._exec_optimizer_step = capture_then_step
    losses = [float(engine.train_batch(iter(batches(step)))) for step in range(steps)]
    params = {n: p.detach().clone() for n, p in named.items()}
    eval_loss = float(engine.eval_batch(iter(eval_batches))) if eval_batches is not None else None
    return {"losses": losses, "grads": grads, "params": params, "stage": engine.stage_id, "eval": eval_loss}


def save_rank(results: dict, out_dir: str) -> None:
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


def merge_ranks(out_dir, world: int) -> dict:
    """{case name: {"losses", "eval", "grads", "params"}} merged over the ranks' ``save_rank`` files.

    Every rank must report the same losses; a parameter held by two ranks (tied weights,
    data-parallel replicas) must agree across them.
    """
    merged = {}
    for rank in range(world):
        for name, result in torch.load(os.path.join(out_dir, f"rank{rank}.pt")).items():
            entry = merged.setdefault(name, {"losses": result["losses"], "eval": result["eval"],
                                             "grads": {}, "params": {}})
            assert entry["losses"] == result["losses"], f"{name}: stages disagree on the loss"
            assert entry["eval"] == result["eval"], f"{name}: stages disagree on the eval loss"
            for kind in ("grads", "params"):
                for hf_name, tensor in result[kind].items():
                    if hf_name in entry[kind]:
                        assert relative(tensor, entry[kind][hf_name]) <= 1e-6, f"{name}: copies of {hf_name}"
                    entry[kind][hf_name] = tensor
    return merged


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
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(got: dict, ref: dict, zero_grads: tuple[str, ...] = ()) -> dict:
    """Check a merged pipeline result against ``reference``; return the largest differences.

    ``zero_grads``: name suffixes of parameters whose gradient is zero in exact arithmetic (e.g. a
    key bias: softmax ignores a constant added to every score of a query). Their gradients are
    float noise in both runs, so a ratio to max |reference| means nothing; they must instead be
    within GRAD_TOL of the model's largest gradient, as must their difference.
    """
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "eval": 0.0}
    for step, (mine, theirs) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        diff = abs(mine - theirs) / abs(theirs)
        assert diff <= LOSS_TOL, f"step {step}: loss {mine} != HF {theirs}"
        worst["loss"] = max(worst["loss"], diff)
    assert set(got["grads"]) == set(ref["grads"]), (
        f"pipeline stages must cover every HF parameter once: missing {set(ref['grads']) - set(got['grads'])}, "
        f"extra {set(got['grads']) - set(ref['grads'])}")
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, theirs in ref["grads"].items():
        mine = got["grads"][name]
        if name.endswith(zero_grads):
            assert float(theirs.abs().max()) <= GRAD_TOL * scale, f"{name}: expected a zero gradient"
            diff = float((mine - theirs).abs().max()) / scale
        else:
            diff = relative(mine, theirs)
        assert diff <= GRAD_TOL, f"gradient of {name}: {diff:.3g}"
        worst["grad"] = max(worst["grad"], diff)
    for name, theirs in ref["params"].items():
        diff = relative(got["params"][name], theirs)
        assert diff <= PARAM_TOL, f"parameter {name} after {len(ref['losses'])} steps: {diff:.3g}"
        worst["param"] = max(worst["param"], diff)
    if ref["eval"] is not None:
        diff = abs(got["eval"] - ref["eval"]) / abs(ref["eval"])
        assert diff <= EVAL_TOL, f"eval loss {got['eval']} != HF {ref['eval']}"
        worst["eval"] = diff
    return worst
