"""Checkpoints in and out: per-stage loading, the HF round trip, the export CLI, the errors.

One launch of 2 ranks (checkpoint_worker.py) loads tiny tied / untied GPT-2 checkpoints stage by
stage, trains 2 steps from each, writes an HF directory (save_hf_checkpoint) and a DeepSpeed
checkpoint; the tests here check those outputs in one process.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import checkpoint_worker as cw
import pytest
import torch
from multirank import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig

from tp_trainer import export
from tp_trainer.checkpoint import (
    CheckpointError,
    checkpoint_config,
    materialize_stage,
    meta_model,
)
from tp_trainer.model.families import gpt2
from tp_trainer.model.stages.split import split_for_config

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("tied", "untied")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Checkpoint directories, the worker's output directory and its per-rank results."""
    out = tmp_path_factory.mktemp("ckpt_io")
    ckpts = {kind: str(out / f"start-{kind}") for kind in KINDS}
    for kind, path in ckpts.items():
        cw.write_tiny_checkpoint(path, kind == "tied")
    run_ranks(WORKER, 2, [str(out), ckpts["tied"], ckpts["untied"]], timeout=300)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"out": out, "ckpts": ckpts, "ranks": ranks}


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(file))
    return out


def expected_stage_names(ckpt: str) -> list[set[str]]:
    """HF tensor names of each of 2 stages, from the split (blocks) and GPT-2's layer layout."""
    config = checkpoint_config(ckpt)
    split = split_for_config(config, 2, gpt2.PREFIX, gpt2.SUFFIX)
    keys = set(checkpoint_tensors(ckpt))
    stages = []
    for stage, layers in enumerate(split.names):
        prefixes = [f"transformer.{layer}." for layer in layers if layer.startswith("h.")]
        if stage == 0:
            prefixes += ["transformer.wte.", "transformer.wpe."]
        if stage == 1:
            prefixes += ["transformer.ln_f.", "transformer.wte." if config.tie_word_embeddings else "lm_head."]
        stages.append({k for k in keys if k.startswith(tuple(prefixes))})
    return stages


