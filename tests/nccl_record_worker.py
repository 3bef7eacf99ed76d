"""tests/test_nccl_model.py's recorded runs: a tiny GPT-2 pipeline trained 2 steps in fp32 with every
``deepspeed.comm`` call of the second step recorded (kind; peer, or group with its name, the function
and its tensors' elements and dtype; each wait), written to OUT_DIR/CASE.rankR.json for the NCCL model
(``schedule/nccl_model.py``, ``schedule/calls.recorded_calls``). Cases: 2 and 3 stages, gpipe and 1f1b;
2 stages x 2 replicas with ZeRO-1; 2 stages x 2 sequence ranks (tests/sequence_cases.py's configs:
slices [6, 4, 4, 2], ``terapipe.sequence_parallel`` 2), gpipe and 1f1b with activation checkpointing,
whose F and B exchange through ``all_to_all_single`` on each stage's sequence group. ``main`` runs the
cases of this launch's world size; tests/exactness_worker.py calls it last in each of its launches.

Usage: nccl_record_worker.py CASES OUT_DIR   (CASES: comma-separated names of ``CASES`` below)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import sequence_cases  # noqa: E402

from tp_trainer.failures import leave  # noqa: E402

CASES = {"pp2-gpipe": ec._case(2, 2, "uneven", True, "gpipe"),
         "pp2-1f1b": ec._case(2, 3, "uneven", True, "1f1b"),
         "pp3-gpipe": ec._case(3, 2, "uneven", True, "gpipe"),
         "pp3-1f1b": ec._case(3, 3, "uneven", True, "1f1b"),
         "pp2-dp2-zero1": ec._case(2, 2, "uneven", True, "gpipe", replicas=2, zero=1),
         "pp2-sp2-gpipe": sequence_cases._case(2, "gpt2", True, "gpipe"),
         "pp2-sp2-1f1b-ckpt": sequence_cases._case(2, "gpt2", False, "1f1b", ckpt=True)}
P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
# each collective of deepspeed.comm -> the position of its group argument (deepspeed/comm/comm.py)
COLLECTIVES = {"all_reduce": 2, "inference_all_reduce": 2, "broadcast": 2, "all_gather": 2,
               "all_gather_into_tensor": 2, "reduce_scatter": 3, "reduce_scatter_tensor": 3, "reduce": 3,
               "barrier": 0, "all_reduce_coalesced": 2, "all_to_all_single": 4, "all_to_all": 2}


class Recorder:
    """Wraps deepspeed.comm's point-to-point and collective functions while ``on``."""

    def __init__(self):
        self.calls, self.on = [], False

    def install(self, comm) -> None:
        for name in (*P2P, *COLLECTIVES):
            if hasattr(comm, name):
                setattr(comm, name, self._wrap(name, getattr(comm, name)))

    def _wrap(self, name, fn):
        def recorded(*args, **kwargs):
            work = fn(*args, **kwargs)
            if not self.on:
                return work
            label = f"{len(self.calls)}:{name}"
            self.calls.append({"label": label, **self._describe(name, args, kwargs)})
            if work is None or not hasattr(work, "wait"):
                self.calls.append({"wait": label})
                return work
            return RecordedWork(work, label, self)
        return recorded

    @staticmethod
    def _describe(name, args, kwargs) -> dict:
        import torch.distributed as td
        if name in P2P:
            peer = kwargs.get("dst", kwargs.get("src"))
            peer = args[1] if peer is None and len(args) > 1 else peer
            return {"kind": P2P[name], "peer": int(peer)}
        group = kwargs.get("group")
        if group is None and len(args) > COLLECTIVES[name]:   # positional: all_reduce(tensor, op, group), ...
            group = args[COLLECTIVES[name]]
        ranks = td.get_process_group_ranks(group) if group is not None else list(range(td.get_world_size()))
        tensors = list(_tensors((*args, *kwargs.values())))
        return {"kind": "collective", "group": sorted(ranks), "op": name,
                "name": getattr(group, "group_name", None) if group is not None else None,
                "numel": sum(tensor.numel() for tensor in tensors),
                "dtype": str(tensors[0].dtype) if tensors else None}


def _tensors(values):
    """The tensors among a call's arguments, inside lists and tuples too."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class RecordedWork:
    """A Work whose wait() is recorded."""

    def __init__(self, work, label, recorder):
        self._work, self._label, self._recorder = work, label, recorder

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._recorder.calls.append({"wait": self._label})
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def main(names: str, out_dir: str) -> None:
    from deepspeed import comm

    from tp_trainer.initialize import initialize
    recorder = Recorder()
    recorder.install(comm)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    for name in names.split(","):
        case = CASES[name]
        if case["stages"] * case["replicas"] * case.get("sequence_ranks", 1) != world:
            continue
        sequence = "sequence_ranks" in case
        engine, *_ = initialize(sequence_cases.model(case) if sequence else ec.tiny_model(case["tied"]),
                                sequence_cases.ds_config(case) if sequence else ec.ds_config(case))
        replica = engine.grid.data_parallel_id
        engine.train_batch(iter(ec.batches(case, 0, replica)))
        recorder.calls, recorder.on = [], True
        engine.train_batch(iter(ec.batches(case, 1, replica)))
        recorder.on = False
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w", encoding="utf-8") as handle:
            json.dump(recorder.calls, handle)
        del engine
        torch.manual_seed(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave(0)
