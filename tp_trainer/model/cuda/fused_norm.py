"""HF's RMSNorm as torch's fused kernels on a GPU.

HF's ``LlamaRMSNorm`` (Mistral's, Qwen2's and Qwen3's are the same code) runs 7 kernels forward (to
float32, pow, mean, add eps, rsqrt, multiply, back to the input dtype, multiply by the weight) and
about 12 backward, several of them over float32 copies of the activations (twice the bf16 bytes).
Sliced, every slice and norm pays them again. ``aten._fused_rms_norm`` (CUDA) computes the same
function in one pass forward and a fused backward: float32 statistics, the weight applied before the
one rounding to the input dtype (HF rounds once more in between, so in bf16 the fused result is the
closer to float64).

On CUDA by default (``terapipe.fused_rms_norm``: "auto"), measured by ``benchmarks/gpu_check.py``'s
slice step ("fused norm"; figures: benchmarks/RESULTS.md): the gain is in bytes, not launches. On a
CPU torch runs the op as a composite of ATen ops (what the tests check): nothing is gained there, so
"auto" leaves HF's norm. float64 keeps HF's forward, which takes its statistics in float32 even then
(the exactness tests' float64 runs match HF to 1e-12).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

FUSABLE = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` is one of HF's RMSNorms whose function the fused kernel computes."""
    return (type(module).__name__ in FUSABLE and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def config_has_fusable_norms(config) -> bool:
    """Whether a model of ``config`` has RMSNorms ``fuse_rms_norms`` changes: HF names a family's norm
    after its config (``LlamaConfig`` -> ``LlamaRMSNorm``)."""
    family = type(config).__name__.removesuffix("Config")
    return f"{family}RMSNorm" in FUSABLE


def fused_rms_norm(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``module``'s forward through ``aten._fused_rms_norm``; HF's own in float64, or where the input's
    dtype is not the weight's (HF's result then takes the promoted dtype, the fused kernel's would not)."""
    if hidden.dtype != module.weight.dtype or hidden.dtype == torch.float64:
        return type(module).forward(module, hidden)
    return torch.ops.aten._fused_rms_norm(hidden, [hidden.shape[-1]], module.weight, module.variance_epsilon)[0]


def fuse_rms_norms(roots) -> list[nn.Module]:
    """Route the forward of every fusable RMSNorm under ``roots`` through ``fused_rms_norm``; returns
    the modules changed (``unfuse`` puts them back)."""
    changed = []
    for root in roots:
        for module in root.modules():
            if fusable(module):
                module.forward = partial(fused_rms_norm, module)
                changed.append(module)
    return changed


def unfuse(modules) -> None:
    """Give each module its class's forward again."""
    for module in modules:
        vars(module).pop("forward", None)
