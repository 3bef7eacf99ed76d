"""benchmarks/_gpu_attention_time.py, the GPU check's slice attention alone, on a CPU against the
stand-in ``cudnn`` of test_attention_cudnn (whose graphs compute the mask they are given): each
spelling of the mask (benchmarks/_cudnn_spellings.py) computes the slice through the graphs it says;
every spelling and PyTorch's kernel on the whole sequence measured, their gradients agreeing, the
report's table; a spelling that asks for another mask shows in its gradient difference."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _gpu_capture as cap  # noqa: E402
from _cudnn_spellings import SPELLINGS, SpelledFrontend  # noqa: E402
from _gpu_attention_time import WHOLE, attention_alone, attention_alone_lines  # noqa: E402
from test_attention_cudnn import _fake_cudnn, _through_frontend  # noqa: E402

CPU = torch.device("cpu")
LLAMA = cap.CPU_SETS["llama-w64"]   # 4 heads, 2 K/V heads, head size 16, seq 128


@pytest.mark.parametrize("spelling,backward_masks", [
    ("bottom-right", [("BOTTOM_RIGHT", 0)]),
    ("top-left band", [("TOP_LEFT", 7)]),
    ("split backward", [None, ("TOP_LEFT", 0)]),   # the context's keys unmasked, then the slice's own
])
def test_each_mask_spelling_computes_the_slice(spelling, backward_masks):
    """The three spellings of a slice's mask (``SpelledFrontend.spelling``): the same output and
    gradients as the reference, through the graphs each says (here 7 tokens of context)."""
    fake = _fake_cudnn()
    backend = SpelledFrontend(fake, spelling)
    assert _through_frontend(backend, 7) < 5e-3
    masks = [(g.op[0], g.op[1].get("diagonal_alignment"), g.op[1].get("diagonal_band_right_bound"))
             for g in fake.graphs]
    forward = ("TOP_LEFT", 7) if spelling == "top-left band" else ("BOTTOM_RIGHT", 0)
    assert masks[0] == ("sdpa", fake.diagonal_alignment[forward[0]], forward[1])
    assert masks[1:] == [("sdpa_backward", *((fake.diagonal_alignment[m[0]], m[1]) if m else (None, None)))
                         for m in backward_masks]
    before = len(fake.graphs)
    assert _through_frontend(backend, 0) < 5e-3   # a context-free slice: one graph each way
    assert [g.op[0] for g in fake.graphs[before:]] == ["sdpa", "sdpa_backward"]


def test_a_wrong_mask_spelling_is_caught():
    """The check above can fail: top-left causal without the band is another mask for a slice with
    context, and an unknown spelling is refused with the choices."""
    backend = SpelledFrontend(_fake_cudnn())
    backend._mask = lambda context, top_left: {"diagonal_alignment": backend.cudnn.diagonal_alignment.TOP_LEFT,
                                               "diagonal_band_right_bound": 0}
    assert _through_frontend(backend, 7) > 0.1
    with pytest.raises(ValueError, match="bottom-right, top-left band, split backward"):
        SpelledFrontend(_fake_cudnn(), "top-right")


def test_every_spelling_measured_and_agreeing():
    found = attention_alone(LLAMA, CPU, torch.float32, cudnn=_fake_cudnn())
    rows = found["rows"]
    assert [(r["spelling"], r["slices"]) for r in rows] == [(WHOLE, 1)] + [
        (s, n) for s in SPELLINGS for n in (1, 8)]
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
    monkeypatch.setattr(SpelledFrontend, "_mask", narrow)
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
    original = SpelledFrontend.forward
    monkeypatch.setattr(SpelledFrontend, "forward", refuse)
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
