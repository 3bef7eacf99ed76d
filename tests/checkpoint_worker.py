"""One rank of the checkpoint tests (2 ranks, 2 pipeline stages): loading and the round trip.

Usage: checkpoint_worker.py OUT_DIR CKPT_TIED CKPT_UNTIED. Saves OUT_DIR/rank{R}.pt with, per
checkpoint kind ("tied", "untied"):
  load   the stage's LoadReport, the keys read through safetensors (counted), the stage's
         parameters after build_pipeline_module, the HF names left on meta, a seeded-init stage
  train  losses of 2 steps from the checkpoint, the eval loss, the trained stage tensors, the
         pipeline's logits on the eval batch (last stage); writes OUT_DIR/hf-KIND (save_hf_checkpoint)
         and OUT_DIR/ds-KIND (engine.save_checkpoint)
The test helpers (tiny checkpoint, batches, DeepSpeed config) live here too.
"""

import os
import sys
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQ_LEN, MICRO_BATCH, MICROBATCHES, VOCAB, STEPS, EVAL_STEP, SEED = 16, 2, 2, 64, 2, 99, 5


def write_tiny_checkpoint(directory: str, tied: bool) -> None:
    """A 3-block GPT-2 with a small word-level tokenizer, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ_LEN, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(11 if tied else 12)
    GPT2LMHeadModel(config).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0", unk_token="w0").save_pretrained(directory)


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches (input_ids, labels) of one step, blocks of SEQ_LEN + 1 tokens shifted by one."""
    gen = torch.Generator().manual_seed(1000 * step + 3)
    blocks = torch.randint(0, VOCAB, (MICROBATCHES, MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICROBATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-5, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "pipeline": {"stages": 2},
        "steps_per_print": 1000,
        "terapipe": {"seq_len": SEQ_LEN, "slices": [7, 5, 4], "schedule": "gpipe"},
    }


class CountingSafeOpen:
    """safetensors.safe_open that records every key read with get_tensor."""

    reads: list = []

    def __init__(self, *args, **kwargs):
        from safetensors import safe_open
        self.inner = safe_open(*args, **kwargs)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key):
        CountingSafeOpen.reads.append(key)
        return self.inner.get_tensor(key)


def load_case(ckpt: str) -> dict:
    """Meta model -> materialize this stage -> build the stage's pipeline module."""
    from tp_trainer.checkpoint import (
        checkpoint_config,
        hf_load,
        materialize_stage,
        meta_model,
    )
    from tp_trainer.model.stages.pipeline import build_pipeline_module, hf_named_parameters
    model = meta_model(checkpoint_config(ckpt))
    hf_load.safe_open, CountingSafeOpen.reads = CountingSafeOpen, []
    report = materialize_stage(model, 2, ckpt, seed=SEED)
    reads = list(CountingSafeOpen.reads)
    module = build_pipeline_module(model, 2)
    params = {n: p.detach().clone() for n, p in hf_named_parameters(module).items()}
    meta_left = sorted(n for n, p in model.named_parameters() if p.is_meta)
    init_model = meta_model(checkpoint_config(ckpt))
    init_report = materialize_stage(init_model, 2, None, seed=SEED)
    init = {n: init_model.get_parameter(n).detach().clone() for n in init_report.names}
    return {"report": asdict(report), "reads": reads, "params": params, "meta_left": meta_left, "init": init}


def pipeline_logits(engine, input_ids: torch.Tensor):
    """Logits of the whole sequence through the stages (one slice), on the last stage; else None."""
    from deepspeed.runtime.pipe import p2p

    from tp_trainer.model.slices.slice_cache import SequenceKV
    engine.module.eval()
    engine.module.slice_context.begin(SequenceKV(input_ids.shape[1]), 0, input_ids.shape[1])
    with torch.no_grad():
        if engine.is_first_stage():
            hidden = input_ids
        else:
            hidden = torch.empty(*input_ids.shape, engine.hidden_size)
            p2p.recv(hidden, engine.prev_stage)
        out = engine.module(hidden)
        if not engine.is_last_stage():
            p2p.send(out.contiguous(), engine.next_stage)
            return None
    return out


def train_case(ckpt: str, out_dir: str, kind: str) -> dict:
    """Train STEPS steps from ``ckpt`` (materialized per stage), then save both ways."""
    from transformers import AutoTokenizer

    import tp_trainer.initialize as tpi
    from tp_trainer.checkpoint import (
        checkpoint_config,
        materialize_stage,
        meta_model,
        save_hf_checkpoint,
        stage_state,
    )
    original = tpi.build_pipeline_module

    def build_materialized(model, stages, **kwargs):  # what initialize.py will do (see report)
        materialize_stage(model, stages, ckpt, seed=SEED, device="cpu")
        return original(model, stages, **kwargs)

    tpi.build_pipeline_module = build_materialized
    try:
        config = checkpoint_config(ckpt)
        engine, *_ = tpi.initialize(meta_model(config), ds_config())
    finally:
        tpi.build_pipeline_module = original
    losses = [float(engine.train_batch(iter(batches(step)))) for step in range(STEPS)]
    eval_loss = float(engine.eval_batch(iter(batches(EVAL_STEP))))
    eval_ids = torch.cat([ids for ids, _ in batches(EVAL_STEP)])
    logits = pipeline_logits(engine, eval_ids)
    save_hf_checkpoint(engine, os.path.join(out_dir, f"hf-{kind}"), config, tokenizer=AutoTokenizer.from_pretrained(ckpt))
    engine.save_checkpoint(os.path.join(out_dir, f"ds-{kind}"))
    tensors = {n: t.detach().clone() for n, t in stage_state(engine.module).items()}
    return {"losses": losses, "eval": eval_loss, "tensors": tensors, "logits": logits, "stage": engine.stage_id,
            "save_error": save_error(engine, out_dir, config)}


def save_error(engine, out_dir: str, config) -> str:
    """The message every rank gets when rank 0 cannot create the directory (a file is in the way)."""
    from tp_trainer.checkpoint import CheckpointError, save_hf_checkpoint
    blocker = os.path.join(out_dir, "not-a-dir")
    if engine.global_rank == 0:
        with open(blocker, "w", encoding="utf-8") as handle:
            handle.write("x")
    torch.distributed.barrier()
    try:
        save_hf_checkpoint(engine, os.path.join(blocker, "hf"), config)
    except CheckpointError as err:
        return str(err)
    return ""


def main():
    out_dir, ckpts = sys.argv[1], {"tied": sys.argv[2], "untied": sys.argv[3]}
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for kind, ckpt in ckpts.items():
        results[kind] = {"load": load_case(ckpt), "train": train_case(ckpt, out_dir, kind)}
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
