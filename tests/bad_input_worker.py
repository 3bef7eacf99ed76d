"""Runs many launch/train.py command lines in one 2-rank launch (tests/test_bad_input_launch.py).

    deepspeed --num_gpus 2 tests/bad_input_worker.py CASES.json RESULTS_DIR

Why one launch for all cases: starting the launcher and two ranks costs ~10 s of the suite's time
per case; the cases themselves fail in well under a second. Each case calls ``launch/train.py``'s
``main`` with its argv on both ranks, with file descriptors 1 and 2 redirected to a file of its
own (the log handler, DeepSpeed's prints and any traceback land there); the exit code is what
``SystemExit`` carries, or 1 with the traceback written out when anything else escapes. The
process group, once a case has started it, stays for the next cases (``init_distributed`` only
starts it once), so a case that leaves the ranks out of step makes the next collective fail:
the test then sees the launch itself fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))
sys.path.insert(0, REPO)

import train  # noqa: E402  (launch/train.py)


def run_case(argv: list[str], log_path: str) -> int:
    """``train.main(argv)`` with fds 1 and 2 going to ``log_path``; returns the exit code."""
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            code = train.main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # noqa: BLE001 - the test asserts there is no traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code


def main() -> None:
    cases_path, results = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    rank = int(os.environ["RANK"])
    with open(cases_path, encoding="utf-8") as handle:
        cases = json.load(handle)
    for case in cases:
        began = time.perf_counter()
        log_path = os.path.join(results, f"{case['id']}.rank{rank}.log")
        code = run_case(case["argv"], log_path)
        record = {"code": code, "seconds": time.perf_counter() - began}
        with open(os.path.join(results, f"{case['id']}.rank{rank}.json"), "w", encoding="utf-8") as handle:
            json.dump(record, handle)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
