"""What a run computes, decided once at start-up: ``RunChoices``, and the combinations it refuses: ``RULES``.

The facts that decide what a step computes (precision, ZeRO stage, whether W is deferred, captured or
compiled blocks, fused norms, LoRA, packing, activation checkpointing) come from several inputs: the
``terapipe`` section, the rest of the DeepSpeed config, the machine's accelerator, the model's config and
the run's flags. They are read here, once, before any process group (``checks.check_pipeline``), into
one frozen value that ``initialize``, the engine and the planner read instead of deriving them again.

The refused combinations of those inputs are one table, ``RULES``: each entry a predicate over the
inputs (``RunInputs``), the keys it names and the message naming the keys and the fix. ``check`` raises
one ``ConfigError`` for the first entry that refuses. A single key's own type or range is checked where
the key is read (``config.TeraPipeConfig``, ``lora.LoraSettings``); a setting against what the model
holds (LoRA's target modules, the positions, the depth) where the model is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .config import ConfigError, TeraPipeConfig
from .model.cuda.fused_norm import config_has_fusable_norms
from .model.slices.grad_sink import CAPTURED_MERGED, GradSinkChoice, grad_sink_choice, weight_grads_in_b

# DeepSpeed's names of a dtype (its ``DtypeEnum``), as this module writes them
DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
               "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
               "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


def compute_dtype_name(ds_config: dict) -> str:
    """The dtype the model computes in under ``ds_config``: "bf16", "fp16" or "fp32"."""
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if _enabled(ds_config, key):
            return name
    return "fp32"


def accumulation_name(ds_config: dict) -> str:
    """The dtype DeepSpeed accumulates gradients in (``data_types.grad_accum_dtype``; unset: the model's)."""
    given = ds_config.get("data_types", {}).get("grad_accum_dtype")
    return compute_dtype_name(ds_config) if given is None else DTYPE_NAMES.get(str(given).lower(), str(given))


def fuses_norms(setting, device_type: str) -> bool:
    """``terapipe.fused_rms_norm``'s rule: true / false force it, "auto" fuses on CUDA only."""
    return setting is True or (setting == "auto" and device_type == "cuda")


def checkpoints_activations(ds_config: dict) -> bool:
    """Whether the DeepSpeed config asks for activation checkpointing (pipeline.activation_checkpoint_interval)."""
    return int(ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0)) > 0


def _enabled(ds_config: dict, key: str) -> bool:
    section = ds_config.get(key)
    return isinstance(section, dict) and bool(section.get("enabled"))


def _zero(ds_config: dict) -> dict:
    return ds_config.get("zero_optimization", {})


def bf16_optimizer(precision: str, accumulation: str, zero_stage: int, offloaded: bool) -> bool:
    """Whether DeepSpeed wraps the optimizer in its BF16_Optimizer (``_do_optimizer_sanity_check``):
    bf16 without ZeRO, or bf16 under ZeRO-1 accumulating in fp32 without CPU offload."""
    if zero_stage:
        return precision == "bf16" and accumulation == "fp32" and zero_stage == 1 and not offloaded
    return precision == "bf16" and accumulation == "bf16"


# ---------------------------------------------------------------- the inputs and the refused combinations

@dataclass(frozen=True)
class RunInputs:
    """What the choices are made from: the checked sections and the facts of the machine and the run."""

    terapipe: TeraPipeConfig
    ds_config: dict
    device_type: str = "cpu"
    """The accelerator's device type ("cpu", "cuda"), as DeepSpeed names it."""
    supported: frozenset = frozenset({"fp16", "bf16"})
    """The half precisions the accelerator computes in (``is_fp16_supported`` / ``is_bf16_supported``)."""
    model_config: object = None
    """The HF config to train (None: not known, e.g. a test's inputs)."""
    packing: str = "none"
    """``--packing`` (a library caller's run: none)."""
    merge_lora: bool = False
    """``--merge_lora``."""

    @property
    def zero_stage(self) -> int:
        return int(_zero(self.ds_config).get("stage", 0))


