"""Bad input met after the process group has started ends cleanly on every rank, through the launcher.

For each case: every rank exits with code 2, the ranks' output holds exactly one ``error:`` line
(naming the input and the fix), no traceback, no peer-crash noise ("Connection closed"), and the
output directory is never created. All cases run in ONE 2-rank launch (tests/bad_input_worker.py
calls launch/train.py's main per case: one launcher start instead of one per case, ~10 s each).
The case only rank 1 meets also runs as its own ``deepspeed`` command, to check the launcher's
exit code and what the processes print while exiting.

Those ``deepspeed`` commands also hold the report race: the one ``error:`` line reaches the user even
when the rank that writes it is the last to get there (DeepSpeed's launcher kills every rank as soon as
one exits with an error, so the other ranks must wait for it: ``failures.stop_before_start``,
``failures.stop_together``). The reporting rank is slowed by 4 s through tests/slow_report/sitecustomize.py;
without the wait its line is lost every time. The bad command lines are the case before the process
group starts (every rank finds it), the two launcher cases the ones after it (rank 0 in the data phase,
rank 1 loading its stage).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small_run import REPO, small_config

from test_launch import needs_launcher

CHAT_TEMPLATES = Path(__file__).with_name("chat_templates")

CASES = [  # id, flags, substrings of the one error line, the rank that reports (None: any)
    ("text_column_missing", ["--train_file", "{content.jsonl}"],
     ["--text_column='text': no such column", "{content.jsonl}", "pass --text_column with one of ['content']"], 0),
    ("csv_without_text", ["--train_file", "{notext.csv}"],
     ["--text_column='text'", "columns ['title', 'body']", "--text_column with one of ['title', 'body']"], 0),
    ("train_shorter_than_block", ["--train_file", "{short.txt}"],
     ["fewer than one block of block_size + 1 = 65", "lower --block_size"], 0),
    ("tokenizer_not_found", ["--tokenizer_name", "no-such-org/no-such-tokenizer"],
     ["--tokenizer_name 'no-such-org/no-such-tokenizer': not a local directory", "leave out --tokenizer_name"], 0),
    ("tokenizer_dir_missing", ["--tokenizer_name", "{tmp}/no/such/tokenizer"],
     ["--tokenizer_name '{tmp}/no/such/tokenizer': directory does not exist"], 0),
    ("config_field_type", ["--model_name_or_path", "{ckpt_bad_type}"],
     ["{ckpt_bad_type}/config.json does not load as a model config", "n_layer", "fix that field"], 0),
    ("checkpoint_without_tokenizer", ["--model_name_or_path", "{ckpt_no_tokenizer}"],
     ["--model_name_or_path {ckpt_no_tokenizer}: no tokenizer files (none of tokenizer.json, vocab.json",
      "pass --tokenizer_name"], 0),
    ("train_file_directory", ["--train_file", "{tmp}"], ["--train_file: '{tmp}' is a directory"], 0),
    ("corrupt_parquet", ["--train_file", "{corrupt.parquet}"],
     ["--train_file: '{corrupt.parquet}' is not a readable parquet file"], 0),
    ("truncated_safetensors", ["--model_name_or_path", "{ckpt_truncated}"],
     ["{ckpt_truncated}/model.safetensors is not a readable safetensors file", "save the checkpoint again"], 0),
    ("vocabulary_mismatch", ["--model_name_or_path", "{ckpt_vocab300}", "--tokenizer_name", "{tokenizer}",
                             "--train_file", "{val.txt}", "--validation_file", "{val.txt}"],
     ["--tokenizer_name {tokenizer}: the tokenizer has 400 tokens", "vocab_size 300"], 0),
    ("stage1_tensor_missing", ["--model_name_or_path", "{ckpt_no_h3}", "--tokenizer_name", "{tokenizer}",
                               "--train_file", "{val.txt}", "--validation_file", "{val.txt}"],
     ["tensor 'transformer.h.3.mlp.c_fc.weight' is missing (needed by stage 1)"], 1),
    ("validation_too_small", ["--validation_file", "{short_val.txt}", "--eval_batches", "3"],
     ["--eval_batches 3: needs 12 validation blocks", "--validation_file"], 0),
    # instruction data (row 3 of each file is the bad one; the train split holds rows 0..48 as they are)
    ("messages_unknown_role", ["--train_file", "{bad_role.jsonl}"],
     ["row 3 of the train data of file:{bad_role.jsonl}: messages[1] has role 'bot'",
      "one of system, user, assistant, tool"], 0),
    ("messages_without_content", ["--train_file", "{no_content.jsonl}"],
     ["row 3 of the train data", "messages[0] (user) has no content"], 0),
    ("completion_missing", ["--train_file", "{no_completion.jsonl}"],
     ["row 3 of the train data", "'completion' is None", "give every row its completion"], 0),
    ("messages_without_chat_template", ["--tokenizer_name", "{tokenizer}", "--train_file", "{chat.jsonl}"],
     ["has no chat template", "pass --chat_template FILE"], 0),
    ("example_longer_than_block", ["--train_file", "{long.jsonl}", "--long_examples", "refuse"],
     ["row 3 of the train data", "more than --block_size 64", "pass --long_examples split"], 0),
    ("messages_streamed", ["--train_file", "{chat.jsonl}", "--packing", "stream"],
     ["--packing stream", "use --packing examples"], 0),
    # chat templates without generation markers (tests/chat_templates/; their assistant turns found from the rendering)
    ("messages_template_not_prefix_stable", ["--train_file", "{system_prompt.jsonl}", "--chat_template",
                                             "{mistral_system_last.jinja}"],
     ["row 3 of the train data of file:{system_prompt.jsonl}: the chat template has no", "not prefix-stable",
      "(--chat_template), or pass --train_on_prompt"], 0),
    ("messages_turn_inside_a_token", ["--train_file", "{chat.jsonl}", "--chat_template", "{space_prompt.jinja}"],
     ["row 0 of the train data", "the assistant turn messages[1] starts inside a token", "--train_on_prompt"], 0),
    ("messages_template_fails_on_a_row", ["--train_file", "{two_users.jsonl}", "--chat_template",
                                          "{mistral_inst.jinja}"],
     ["row 3 of the train data", "the chat template failed on this row (TemplateError: After the optional system "
      "message, conversation roles must alternate", "fix the row (or drop it)"], 0),
]
TRAINS = ("validation_file_alone", ["--validation_file", "{val.txt}", "--eval_batches", "1", "--max_steps", "1",
                                    "--eval_interval", "1"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Every bad input of the cases, written once: name -> path."""
    tmp = tmp_path_factory.mktemp("inputs")
    paths = {"tmp": str(tmp), "config": small_config(tmp)}
    paths.update(_data_files(tmp))
    paths.update(_checkpoints(tmp))
    return paths


