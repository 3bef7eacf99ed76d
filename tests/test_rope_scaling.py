"""RoPE scaling for rotary models: ``--rope_scaling`` (HF's ``rope_scaling``
JSON) and a checkpoint's own ``rope_parameters`` let a Llama-style model fine-tune at
``--block_size`` beyond ``max_position_embeddings``; learned-position models keep their error; bad
settings stop before any work with one message naming the field and the fix.

The pipeline with scaling equals HF with the same scaling in the engine's exactness cases
(families_worker.py: ``rope=yarn4`` on 2 stages, ``rope=linear2`` on 1 stage, max_position_embeddings
8 trained at 16 tokens, float64 and fp32). Here: the config the checks hand to the run is the one HF
builds from the same flag, and the refusals.
"""

import json
import logging

import pytest
import torch
from test_bad_input import stops_with_one_error
from test_launch import write_config

from tp_trainer.checks import validate
from tp_trainer.run import RunArgs

YARN = {"rope_type": "yarn", "factor": 4.0}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A 2-layer Llama of 8 positions (save_pretrained; a tokenizer file so the checks reach RoPE)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("llama8")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                         rope_theta=5000.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def checked(tmp_path, checkpoint, rope_scaling=None, seq_len=32):
    """``checks.validate`` of a 2-stage run of ``checkpoint`` at ``seq_len`` tokens (no process group)."""
    config = write_config(tmp_path, **{"terapipe.seq_len": seq_len, "terapipe.slices": "uniform:4"})
    args = RunArgs(deepspeed_config=config, model_name_or_path=checkpoint, rope_scaling=rope_scaling,
                   output_dir=str(tmp_path / "run"))
    return validate(args, 2)


def test_flag_gives_hf_own_rope_parameters(tmp_path, llama_checkpoint, caplog):
    """--rope_scaling yarn x4 on 8 positions: a 32-token run passes the checks without a warning, and
    the model's rotary cos / sin equal those of HF's from_pretrained(..., rope_parameters=...)."""
    from transformers import LlamaForCausalLM
    with caplog.at_level(logging.WARNING, logger="tp_trainer"):
        spec = checked(tmp_path, llama_checkpoint, json.dumps(YARN))
    assert not [r for r in caplog.records if "rope_scaling" in r.getMessage()]
    params = spec.checkpoint_config.rope_parameters
    assert params == {**YARN, "rope_theta": 5000.0, "original_max_position_embeddings": 8}, params
    ours = LlamaForCausalLM(spec.checkpoint_config).model.rotary_emb
    # HF 5.23's own spelling (rope_scaling= alone would drop rope_theta: TypeError in YaRN's init)
    theirs = LlamaForCausalLM.from_pretrained(llama_checkpoint, rope_parameters={**YARN, "rope_theta": 5000.0})
    theirs = theirs.model.rotary_emb
    plain = LlamaForCausalLM.from_pretrained(llama_checkpoint).model.rotary_emb
    x, positions = torch.zeros(1, 32, 8), torch.arange(32)[None]
    for a, b in zip(ours(x, positions), theirs(x, positions)):
        assert torch.equal(a, b)
    assert not torch.allclose(ours(x, positions)[0], plain(x, positions)[0])  # the scaling does change them


def test_config_json_scaling_is_used(tmp_path, llama_checkpoint, caplog):
    """A checkpoint whose config.json holds rope_parameters (as the export writes them) runs with them:
    32 tokens on 8 x 4 positions, no warning."""
    import shutil
    from transformers import AutoConfig
    scaled = tmp_path / "yarn"
    shutil.copytree(llama_checkpoint, scaled)
    config = AutoConfig.from_pretrained(scaled)
    config.rope_parameters = {**YARN, "rope_theta": 5000.0, "original_max_position_embeddings": 8}
    config.save_pretrained(scaled)
    with caplog.at_level(logging.WARNING, logger="tp_trainer"):
        spec = checked(tmp_path, str(scaled))
    assert spec.checkpoint_config.rope_parameters["rope_type"] == "yarn"
    assert not [r for r in caplog.records if "rope_scaling" in r.getMessage()]


def test_rotary_beyond_positions_without_scaling_warns(tmp_path, llama_checkpoint, caplog, monkeypatch):
    """HF's rotary models run at any length: no refusal, one warning naming the flag and a factor."""
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="tp_trainer"):
        checked(tmp_path, llama_checkpoint, seq_len=32)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("beyond the 8 positions" in w and "--rope_scaling" in w and '"factor": 4' in w for w in warnings), warnings


BAD = [
    ('{"rope_type": "ntk", "factor": 2.0}', "--rope_scaling: unknown rope_type 'ntk'; use one of linear, yarn, llama3"),
    ('{"rope_type": "yarn", "factor": 0}', "--rope_scaling: factor must be a number > 0"),
    ('{"rope_type": "linear", "factor": -2.0}', "--rope_scaling: factor must be a number > 0"),
    ('{"rope_type": "linear"}', "--rope_scaling: factor must be a number > 0 (the new context over the trained "
                                "one, e.g. 4.0), got None"),
    ('{"rope_type": "dynamic", "factor": 2.0}', "--rope_scaling: rope_type 'dynamic' picks its frequencies"),
    ('{"rope_type": "llama3", "factor": 2.0}', "--rope_scaling: \"Missing required keys in `rope_parameters` "
                                               "for 'rope_type'='llama3'"),
    ('yarn', "--rope_scaling: not valid JSON"),
    ('[4.0]', "--rope_scaling: must be a JSON object"),
]


@pytest.mark.parametrize("flag,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_rope_scaling(tmp_path, monkeypatch, caplog, llama_checkpoint, flag, message):
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, model_name_or_path=llama_checkpoint,
                                 rope_scaling=flag)
    assert error.startswith("error: " + message), error


def test_scaling_refused_on_learned_positions(tmp_path, monkeypatch, caplog):
    """GPT-2 (the default preset) has a position table: the flag is refused, naming the fix."""
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, rope_scaling=json.dumps(YARN))
    assert error == ("error: --rope_scaling: gpt2 models have learned position embeddings, which RoPE scaling "
                     "does not extend; drop --rope_scaling and keep --block_size <= 1024, or fine-tune a rotary "
                     "model (llama, mistral, qwen2)"), error


def test_learned_positions_keep_their_error(tmp_path, monkeypatch, caplog):
    """HF's GPT-2 would index past its position table: still refused, saying the flag cannot help."""
    monkeypatch.setattr("test_bad_input.write_config", lambda path: write_config(path, **{"terapipe.slices": "uniform:4"}))
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, block_size=2048)
    assert error == ("error: terapipe.seq_len: 2048 exceeds the model's 1024 positions; use a sequence length "
                     "<= 1024 (--block_size; gpt2 has learned position embeddings, which --rope_scaling cannot "
                     "extend)"), error


def test_checkpoint_rope_type_checked(tmp_path, monkeypatch, caplog, llama_checkpoint):
    """A config.json with a RoPE type the slices cannot reproduce stops with its field named."""
    import shutil
    bad = tmp_path / "dynamic"
    shutil.copytree(llama_checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}
    (bad / "config.json").write_text(json.dumps(config))
    error = stops_with_one_error(tmp_path, monkeypatch, caplog, model_name_or_path=str(bad))
    assert error.startswith("error: --model_name_or_path config.json rope_parameters: rope_type 'dynamic'"), error
