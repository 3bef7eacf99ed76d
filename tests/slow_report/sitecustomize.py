"""Test hook (tests/test_bad_input_launch.py puts this folder on PYTHONPATH): the rank named by
TP_TEST_SLOW_REPORT_RANK waits TP_TEST_SLOW_REPORT_S seconds before it writes its ``error:`` line,
so that it is the last rank to get there. Python imports ``sitecustomize`` at start-up."""

import os
import time

if os.environ.get("TP_TEST_SLOW_REPORT_RANK") is not None and \
        os.environ.get("RANK") == os.environ["TP_TEST_SLOW_REPORT_RANK"]:
    import tp_trainer.failures as failures

    _announce = failures.announce

    def _slow_announce(error):
        time.sleep(float(os.environ.get("TP_TEST_SLOW_REPORT_S", "3")))
        _announce(error)

    failures.announce = _slow_announce