def _data_files(tmp) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    files = {name: tmp / name for name in ("content.jsonl", "notext.csv", "short.txt", "short_val.txt",
                                           "val.txt", "corrupt.parquet")}
    files["content.jsonl"].write_text("".join(json.dumps({"content": f"def f{i}(): return {i}\n" * 20, "id": i}) + "\n"
                                              for i in range(100)))
    files["notext.csv"].write_text("title,body\n" + "".join(f"t{i},body number {i}\n" for i in range(100)))
    files["short.txt"].write_text("only a few words\n")
    decoder = open(os.path.join(os.path.dirname(json.__file__), "decoder.py"), encoding="utf-8").read()
    files["short_val.txt"].write_text(decoder[:1500])  # a few blocks of 65 tokens
    files["val.txt"].write_text(decoder)
    pq.write_table(pa.table({"text": [f"row {i} " * 50 for i in range(200)]}), files["corrupt.parquet"])
    files.update(_instruction_files(tmp))
    data = files["corrupt.parquet"].read_bytes()
    files["corrupt.parquet"].write_bytes(data[: len(data) // 2])
    return {name: str(path) for name, path in files.items()}


def _instruction_files(tmp) -> dict:
    """Chat and prompt/completion files of 60 rows whose row 3 is bad one way each."""
    def chat(i):
        return {"messages": [{"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"{i}"}]}
    bad = {"bad_role.jsonl": {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
           "no_content.jsonl": {"messages": [{"role": "user"}, {"role": "assistant", "content": "hello"}]},
           "no_completion.jsonl": {"prompt": "what is 3?", "completion": None},
           "long.jsonl": {"prompt": "tell me everything", "completion": " and" * 100},
           "chat.jsonl": chat(3),
           "system_prompt.jsonl": {"messages": [{"role": "system", "content": "be brief"}, *chat(3)["messages"],
                                                *chat(4)["messages"]]},   # two user turns: it moves the system prompt
           "two_users.jsonl": {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "hello"}]}}
    files = {}
    for name, row in bad.items():
        good = ({"prompt": f"what is {i}?", "completion": f" {i}"} if "completion" in row else chat(i)
                for i in range(60))
        rows = [row if i == 3 else good_row for i, good_row in enumerate(good)]
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[name] = tmp / name
    for name in ("mistral_system_last.jinja", "mistral_inst.jinja"):
        files[name] = CHAT_TEMPLATES / name
    files["space_prompt.jinja"] = tmp / "space_prompt.jinja"   # its generation prompt ends with a space
    files["space_prompt.jinja"].write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                           "{% if add_generation_prompt %}assistant: {% endif %}")
    return files


def _checkpoints(tmp) -> dict:
    """A 400-token tokenizer and small GPT-2 checkpoints (4 layers), each broken one way."""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from tp_trainer.data.tokenizer import train_bpe, wrap
    tokenizer = tmp / "tokenizer"
    sources = [open(os.path.join(os.path.dirname(json.__file__), f), encoding="utf-8").read()
               for f in ("decoder.py", "encoder.py", "scanner.py")]
    trained = wrap(train_bpe(sources, vocab_size=400, show_progress=False))
    assert len(trained) == 400
    trained.save_pretrained(tokenizer)
    paths = {"tokenizer": str(tokenizer)}
    for name, vocab in (("ckpt_vocab300", 300), ("ckpt_no_h3", 400)):
        config = GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=128, vocab_size=vocab,
                            bos_token_id=0, eos_token_id=0)
        GPT2LMHeadModel(config).save_pretrained(tmp / name)
        paths[name] = str(tmp / name)
    weights = tmp / "ckpt_no_h3" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["transformer.h.3.mlp.c_fc.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    for name in ("ckpt_bad_type", "ckpt_no_tokenizer", "ckpt_truncated"):
        shutil.copytree(tmp / "ckpt_vocab300", tmp / name)
        paths[name] = str(tmp / name)
    config = json.loads((tmp / "ckpt_bad_type" / "config.json").read_text())
    (tmp / "ckpt_bad_type" / "config.json").write_text(json.dumps({**config, "n_layer": "four"}))
    truncated = tmp / "ckpt_truncated" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    for name in ("ckpt_bad_type", "ckpt_truncated"):  # so only the broken part can stop them
        shutil.copytree(tokenizer, tmp / name, dirs_exist_ok=True)
    return paths


def fill(text: str, paths: dict) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: paths[m.group(1)], text)


def argv(flags, paths, out) -> list[str]:
    return ["--deepspeed_config", paths["config"], "--output_dir", out, "--no_save_hf",
            *[fill(flag, paths) for flag in flags]]


SLOW_REPORT = os.path.join(REPO, "tests", "slow_report")
SLOW_REPORT_S = 4


def launcher_env(slow_reporter: int | None = None) -> dict:
    """The ranks' environment; with ``slow_reporter``, that rank waits SLOW_REPORT_S before it writes its
    ``error:`` line (tests/slow_report/sitecustomize.py), so that it is the last rank to get there."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if slow_reporter is not None:
        env.update(TP_TEST_SLOW_REPORT_RANK=str(slow_reporter), TP_TEST_SLOW_REPORT_S=str(SLOW_REPORT_S),
                   PYTHONPATH=os.pathsep.join(p for p in [SLOW_REPORT, os.environ.get("PYTHONPATH", "")] if p))
    return env


def deepspeed_command(*args: str) -> list[str]:
    """2 ranks on a free port: another launch on the default port (a test run beside this one)
    would otherwise meet these ranks' process group."""
    from multirank import free_port
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), *args]


