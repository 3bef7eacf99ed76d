"""A slice's attention as one cuDNN kernel with its causal diagonal aligned bottom-right
(``terapipe.attention`` "cudnn-br", and "auto"'s choice for slices with context where the package is
installed: ``attention_cuda`` gives the figures).

PyTorch's cuDNN attention aligns the causal diagonal top-left, so ``attention_cuda`` runs a slice
[c, c + l) there as two attentions joined by their log-sum-exp (``SplitAttention``): per slice and
layer two forward and two backward kernels, the join's float32 arithmetic and the K/V gradients'
concatenation (what that costs on the H200: benchmarks/RESULTS.md). cuDNN itself
takes the alignment as an attribute of its graph: NVIDIA's Python frontend (``pip install
nvidia-cudnn-frontend``, the ``pygraph`` API of 1.16) builds ``sdpa(q, k, v, diagonal_alignment=
BOTTOM_RIGHT, diagonal_band_right_bound=0)`` and its backward: one kernel each way over keys [0, c + l),
with grouped-query K/V as they are (no repeat) and no mask built or saved.

Graphs: one forward and one backward per (shapes, strides, dtype, scale, mask, device), built at
first use and kept for the process (``CudnnFrontend``). ``capture.UnitGraphs`` runs every unit
eagerly before it captures, so they are built outside a capture. Each call points the cuDNN handle at torch's current
stream (the capturing one under ``torch.cuda.graph``); the workspace is a torch tensor (from the graph
pool under capture).

Layout: the output is (b, l, h, d) in memory, handed to cuDNN as (b, h, l, d) strides, so the layer's
output projection reads it with no transpose copy; dK / dV come out in the cache's layout (token-major
on CUDA, ``slice_cache.TOKEN_MAJOR``), dQ in the query's. Saved for backward: q, the output, the
log-sum-exp (O(l)) and the K/V views (no copy).
"""

from __future__ import annotations

import ctypes
import re

import torch

PIN = "nvidia-cudnn-frontend==1.16.0"   # the pygraph API used here; later releases restructure the package
INSTALL = f"pip install {PIN}"
_FRONTEND: dict = {}


class BottomRightAttention(torch.autograd.Function):
    """softmax(q K^T, causal aligned bottom-right) V of one slice: q (b, h, l, d), keys / values
    (b, g, c + l, d) with g dividing h; returns (b, h, l, d), a view of (b, l, h, d) memory.
    ``backend``: ``forward(q, k, v, out, stats, scale)`` and ``backward(q, k, v, out, dout, stats, dq,
    dk, dv, scale)`` writing into the tensors given (``CudnnFrontend``; a reference in the tests)."""

    @staticmethod
    def forward(ctx, query, keys, values, scale: float, backend):
        b, h, length, d = query.shape
        out = query.new_empty(b, length, h, d).transpose(1, 2)
        stats = torch.empty(b, h, length, 1, dtype=torch.float32, device=query.device)   # log-sum-exp
        backend.forward(query, keys, values, out, stats, scale)
        ctx.save_for_backward(query, keys, values, out, stats)
        ctx.scale, ctx.backend = scale, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, stats = ctx.saved_tensors
        dout = grad_out
        if dout.stride() != out.stride():   # cuDNN reads dO as it reads O
            dout = torch.empty_like(out).copy_(grad_out)
        # empty_like keeps the dimension order of a view (token-major K/V stay token-major), dense
        dq, dk, dv = torch.empty_like(query), torch.empty_like(keys), torch.empty_like(values)
        ctx.backend.backward(query, keys, values, out, dout, stats, dq, dk, dv, ctx.scale)
        return dq, dk, dv, None, None


