"""What torch's own CPU kernels run under the ``ATEN_CPU_CAPABILITY`` this process started with."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def bf16_flash_problem() -> str | None:
    """None where torch's own CPU flash attention runs in bf16 at a slice above the fp32 upcast
    threshold (160 tokens x 64); else the reason it does not, for a skip.

    torch 2.13 packs bf16 blocks for AMX by what the hardware has, but only its avx512 kernels can pack
    (``pack_vnni2``): on an AMX CPU started with ATEN_CPU_CAPABILITY=avx2 or default, its SDPA raises.
    A limit of torch under a forced capability, met before any of tp_trainer's code runs."""
    q = torch.randn(1, 4, 160, 64, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as err:
        return (f"torch's own bf16 scaled_dot_product_attention fails under the CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}: {err}")
    return None
