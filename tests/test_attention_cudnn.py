"""attention_cudnn: one bottom-right causal attention per slice (terapipe.attention "cudnn-br").

cuDNN needs a GPU, so here the autograd function runs against a float64 reference backend, and
``CudnnFrontend`` (graph building, caching, the variant pack) against a stand-in ``cudnn`` module
whose graphs execute that reference: what the GPU check then measures is cuDNN's kernels, not this
plumbing."""

import sys
import types
from enum import Enum

import pytest
import torch

from tp_trainer.model.cuda import attention_cudnn
from tp_trainer.model.cuda.attention_cudnn import BottomRightAttention, CudnnFrontend, loaded_library
from test_attention_cuda import reference


def _attend(q, k, v, scale):
    """Bottom-right causal attention and its log-sum-exp (b, h, l, 1), GQA by repeat."""
    start = k.shape[2] - q.shape[2]
    groups = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    allowed = torch.arange(k.shape[2])[None] <= torch.arange(start, start + q.shape[2])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return reference(q, k, v, start, scale), torch.logsumexp(scores, -1, keepdim=True)


class ReferenceBackend:
    """``BottomRightAttention``'s backend in float64 math, writing into the tensors it is given."""

    def forward(self, q, k, v, out, stats, scale):
        o, lse = _attend(q.double(), k.double(), v.double(), scale)
        out.copy_(o)
        stats.copy_(lse)

    def backward(self, q, k, v, out, dout, stats, dq, dk, dv, scale):
        with torch.enable_grad():
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            grads = torch.autograd.grad(_attend(*leaves, scale)[0], leaves, dout.double())
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)


def _inputs(start, length, heads, kv_heads, token_major, dtype=torch.float64):
    torch.manual_seed(start * 7 + length)
    q = torch.randn(2, length, heads, 8, dtype=dtype).transpose(1, 2).requires_grad_()   # a projection's view

    def cache_view():   # token-major: a view of a longer sequence buffer, as on CUDA
        if token_major:
            return torch.randn(2, start + length + 5, kv_heads, 8, dtype=dtype).transpose(1, 2)[:, :, :start + length]
        return torch.randn(2, kv_heads, start + length, 8, dtype=dtype)
    return q, cache_view().requires_grad_(), cache_view().requires_grad_()


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("start,length,heads,kv_heads", [(0, 5, 4, 4), (7, 5, 4, 2), (16, 3, 6, 3), (9, 9, 2, 1)])
def test_bottom_right_attention_exact(start, length, heads, kv_heads, token_major):
    q, k, v = _inputs(start, length, heads, kv_heads, token_major)
    grad = torch.randn(2, heads, length, 8, dtype=torch.float64)
    out = BottomRightAttention.apply(q, k, v, 8 ** -0.5, ReferenceBackend())
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out = reference(q, k, v, start, 8 ** -0.5)
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-11)
    assert out.transpose(1, 2).is_contiguous()   # (b, l, h, d) memory: the output projection's input
    assert got[1].stride() == torch.empty_like(k).stride()   # the cache's dimension order


def test_bottom_right_is_not_top_left():
    """The check above can fail: a top-left diagonal (queries 0..l-1) gives another output."""
    q, k, v = _inputs(6, 4, 2, 2, False)
    out = BottomRightAttention.apply(q, k, v, 8 ** -0.5, ReferenceBackend())
    assert not torch.allclose(out, reference(q, k, v, 0, 8 ** -0.5), atol=1e-3)


class _Node:
    """A stand-in cudnn tensor: records what the graph sets on it."""

    def __init__(self, name, **attrs):
        self.name, self.attrs = name, dict(attrs)

    def __getattr__(self, item):
        if not item.startswith("set_"):
            raise AttributeError(item)
        return lambda value: (self.attrs.__setitem__(item[4:], value), self)[1]


