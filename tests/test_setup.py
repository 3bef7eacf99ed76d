"""scripts/setup.sh's venv builds DeepSpeed's JIT ops under itself, and has them built before any test.

torch's default JIT cache (~/.cache/torch_extensions/<python>_<device>/<op>) is one folder per op
shared by every venv, and its build files name the venv's include paths: two checkouts rebuilt each
other's ops (minutes each on 2 cores), inside a rank or a test. setup.sh writes a ``.pth`` line
that points TORCH_EXTENSIONS_DIR at ``<venv>/torch_extensions`` for every python of the venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

PTH = Path(sysconfig.get_paths()["purelib"]) / "tp_trainer_torch_extensions.pth"
pytestmark = pytest.mark.skipif(not PTH.exists(), reason="not the venv made by scripts/setup.sh")


def extensions_dir_seen(env: dict) -> str:
    """TORCH_EXTENSIONS_DIR as a new python of this venv, started with ``env``, sees it."""
    return subprocess.run([sys.executable, "-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_a_new_python_of_the_venv_builds_its_ops_under_the_venv():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    assert extensions_dir_seen(env) == os.path.join(sys.prefix, "torch_extensions")


def test_an_explicit_dir_wins():
    assert extensions_dir_seen({**os.environ, "TORCH_EXTENSIONS_DIR": "/elsewhere"}) == "/elsewhere"


@pytest.mark.parametrize("op", ["deepspeed_shm_comm", "fused_adam"])
def test_setup_built_the_ops_there(op):
    if "TORCH_EXTENSIONS_DIR" in os.environ and os.environ["TORCH_EXTENSIONS_DIR"] != os.path.join(
            sys.prefix, "torch_extensions"):
        pytest.skip("TORCH_EXTENSIONS_DIR set elsewhere")
    assert (Path(sys.prefix) / "torch_extensions" / op / f"{op}.so").is_file()