@pytest.mark.parametrize("kind", KINDS)
def test_each_stage_reads_only_its_tensors(run, kind):
    ckpt = run["ckpts"][kind]
    stored = checkpoint_tensors(ckpt)
    expected = expected_stage_names(ckpt)
    for stage, result in enumerate(r[kind]["load"] for r in run["ranks"]):
        assert result["report"]["stage"] == stage
        assert len(result["reads"]) == len(expected[stage]), f"stage {stage} read {len(result['reads'])} tensors"
        assert set(result["reads"]) == expected[stage] == set(result["report"]["names"])
        assert set(result["params"]) == expected[stage]
        for name, value in result["params"].items():
            assert torch.equal(value, stored[name]), name
        assert expected[stage].isdisjoint(result["meta_left"])
        assert expected[1 - stage] - expected[stage] <= set(result["meta_left"]), "other stage materialized"
    reads = [set(r[kind]["load"]["reads"]) for r in run["ranks"]]
    assert reads[0] | reads[1] == set(stored)
    # the tied embedding is the LM head on the last stage: read by both stages, and only it
    assert reads[0] & reads[1] == ({"transformer.wte.weight"} if kind == "tied" else set())


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_init_does_not_depend_on_stages(run, kind):
    model = meta_model(checkpoint_config(run["ckpts"][kind]))
    report = materialize_stage(model, 1, None, seed=cw.SEED, stage=0)
    whole = {n: model.get_parameter(n) for n in report.names}
    for result in run["ranks"]:
        for name, value in result[kind]["load"]["init"].items():
            assert torch.equal(value, whole[name]), name
    first, second = whole["transformer.h.0.attn.c_attn.weight"], whole["transformer.h.1.attn.c_attn.weight"]
    assert not torch.equal(first, second)
    assert 0.015 < float(first.detach().std()) < 0.025  # GPT-2's initializer_range 0.02
    assert torch.all(whole["transformer.ln_f.weight"] == 1)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_from_pretrained(run, kind):
    hf_dir, ranks = run["out"] / f"hf-{kind}", [r[kind]["train"] for r in run["ranks"]]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["eval"] == ranks[1]["eval"]
    for result in ranks:  # rank 0 could not create the directory: every rank raised, nothing hung
        assert "not-a-dir/hf" in result["save_error"] and "save_hf_checkpoint" in result["save_error"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    micro = cw.batches(cw.EVAL_STEP)
    ids, labels = torch.cat([i for i, _ in micro]), torch.cat([t for _, t in micro])
    with torch.no_grad():
        logits = model(ids).logits
    assert (logits - ranks[1]["logits"]).abs().max().item() <= 1e-5
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert loss == pytest.approx(ranks[0]["eval"], rel=1e-6)
    written = checkpoint_tensors(hf_dir)
    trained = {**ranks[1]["tensors"], **ranks[0]["tensors"]}
    assert set(written) == set(trained) == set(checkpoint_tensors(run["ckpts"][kind]))
    for name, value in written.items():
        assert torch.equal(value, trained[name]), name
    start = checkpoint_tensors(run["ckpts"][kind])
    assert not torch.equal(written["transformer.h.0.mlp.c_fc.weight"], start["transformer.h.0.mlp.c_fc.weight"])
    check_layout(hf_dir, ranks, kind)


def check_layout(hf_dir, ranks, kind):
    """One shard per stage under HF names, a tied weight once (first stage), tokenizer, no leftovers."""
    with open(hf_dir / "model.safetensors.index.json", encoding="utf-8") as handle:
        weight_map = json.load(handle)["weight_map"]
    for stage, result in enumerate(ranks):
        shard = f"model-{stage + 1:05d}-of-00002.safetensors"
        with safe_open(hf_dir / shard, framework="pt") as handle:
            assert set(handle.keys()) == {n for n, f in weight_map.items() if f == shard}
        owned = set(result["tensors"]) - (set(ranks[0]["tensors"]) if stage == 1 else set())
        assert {n for n, f in weight_map.items() if f == shard} == owned
    assert ("lm_head.weight" in weight_map) == (kind == "untied")
    assert AutoTokenizer.from_pretrained(hf_dir)("w3 w5")["input_ids"] == [3, 5]
    assert not [p for p in os.listdir(hf_dir.parent) if ".tmp-" in p or ".old-" in p]


def test_export_cli_from_deepspeed_checkpoint(run):
    out = run["out"] / "exported-tied"
    proc = subprocess.run([sys.executable, "-m", "tp_trainer.export", "--checkpoint_dir", str(run["out"] / "ds-tied"),
                           "--output_dir", str(out), "--model_name_or_path", run["ckpts"]["tied"]],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, saved = checkpoint_tensors(out), checkpoint_tensors(run["out"] / "hf-tied")
    assert set(exported) == set(saved)
    for name, value in exported.items():
        assert torch.equal(value, saved[name]), name
    assert AutoModelForCausalLM.from_pretrained(out) is not None
    assert os.path.isfile(out / "tokenizer.json")


def test_export_config_from_checkpoint_dir_replaces_output(run):
    ds_dir, out = run["out"] / "ds-untied", run["out"] / "exported-untied"
    shutil.copy(os.path.join(run["ckpts"]["untied"], "config.json"), ds_dir / "config.json")
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert export.main(["--checkpoint_dir", str(ds_dir), "--output_dir", str(out), "--no_tokenizer"]) == 0
    assert not (out / "stale.txt").exists()
    exported, saved = checkpoint_tensors(out), checkpoint_tensors(run["out"] / "hf-untied")
    assert set(exported) == set(saved) and all(torch.equal(exported[n], saved[n]) for n in saved)
    assert not [p for p in os.listdir(run["out"]) if ".tmp-" in p or ".old-" in p]


def test_export_missing_layer_leaves_nothing(run, tmp_path):
    broken = tmp_path / "ds"
    shutil.copytree(run["out"] / "ds-tied", broken)
    os.remove(glob.glob(str(broken / "global_step2" / "layer_03-*"))[0])
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=r"layer_03-model_states.pt is missing.*transformer.h.1"):
        export.export_from_deepspeed(str(broken), checkpoint_config(run["ckpts"]["tied"]), str(out))
    assert sorted(os.listdir(tmp_path)) == ["ds"]
    with pytest.raises(CheckpointError, match="transformer.wte.weight' has shape .* pass the training's config"):
        wide = checkpoint_config(run["ckpts"]["tied"])
        wide.vocab_size = 80
        export.export_from_deepspeed(str(run["out"] / "ds-tied"), wide, str(out))
    assert sorted(os.listdir(tmp_path)) == ["ds"]
    with pytest.raises(CheckpointError, match="global_step9 does not exist"):
        export.tag_dir(str(broken), "global_step9")


def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nope.* does not exist"):
        checkpoint_config(missing)
    model = meta_model(cw_config(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        materialize_stage(model, 1, missing, stage=0)


def cw_config(tmp_path):
    path = str(tmp_path / "tiny")
    cw.write_tiny_checkpoint(path, True)
    return checkpoint_config(path)


def test_unsupported_model_type(tmp_path):
    BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="model_type 'bert' has no pipeline adapter"):
        checkpoint_config(str(tmp_path))


def test_missing_tensor_and_missing_weights(tmp_path):
    path = tmp_path / "tiny"
    cw.write_tiny_checkpoint(str(path), False)
    tensors = checkpoint_tensors(str(path))
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = meta_model(checkpoint_config(str(path)))
    with pytest.raises(CheckpointError, match=rf"{path}: tensor 'transformer.h.1.mlp.c_fc.bias' is missing"):
        materialize_stage(model, 1, str(path), stage=0)
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        checkpoint_config(str(path))


def test_export_with_preset_config(tmp_path):
    """--config_name: the preset's config, the vocabulary size read from the embedding layer file.
    Layer files written as PipelineModule.save_state_dict does (state_dict of each built layer)."""
    from tp_trainer.model.stages.layers import SliceContext
    from tp_trainer.run import RunArgs, model_config
    config = model_config(RunArgs(deepspeed_config="unused", config_name="gpt2-tiny"), vocab_size=300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    (tmp_path / "ds" / "step7").mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("step7")
    seen = set()
    for index, spec in enumerate(gpt2.layer_specs(model, SliceContext())):
        key = getattr(spec, "key", None)
        if key is not None and key in seen:
            continue  # a later use of a tied layer is a function: DeepSpeed saves nothing for it
        seen.add(key)
        torch.save(spec.build().state_dict(), tmp_path / "ds" / "step7" / f"layer_{index:02d}-model_states.pt")
    out = tmp_path / "hf"
    assert export.main(["--checkpoint_dir", str(tmp_path / "ds"), "--output_dir", str(out), "--no_tokenizer"]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.vocab_size == 300 and reloaded.config.n_layer == config.n_layer
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
