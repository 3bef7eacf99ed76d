"""Pipeline schedules as data: instructions, orders, and a simulator that checks them.

Nothing here needs torch or a process group: a schedule is a list of steps per
stage, each step a list of :class:`Instruction`; :func:`simulate` runs all stages
together and raises :class:`ScheduleError` on deadlock or broken dependency.
"""

from .instructions import (
    INSTRUCTION_TYPES,
    BackwardSlice,
    ForwardSlice,
    Instruction,
    LoadSlice,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    SliceInstruction,
    WeightGrad,
    parse_instruction,
)
from .orders import (
    SCHEDULES,
    backward_step,
    backward_units,
    build_schedule,
    final_steps,
    format_schedule,
    forward_only,
    forward_step,
    gpipe,
    one_f_one_b,
    one_f_one_b_warmup,
    peak_inflight,
    place_weight_grads,
    units,
    validate_schedule_args,
)
from .simulator import (
    ScheduleError,
    SimulationResult,
    check_schedule,
    default_comm_time,
    default_duration,
    format_grid,
    simulate,
)

__all__ = [
    "INSTRUCTION_TYPES", "BackwardSlice", "ForwardSlice", "Instruction", "LoadSlice",
    "OptimizerStep", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads",
    "SendActivation", "SendGrad", "SliceInstruction", "WeightGrad", "parse_instruction",
    "SCHEDULES", "forward_only", "backward_step", "backward_units", "build_schedule", "final_steps",
    "format_schedule", "forward_step", "gpipe", "one_f_one_b", "one_f_one_b_warmup",
    "peak_inflight", "place_weight_grads", "units", "validate_schedule_args",
    "ScheduleError", "SimulationResult", "check_schedule", "default_comm_time",
    "default_duration", "format_grid", "simulate",
]
