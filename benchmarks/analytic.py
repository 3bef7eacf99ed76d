"""The analytic FLOP/byte cost model is ``tp_trainer/planner/analytic.py`` (the dry run of
``launch/train.py --dry_run`` reads it too); the benchmarks and their tests import it from here."""

from tp_trainer.planner.analytic import *  # noqa: F401,F403
from tp_trainer.planner.analytic import _coef  # noqa: F401 (block_split_sim.py)