class _Graph:
    def __init__(self, module, **kwargs):
        self.module, self.kwargs, self.calls, self.op = module, kwargs, [], None
        module.graphs.append(self)

    def tensor(self, name, dim, stride, data_type):
        return _Node(name, dim=dim, stride=stride, data_type=data_type)

    def sdpa(self, **kwargs):
        self.op = ("sdpa", kwargs)
        return [_Node("o"), _Node("stats")]

    def sdpa_backward(self, **kwargs):
        self.op = ("sdpa_backward", kwargs)
        return [_Node("dq"), _Node("dk"), _Node("dv")]

    def __getattr__(self, item):   # validate, build_operation_graph, ...: recorded in order
        return lambda *args, **kwargs: self.calls.append(item)

    def get_workspace_size(self):
        return 64

    def execute(self, pack, workspace, handle):
        """cuDNN's math in float64 for the mask the graph was given (the spelling under test), writing
        into the buffers of the variant pack."""
        assert handle in self.module.made and workspace.numel() == 64
        for node, t in pack.items():   # each buffer is the one the graph was built for
            assert node.attrs["dim"] == list(t.shape) and node.attrs["stride"] == list(t.stride())
        kind, kwargs = self.op
        buffers = list(pack.values())
        q, k, v = (t.double() for t in buffers[:3])
        allowed = _allowed(self.module, q.shape[2], k.shape[2], kwargs)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2) * kwargs["attn_scale"]).masked_fill(~allowed, float("-inf"))
        if kind == "sdpa":
            stats = torch.logsumexp(scores, -1, keepdim=True)
            buffers[3].copy_(torch.softmax(scores, -1) @ v)
            buffers[4].copy_(stats)
            return
        out, dout, stats = (t.double() for t in buffers[3:6])
        probs = torch.exp(scores - stats)   # this graph's keys' share of the joint softmax
        dscores = probs * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
        grads = (dscores @ k * kwargs["attn_scale"], dscores.transpose(-1, -2) @ q * kwargs["attn_scale"],
                 probs.transpose(-1, -2) @ dout)
        b, kv_heads, n, d = buffers[1].shape
        buffers[6].copy_(grads[0])
        for target, grad in zip(buffers[7:], grads[1:]):   # grouped-query heads summed per K/V head
            target.copy_(grad.reshape(b, kv_heads, groups, n, d).sum(2))


def _allowed(module, q_len, kv_len, kwargs):
    """The (q_len, kv_len) keys each query sees under the graph's mask attributes (none: all)."""
    if "diagonal_alignment" not in kwargs:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    shift = kv_len - q_len if kwargs["diagonal_alignment"] == module.diagonal_alignment.BOTTOM_RIGHT else 0
    return torch.arange(kv_len)[None] <= torch.arange(q_len)[:, None] + shift + kwargs["diagonal_band_right_bound"]


def _fake_cudnn():
    module = types.SimpleNamespace(graphs=[], handles=0, made=[])
    module.data_type = Enum("data_type", "BFLOAT16 HALF FLOAT")
    module.diagonal_alignment = Enum("diagonal_alignment", "TOP_LEFT BOTTOM_RIGHT")
    module.heur_mode = Enum("heur_mode", "A FALLBACK")
    module.pygraph = lambda **kwargs: _Graph(module, **kwargs)

    def create_handle():
        module.handles += 1
        module.made.append(f"handle-{module.handles - 1}")
        return module.made[-1]
    module.create_handle = create_handle
    return module


def test_frontend_builds_each_shape_once_and_runs_it():
    """``CudnnFrontend`` over a stand-in ``cudnn``: bottom-right mask, stats generated, the graph's
    steps in cuDNN's order, one forward and one backward graph per shape, reused."""
    fake = _fake_cudnn()
    backend = CudnnFrontend(fake)
    for start in (7, 7, 3):
        q, k, v = _inputs(start, 5, 4, 2, True, dtype=torch.float16)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out = BottomRightAttention.apply(q, k, v, 0.25, backend)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        want = reference(q64, k64, v64, start, 0.25)
        assert torch.allclose(out.double(), want, atol=2e-3)
        for a, b in zip(grads, torch.autograd.grad(want, (q64, k64, v64), torch.ones_like(want))):
            assert torch.allclose(a.double(), b, atol=2e-2)
    assert fake.handles == 1
    assert [g.op[0] for g in fake.graphs] == ["sdpa", "sdpa_backward"] * 2   # start 7 twice: built once
    for graph in fake.graphs:
        assert graph.kwargs["io_data_type"] == fake.data_type.HALF
        assert graph.calls == ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                               "build_plans"]
        kwargs = graph.op[1]
        assert kwargs["diagonal_alignment"] == fake.diagonal_alignment.BOTTOM_RIGHT
        assert kwargs["diagonal_band_right_bound"] == 0 and kwargs["attn_scale"] == 0.25
    assert fake.graphs[0].op[1]["generate_stats"] is True


