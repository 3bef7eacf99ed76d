import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_command(name): the test runs a command-line tool (e.g. the "
                                       "deepspeed launcher); skipped where it is missing, a failure under CI=true")
    config.addinivalue_line("markers", "xdist_group(name): the tests of one group run on one pytest-xdist worker "
                                       "(set by pytest_collection_modifyitems, see xdist_groups.py)")


GROUPS_LOST = pytest.StashKey[str | None]()   # xdist_groups.groups_lost, for pytest_runtest_setup


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook, which reads the marks
def pytest_collection_modifyitems(items):
    """Under ``pytest -n N --dist loadgroup`` (scripts/test.sh), the tests that share a fixture
    wider than a test run on one worker, so that fixture (a multi-rank launch, often) runs once."""
    from xdist_groups import add_group_marks
    add_group_marks(items)


def pytest_collection_finish(session):
    from xdist_groups import groups_lost
    session.config.stash[GROUPS_LOST] = groups_lost(session)


def pytest_runtest_setup(item):
    """A test marked ``requires_command("deepspeed")`` skips where the tool is not on PATH, except
    under CI=true: there a missing tool means a broken install, and a skip would hide it. Under
    pytest-xdist, every test fails where the workers lost the suite's groups (xdist_groups.py)."""
    lost = item.config.stash.get(GROUPS_LOST, None)
    if lost:   # every test fails, before its fixtures start: a run that would launch ranks twice
        pytest.fail(lost, pytrace=False)
    for marker in item.iter_markers("requires_command"):
        name = marker.args[0]
        if shutil.which(name) is None:
            message = f"{name!r} is not on PATH (install the project: bash scripts/setup.sh, then activate .venv)"
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true: {message}", pytrace=False)
            pytest.skip(message)


@pytest.fixture(autouse=True)
def _remove_shm_buffers():
    """After each test, the /dev/shm all-reduce buffers (66 MiB a rank, RAM) that DeepSpeed's CPU
    launches on the ports of ``multirank.free_port`` left behind (tp_trainer.ds_compat.shm)."""
    yield
    import multirank
    from tp_trainer.ds_compat.shm import remove_leftovers
    while multirank.ISSUED_PORTS:
        remove_leftovers(multirank.ISSUED_PORTS.pop())


@pytest.fixture(scope="session")
def exactness_runs(tmp_path_factory):
    """The exactness launches, each started on first use and shared by the session's test modules
    (exactness_launch.py)."""
    from exactness_launch import ExactnessRuns
    return ExactnessRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def small_reference(tmp_path_factory):
    """The output directory of the unbroken small run (small_run.reference_run), shared by the resume
    tests of the session."""
    from small_run import reference_run
    return reference_run(tmp_path_factory.mktemp("small_reference"))
