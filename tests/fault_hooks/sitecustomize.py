"""Test hook: faults injected into a training run (tests/small_run.py's ``fault_env`` puts this folder
on PYTHONPATH and sets TP_TEST_FAULT; Python imports ``sitecustomize`` at start-up). In every rank
of launch/train.py (RANK set) it wraps the functions of tp_trainer that the fault needs:

    crash_after_save:N    every rank exits hard (os._exit) right after checkpoint N is complete
    crash_in_save:N       every rank exits hard while writing checkpoint N (files written, not
                          yet marked complete): the previous checkpoint must stay the usable one
    sigkill_rank:R:N      global rank R kills itself with SIGKILL at the start of step N
    nan_loss:N            the loss of step N is reported as NaN (detection test)
    step_files:N          not a fault: step N runs under ``sys.setprofile``, and each rank writes the
                          files whose Python code that step executed, one per line, to
                          ``$TP_TEST_STEP_FILES/rank<R>.txt`` (tests/test_launch.py: the step's files)
"""

import os
import signal

FAULT = os.environ.get("TP_TEST_FAULT", "")
EXIT_CODE = 17


def _fault(kind: str, step: int) -> bool:
    name, _, at = FAULT.partition(":")
    if kind == "sigkill_rank" and name == kind:
        rank, _, at = at.partition(":")
        if rank != os.environ.get("RANK"):
            return False
    return name == kind and at.isdigit() and int(at) == step


def _install():
    import tp_trainer.resume as resume
    import tp_trainer.run as run

    step_fn, save_fn, commit_fn = run._step, resume.save, resume.commit

    def faulty_step(job, args, step):  # run._loop looks ``_step`` up in its module at each call
        if _fault("sigkill_rank", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if _fault("step_files", step):
            return _profiled(step_fn, job, args, step)
        loss = step_fn(job, args, step)
        return float("nan") if _fault("nan_loss", step) else loss

    def faulty_save(engine, ckpt, step, samples, **kwargs):  # run._loop calls ``resume.save``
        tag = save_fn(engine, ckpt, step, samples, **kwargs)
        if _fault("crash_after_save", step):
            os._exit(EXIT_CODE)
        return tag

    def faulty_commit(engine, ckpt, tag, step, *args):  # resume.save looks ``commit`` up at each call
        if _fault("crash_in_save", step):
            os._exit(EXIT_CODE)
        commit_fn(engine, ckpt, tag, step, *args)

    run._step, resume.save, resume.commit = faulty_step, faulty_save, faulty_commit


def _profiled(step_fn, job, args, step):
    """Run one step recording the file of every Python function it calls (this thread: the step's)."""
    import sys
    files = set()

    def record(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)
    sys.setprofile(record)
    try:
        loss = step_fn(job, args, step)
    finally:
        sys.setprofile(None)
    path = os.path.join(os.environ["TP_TEST_STEP_FILES"], f"rank{os.environ['RANK']}.txt")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(sorted(files)) + "\n")
    return loss


if FAULT and os.environ.get("RANK") is not None:
    _install()