class CudnnFrontend:
    """Builds, keeps and runs the slice's causal SDPA graphs through the ``cudnn`` module: a slice
    [c, c + l) asks for its mask as the diagonal aligned bottom-right, one graph each way (other
    spellings of the same mask, for the GPU check to time against it: ``benchmarks/_cudnn_spellings.py``)."""

    def __init__(self, cudnn):
        self.cudnn = cudnn
        self.graphs: dict = {}
        self.handles: dict = {}

    def forward(self, q, k, v, out, stats, scale: float) -> None:
        mask = self._slice_mask(q, k)
        self._run(("F", scale, *mask.items()), (q, k, v), (out, stats),
                  lambda g, t: g.sdpa(name="slice_sdpa", q=t[0], k=t[1], v=t[2], generate_stats=True,
                                      attn_scale=scale, **mask))

    def backward(self, q, k, v, out, dout, stats, dq, dk, dv, scale: float) -> None:
        self._backward(q, k, v, out, dout, stats, (dq, dk, dv), scale, self._slice_mask(q, k))

    def _backward(self, q, k, v, out, dout, stats, grads, scale: float, mask: dict) -> None:
        self._run(("B", scale, *mask.items()), (q, k, v, out, dout, stats), grads,
                  lambda g, t: g.sdpa_backward(name="slice_sdpa_backward", q=t[0], k=t[1], v=t[2], o=t[3],
                                               dO=t[4], stats=t[5], attn_scale=scale, **mask))

    def _slice_mask(self, q, k) -> dict:
        """The mask of the slice whose queries are ``q`` over keys ``k``: causal aligned bottom-right."""
        return {"diagonal_alignment": self.cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}

    def _run(self, kind: tuple, inputs, outputs, add_op) -> None:
        """Build (once per kind, which names the op, its mask and scale, and layouts) and execute the
        graph reading ``inputs`` and writing ``outputs``; ``add_op(graph, input nodes)`` adds the
        attention and returns its output nodes."""
        buffers = (*inputs, *outputs)
        device = buffers[0].device
        key = (kind, device, *_layouts(buffers))
        handle = self._handle(device)
        found = self.graphs.get(key)
        if found is None:
            found = self.graphs[key] = self._graph_for(handle, inputs, outputs, add_op)
        graph, nodes = found
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        graph.execute(dict(zip(nodes, buffers)), workspace, handle=handle)

    def _handle(self, device):
        """The device's cuDNN handle, pointed at torch's current stream."""
        handle = self.handles.get(device)
        if handle is None:
            handle = self.handles[device] = self.cudnn.create_handle()
        if device.type == "cuda":
            self.cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        return handle

    def _graph_for(self, handle, inputs, outputs, add_op):
        c = self.cudnn
        graph = c.pygraph(io_data_type=_cudnn_type(c, inputs[0]), intermediate_data_type=c.data_type.FLOAT,
                          compute_data_type=c.data_type.FLOAT, handle=handle)
        in_nodes = [graph.tensor(name=f"in{i}", dim=list(t.shape), stride=list(t.stride()), data_type=_cudnn_type(c, t))
                    for i, t in enumerate(inputs)]
        out_nodes = add_op(graph, in_nodes)
        for node, t in zip(out_nodes, outputs):
            node.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(_cudnn_type(c, t))
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph, [*in_nodes, *out_nodes]


def _layouts(tensors) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _cudnn_type(cudnn, tensor):
    return {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF,
            torch.float32: cudnn.data_type.FLOAT}[tensor.dtype]


def frontend() -> CudnnFrontend:
    """The process's ``CudnnFrontend``, bound to the libcudnn torch loaded. ImportError naming the
    package where ``cudnn`` (nvidia-cudnn-frontend) is not installed (tried once a process: a failed
    import is not cached by Python, and "auto" asks on every slice)."""
    if "backend" not in _FRONTEND:
        if "missing" in _FRONTEND:
            raise ImportError(_FRONTEND["missing"])
        try:
            import cudnn
        except ImportError as err:
            _FRONTEND["missing"] = f"cuDNN's bottom-right attention needs NVIDIA's cuDNN frontend: {INSTALL}"
            raise ImportError(_FRONTEND["missing"]) from err
        _bind_torch_cudnn(cudnn)
        _FRONTEND["backend"] = CudnnFrontend(cudnn)
    return _FRONTEND["backend"]


def available() -> bool:
    """Whether the frontend loads in this process ("auto" takes the bottom-right kernel only then)."""
    try:
        frontend()
    except ImportError:
        return False
    return True


def _bind_torch_cudnn(cudnn) -> None:
    """Point the frontend at the libcudnn this process already runs (torch's), not another copy: its own
    search looks in one site-packages folder only."""
    bind = getattr(getattr(cudnn, "_pybind_module", None), "_set_dlhandle_cudnn", None)
    path = loaded_library(r"/libcudnn\.so\.\d+$")
    if bind is not None and path is not None:
        bind(ctypes.cast(ctypes.CDLL(path)._handle, ctypes.c_void_p).value)


def loaded_library(pattern: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of a shared library mapped into this process whose path matches ``pattern``."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split()   # address, perms, offset, device, inode[, path]
                if len(fields) >= 6 and re.search(pattern, fields[-1]):
                    return fields[-1]
    except OSError:
        return None
    return None