def _through_frontend(backend, start, length=5):
    """One slice (fp16, token-major K/V, grouped-query) through ``backend``: its output and gradients
    against the float64 reference's."""
    q, k, v = _inputs(start, length, 4, 2, True, dtype=torch.float16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    grad = torch.randn(2, 4, length, 8, dtype=torch.float64)
    out = BottomRightAttention.apply(q, k, v, 0.25, backend)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want_out = reference(q64, k64, v64, start, 0.25)
    want = torch.autograd.grad(want_out, (q64, k64, v64), grad)
    return max([float((out.detach().double() - want_out.detach()).abs().max())]
               + [float((a.double() - b).abs().max()) for a, b in zip(got, want)])


def test_a_wrong_mask_is_caught():
    """The checks of the frontend's slice can fail: top-left causal without the band is another mask
    for a slice with context (the other spellings of the right one: test_gpu_attention_time)."""
    backend = CudnnFrontend(_fake_cudnn())
    backend._slice_mask = lambda q, k: {"diagonal_alignment": backend.cudnn.diagonal_alignment.TOP_LEFT,
                                        "diagonal_band_right_bound": 0}
    assert _through_frontend(backend, 7) > 0.1


def test_frontend_names_the_package_when_missing(monkeypatch):
    monkeypatch.setattr(attention_cudnn, "_FRONTEND", {})
    monkeypatch.setitem(sys.modules, "cudnn", None)   # import cudnn raises ImportError
    for _ in range(2):   # the second call answers from the first's record
        with pytest.raises(ImportError, match="pip install nvidia-cudnn-frontend"):
            attention_cudnn.frontend()
    assert attention_cudnn.available() is False


def test_loaded_library_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
                    "7f2-7f3 r-xp 0 08:01 2 /site/nvidia/cudnn/lib/libcudnn_graph.so.9\n"
                    "7f4-7f5 r-xp 0 08:01 3 /site/nvidia/cudnn/lib/libcudnn.so.9\n"
                    "7f6-7f7 rw-p 0 00:00 0\n")
    assert loaded_library(r"/libcudnn\.so\.\d+$", str(maps)) == "/site/nvidia/cudnn/lib/libcudnn.so.9"
    assert loaded_library(r"/libnothing\.so", str(maps)) is None
    assert loaded_library("x", str(tmp_path / "missing")) is None


@pytest.fixture
def cpu_slices(monkeypatch):
    """``slice_attention_cuda`` on the CPU: the split runs on the CPU's kernels, from any slice size, and
    no frontend is loaded yet."""
    from tp_trainer.model.cuda import attention_cuda
    monkeypatch.setattr(attention_cuda, "CUDNN", attention_cuda.CPU_FLASH)
    monkeypatch.setattr(attention_cuda, "CUDNN_FROM", 0)
    monkeypatch.setattr(attention_cuda, "BR_FROM", 0)
    monkeypatch.setattr(attention_cudnn, "_FRONTEND", {})
    return attention_cuda


def _check_slice(attention_cuda, choice, start, length=5):
    """One slice through ``slice_attention_cuda`` under ``choice`` (an ``AttentionChoice``) in float32
    (the stand-in graphs take no float64), against the float64 reference."""
    from tp_trainer.model.slices.attention import SliceSpan
    q, k, v = _inputs(start, length, 4, 2, False)
    out = attention_cuda.slice_attention_cuda(q.float(), k.float(), v.float(), SliceSpan(start, length), 8 ** -0.5,
                                              choice)
    assert torch.allclose(out.transpose(1, 2).double(), reference(q, k, v, start, 8 ** -0.5), rtol=0, atol=1e-5)


def test_auto_takes_the_bottom_right_kernel_for_slices_with_context(cpu_slices, monkeypatch):
    """Where the frontend loads, "auto" runs a slice with context as one bottom-right graph and a
    context-free slice through the split's one causal kernel (the same square, where PyTorch's cuDNN
    backward skips the masked half); a slice under ``BR_FROM`` tokens x head size takes the others."""
    from tp_trainer.model.slices.attention import SliceSpan
    fake = _fake_cudnn()
    attention_cudnn._FRONTEND["backend"] = CudnnFrontend(fake)
    monkeypatch.setattr(cpu_slices, "BR_FROM", 5 * 8)
    auto = cpu_slices.AttentionChoice("auto")
    _check_slice(cpu_slices, auto, 0)
    assert fake.graphs == []
    _check_slice(cpu_slices, auto, 7)
    assert [g.op[0] for g in fake.graphs] == ["sdpa"]   # forward only: the check takes no gradient
    _check_slice(cpu_slices, auto, 7, length=4)   # 4 x 8 < BR_FROM
    assert len(fake.graphs) == 1
    takes = auto.takes_bottom_right
    assert takes(SliceSpan(7, 5), 8) and not takes(SliceSpan(7, 5, window=4), 8)
    takes = cpu_slices.AttentionChoice("cudnn-br").takes_bottom_right   # chosen: any size, not a context-free slice
    assert takes(SliceSpan(7, 4), 8) and not takes(SliceSpan(0, 5), 8)
    for kernel in ("cudnn", "flash"):
        assert not cpu_slices.AttentionChoice(kernel).takes_bottom_right(SliceSpan(7, 5), 8)


