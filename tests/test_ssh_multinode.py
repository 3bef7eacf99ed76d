"""The README's "Moving a run to more machines" through DeepSpeed's default multi-node runner
(ssh + pdsh), on one machine: tests/ssh_multinode.sh starts its own sshd on 127.0.0.1 and
127.0.0.2, saves a 1-stage run, resumes it as 2 stages over a two-host hostfile with
`deepspeed --hostfile`, and stops the sshd by its pid.

It needs sshd and pdsh (as root it installs Debian's openssh-server and pdsh). Elsewhere the script
exits 77 and this test skips, saying what is missing; under CI=true that is a failure, not a skip.
"""

import json
import os
import subprocess

import pytest
from small_run import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "ssh_multinode.sh")
SKIPPED = 77
LOSS_RTOL = 1e-5  # another layout: fp32 rounding of the reductions only (see test_resume_layout.py)


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path).read().splitlines())}


@pytest.mark.requires_command("deepspeed")
def test_resume_over_ssh_and_pdsh(tmp_path):
    two_stages = small_config(tmp_path)
    config = json.load(open(two_stages))
    config["pipeline"]["stages"] = 1
    one_stage = tmp_path / "ds1.json"
    one_stage.write_text(json.dumps(config))
    work = tmp_path / "work"
    proc = subprocess.run(["bash", SCRIPT, str(work), str(one_stage), two_stages], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == SKIPPED:
        reason = proc.stderr.strip().splitlines()[-1]
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, but the ssh + pdsh test could not run: {reason}")
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resume_log = (work / "resume.log").read_text()
    assert "cmd = pdsh -S -f 1024 -w 127.0.0.1,127.0.0.2" in resume_log, resume_log[-3000:]
    assert "127.0.0.2: " in resume_log and "[rank 1]" in resume_log  # rank 1 ran behind the second address
    assert "resumed from step2 at step 2" in resume_log and "layout-free" in resume_log
    saved, resumed = losses(work / "save_log.jsonl"), losses(work / "run" / "train_log.jsonl")
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(resumed[step] - saved[step]) <= LOSS_RTOL * abs(saved[step]), (step, resumed, saved)
    assert not os.path.exists(work / "sshd.pid") or not _running(work / "sshd.pid"), "sshd left running"


def _running(pid_file) -> bool:
    try:
        os.kill(int(open(pid_file).read().strip()), 0)
    except (OSError, ValueError):
        return False
    return True
