"""Multi-node launches with a hostfile: the hostfile checker's errors, and two `deepspeed --no_ssh`
launchers (node ranks 0 and 1 of a 2-line hostfile, on this machine) forming one pipeline of 2 stages
x 2 sequence ranks whose losses equal the same 4 ranks on one node bit for bit."""

import json
import os
import shutil
import signal
import subprocess

import pytest
from multirank import free_port, train_ranks
from small_run import small_config

from tp_trainer.config import ConfigError
from tp_trainer.hostfile import describe, read_hostfile
from tp_trainer.hostfile import main as hostfile_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "launch", "hostfile.example")
MULTINODE = os.path.join(REPO, "launch", "multinode.sh")
needs_launcher = pytest.mark.requires_command("deepspeed")  # conftest: a failure under CI=true

# (hostfile text, line number of the error, the bad line as quoted, the fix in the message)
MALFORMED = [
    ("worker-0 slots=4\nworker-1\n", 2, "'worker-1'", "missing slots=N after the host; write `worker-1 slots=N`"),
    ("worker-0 4\n", 1, "'worker-0 4'", "expected slots=N after the host, got '4'; write `worker-0 slots=4`"),
    ("# two nodes\nworker-0 slots=four\n", 2, "'worker-0 slots=four'", "slots='four' is not a positive integer"),
    ("worker-0 slots=\n", 1, "'worker-0 slots='", "slots='' is not a positive integer; write `worker-0 slots=N`"),
    ("worker-0 slots=-2\n", 1, "'worker-0 slots=-2'", "slots='-2' is not a positive integer"),
    ("worker-0 slots=1.5\n", 1, "'worker-0 slots=1.5'", "slots='1.5' is not a positive integer"),
    ("worker-0 slots=0\n", 1, "'worker-0 slots=0'", "slots=0 gives worker-0 no ranks; set slots >= 1 or delete the line"),
    ("worker-0 slots=2\n\nworker-0 slots=2\n", 3, "'worker-0 slots=2'",
     "host 'worker-0' is already listed on line 1; list each host once"),
    ("worker-0 slots=2 gpus=8\n", 1, "'worker-0 slots=2 gpus=8'",
     "unexpected 'gpus=8' after slots=2; a line is only `worker-0 slots=2` (put remarks after '#')"),
    ("slots=2\n", 1, "'slots=2'", "no host name before 'slots=2'; write `HOST slots=2`"),
]


@pytest.mark.parametrize("text,line,bad,fix", MALFORMED, ids=[m[-1][:32] for m in MALFORMED])
def test_malformed_hostfile_names_line_and_fix(tmp_path, text, line, bad, fix):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_hostfile(path)
    message = str(err.value)
    assert message.startswith(f"hostfile {str(path)!r}, line {line}: {bad}: "), message
    assert fix in message, message


def test_missing_and_empty_hostfile(tmp_path):
    with pytest.raises(ConfigError, match=r"hostfile '.*/nope': file not found; pass the path of a DeepSpeed "
                                          r"hostfile .*see launch/hostfile.example"):
        read_hostfile(tmp_path / "nope")
    for text in ("", "\n\n", "# only a comment\n   # another\n"):
        path = tmp_path / "hosts"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"no hosts \(the file is empty or only comments\); add one "
                                              r"`HOST slots=N` line per node.*e.g. `worker-0 slots=8`"):
            read_hostfile(path)


def test_valid_hostfile_matches_deepspeed(tmp_path):
    """Comments (whole-line and trailing), blank lines, tabs and indentation are accepted; the hosts
    and their order are what DeepSpeed's own parser reads."""
    from deepspeed.launcher.runner import fetch_hostfile
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\n  worker-0 slots=8\nworker-1\tslots=4   # the small one\n10.0.0.7 slots=1\n")
    hosts = read_hostfile(path)
    assert hosts == [("worker-0", 8), ("worker-1", 4), ("10.0.0.7", 1)]
    assert list(fetch_hostfile(str(path)).items()) == hosts
    assert describe(hosts) == ["node 0: worker-0 slots=8 (ranks 0-7)", "node 1: worker-1 slots=4 (ranks 8-11)",
                               "node 2: 10.0.0.7 slots=1 (rank 12)"]
    assert read_hostfile(EXAMPLE) == [("127.0.0.1", 1), ("127.0.0.2", 1)]
    assert list(fetch_hostfile(EXAMPLE).items()) == read_hostfile(EXAMPLE)


