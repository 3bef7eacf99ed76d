"""The ``terapipe`` section of the DeepSpeed JSON config, read and checked before any work.

Example (inside the DeepSpeed config):

    "pipeline": {"stages": 2},
    "terapipe": {"seq_len": 256, "slices": "uniform:4", "schedule": "gpipe"}

Each key's own value (type, range) is checked here; the combinations of keys (with each other, the
rest of the DeepSpeed config, the machine and the run's flags) in ``choices.RULES``. Every error is a
``ConfigError`` naming the field, the value and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from .plan import PlanError, SlicePlan, parse_slices
from .schedule import SCHEDULES


class ConfigError(ValueError):
    """An invalid configuration; raised before any process group, model or file is touched."""


COMPILE_BACKENDS = (None, "inductor", "aot_eager")   # terapipe.compile_blocks
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "cudnn-br")   # terapipe.attention (model/cuda/attention_cuda.py)

REMOVED_KEYS = {
    "calibrate": "the start-up calibration measured no faster step on 2 CPU ranks and added ~10 s to every "
                 "start; the planner's profile decides",
}


@dataclass
class TeraPipeConfig:
    """Token-slice pipelining options (the ``terapipe`` section)."""

    seq_len: int = 1024
    """Tokens per training sequence (block size); the model must have at least this many positions."""

    slices: object = "uniform:1"
    """Slice lengths: a list of positive ints summing to seq_len, "uniform:N", or "auto" (profile this
    machine at start-up and run TeraPipe's dynamic program)."""

    microbatches: object = None
    """None: DeepSpeed's batch settings decide; "auto" (with slices "auto"): the dynamic program also
    splits each replica's batch (train_micro_batch_size_per_gpu x gradient_accumulation_steps)."""

    cost_model: str | None = None
    """With "auto": a cost-model JSON to plan from (no profiling); written after profiling if absent."""

    granularity: int = 8
    """With "auto": slice lengths are multiples of this many tokens (the DP's step; with N sequence ranks of
    lcm(granularity, N): ``planner.sequence_cost.planner_granularity``)."""

    profile_seconds: float = 60.0
    """With "auto": time budget of the start-up profile of each stage."""

    schedule: str = "gpipe"
    """Order of the (microbatch, slice) units: "gpipe" (TeraPipe: all forwards, then all backwards
    in reverse) or "1f1b" (warm-up forwards, then one forward / one backward: fewer units in flight)."""

    defer_weight_grads: bool = True
    """Split every stage's backward into B (input gradients, which the previous stage waits for) and
    W (weight gradients of the linear layers, the LM head, tied or not, and the embeddings): the
    schedule carries a ``WeightGrad`` per unit, placed zero-bubble style (schedule/orders.py:
    place_weight_grads), so the bubble loses the W time. Applies in fp32 (or float64), bf16 and fp16,
    with ZeRO stage 0 or 1 (without overlap_comm); ignored (W inside B, as with false) where
    DeepSpeed takes each gradient out of ``.grad`` in hooks during the backward, since a W writes its
    gradient without autograd and no hook would fire for it: ZeRO >= 2, ZeRO-1 with overlap_comm, or
    ZeRO-1 accumulating in another dtype than the model's (fp16 with grad_accum_dtype fp32).
    fp32 / fp16 and ZeRO-1: the optimizers read ``.grad`` at ReduceGrads / the step, where W has
    added into it (fp16: its overflow check sees every gradient). bf16 (DeepSpeed's BF16_Optimizer):
    W adds into the optimizer's gradient buffers directly (ds_compat/grad_fold.py)."""

    cuda_graphs: bool = False
    """Run each stage's decoder blocks as CUDA graphs, one forward and one backward graph per unit
    (microbatch, slice), captured at the first step in the schedule's order and replayed after it
    (model/cuda/captured_blocks.py): no host time per block and slice. Embedding, head, loss and
    DeepSpeed's step stay eager. Weight gradients: with defer_weight_grads (the default) the blocks'
    are made once per sequence, one product per weight inside the captured backward of each
    microbatch's first slice, and the other layers' in B; without it all in B. Needs ZeRO stage 0, no activation
    checkpointing (nor memory_limit_gib, whose plan may checkpoint), bf16 gradient buffers under bf16,
    and one example per row (no packed examples). Without CUDA the same units run eagerly in the same
    order (what the CPU tests check). With "slices": "auto" the planner times the blocks replayed from
    captured graphs too (planner/profile.py, ``StageRunner.captured_run``). Opt-in: measured on one
    GPU, 1 stage (benchmarks/RESULTS.md); stages joined by NCCL have not run captured on a GPU, and
    the needs above rule out ZeRO-1 and checkpointed runs."""

    compile_blocks: object = None
    """A ``torch.compile`` backend ("inductor"; "aot_eager" runs ATen's kernels, exact in float64) for
    each decoder block, compiled around its K/V append and attention, which stay eager
    (model/cuda/compiled_blocks.py): fewer, fused kernels per slice. For GPUs with cuda_graphs, whose
    capture removes the host time the graph breaks cost; eagerly (CPU) it adds that time. Needs no
    activation checkpointing (nor memory_limit_gib) and no LoRA. null: off (the default). With
    cuda_graphs on a GPU its gain over fused_rms_norm alone is within noise (figures:
    benchmarks/RESULTS.md): inductor fuses the norms too."""

    fused_rms_norm: object = "auto"
    """Run HF's RMSNorms (Llama, Mistral, Qwen2, Qwen3) through torch's fused kernels (model/cuda/fused_norm.py)
    instead of HF's ~19 kernels and float32 copies of the activations. "auto" (the default): on CUDA,
    off elsewhere (on a CPU torch runs the op as a composite of ATen ops: no gain); true / false force
    it (figures: benchmarks/RESULTS.md). The statistics stay float32, the weight is
    applied before the one rounding to bf16 / fp16 (HF rounds once more: the fused result is the
    closer to float64); float64 keeps HF's forward."""

    attention: str = "auto"
    """The slices' attention kernel on CUDA in fp16 / bf16 (model/cuda/attention_cuda.py, held per run
    as an ``AttentionChoice``). l x d: a slice's tokens x head size.
    "auto" (the default): per slice by its size: a slice with context takes one cuDNN kernel with the
    causal diagonal aligned bottom-right where NVIDIA's cuDNN frontend is installed (``pip install
    .[cuda]``) and l x d >= 32768; else cuDNN split at the context boundary (the context unmasked, the
    slice's own keys causal, joined by their log-sum-exp) for l x d >= 65536; else PyTorch's flash
    kernel. "flash": the flash kernel for every slice. "cudnn": cuDNN's split for every slice.
    "cudnn-br": the bottom-right kernel for every slice with context (a context-free slice as "auto").
    Under every choice a sliding window takes flash and packed examples HF's SDPA with their mask; a
    CPU runs its flash kernel, and fp32 on CUDA HF's SDPA. A kernel that fails on a slice is given up
    for the rest of the run with one warning (the bottom-right kernel for the split, the split for
    flash), and the run records it in plan.json. The plan line names the kernel of each kind of slice.
    Which is faster where: benchmarks/RESULTS.md."""

    memory_limit_gib: object = None
    """With "auto" slices: the most memory (GiB) one rank may use for this run (parameters, gradients,
    optimizer state, activations and K/V; measured as peak RSS above the process's size before the
    model is built; on a GPU, the allocator's peak above what the device used before the model, the
    CUDA context included: tp_trainer/memory.py, not yet run on a GPU), or "auto": the device's memory
    (a GPU's total; on CPU the machine's RAM divided by the ranks on it). The planner then also
    chooses the order (gpipe / 1f1b) and activation checkpointing per stage: the least predicted step
    time whose predicted peak fits. If no plan fits, the run stops before building the model, naming
    the limit that would fit and the longest sequence that fits this one. None: no limit (time alone)."""

    split_blocks: bool = True
    """With "auto" slices: a stage boundary may fall inside a decoder block, between its attention and
    its MLP, where the family allows it (GPT-2, Llama, Qwen2, Mistral; ``model/stages/halves.py``): the
    profile then times the two halves apart (measured on 2 CPU ranks and simulated for GPUs:
    benchmarks/RESULTS.md). false: whole blocks per stage."""

    share_halves: bool = True
    """With "auto" slices, ``split_blocks``, 2 stages and no memory limit: a half near the boundary may
    also be held by both stages and run by slices (the early slices on the back stage, the later ones
    on the front stage), balancing the stages to a slice's grain: an MLP half
    (``model/stages/shared_half.py``), or with SDPA attention an attention half (``model/stages/shared_attention.py``).
    Measured side by side: benchmarks/RESULTS.md. false: boundaries between halves only."""

    sequence_parallel: int = 1
    """Sequence ranks per stage, N: each slice's l tokens are spread over N ranks of its stage, l/N
    contiguous tokens each, with an all-to-all around attention (Ulysses over the slice, through the K/V
    cache: ``model/slices/sequence_ranks.py``). The world is stages x N x replicas, a sequence group N
    consecutive ranks of one node; slice lengths are multiples of N ("auto" plans them on a grain of
    lcm(granularity, N), pricing a rank's share and its all-to-alls: ``planner/sequence_cost.py``); the heads (and
    K/V heads, or N a multiple of them) split over N. Each rank keeps l/N tokens' activations and its
    heads' K/V. 1 (the default): off. Also ``--sequence_parallel``."""

    bind_cores: bool = True
    """On CPU (DeepSpeed's CPU accelerator): pin each rank on this machine to its own share of the
    cores and run that many torch threads (``tp_trainer/cpu_binding.py``), as DeepSpeed's launcher
    does with its bind_cores_to_rank option (numactl). Left alone where the launcher bound the ranks already or
    there are fewer cores than ranks; no effect on GPUs. false: the launcher's defaults (every rank
    on every core, torch's default thread count)."""

    lora: object = None
    """LoRA through peft: {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": [...],
    "modules_to_save": [...], "adapter_name_or_path": DIR} (``lora.LoraSettings``; the LoRA flags
    (``--lora_r``, ...) win; checked against the model by ``lora.check``, which makes it a ``LoraSettings``). Base
    weights frozen; each stage injects adapters into its own layers. None: off."""

    def __post_init__(self):
        self._check_memory_limit()
        if self.lora is not None and not isinstance(self.lora, dict) and type(self.lora).__name__ != "LoraSettings":
            raise ConfigError(f"terapipe.lora: must be an object such as {{\"r\": 8}}, got {self.lora!r}")
        if not isinstance(self.bind_cores, bool):
            raise ConfigError(f"terapipe.bind_cores: must be true or false, got {self.bind_cores!r}")
        if not isinstance(self.share_halves, bool):
            raise ConfigError(f"terapipe.share_halves: must be true or false, got {self.share_halves!r}")
        if not isinstance(self.split_blocks, bool):
            raise ConfigError(f"terapipe.split_blocks: must be true or false, got {self.split_blocks!r}")
        if not (isinstance(self.fused_rms_norm, bool) or self.fused_rms_norm == "auto"):
            raise ConfigError(f"terapipe.fused_rms_norm: must be true, false or \"auto\", got {self.fused_rms_norm!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"terapipe.cuda_graphs: must be true or false, got {self.cuda_graphs!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"terapipe.attention: {self.attention!r}; use one of {list(ATTENTION_KERNELS)}")
        if self.compile_blocks not in COMPILE_BACKENDS:
            raise ConfigError(f"terapipe.compile_blocks: {self.compile_blocks!r}; use one of "
                              f"{[b for b in COMPILE_BACKENDS if b]} or null (off)")
        if not isinstance(self.defer_weight_grads, bool):
            raise ConfigError(f"terapipe.defer_weight_grads: must be true or false, got {self.defer_weight_grads!r}")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError(f"terapipe.seq_len: must be a positive integer, got {self.seq_len!r}")
        if not isinstance(self.sequence_parallel, int) or isinstance(self.sequence_parallel, bool) \
                or self.sequence_parallel < 1:
            raise ConfigError(f"terapipe.sequence_parallel: must be a positive integer (sequence ranks per stage), "
                              f"got {self.sequence_parallel!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"terapipe.schedule: unknown schedule {self.schedule!r}; "
                              f"use one of {sorted(SCHEDULES)}")
        if self.microbatches not in (None, "auto"):
            raise ConfigError(f"terapipe.microbatches: {self.microbatches!r}; use \"auto\" or leave it out "
                              f"(DeepSpeed's gradient_accumulation_steps then decides)")
        if not isinstance(self.granularity, int) or not 1 <= self.granularity <= self.seq_len:
            raise ConfigError(f"terapipe.granularity: must be an integer in 1..{self.seq_len}, got {self.granularity!r}")
        if self.slices == "auto":
            self.slice_lengths = None
            return
        try:
            self.slice_lengths = parse_slices(self.slices, self.seq_len)
            SlicePlan(self.seq_len, self.slice_lengths)
        except PlanError as err:
            raise ConfigError(str(err)) from None

    def _check_memory_limit(self) -> None:
        limit = self.memory_limit_gib
        if limit is None:
            return
        if limit != "auto" and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise ConfigError(f"terapipe.memory_limit_gib: must be a positive number of GiB or \"auto\", got {limit!r}")

    @property
    def auto(self) -> bool:
        return self.slices == "auto"

    @classmethod
    def from_section(cls, section: dict | None) -> "TeraPipeConfig":
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        for key in sorted(set(section) & set(REMOVED_KEYS)):
            raise ConfigError(f"terapipe.{key}: no longer exists ({REMOVED_KEYS[key]}); delete the key")
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"terapipe: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**section)

    def plan(self, microbatches: int, microbatch_size: int) -> SlicePlan:
        if self.auto:
            raise ValueError("terapipe.slices is \"auto\": the plan comes from tp_trainer.planner")
        return SlicePlan(self.seq_len, tuple(self.slice_lengths), microbatches, microbatch_size)


def load_ds_config(config) -> dict:
    """The DeepSpeed config as a dict, from a dict or a JSON file path, with clear errors."""
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config: file {path!r} does not exist; pass the path of a DeepSpeed "
                          f"JSON config (see ds_configs/)")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--deepspeed_config: {path} is not valid JSON ({err.msg} at line {err.lineno}, "
                          f"column {err.colno}); fix the file") from None


def pipeline_stages(ds_config: dict, world_size: int, sequence_ranks: int = 1) -> int:
    """Number of pipeline stages from DeepSpeed's ``pipeline.stages`` ("auto" = every rank, or every
    group of ``sequence_ranks``); the world must be stages x sequence ranks x replicas."""
    stages = ds_config.get("pipeline", {}).get("stages", "auto")
    per_replica = "" if sequence_ranks == 1 else f" x {sequence_ranks} sequence ranks"
    if stages == "auto":
        if world_size % sequence_ranks:
            raise ConfigError(f"terapipe.sequence_parallel: world size {world_size} is not a multiple of "
                              f"{sequence_ranks} sequence ranks; launch a multiple of {sequence_ranks} ranks or "
                              f"change terapipe.sequence_parallel")
        return world_size // sequence_ranks
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"pipeline.stages: must be a positive integer or \"auto\", got {stages!r}")
    if world_size % (stages * sequence_ranks):
        raise ConfigError(f"pipeline.stages: world size {world_size} is not divisible by {stages} stages"
                          f"{per_replica}; launch a multiple of {stages * sequence_ranks} ranks or change "
                          f"pipeline.stages" + (" or terapipe.sequence_parallel" if per_replica else ""))
    return stages


def check_zero_stage(ds_config: dict) -> None:
    """DeepSpeed's pipeline engine allows ZeRO stage 0 or 1 only."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1):
        raise ConfigError(f"zero_optimization.stage: {stage} cannot be combined with pipeline parallelism "
                          f"(DeepSpeed partitions gradients across the pipeline's micro-steps only for "
                          f"stage <= 1); use \"stage\": 1 (optimizer-state partitioning)")