def test_auto_without_the_package_runs_the_split_silently(cpu_slices, monkeypatch, recwarn):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    auto = cpu_slices.AttentionChoice("auto")
    _check_slice(cpu_slices, auto, 7)
    _check_slice(cpu_slices, auto, 7)
    assert auto.kernel == "auto" and not recwarn.list and auto.fallbacks == []
    assert "nvidia-cudnn-frontend" in attention_cudnn._FRONTEND["missing"]   # tried once


class _Refusing:
    """A frontend whose graphs cuDNN does not support."""

    def __init__(self):
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        raise RuntimeError("cudnn: no execution plan supports this graph")


def test_auto_gives_up_a_failing_bottom_right_kernel_once(cpu_slices):
    """One warning with the reason, and the fallback recorded on the run's ``AttentionChoice`` (which the
    run writes into plan.json); another run's choice tries the kernel again."""
    refusing = attention_cudnn._FRONTEND["backend"] = _Refusing()
    auto = cpu_slices.AttentionChoice("auto")
    with pytest.warns(UserWarning, match="bottom-right attention failed.*no execution plan.*split or flash") as caught:
        _check_slice(cpu_slices, auto, 7)
        _check_slice(cpu_slices, auto, 7)
    assert len(caught) == 1
    assert refusing.calls == 1 and auto.kernel == "auto" and auto.bottom_right_off
    assert "no execution plan" in auto.fallback_reason   # what gpu_check's check_kernel reports
    assert [(f["failed"], f["to"]) for f in auto.fallbacks] == [("cudnn-br", "auto")]
    again = cpu_slices.AttentionChoice("auto")   # chosen again: tried again, no reason recorded
    assert again.fallback_reason == "" and again.fallbacks == []
    with pytest.warns(UserWarning, match="bottom-right attention failed"):
        _check_slice(cpu_slices, again, 7)
    assert refusing.calls == 2


def test_a_failing_kernel_falls_back_once_with_its_reason(cpu_slices, monkeypatch):
    """cudnn-br without its package: the slice runs cuDNN's split instead (here on the CPU's kernels),
    one warning names the reason, and the slices after it take the split directly."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    chosen = cpu_slices.AttentionChoice("cudnn-br")
    with pytest.warns(UserWarning, match="bottom-right attention failed.*pip install nvidia-cudnn-frontend"):
        _check_slice(cpu_slices, chosen, 7)
    assert chosen.kernel == "cudnn" and chosen.chosen == "cudnn-br"
    assert "nvidia-cudnn-frontend" in chosen.fallback_reason


def test_cost_models_record_the_bottom_right_kernel(cpu_slices, monkeypatch):
    """A cost model measured with the bottom-right kernel says so (``planner.auto.measured_settings``):
    its slices with context cost otherwise than the split's."""
    from tp_trainer.planner.auto import measured_settings
    kernel = cpu_slices.AttentionChoice("auto").measured
    monkeypatch.setitem(sys.modules, "cudnn", None)
    assert kernel("cuda", "bf16") == kernel("cpu", "bf16") == "auto"
    monkeypatch.setattr(attention_cudnn, "_FRONTEND", {"backend": CudnnFrontend(_fake_cudnn())})
    assert kernel("cuda", "bf16") == "auto with cudnn-br" and kernel("cuda", "fp32") == kernel("cpu", "bf16") == "auto"
    assert cpu_slices.AttentionChoice("flash").measured("cuda", "fp16") == "flash"
    config = types.SimpleNamespace(model_type="gpt2")   # the run's choice is what its cost model records
    flash = cpu_slices.AttentionChoice("flash")
    assert measured_settings("cuda", "bf16", False, config, attention=flash)["attention"] == "flash"
    assert measured_settings("cuda", "bf16", False, config)["attention"] == "auto with cudnn-br"


def test_the_cuda_extra_installs_the_pinned_frontend():
    """``pip install .[cuda]`` brings the frontend release whose API this module uses."""
    import tomllib
    from pathlib import Path
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["cuda"] == [attention_cudnn.PIN]
