"""``python -m tp_trainer.planner``: the slice planner's command line (``cli.main``).

The entry point lives in the planner package, not in ``tp_trainer/plan.py``: the plan value object
is imported by the planner, so the plan module importing the planner back would be a cycle.
"""

from .cli import main

if __name__ == "__main__":
    main()
