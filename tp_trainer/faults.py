"""Fault injection for the reliability tests: ``TP_TRAINER_FAULT=<kind>:<step>``.

    crash_after_save:N    every rank exits hard (os._exit) right after checkpoint N is complete
    crash_in_save:N       every rank exits hard while writing checkpoint N (files written, not
                          yet marked complete): the previous checkpoint must stay the usable one
    sigkill_rank:R:N      global rank R kills itself with SIGKILL at the start of step N
    nan_loss:N            the loss of step N is reported as NaN (detection test)
Unset in normal runs; nothing here runs then.
"""

from __future__ import annotations

import os
import signal


def _fault(kind: str, step: int) -> bool:
    spec = os.environ.get("TP_TRAINER_FAULT", "")
    name, _, at = spec.partition(":")
    if kind == "sigkill_rank" and name == kind:
        rank, _, at = at.partition(":")
        if rank != os.environ.get("RANK"):
            return False
    return name == kind and at.isdigit() and int(at) == step


def _exit():
    os._exit(17)


def during_save(step: int):
    """The hook ``resume.save`` runs before marking checkpoint ``step`` complete (or None)."""
    return _exit if _fault("crash_in_save", step) else None


def after_save(step: int) -> None:
    if _fault("crash_after_save", step):
        _exit()


def before_step(step: int) -> None:
    if _fault("sigkill_rank", step):
        os.kill(os.getpid(), signal.SIGKILL)


def reported_loss(step: int, loss: float) -> float:
    return float("nan") if _fault("nan_loss", step) else loss