@dataclass(frozen=True)
class Rule:
    """One refused combination: ``refuses(inputs)`` says whether these inputs are refused; the message
    (``message(inputs)`` where it names values) names the ``keys`` and the fix."""

    keys: tuple[str, ...]
    refuses: Callable[[RunInputs], bool]
    message: str | Callable[[RunInputs], str]

    def text(self, inputs: RunInputs) -> str:
        return self.message(inputs) if callable(self.message) else self.message


def _precision_rule(key: str, other: str) -> Rule:
    """fp16 / bf16 only where this machine's accelerator computes in them."""
    return Rule((f"{key}.enabled",), lambda i: _enabled(i.ds_config, key) and key not in i.supported,
                lambda i: f"{key}.enabled: the {i.device_type} accelerator of this machine does not support {key} "
                          f"(DeepSpeed: \"Type {key} is not supported on your device\"); use {other} here, or run "
                          f"this config on a GPU")


def _memory_limit_message(inputs: RunInputs) -> str:
    terapipe = inputs.terapipe
    return (f"terapipe.memory_limit_gib: {terapipe.memory_limit_gib!r} needs \"slices\": \"auto\" (the planner "
            f"chooses slices, order and checkpointing under the limit), got slices {terapipe.slices!r}")


def _hooks_fp32_buffers(inputs: RunInputs) -> bool:
    """bf16 with fp32 gradient buffers: the bf16 optimizer folds each gradient in a Python hook."""
    return compute_dtype_name(inputs.ds_config) == "bf16" and accumulation_name(inputs.ds_config) == "fp32"


RULES: tuple[Rule, ...] = (
    Rule(("terapipe.memory_limit_gib", "terapipe.slices"),
         lambda i: i.terapipe.memory_limit_gib is not None and i.terapipe.slices != "auto", _memory_limit_message),
    Rule(("terapipe.cuda_graphs", "terapipe.memory_limit_gib"),
         lambda i: i.terapipe.cuda_graphs and i.terapipe.memory_limit_gib is not None,
         "terapipe.cuda_graphs: the plan under memory_limit_gib may checkpoint activations, which captured blocks "
         "cannot; drop memory_limit_gib or set cuda_graphs false"),
    Rule(("terapipe.compile_blocks", "terapipe.memory_limit_gib"),
         lambda i: bool(i.terapipe.compile_blocks) and i.terapipe.memory_limit_gib is not None,
         "terapipe.compile_blocks: the plan under memory_limit_gib may checkpoint activations, which compiled "
         "blocks do not run under; drop memory_limit_gib or compile_blocks"),
    Rule(("terapipe.compile_blocks", "terapipe.lora"),
         lambda i: bool(i.terapipe.compile_blocks) and i.terapipe.lora is not None,
         "terapipe.compile_blocks: not with LoRA adapters (untested); drop one of them"),
    Rule(("terapipe.microbatches", "terapipe.slices"),
         lambda i: i.terapipe.microbatches == "auto" and i.terapipe.slices != "auto",
         "terapipe.microbatches: \"auto\" needs \"slices\": \"auto\" (one plan decides both)"),
    _precision_rule("fp16", "bf16"),
    _precision_rule("bf16", "fp32 (no precision section)"),
    # captured blocks: nothing per backward may run as Python inside a graph (model/cuda/captured_blocks.py)
    Rule(("terapipe.cuda_graphs", "zero_optimization.stage"),
         lambda i: i.terapipe.cuda_graphs and i.zero_stage != 0,
         lambda i: f"terapipe.cuda_graphs: ZeRO stage {i.zero_stage} hooks every parameter's gradient in Python, "
                   f"which a graph would run only while it is captured; set zero_optimization.stage 0 or "
                   f"terapipe.cuda_graphs false"),
    Rule(("terapipe.cuda_graphs", "pipeline.activation_checkpoint_interval"),
         lambda i: i.terapipe.cuda_graphs and checkpoints_activations(i.ds_config),
         "terapipe.cuda_graphs: activation checkpointing recomputes the blocks outside the captured backward; set "
         "pipeline.activation_checkpoint_interval 0 (and no terapipe.memory_limit_gib) or terapipe.cuda_graphs false"),
    Rule(("terapipe.cuda_graphs", "data_types.grad_accum_dtype"),
         lambda i: i.terapipe.cuda_graphs and _hooks_fp32_buffers(i),
         "terapipe.cuda_graphs: the bf16 optimizer with fp32 gradient buffers (data_types.grad_accum_dtype fp32) "
         "folds every gradient in a Python hook; leave grad_accum_dtype at bf16 or set terapipe.cuda_graphs false"),
    Rule(("terapipe.compile_blocks", "pipeline.activation_checkpoint_interval"),
         lambda i: bool(i.terapipe.compile_blocks) and checkpoints_activations(i.ds_config),
         "terapipe.compile_blocks: not with activation checkpointing (pipeline.activation_checkpoint_interval); "
         "set it to 0 or compile_blocks to null"),
    Rule(("--merge_lora", "--lora_r", "terapipe.lora"),
         lambda i: i.merge_lora and i.terapipe.lora is None,
         "--merge_lora: there is no LoRA to merge; add --lora_r (or terapipe.lora)"),
    Rule(("--packing", "terapipe.cuda_graphs"),
         lambda i: i.terapipe.cuda_graphs and i.packing == "examples",
         "--packing examples: several examples per row change the attention of every microbatch, which "
         "terapipe.cuda_graphs cannot capture; use --packing none or set terapipe.cuda_graphs false"),
)


