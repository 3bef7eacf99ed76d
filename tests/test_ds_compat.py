"""The DeepSpeed internals tp_trainer relies on (tp_trainer/ds_compat) hold in the installed DeepSpeed.

Runs without a process group: classes, signatures and source text only. A failure names the touch
and what changed; tp_trainer/ds_compat/touches.py says what the touch is for and who uses it.
Mutation checks below show each kind of check can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from tp_trainer.ds_compat import OVERRIDES, TOUCHES, Touch, check_override, check_touch
from tp_trainer.engine import TeraPipeEngine
from tp_trainer.model.stages.pipeline import TeraPipeModule

PACKAGE = Path(__file__).resolve().parents[1] / "tp_trainer"
OURS = {"PipelineEngine": TeraPipeEngine, "DeepSpeedEngine": TeraPipeEngine, "PipelineModule": TeraPipeModule}


@pytest.mark.parametrize("touch", TOUCHES, ids=lambda t: t.name)
def test_touch_holds(touch):
    problems = check_touch(touch)
    assert not problems, "DeepSpeed changed what tp_trainer relies on:\n" + "\n".join(problems)


@pytest.mark.parametrize("touch", OVERRIDES, ids=lambda t: t.name)
def test_override_holds(touch):
    problems = check_override(touch, OURS[touch.owner.rpartition(":")[2]])
    assert not problems, "DeepSpeed changed a method tp_trainer overrides:\n" + "\n".join(problems)


def test_every_touch_is_documented():
    for touch in TOUCHES + OVERRIDES:
        assert len(touch.why) > 20 and touch.since and touch.used_by, touch.name


def test_every_override_is_listed():
    """A method of our subclasses with the name of a DeepSpeed method is an override: listed."""
    listed = {(t.owner.rpartition(":")[2], t.member) for t in OVERRIDES}
    for ours, bases in ((TeraPipeEngine, (PipelineEngine, DeepSpeedEngine)), (TeraPipeModule, (PipelineModule,))):
        for name, value in vars(ours).items():
            base = next((b for b in bases if hasattr(b, name)), None)
            if callable(value) and base is not None and name != "__init__":
                assert (base.__name__, name) in listed or any((b.__name__, name) in listed for b in bases), \
                    f"{ours.__name__}.{name} overrides {base.__name__}.{name}: list it in ds_compat OVERRIDES"


def deepspeed_private_names() -> set[str]:
    """Private members of the DeepSpeed classes we subclass or drive, and the private instance
    attributes the touches name (torch.nn.Module's own excluded: the engines are modules)."""
    classes = (PipelineEngine, DeepSpeedEngine, PipelineModule, BF16_Optimizer, DeepSpeedZeroOptimizer)
    names = {n for cls in classes for n in dir(cls)}
    names |= {t.member for t in TOUCHES if t.instance_attr}
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - set(dir(torch.nn.Module))


def private_uses(source: str, names: set[str], allowed: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every ``x.<name>`` in ``source`` with a name from ``names``, not ``allowed``."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names and node.attr not in allowed]


def test_only_ds_compat_touches_private_deepspeed_members():
    """Elsewhere in the package a private DeepSpeed member is reached through ds_compat; calling one of
    our own overrides by name (``self._partition_layers``) is fine."""
    names, overrides = deepspeed_private_names(), {t.member for t in OVERRIDES}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        if "ds_compat" not in path.parts:
            found += [f"{relative}:{line}: .{name}"
                      for line, name in private_uses(path.read_text(encoding="utf-8"), names, overrides)]
    assert not found, "private DeepSpeed members used outside tp_trainer/ds_compat:\n" + "\n".join(found)


# ----------------------------------------------------------------------------- mutation checks
class FakeEngine:
    """Stands for a DeepSpeed release that changed things."""

    def __init__(self):
        self._running_engine_backward = False

    def _exec_reduce_grads(self, bucket_size):  # gained a required parameter
        pass

    def _exec_backward_pass(self, buffer_id):  # no longer sets the flag
        outputs = None
        outputs.backward()


def _touch(member, **changes):
    return next(t for t in TOUCHES + OVERRIDES if t.member == member and all(
        getattr(t, k) == v for k, v in changes.items()))


def test_a_missing_member_is_reported_by_name():
    problems = check_touch(_touch("_exec_optimizer_step"), FakeEngine)
    assert problems[0] == "PipelineEngine._exec_optimizer_step: FakeEngine has no member '_exec_optimizer_step'"


def test_a_changed_signature_is_reported():
    problems = check_touch(_touch("_exec_reduce_grads"), FakeEngine)
    assert len(problems) == 2 and "takes (self, bucket_size), we call it as (self, ...)" in problems[0]
    assert "no longer contains `self._force_grad_boundary = True`" in problems[1]


def test_changed_behaviour_is_reported_from_the_source():
    problems = check_touch(_touch("_exec_backward_pass"), FakeEngine)
    assert any("no longer contains `self._running_engine_backward = True`" in p for p in problems)
    assert all(p.startswith("PipelineEngine._exec_backward_pass: ") for p in problems)


def test_an_instance_attribute_whose_setter_is_gone_is_reported():
    class Renamed:
        def __init__(self):
            self._engine_backward_running = False

        def _backward_post_hook(self):
            return not self._engine_backward_running
    problems = check_touch(_touch("_running_engine_backward"), Renamed)
    assert len(problems) == 2 and all("_running_engine_backward" in p for p in problems)


def test_an_override_deepspeed_no_longer_calls_or_we_dropped_is_reported():
    class Base:
        def __init__(self):
            self.partition()

        def _partition_layers(self, method):
            pass

    class Ours(Base):
        pass
    problems = check_override(_touch("_partition_layers"), Ours, Base)
    assert any("no longer contains `self._partition_layers(method=partition_method)`" in p for p in problems)
    assert any("Ours no longer overrides '_partition_layers'" in p for p in problems)


def test_an_unknown_owner_is_reported():
    touch = Touch("deepspeed.runtime.pipe.engine:GoneEngine", "_x", "a class removed by an upgrade",
                  "never", ("nowhere",))
    assert check_touch(touch)[0].startswith("GoneEngine._x: deepspeed.runtime.pipe.engine:GoneEngine cannot be "
                                            "imported")


def test_the_scan_finds_a_private_member_outside_ds_compat():
    names = deepspeed_private_names()
    planted = "def step(engine):\n    engine._exec_optimizer_step()\n    engine._partition_layers('x')\n"
    assert private_uses(planted, names, {"_partition_layers"}) == [(2, "_exec_optimizer_step")]


def test_throughput_timer_never_synchronizes(monkeypatch):
    """The engine's throughput timer, started by DeepSpeed's forward on every slice, never
    synchronizes the device, even past DeepSpeed's start_step (which the pipeline never reaches today)."""
    from types import SimpleNamespace

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils.timer import ThroughputTimer

    from tp_trainer import ds_compat
    config = DeepSpeedConfig({"train_batch_size": 1}).timers_config   # what DeepSpeedEngine gives its timer
    assert config.synchronized   # DeepSpeed's default: it would
    engine = SimpleNamespace(tput_timer=ThroughputTimer(config, batch_size=1))
    syncs = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, *a: syncs.append(1))
    engine.tput_timer.global_step_count = 10
    engine.tput_timer.start()
    assert syncs == [1]   # the hazard: a start past start_step synchronizes
    ds_compat.unsynchronized_throughput_timer(engine)
    engine.tput_timer.start()
    engine.tput_timer.stop(global_step=True)
    assert syncs == [1] and config.synchronized   # none more; DeepSpeed's config untouched