def test_hostfile_cli(tmp_path, capsys):
    assert hostfile_main([EXAMPLE, "--node_rank", "1"]) == 0
    assert "2 host(s), world size 2" in capsys.readouterr().out
    assert hostfile_main([EXAMPLE, "--node_rank", "2"]) == 2
    assert "--node_rank 2: hostfile" in capsys.readouterr().err
    bad = tmp_path / "hosts"
    bad.write_text("worker-0 slots=0\n")
    assert hostfile_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hostfile") and "line 1" in err and "set slots >= 1" in err


def test_multinode_script_checks_hostfile_first(tmp_path):
    """A bad hostfile or node rank stops launch/multinode.sh (exit 2) before DeepSpeed starts."""
    bad = tmp_path / "hosts"
    bad.write_text("127.0.0.1 slots=1\n127.0.0.2\n")
    env = dict(os.environ, PATH="/usr/bin:/bin")  # no deepspeed on PATH: reaching it would fail otherwise
    env["PYTHON"] = shutil.which("python") or "python"
    for args, message in [([str(bad), "0", "127.0.0.1"], "line 2: '127.0.0.2': missing slots=N"),
                          ([EXAMPLE, "2", "127.0.0.1"], "--node_rank 2: hostfile"),
                          ([EXAMPLE, "one", "127.0.0.1"], "NODE_RANK must be a whole number"),
                          ([EXAMPLE], "usage: ")]:
        proc = subprocess.run(["bash", MULTINODE, *args], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
        assert "deepspeed" not in proc.stderr.replace("DeepSpeed", ""), proc.stderr




def launcher_env(port=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TP_TEST_FAULT", None)
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


def losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())]


def sequence_config(tmp_path, sequence_ranks: int) -> str:
    """small_config on 2 stages with ``sequence_ranks`` per stage (its slices [24, 16, 16, 8] are even)."""
    config = json.loads(open(small_config(tmp_path)).read())
    config["pipeline"]["stages"] = 2
    config["terapipe"]["sequence_parallel"] = sequence_ranks
    path = tmp_path / f"ds-sp{sequence_ranks}.json"
    path.write_text(json.dumps(config))
    return str(path)


@needs_launcher
def test_two_nodes_of_two_sequence_ranks_train_export_and_resume_on_one(tmp_path):
    """The main job on 2 stages x 2 sequence ranks, one stage's sequence group per node (two launchers,
    2 slots each): it trains, evaluates, saves, exports an HF model that loads, and its losses equal those
    of the same 4 ranks on one node bit for bit; the checkpoint then resumes on 2 stages x 1 (one launcher,
    2 ranks) through the layout-free form and trains on."""
    from transformers import GPT2LMHeadModel
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    out, env = tmp_path / "run", launcher_env(free_port())
    flags = ["--deepspeed_config", sequence_config(tmp_path, 2), "--max_steps", "2", "--eval_interval", "2",
             "--eval_batches", "1", "--save_interval", "2", "--output_dir", str(out)]
    nodes = [subprocess.Popen(["bash", MULTINODE, str(hostfile), str(rank), "127.0.0.1", *flags], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    for rank, (node, log) in enumerate(zip(nodes, logs)):
        assert node.returncode == 0, f"node {rank}:\n{log[-4000:]}"
    for rank, log in enumerate(logs):  # deepspeed.launcher.launch's own report: world size from the hostfile
        assert f"nnodes=2, num_local_procs=2, node_rank={rank}" in log and "dist_world_size=4" in log, log[-3000:]
    assert "[rank 2]" in logs[1] and "[rank 0]" not in logs[1]
    assert "2 stages x 2 sequence ranks" in logs[0] and "step 2 validation loss" in logs[0], logs[0][-3000:]
    assert json.loads((out / "plan.json").read_text())["sequence_ranks"] == 2
    exported = GPT2LMHeadModel.from_pretrained(out / "hf_model")
    assert exported.config.n_layer == 4

    one = tmp_path / "one"   # the same 4 ranks on one node (as its launcher starts them): the same losses
    train_ranks(4, [*flags[:flags.index("--output_dir")], "--no_save_hf", "--output_dir", str(one)])
    assert [step for step, _ in losses(out)] == [1, 2]
    assert losses(out) == losses(one)  # bit for bit: json keeps every digit of the float

    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
           "--deepspeed_config", sequence_config(tmp_path, 1), "--max_steps", "3", "--eval_interval", "100",
           "--eval_batches", "1", "--no_save_hf", "--resume", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "resumed from step2 at step 2" in log and "layout-free" in log, log[-3000:]
    assert [step for step, _ in losses(out)][-1] == 3
