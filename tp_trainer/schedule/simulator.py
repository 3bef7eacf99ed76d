"""Schedule simulator: run every stage's instruction list without any process group.

The semantics are the strictest a real run can meet, so a schedule that passes
here cannot deadlock when executed:

* each stage executes its flattened instruction list in order;
* a send and the matching receive on the peer stage are a *rendezvous*: they
  execute together, and only when both are the next instruction of their stage;
* ``ReduceTiedGrads`` and ``OptimizerStep`` are collectives: they execute only
  when every stage's next instruction is of the same kind;
* compute instructions (``LoadSlice``, ``ForwardSlice``, ``BackwardSlice``,
  ``WeightGrad``, ``ReduceGrads``) execute when next, after their dependencies are checked.
  A ``WeightGrad`` needs the ``BackwardSlice`` of its unit done on its stage; a stage whose
  schedule holds any W must give every unit its W, and before its reductions and step. All
  dependencies are on the stage's own earlier work, so one that is not met when
  the instruction is next never will be: a hard error ("broken dependency").

The simulation runs in rounds; in each round every stage executes at most one
instruction (a matched pair counts once for each side, a collective once for
all). A round without progress while some stage is unfinished is a deadlock.
Every failure raises :class:`ScheduleError` whose message names the problem and
carries a round x stage grid of what each stage executed, plus a last row with
each stage's blocked next instruction.

Timing: each stage keeps a clock. A compute instruction advances its stage's
clock by ``duration(instr)``; a matched pair sets both clocks to their max plus
``comm_time(send)``; a collective sets all clocks to the max (plus its duration).
With ``eager_sends`` (how the engine runs: non-blocking sends, receives posted ahead) the
order checks stay the same, but a send costs its stage no time and the receiver's clock becomes
max(its clock, the sender's clock + comm_time): a sender never waits for its peer.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, Optional, Sequence

from .instructions import (
    BackwardSlice,
    ForwardSlice,
    Instruction,
    LoadSlice,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    SliceInstruction,
    WeightGrad,
)
from .orders import build_schedule

IDLE = "."
GRID_MAX_ROWS = 400  # rounds shown in an error message (the latest ones)
_PEER_TYPE = {SendActivation: RecvActivation, RecvActivation: SendActivation,
              SendGrad: RecvGrad, RecvGrad: SendGrad}


class ScheduleError(ValueError):
    """A schedule is wrong: deadlock, broken dependency, unmatched or duplicated work."""


def default_duration(ins: Instruction) -> float:
    """1.0 for ForwardSlice and BackwardSlice, 0.0 for every other instruction (WeightGrad
    included: B stands for the whole backward unless a ``duration`` splits it)."""
    return 1.0 if isinstance(ins, (ForwardSlice, BackwardSlice)) else 0.0


def default_comm_time(ins: Instruction) -> float:
    """0.0: messages cost nothing beyond the rendezvous."""
    return 0.0


def format_grid(rows: Sequence[Sequence[Optional[Instruction]]], stages: int,
                blocked: Optional[Sequence[Optional[Instruction]]] = None,
                max_rows: Optional[int] = None) -> str:
    """Fixed-width text table: one row per round, one column per stage.

    A cell is the instruction the stage executed in that round, or ``.`` when
    idle. ``blocked`` (each stage's next instruction, None when finished) adds a
    last row labelled ``blocked``. ``max_rows`` keeps only the latest rounds.
    """
    first = 0 if max_rows is None else max(0, len(rows) - max_rows)
    body = [[str(c) if c is not None else IDLE for c in row] for row in rows[first:]]
    labels = [str(first + k) for k in range(len(body))]
    if blocked is not None:
        body.append([str(c) if c is not None else "done" for c in blocked])
        labels.append("blocked")
    heads = [f"stage {i}" for i in range(stages)]
    widths = [max([len(heads[i])] + [len(r[i]) for r in body]) for i in range(stages)]
    lw = max([len("round")] + [len(x) for x in labels])

    def line(label: str, cells: Sequence[str]) -> str:
        text = " | ".join(c.ljust(w) for c, w in zip(cells, widths))
        return f"{label.rjust(lw)} | {text}".rstrip()

    out = [line("round", heads), "-" * (lw + 1) + "".join("+" + "-" * (w + 2) for w in widths)]
    if first:
        out.append(f"{'':>{lw}} | ... {first} earlier rounds not shown ...")
    out += [line(lab, cells) for lab, cells in zip(labels, body)]
    return "\n".join(out)


class SimulationResult:
    """Outcome of a successful simulation.

    ``rounds``: number of rounds; ``makespan``: max stage clock; ``clocks``: each
    stage's final clock; ``timeline``: (stage, instruction, start, end) for every
    compute instruction; ``grid``: the round x stage table (built on first use).
    """

    def __init__(self, rows: list, stages: int, clocks: list[float],
                 timeline: list[tuple[int, Instruction, float, float]]):
        self.rows = rows
        self.stages = stages
        self.rounds = len(rows)
        self.clocks = clocks
        self.makespan = max(clocks) if clocks else 0.0
        self.timeline = timeline

    @cached_property
    def grid(self) -> str:
        return format_grid(self.rows, self.stages)

    def __repr__(self) -> str:
        return (f"SimulationResult(stages={self.stages}, rounds={self.rounds}, "
                f"makespan={self.makespan})")


class _Simulator:
    """State of one simulation; see the module docstring for the semantics."""

    def __init__(self, schedules, duration, comm_time, eager_sends: bool = False):
        self.K = len(schedules)
        self.eager_sends = eager_sends
        if self.K < 1:
            raise ScheduleError("no stages: schedules must hold one list of steps per stage")
        self.duration = duration or default_duration
        self.comm_time = comm_time or default_comm_time
        self.rows: list[list[Optional[Instruction]]] = []
        self.progs = [self._flatten(i, steps) for i, steps in enumerate(schedules)]
        self.pc = [0] * self.K
        self.done: list[set] = [set() for _ in range(self.K)]  # keys (CODE, microbatch, slice)
        self.n_backward = [0] * self.K
        self.n_weight = [0] * self.K
        self.splits_w = [any(isinstance(x, WeightGrad) for x in prog) for prog in self.progs]
        self.units = [{x.unit for x in prog if isinstance(x, SliceInstruction)}
                      for prog in self.progs]
        self.nslices = [self._slice_counts(u) for u in self.units]
        self.clock = [0.0] * self.K
        self.timeline: list[tuple[int, Instruction, float, float]] = []

    def _flatten(self, i: int, steps) -> list[Instruction]:
        prog = [ins for step in steps for ins in step]
        for ins in prog:
            if not isinstance(ins, Instruction) or not ins.CODE:
                raise ScheduleError(f"stage {i}'s schedule holds {ins!r}, not an instruction")
            if ins.stage != i:
                raise ScheduleError(f"stage {i}'s schedule holds {ins}, an instruction of stage {ins.stage}")
        return prog

    @staticmethod
    def _slice_counts(units: set) -> dict[int, int]:
        counts: dict[int, int] = {}
        for m, j in units:
            counts[m] = max(counts.get(m, 0), j + 1)
        return counts

    # ------------------------------------------------------------ failures
    def fail(self, message: str, blocked=None) -> None:
        grid = format_grid(self.rows, self.K, blocked, max_rows=GRID_MAX_ROWS)
        raise ScheduleError(f"{message}\n\n{grid}")

    # ------------------------------------------------------------ checks (state at round start)
    def check(self, i: int, ins: Instruction, nexts) -> None:
        """Raise if ``ins``, next on stage ``i``, can never execute correctly."""
        key = (ins.CODE,) + ins.unit if isinstance(ins, SliceInstruction) else None
        if key is not None and key in self.done[i]:
            self.fail(f"duplicate: {ins} executed twice on stage {i}", nexts)
        missing = self._missing(i, ins, nexts)
        if missing is not None:
            self.fail(f"broken dependency: {ins} before {missing} on stage {i} "
                      f"({ins} needs {missing} done first)", nexts)

    def _missing(self, i: int, ins: Instruction, nexts) -> Optional[Instruction]:
        """The first unmet dependency of ``ins`` on stage ``i``, or None."""
        if isinstance(ins, ForwardSlice):
            return self._missing_forward(i, ins, nexts)
        if isinstance(ins, BackwardSlice):
            return self._missing_backward(i, ins)
        if isinstance(ins, WeightGrad):
            return None if ("B",) + ins.unit in self.done[i] else BackwardSlice(i, *ins.unit)
        if isinstance(ins, LoadSlice) and 0 < i < self.K - 1:
            self.fail(f"misplaced: {ins} on stage {i}, which is neither the first "
                      f"nor the last stage (LoadSlice belongs to those only)", nexts)
        if ins.is_comm:
            return self._missing_comm(i, ins, nexts)
        if isinstance(ins, ReduceGrads) or ins.is_collective:
            return self._missing_any_backward(i) or self._missing_any_weight(i)
        return None

    def _missing_forward(self, i: int, ins: ForwardSlice, nexts) -> Optional[Instruction]:
        m, j = ins.microbatch, ins.slice
        done = self.done[i]
        if i > 0 and ("RECV_F", m, j) not in done:
            return RecvActivation(i, m, j)
        if i > 0 and ("F", m, j) not in self.done[i - 1]:
            return ForwardSlice(i - 1, m, j)
        if (i == 0 or i == self.K - 1) and ("LOAD", m, j) not in done:
            return LoadSlice(i, m, j)
        if j > 0 and ("F", m, j - 1) not in done:
            return ForwardSlice(i, m, j - 1)
        return None

    def _missing_backward(self, i: int, ins: BackwardSlice) -> Optional[Instruction]:
        m, j = ins.microbatch, ins.slice
        done = self.done[i]
        if ("F", m, j) not in done:
            return ForwardSlice(i, m, j)
        if i < self.K - 1 and ("RECV_B", m, j) not in done:
            return RecvGrad(i, m, j)
        if i < self.K - 1 and ("B", m, j) not in self.done[i + 1]:
            return BackwardSlice(i + 1, m, j)
        if j + 1 < self.nslices[i][m] and ("B", m, j + 1) not in done:
            return BackwardSlice(i, m, j + 1)
        return None

    def _missing_comm(self, i: int, ins: SliceInstruction, nexts) -> Optional[Instruction]:
        p = ins.peer_stage
        if not 0 <= p < self.K:
            self.fail(f"bad peer: {ins} on stage {i} talks to stage {p}, which does not "
                      f"exist (stages 0..{self.K - 1})", nexts)
        m, j = ins.unit
        if isinstance(ins, SendActivation) and ("F", m, j) not in self.done[i]:
            return ForwardSlice(i, m, j)
        if isinstance(ins, SendGrad) and ("B", m, j) not in self.done[i]:
            return BackwardSlice(i, m, j)
        return None

    def _missing_any_backward(self, i: int) -> Optional[Instruction]:
        if self.n_backward[i] == len(self.units[i]):
            return None
        m, j = min(u for u in self.units[i] if ("B",) + u not in self.done[i])
        return BackwardSlice(i, m, j)

    def _missing_any_weight(self, i: int) -> Optional[Instruction]:
        if not self.splits_w[i] or self.n_weight[i] == len(self.units[i]):
            return None
        m, j = min(u for u in self.units[i] if ("W",) + u not in self.done[i])
        return WeightGrad(i, m, j)

    # ------------------------------------------------------------ execution
    def _mark(self, i: int, ins: Instruction, row) -> None:
        if isinstance(ins, SliceInstruction):
            self.done[i].add((ins.CODE,) + ins.unit)
            if isinstance(ins, BackwardSlice):
                self.n_backward[i] += 1
            elif isinstance(ins, WeightGrad):
                self.n_weight[i] += 1
        self.pc[i] += 1
        row[i] = ins

    def run_compute(self, i: int, ins: Instruction, row) -> None:
        start = self.clock[i]
        end = start + self.duration(ins)
        self.clock[i] = end
        self.timeline.append((i, ins, start, end))
        self._mark(i, ins, row)

    def matches(self, ins: Instruction, other: Optional[Instruction]) -> bool:
        """True when ``other`` (next on the peer stage) is the counterpart of ``ins``."""
        return (other is not None and type(other) is _PEER_TYPE[type(ins)]
                and other.unit == ins.unit)

    def run_pair(self, i: int, ins: Instruction, p: int, other: Instruction, row) -> None:
        send = ins if ins.is_send else other
        if self.eager_sends:
            sender, receiver = (i, p) if ins.is_send else (p, i)
            arrival = self.clock[sender] + self.comm_time(send)
            self.clock[receiver] = max(self.clock[receiver], arrival)
        else:
            t = max(self.clock[i], self.clock[p]) + self.comm_time(send)
            self.clock[i] = self.clock[p] = t
        self._mark(i, ins, row)
        self._mark(p, other, row)

    def run_collective(self, nexts, row) -> None:
        t = max(self.clock) + max(self.duration(x) for x in nexts)
        self.clock = [t] * self.K
        for i, ins in enumerate(nexts):
            self._mark(i, ins, row)

    # ------------------------------------------------------------ main loop
    def step(self) -> bool:
        """Run one round; return False when every stage has finished."""
        nexts = [prog[pc] if pc < len(prog) else None for prog, pc in zip(self.progs, self.pc)]
        live = [i for i in range(self.K) if nexts[i] is not None]
        if not live:
            return False
        for i in live:
            self.check(i, nexts[i], nexts)
        row: list[Optional[Instruction]] = [None] * self.K
        first = nexts[0]
        if first is not None and first.is_collective and all(type(x) is type(first) for x in nexts):
            self.run_collective(nexts, row)
            self.rows.append(row)
            return True
        acted = [False] * self.K
        for i in live:
            ins = nexts[i]
            if acted[i] or ins.is_collective:
                continue
            if ins.is_compute:
                self.run_compute(i, ins, row)
                acted[i] = True
            elif not acted[ins.peer_stage] and self.matches(ins, nexts[ins.peer_stage]):
                p = ins.peer_stage
                self.run_pair(i, ins, p, nexts[p], row)
                acted[i] = acted[p] = True
        if not any(acted):
            self.fail(self._deadlock_message(nexts), nexts)
        self.rows.append(row)
        return True

    def _deadlock_message(self, nexts) -> str:
        waits = [f"stage {i} waits on {x}" for i, x in enumerate(nexts) if x is not None]
        lines = ["deadlock: " + ", ".join(waits)]
        for i, ins in enumerate(nexts):
            if ins is None:
                continue
            if ins.is_comm:
                p = ins.peer_stage
                at = f"is at {nexts[p]}" if nexts[p] is not None else "has finished"
                lines.append(f"  {ins} needs {ins.peer()} on stage {p}, but stage {p} {at}")
            else:
                others = ", ".join(f"stage {k} is at {x if x is not None else 'its end'}"
                                   for k, x in enumerate(nexts) if type(x) is not type(ins))
                lines.append(f"  {ins} is a collective waiting for every stage; {others}")
        return "\n".join(lines)

    def check_end(self, forward_only: bool = False) -> None:
        """Every stage forwarded (and, training, backwarded) each of its units once, same units everywhere."""
        for i in range(self.K):
            work = (("F", ForwardSlice),) if forward_only else (("F", ForwardSlice), ("B", BackwardSlice))
            if self.splits_w[i] and not forward_only:
                work += (("W", WeightGrad),)
            for m, j in sorted(self.units[i]):
                for code, cls in (("B", BackwardSlice), ("W", WeightGrad)):
                    if forward_only and (code, m, j) in self.done[i]:
                        self.fail(f"backward in a forward-only schedule: {cls(i, m, j)}")
                for code, cls in work:
                    if (code, m, j) not in self.done[i]:
                        self.fail(f"missing work: unit ({m}, {j}) appears on stage {i} "
                                  f"but {cls(i, m, j)} never ran")
            if self.units[i] != self.units[0]:
                diff = sorted(self.units[i] ^ self.units[0])[:8]
                self.fail(f"mismatched units: stage {i} and stage 0 do not work on the same "
                          f"(microbatch, slice) units; they differ on {diff}")


def simulate(schedules: Sequence[Sequence[Sequence[Instruction]]],
             duration: Optional[Callable[[Instruction], float]] = None,
             comm_time: Optional[Callable[[Instruction], float]] = None,
             forward_only: bool = False, eager_sends: bool = False) -> SimulationResult:
    """Simulate ``schedules[i]`` (stage i's steps) for all stages together.

    ``forward_only``: an evaluation schedule (no backward may appear, none is required).
    ``eager_sends``: time sends as the engine runs them (the sender does not wait; see above).

    Returns a :class:`SimulationResult`; raises :class:`ScheduleError` (message:
    what is wrong, then the round x stage grid) on deadlock, broken dependency,
    duplicated, misplaced or missing work. ``duration`` and ``comm_time`` map an
    instruction to seconds (defaults: :func:`default_duration`,
    :func:`default_comm_time`).
    """
    sim = _Simulator(schedules, duration, comm_time, eager_sends)
    while sim.step():
        pass
    sim.check_end(forward_only)
    return SimulationResult(sim.rows, sim.K, sim.clock, sim.timeline)


def check_schedule(name: str, stages: int, microbatches: int, num_slices: int,
                   duration: Optional[Callable[[Instruction], float]] = None,
                   comm_time: Optional[Callable[[Instruction], float]] = None) -> SimulationResult:
    """Build every stage's schedule with :func:`build_schedule` and simulate them."""
    schedules = [build_schedule(name, stages, i, microbatches, num_slices) for i in range(stages)]
    return simulate(schedules, duration, comm_time)
