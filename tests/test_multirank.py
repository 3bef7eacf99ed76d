"""multirank.start_ranks forks ranks from tests/rank_zygote.py where it may: such a rank sees what a
fresh ``python script args`` sees (``__main__``, argv, sys.path[0], its environment and working
directory, its own string hashing), and its exit code and output come back as a fresh rank's do.
A test hook's folder in front of PYTHONPATH is served (its sitecustomize runs before the script, as at an
interpreter's start); any other PYTHONPATH or start-up setting, or TP_TEST_FRESH_RANKS=1, starts fresh
interpreters instead."""

import json
import os

import multirank
import pytest
import rank_zygote
from small_run import FAULT_HOOKS

SCRIPT = """
import json, os, sys
import torch   # preloaded in a zygote, imported here by a fresh rank
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
                  "rank": os.environ["RANK"], "extra": os.environ.get("EXTRA"), "hash": hash("abc"),
                  "parent": os.getppid(), "torch": torch.__version__}))
print("to stderr", file=sys.stderr)
code = sys.argv[1]
if code == "raise":
    raise RuntimeError("boom")
sys.exit(int(code))
"""


def reports(ranks) -> list[dict]:
    return [json.loads(out.splitlines()[0]) for _, out in ranks]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_rank_sees_what_a_fresh_interpreter_sees(script, tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("TP_TEST_FRESH_RANKS", "1" if fresh else "0")
    ranks = multirank.start_ranks(script, 2, ["0", "x"], env={"EXTRA": "yes"}, cwd=str(tmp_path))
    assert [code for code, _ in ranks] == [0, 0]
    got = reports(ranks)
    assert all(r["parent"] == os.getpid() for r in got) == fresh   # started here, or forked by a zygote
    for rank, report in enumerate(got):
        assert report["name"] == "__main__" and report["argv"] == ["0", "x"] and report["extra"] == "yes"
        assert report["path0"] == str(tmp_path) and report["cwd"] == str(tmp_path) and report["rank"] == str(rank)
        assert "to stderr" in ranks[rank][1]
    if "PYTHONHASHSEED" not in os.environ:   # each rank hashes strings its own way, as launched ranks do
        assert got[0]["hash"] != got[1]["hash"]


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_exit_codes_come_back(script, monkeypatch, fresh):
    monkeypatch.setenv("TP_TEST_FRESH_RANKS", "1" if fresh else "0")
    assert [code for code, _ in multirank.start_ranks(script, 1, ["3"])] == [3]
    (code, out), = multirank.start_ranks(script, 1, ["raise"])
    assert code == 1 and "RuntimeError: boom" in out


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_hook_folder_in_front_of_pythonpath_runs_before_the_script(tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("TP_TEST_FRESH_RANKS", "1" if fresh else "0")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("import os\nos.environ['HOOKED'] = os.environ['TP_TEST_FAULT']\n")
    path = tmp_path / "hooked.py"
    path.write_text("import os, sys\nprint(os.environ.get('HOOKED'), sys.path[1], sys.modules['sitecustomize'].__file__,"
                    " os.getppid())\n")
    env = {"TP_TEST_FAULT": "crash_after_save:3",
           "PYTHONPATH": os.pathsep.join(p for p in [str(hooks), os.environ.get("PYTHONPATH", "")] if p)}
    for code, out in multirank.start_ranks(str(path), 2, [], env=env):
        hooked, path1, hook_file, parent = out.split()
        assert code == 0 and (hooked, path1, hook_file) == ("crash_after_save:3", str(hooks), str(hooks / "sitecustomize.py"))
        assert (int(parent) == os.getpid()) == fresh   # started here, or forked by a zygote


def test_a_fault_or_another_interpreter_setting_starts_fresh_ranks(monkeypatch):
    monkeypatch.delenv("TP_TEST_FRESH_RANKS", raising=False)
    env = dict(os.environ, **rank_zygote.ZYGOTE_ENV, RANK="0", TP_TEST_FAULT="")
    assert rank_zygote.usable(env, 2)
    assert not rank_zygote.usable({**env, "TP_TEST_FAULT": "crash_after_save:3"}, 2)   # no hook to read it
    assert not rank_zygote.usable({**env, "PYTHONPATH": os.pathsep.join(["/hooks", env.get("PYTHONPATH", "")])}, 2)
    hooked = {**env, "TP_TEST_FAULT": "crash_after_save:3",
              "PYTHONPATH": os.pathsep.join(p for p in [FAULT_HOOKS, env.get("PYTHONPATH", "")] if p)}
    assert rank_zygote.usable(hooked, 2)   # a hook's folder in front: served, its sitecustomize imported
    assert not rank_zygote.usable({**hooked, "PYTHONPATH": FAULT_HOOKS + os.pathsep + "/elsewhere"}, 2)
    assert not rank_zygote.usable({**env, "OMP_NUM_THREADS": "2"}, 2)
    assert not rank_zygote.usable(env, rank_zygote.ZYGOTES + 1)


def test_a_rank_past_its_timeout_is_killed(tmp_path, monkeypatch):
    monkeypatch.delenv("TP_TEST_FRESH_RANKS", raising=False)
    path = tmp_path / "sleeper.py"
    path.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(multirank.subprocess.TimeoutExpired):
        multirank.start_ranks(str(path), 1, [], timeout=2)
    path.write_text("print('next')\n")   # the zygote goes on serving
    assert multirank.start_ranks(str(path), 1, []) == [(0, "next\n")]
