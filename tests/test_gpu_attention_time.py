"""benchmarks/_gpu_attention_time.py, the GPU check's slice attention alone, on a CPU against the
stand-in ``cudnn`` of test_attention_cudnn (whose graphs compute the mask they are given): every
spelling of the mask and PyTorch's kernel on the whole sequence measured, their gradients agreeing,
the report's table; a spelling that asks for another mask shows in its gradient difference."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _gpu_capture as cap  # noqa: E402
from _gpu_attention_time import WHOLE, attention_alone, attention_alone_lines  # noqa: E402
from test_attention_cudnn import _fake_cudnn  # noqa: E402

from tp_trainer.model.cuda import attention_cudnn  # noqa: E402

CPU = torch.device("cpu")
LLAMA = cap.CPU_SETS["llama-w64"]   # 4 heads, 2 K/V heads, head size 16, seq 128


def test_every_spelling_measured_and_agreeing():
    found = attention_alone(LLAMA, CPU, torch.float32, cudnn=_fake_cudnn())
    rows = found["rows"]
    assert [(r["spelling"], r["slices"]) for r in rows] == [(WHOLE, 1)] + [
        (s, n) for s in attention_cudnn.SPELLINGS for n in (1, 8)]
    assert all(r["ms"] > 0 and r["grad_diff"] < 1e-5 for r in rows), rows
    assert (found["heads"], found["kv_heads"], found["head_size"], found["seq_len"]) == (4, 2, 16, 128)
    text = "\n".join(attention_alone_lines({"attention_alone": {"llama-w64": found}}))
    assert "| slices | PyTorch cuDNN, whole sequence | bottom-right | top-left band | split backward |" in text
    assert "| 8 | - | " in text and "Slice attention alone, one layer of llama-w64 (4 heads, 2 K/V heads" in text


def test_a_spelling_of_another_mask_shows(monkeypatch):
    """The agreement above can fail: a top-left band without its width is plain top-left causal, which
    hides the context from a slice that has one (8 slices), not from the whole sequence (1)."""
    def narrow(self, context, top_left):
        align = self.cudnn.diagonal_alignment
        return {"diagonal_alignment": align.TOP_LEFT if top_left else align.BOTTOM_RIGHT,
                "diagonal_band_right_bound": 0}
    monkeypatch.setattr(attention_cudnn.CudnnFrontend, "_mask", narrow)
    rows = attention_alone(LLAMA, CPU, torch.float32, cudnn=_fake_cudnn())["rows"]
    diff = {(r["spelling"], r["slices"]): r["grad_diff"] for r in rows}
    assert diff[("top-left band", 8)] > 0.1 and diff[("top-left band", 1)] < 1e-5
    assert diff[("split backward", 8)] < 1e-5   # its own keys' part is plain top-left causal anyway


def test_a_spelling_that_fails_is_reported_and_the_others_still_run(monkeypatch):
    """A spelling whose graphs cuDNN refuses keeps its error; the whole sequence and the other spellings
    are still measured (compared with nothing where bottom-right itself failed); without CUDA nothing runs."""
    def refuse(self, *args, **kwargs):
        if self.spelling != "split backward":
            raise RuntimeError("cudnn: no execution plan for this graph")
        return original(self, *args, **kwargs)
    original = attention_cudnn.CudnnFrontend.forward
    monkeypatch.setattr(attention_cudnn.CudnnFrontend, "forward", refuse)
    found = attention_alone(LLAMA, CPU, torch.float32, cudnn=_fake_cudnn())
    assert [(r["spelling"], r["slices"], r["grad_diff"]) for r in found["rows"]] == [
        (WHOLE, 1, None), ("split backward", 1, None), ("split backward", 8, None)]
    assert sorted(found["errors"]) == ["bottom-right", "top-left band"]
    assert "no execution plan" in found["errors"]["top-left band"]
    assert attention_alone(LLAMA, CPU, torch.float32) == {"skipped": "needs CUDA"}
    text = "\n".join(attention_alone_lines({"attention_alone": {"a": {"skipped": "needs CUDA"}, "b": found}}))
    assert "Slice attention alone, a: needs CUDA" in text and "**top-left band failed**" in text
    assert "| slices | PyTorch cuDNN, whole sequence | bottom-right | top-left band | split backward |" in text
    assert "| 8 | - | - | - | " in text and "(-; -)" in text   # failed spellings empty, nothing to compare with
