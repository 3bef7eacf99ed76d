"""The slice plan: how each training sequence is cut into token slices, as a plain value.

A plan is printed at start-up and saved beside the run (``plan.json``), so a run can be reproduced
and a resumed run can check it is continuing with the same slicing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


class PlanError(ValueError):
    """A slice specification that cannot be turned into a plan; the message names the fix."""


@dataclass(frozen=True)
class SlicePlan:
    """Token slices of one sequence and the microbatching of the batch.

    ``slices``: slice lengths, in order; they sum to ``seq_len``. Later slices attend to more
    context, so good plans make them shorter (TeraPipe).
    ``microbatches`` x ``microbatch_size`` sequences are run per step on each data-parallel replica.
    """

    seq_len: int
    slices: tuple[int, ...]
    microbatches: int = 1
    microbatch_size: int = 1

    def __post_init__(self):
        if any(not isinstance(s, int) or s <= 0 for s in self.slices):
            raise PlanError(f"terapipe.slices: every slice must be a positive integer, got {list(self.slices)}")
        if sum(self.slices) != self.seq_len:
            raise PlanError(
                f"terapipe.slices: slices {list(self.slices)} sum to {sum(self.slices)}, but the sequence "
                f"length is {self.seq_len}; make them sum to {self.seq_len} or use \"uniform:N\"")
        if self.microbatches < 1 or self.microbatch_size < 1:
            raise PlanError(f"plan: microbatches ({self.microbatches}) and microbatch_size "
                            f"({self.microbatch_size}) must be >= 1")

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Context length before each slice: offsets[j] = sum(slices[:j])."""
        out, total = [], 0
        for length in self.slices:
            out.append(total)
            total += length
        return tuple(out)

    def to_json(self) -> str:
        data = asdict(self)
        data["slices"] = list(self.slices)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "SlicePlan":
        data = json.loads(text)
        data["slices"] = tuple(data["slices"])
        return cls(**data)

    def __str__(self) -> str:
        return (f"SlicePlan(seq_len={self.seq_len}, {self.num_slices} slices {list(self.slices)}, "
                f"{self.microbatches} microbatches x {self.microbatch_size} sequences)")


@dataclass(frozen=True)
class RunPlan:
    """What ``initialize`` decided for a run, handed to the engine when it is built (``engine.run_plan``)."""

    slices: SlicePlan
    """The token slices and the microbatching the engine runs."""
    schedule: str
    """The order of the units ("gpipe" / "1f1b"): the config's, or the memory-aware planner's choice."""
    report: str | None = None
    """With "auto" slices: the planner's report (costs, the split, the plan, its predicted step)."""
    memory_budget: dict | None = None
    """With a memory limit: this stage's predicted peak, the limit and the baseline RSS, in MiB."""


def parse_slices(spec, seq_len: int) -> tuple[int, ...]:
    """Turn the config's ``slices`` value into slice lengths.

    ``spec`` is a list of ints summing to ``seq_len``, or ``"uniform:N"``: N slices as equal as
    possible; when N does not divide seq_len the first ``seq_len % N`` slices are one token longer
    (later slices carry more context, so they should be the shorter ones).
    """
    if isinstance(spec, str):
        return _uniform(spec, seq_len)
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, int) and not isinstance(s, bool) for s in spec):
        return tuple(spec)
    raise PlanError(f"terapipe.slices: expected a list of positive integers summing to {seq_len} or "
                    f"\"uniform:N\", got {spec!r}")


def _uniform(spec: str, seq_len: int) -> tuple[int, ...]:
    name, _, count = spec.partition(":")
    if name != "uniform" or not count.isdigit() or int(count) < 1:
        raise PlanError(f"terapipe.slices: unknown form {spec!r}; use \"uniform:N\" with N >= 1 "
                        f"or a list of integers summing to {seq_len}")
    n = int(count)
    if n > seq_len:
        raise PlanError(f"terapipe.slices: \"uniform:{n}\" asks for more slices than the {seq_len} tokens "
                        f"of a sequence; use N <= {seq_len}")
    base, extra = divmod(seq_len, n)
    return tuple(base + 1 if j < extra else base for j in range(n))


if __name__ == "__main__":  # the planner's CLI moved; importing it here made plan -> planner -> plan a cycle
    raise SystemExit("python -m tp_trainer.plan moved: run python -m tp_trainer.planner with the same flags")