def _sequence_rule(key: str, refuses: Callable[[RunInputs], bool], setting: str, why: str, fix: str) -> Rule:
    """``setting`` (of ``key``) does not compose with sequence ranks (``terapipe.sequence_parallel`` > 1) yet."""
    return Rule(("terapipe.sequence_parallel", key), lambda i: i.terapipe.sequence_parallel > 1 and refuses(i),
                lambda i: f"terapipe.sequence_parallel: {i.terapipe.sequence_parallel} sequence ranks do not run with "
                          f"{setting} yet ({why}); {fix}")


SEQUENCE_RULES: tuple[Rule, ...] = (
    _sequence_rule("terapipe.cuda_graphs", lambda i: i.terapipe.cuda_graphs, "terapipe.cuda_graphs",
                   "the all-to-alls are collectives a captured block would replay unordered with the transfers",
                   "set cuda_graphs false"),
    _sequence_rule("terapipe.compile_blocks", lambda i: bool(i.terapipe.compile_blocks), "terapipe.compile_blocks",
                   "untested: the exchanges run inside the compiled block's attention", "set compile_blocks to null"),
)
RULES = RULES + SEQUENCE_RULES


def check(inputs: RunInputs) -> None:
    """Raise one ``ConfigError`` for the first combination of ``inputs`` that ``RULES`` refuses."""
    for rule in RULES:
        if rule.refuses(inputs):
            raise ConfigError(rule.text(inputs))