@pytest.fixture(scope="module")
def shared_launch(inputs, tmp_path_factory):
    """Every case in one 2-rank launch; returns (results dir, {case id: output dir})."""
    results = tmp_path_factory.mktemp("results")
    outs = {case[0]: str(results / f"{case[0]}-out") for case in [*CASES, TRAINS]}
    cases = [{"id": case, "argv": argv(flags, inputs, outs[case])} for case, flags, *_ in [*CASES, TRAINS]]
    (results / "cases.json").write_text(json.dumps(cases))
    cmd = deepspeed_command("tests/bad_input_worker.py", str(results / "cases.json"), str(results))
    proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert not error_lines(proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-5000:]  # all in the cases' logs
    return results, outs


def case_result(results, case: str) -> tuple[list[int], list[str]]:
    codes, logs = [], []
    for rank in (0, 1):
        codes.append(json.loads((results / f"{case}.rank{rank}.json").read_text())["code"])
        logs.append((results / f"{case}.rank{rank}.log").read_text())
    return codes, logs


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def assert_clean_stop(text: str, expected: list[str], out: str) -> str:
    """One error line holding every expected piece, no traceback or peer noise, nothing written."""
    errors = error_lines(text)
    assert len(errors) == 1, text[-4000:]
    for piece in expected:
        assert piece in errors[0], (piece, errors[0])
    assert "Traceback" not in text and "Connection closed" not in text, text[-4000:]
    assert not re.search(r"\{[^{}%\s]+\}", errors[0].split("error:", 1)[1]), errors[0]  # no unfilled placeholder
    assert not os.path.exists(out), "nothing may be written on bad input"
    return errors[0]


