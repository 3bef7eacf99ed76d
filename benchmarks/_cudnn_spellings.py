"""Two more spellings of a slice's causal mask to cuDNN, beside the bottom-right one the package runs
(``tp_trainer/model/cuda/attention_cudnn.py``), for the GPU check to time against it
(``_gpu_attention_time.py``): the same mask each way; which runs faster is the check's to measure.

- ``bottom-right``: the package's ``CudnnFrontend`` as it is, one graph each way. Its backward on a
  context-free square was measured slower than PyTorch's top-left kernel's, as if it computed the
  masked tiles (benchmarks/RESULTS.md).
- ``top-left band``: the diagonal aligned top-left, widened by c keys (``diagonal_band_right_bound``
  = c): query i sees keys <= i + c, one graph each way.
- ``split backward``: the forward as ``bottom-right``; the backward of a slice with context as two
  graphs, the context's keys [0, c) unmasked and the slice's own [c, c + l) causal top-left (the mask
  PyTorch's cuDNN kernel gives), each with the joint output and log-sum-exp (the exact gradients, as
  ``attention_cuda.SplitAttention``), writing dK / dV into their two ranges of the buffers given (no
  join); dQ is the two parts' sum.
"""

from __future__ import annotations

import torch

from tp_trainer.model.cuda.attention_cudnn import CudnnFrontend

SPELLINGS = ("bottom-right", "top-left band", "split backward")


class SpelledFrontend(CudnnFrontend):
    """``CudnnFrontend`` asking cuDNN for a slice's mask as ``spelling`` (one of ``SPELLINGS``) says."""

    def __init__(self, cudnn, spelling: str = "bottom-right"):
        if spelling not in SPELLINGS:
            raise ValueError(f"cuDNN mask spelling {spelling!r}; choose {', '.join(SPELLINGS)}")
        super().__init__(cudnn)
        self.spelling = spelling

    def backward(self, q, k, v, out, dout, stats, dq, dk, dv, scale: float) -> None:
        start = k.shape[2] - q.shape[2]
        if self.spelling != "split backward" or not start:
            super().backward(q, k, v, out, dout, stats, dq, dk, dv, scale)
            return
        dq_context = torch.empty_like(dq)
        self._backward(q, k[:, :, :start], v[:, :, :start], out, dout, stats,
                       (dq_context, dk[:, :, :start], dv[:, :, :start]), scale, {})
        self._backward(q, k[:, :, start:], v[:, :, start:], out, dout, stats,
                       (dq, dk[:, :, start:], dv[:, :, start:]), scale, self._mask(0, top_left=True))
        dq.add_(dq_context)

    def _slice_mask(self, q, k) -> dict:
        """The slice's mask as this spelling asks for it whole (``split backward``'s forward: bottom-right)."""
        return self._mask(k.shape[2] - q.shape[2], top_left=self.spelling == "top-left band")

    def _mask(self, context: int, top_left: bool) -> dict:
        """Causal aligned bottom-right, or top-left widened by ``context`` keys (0: plain top-left causal,
        a square's)."""
        align = self.cudnn.diagonal_alignment
        if top_left:
            return {"diagonal_alignment": align.TOP_LEFT, "diagonal_band_right_bound": context}
        return {"diagonal_alignment": align.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}