def this_machine() -> tuple[str, frozenset]:
    """(device type, the half precisions it computes in) of this machine's accelerator (DeepSpeed's)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    supported = {key for key, test in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported))
                 if test()}
    return accelerator.device_name(), frozenset(supported)


@dataclass(frozen=True)
class Machine:
    """The accelerator a run is judged for: its device type, the half precisions it computes in and
    the ranks per node (None: this node's, LOCAL_WORLD_SIZE). ``here()``: this machine; the dry run
    (``tp_trainer/dry_run.py``) gives its target GPU's, so the checks judge the GPU, not this CPU."""

    device_type: str
    supported: frozenset
    local_ranks: int | None = None

    @classmethod
    def here(cls) -> "Machine":
        return cls(*this_machine())


# ---------------------------------------------------------------- the value

@dataclass(frozen=True)
class RunChoices:
    """What every step of this run computes, decided once at start-up (``decide``), read by
    ``initialize``, the engine (``engine.choices``), the planner's entry and the plan line."""

    precision: str
    """The DeepSpeed config's compute dtype: "bf16", "fp16" or "fp32" (fp32 also where the parameters are
    float64, as in the exactness tests: the engine then computes in the parameters' dtype)."""
    zero_stage: int
    """``zero_optimization.stage`` (0 or 1 under pipeline parallelism)."""
    overlap_comm: bool
    """``zero_optimization.overlap_comm`` (DeepSpeed's default: false below stage 3)."""
    accumulation: str
    """The dtype DeepSpeed accumulates gradients in (``data_types.grad_accum_dtype``; unset: ``precision``)."""
    bf16_optimizer: bool
    """DeepSpeed wraps the optimizer in its BF16_Optimizer (W then adds into its fp32 buffers:
    ``ds_compat/grad_fold.py``); the engine checks that DeepSpeed did."""
    defer_weight_grads: bool
    """``terapipe.defer_weight_grads``: W asked to run apart from B."""
    weight_grads_in_b: str | None
    """None: W deferred (the schedule carries a W per unit). Else why W stays inside B, asked or not
    (``grad_sink.weight_grads_in_b``'s reason: the flag false, captured blocks, ZeRO-1 with overlap_comm,
    ZeRO-1 accumulating in another dtype)."""
    cuda_graphs: bool
    """``terapipe.cuda_graphs``: each stage's decoder blocks run as CUDA graphs per unit."""
    compile_blocks: str | None
    """``terapipe.compile_blocks``: the ``torch.compile`` backend of each decoder block, None: eager."""
    fused_norms: bool
    """The model's RMSNorms run through torch's fused kernels (``terapipe.fused_rms_norm`` on this device;
    false where the family has no RMSNorm to fuse)."""
    lora: bool
    """LoRA adapters are trained (``terapipe.lora`` / ``--lora_*``), the base weights frozen."""
    packing: str
    """``--packing`` ("auto", "stream", "examples", "none"; a library caller's run: "none")."""
    checkpointing: bool
    """DeepSpeed's activation checkpointing is on (``pipeline.activation_checkpoint_interval`` > 0; under
    ``memory_limit_gib`` the planner may also choose it per stage, after this value is made)."""
    device_type: str = "cpu"
    """The accelerator's device type the run computes on ("cpu", "cuda")."""
    attention: str = "auto"
    """``terapipe.attention``, the slice attention kernel ("auto" where the section has no such key)."""
    separate_accumulation: bool = field(default=False, repr=False)
    """A ZeRO optimizer (not the bf16 one) accumulating in another dtype than the model's (moves
    ``.grad`` in hooks, so W stays in B)."""

    @classmethod
    def decide(cls, inputs: RunInputs) -> "RunChoices":
        """Refuse what ``RULES`` refuses (one ``ConfigError``), then the choices of ``inputs``."""
        check(inputs)
        terapipe, ds_config = inputs.terapipe, inputs.ds_config
        precision, accumulation, stage = compute_dtype_name(ds_config), accumulation_name(ds_config), inputs.zero_stage
        offloaded = str((_zero(ds_config).get("offload_optimizer") or {}).get("device", "none")).lower() == "cpu"
        bf16_opt = bf16_optimizer(precision, accumulation, stage, offloaded)
        separate = accumulation != precision and not bf16_opt
        overlap = bool(_zero(ds_config).get("overlap_comm") or False)
        fused = fuses_norms(terapipe.fused_rms_norm, inputs.device_type) and (
            inputs.model_config is None or config_has_fusable_norms(inputs.model_config))
        return cls(precision=precision, zero_stage=stage, overlap_comm=overlap, accumulation=accumulation,
                   bf16_optimizer=bf16_opt, defer_weight_grads=terapipe.defer_weight_grads,
                   weight_grads_in_b=weight_grads_in_b(terapipe.defer_weight_grads, stage, overlap, separate,
                                                       captured=terapipe.cuda_graphs),
                   cuda_graphs=terapipe.cuda_graphs, compile_blocks=terapipe.compile_blocks or None,
                   fused_norms=fused, lora=terapipe.lora is not None, packing=inputs.packing,
                   checkpointing=checkpoints_activations(ds_config), device_type=inputs.device_type,
                   attention=getattr(terapipe, "attention", "auto"), separate_accumulation=separate)

    @classmethod
    def of(cls, ds_config: dict, terapipe: TeraPipeConfig | dict | None = None, device_type: str = "cpu",
           **run) -> "RunChoices":
        """The choices of a DeepSpeed config and its terapipe section (default: ``ds_config["terapipe"]``)
        on ``device_type``, for tests and library callers; ``run``: further ``RunInputs`` fields
        (``model_config``, ``packing``, ``merge_lora``, ``supported``)."""
        if not isinstance(terapipe, TeraPipeConfig):
            terapipe = TeraPipeConfig.from_section(ds_config.get("terapipe") if terapipe is None else terapipe)
        return cls.decide(RunInputs(terapipe, ds_config, device_type, **run))

    @property
    def zero_reduces(self) -> bool:
        """DeepSpeed's ZeRO-1 optimizer (not the bf16 one) reduces ``.grad`` into its partitions itself, at
        ReduceGrads (with sequence ranks over sequence x data: it sums the sequence ranks' gradients too)."""
        return self.zero_stage == 1 and not self.bf16_optimizer

    def grad_sink(self, captured: bool) -> GradSinkChoice:
        """Where one stage's weight gradients land and why W stays in its B (``model/slices/grad_sink.py``):
        a stage of a captured run that holds no decoder block (``captured`` false) captures nothing and
        defers its W as an eager run would."""
        return grad_sink_choice(bf16_buffers=self.bf16_optimizer, defer_weight_grads=self.defer_weight_grads,
                                zero_stage=self.zero_stage, overlap_comm=self.overlap_comm,
                                separate_accumulation=self.separate_accumulation, captured=captured)

    @property
    def summary(self) -> str:
        """The plan line's words for what a step computes beside W: "bf16, ZeRO-1", then what is on."""
        words = [self.precision, f"ZeRO-{self.zero_stage}" + (" with overlap_comm" if self.overlap_comm else "")]
        if self.accumulation != self.precision:
            words.append(f"gradients accumulated in {self.accumulation}")
        words += [text for on, text in ((self.cuda_graphs, "blocks captured (terapipe.cuda_graphs)"),
                                        (self.compile_blocks, f"blocks compiled ({self.compile_blocks})"),
                                        (self.fused_norms, "fused RMSNorms"), (self.lora, "LoRA"),
                                        (self.packing == "examples", "packed examples"),
                                        (self.checkpointing, "activation checkpointing")) if on]
        return ", ".join(words)

    @property
    def weight_grads_words(self) -> str:
        """How W runs: "W deferred", or "W in B (why)", the reason said where W was asked for too."""
        if self.weight_grads_in_b is None:
            return "W deferred"
        if self.grad_sink(self.cuda_graphs).kind == CAPTURED_MERGED:
            return "W of the blocks once per sequence inside their captured graphs, the rest in B"
        return f"W in B ({self.weight_grads_in_b})"

    def __str__(self) -> str:
        """E.g. "bf16, ZeRO-1, W deferred" or "fp16, ZeRO-1 with overlap_comm, W in B (ZeRO-1 with
        overlap_comm reduces gradients in backward hooks)"."""
        return f"{self.summary}, {self.weight_grads_words}"