@needs_launcher
@pytest.mark.parametrize("case,flags,expected,reporter", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_every_rank(shared_launch, inputs, case, flags, expected, reporter):
    results, outs = shared_launch
    codes, logs = case_result(results, case)
    assert codes == [2, 2], (codes, logs)
    error = assert_clean_stop("\n".join(logs), [fill(piece, inputs) for piece in expected], outs[case])
    assert error.startswith(f"[rank {reporter}] "), error


@needs_launcher
def test_validation_file_without_train_file(shared_launch, inputs):
    """Train on the embedded corpus, validate on the user's file."""
    results, outs = shared_launch
    codes, logs = case_result(results, TRAINS[0])
    assert codes == [0, 0], logs
    assert f"validation [file:{inputs['val.txt']}]" in logs[0], logs[0][-3000:]
    assert re.search(r"step 1 validation loss [\d.]+ perplexity", logs[0]), logs[0][-3000:]


@needs_launcher
@pytest.mark.parametrize("case", ["stage1_tensor_missing", "messages_template_not_prefix_stable"])
def test_launcher_exit_code_and_output(inputs, tmp_path, case):
    """The deepspeed command itself, for the case only rank 1 meets (a tensor of its stage is missing) and
    for a messages row refused while rank 0 tokenizes the data, the reporting rank the slow one: exit code
    2, one error line in all the command prints (the ranks' output and the launcher's), no traceback or
    "Connection closed" while the ranks exit."""
    _, flags, expected, reporter = next(c for c in CASES if c[0] == case)
    out = str(tmp_path / "out")
    cmd = deepspeed_command("launch/train.py", *argv(flags, inputs, out))
    proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(slow_reporter=reporter), capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    error = assert_clean_stop(text, [fill(piece, inputs) for piece in expected], out)
    assert error.startswith(f"[rank {reporter}] "), error


MESSAGE_SOURCES = ["tp_trainer/checks.py", "tp_trainer/run.py", "tp_trainer/config.py", "tp_trainer/initialize.py",
                   "tp_trainer/resume.py", "tp_trainer/resume_checks.py", "tp_trainer/checkpoint/hf_load.py",
                   "tp_trainer/data/corpus.py", "tp_trainer/data/packing.py", "tp_trainer/data/tokenizer.py",
                   "tp_trainer/data/files.py", "tp_trainer/data/scored_rows.py", "tp_trainer/data/examples.py",
                   "tp_trainer/data/chat_template.py", "tp_trainer/data/chat_spans.py"]


def test_help_lists_every_flag_a_message_names(capsys):
    """Every ``--flag`` the training run's messages name is an option of launch/train.py."""
    sys.path.insert(0, os.path.join(REPO, "launch"))
    import train
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    help_text = capsys.readouterr().out
    named = set()
    for source in MESSAGE_SOURCES:
        named |= set(re.findall(r"(--[a-z][a-z_]+)", open(os.path.join(REPO, source), encoding="utf-8").read()))
    for case in CASES:
        named |= {flag for flag in case[1] if flag.startswith("--")}
    assert len(named) > 10, named
    missing = sorted(flag for flag in named if not re.search(re.escape(flag) + r"\b", help_text))
    assert not missing, f"flags named in messages but not in --help: {missing}"


@pytest.mark.parametrize("flags, expected", [(["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
                                             ([], "--deepspeed_config is required")])
def test_a_bad_command_line_prints_one_error_line(flags, expected):
    """Through the deepspeed command, 2 ranks: argparse's error (and a missing --deepspeed_config) ends as
    other bad input does: exit code 2, one ``error:`` line in all the command prints, from rank 0 (argparse's
    own line, on every rank, names no rank and is cut or doubled as the launcher kills the others), rank 0
    the slow reporter (rank 1 waits for its line)."""
    config = [] if not flags else ["--deepspeed_config", "ds_configs/gpt2_tiny_cpu.json"]
    cmd = deepspeed_command("launch/train.py", *config, *flags)
    proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(slow_reporter=0), capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], errors
    assert errors[0].startswith("[rank 0] "), errors   # the run's own line, saying who speaks
    assert "Traceback" not in text, text[-4000:]


def test_slow_report_hook_is_off_without_its_variable():
    """The hook only acts when a test sets TP_TEST_SLOW_REPORT_RANK (the trainer never reads it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("hook", os.path.join(SLOW_REPORT, "sitecustomize.py"))
    import tp_trainer.failures as failures
    before = failures.announce
    env = os.environ.pop("TP_TEST_SLOW_REPORT_RANK", None)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        if env is not None:
            os.environ["TP_TEST_SLOW_REPORT_RANK"] = env
    assert failures.announce is before
    assert error_lines("x\n[rank 0] error: y\n") == ["[rank 0] error: y"]
