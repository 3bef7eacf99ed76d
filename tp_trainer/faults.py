"""Fault injection for the reliability tests: ``TP_TRAINER_FAULT=<kind>:<step>``.

    crash_after_save:N    every rank exits hard (os._exit) right after checkpoint N is complete
    crash_in_save:N       every rank exits hard while writing checkpoint N (files written, not
                          yet marked complete): the previous checkpoint must stay the usable one
Unset in normal runs; nothing here runs then.
"""

from __future__ import annotations

import os


def _fault(kind: str, step: int) -> bool:
    spec = os.environ.get("TP_TRAINER_FAULT", "")
    name, _, at = spec.partition(":")
    return name == kind and at.isdigit() and int(at) == step


def _exit():
    os._exit(17)


def during_save(step: int):
    """The hook ``resume.save`` runs before marking checkpoint ``step`` complete (or None)."""
    return _exit if _fault("crash_in_save", step) else None


def after_save(step: int) -> None:
    if _fault("crash_after_save", step):
        _exit()
