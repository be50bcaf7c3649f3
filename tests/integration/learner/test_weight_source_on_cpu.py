"""What the learner would send over NCCL is byte for byte what it writes as serving weights."""

from __future__ import annotations

import json
from pathlib import Path

from consumers.weight_digests import MANIFEST
from consumers.weight_transfer import StreamDigests, _checked, buckets
from learner.checkpoint import serving_folder, write_checkpoint_folder
from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.workers.hf import HFPolicyWorker
from learner.workers.weights import ModuleSource


def test_the_module_source_streams_the_serving_folders_digests(tiny_model: Path, tmp_path: Path) -> None:
    worker = HFPolicyWorker(LearnerSettings(model_dir=tiny_model, serving_dtype="bfloat16", lr=3e-2), tiny_model)
    ids = [(7 * i) % 200 + 3 for i in range(48)]
    worker.train_step(TrainBatch([Row(input_ids=ids, prompt_len=16, loss_mask=[1] * 32,
                                      behavior_logprobs=[-5.0] * 32, advantage=1.0)]))
    folder = write_checkpoint_folder(serving_folder(tmp_path, 1), worker.save_serving, manifest=True)
    manifest = json.loads((folder / MANIFEST).read_text())["parameters"]

    source = ModuleSource(worker.lm, worker.serving_dtype)
    meta = source.metadata()
    assert {m.dtype for m in meta} == {"bfloat16"}
    digests = StreamDigests([m.name for m in meta])
    plan = buckets(meta, limit_bytes=1 << 20)
    assert len(plan) > 1
    for bucket in plan:
        for name, tensor in _checked(source.tensors([m.name for m in bucket]), bucket):
            digests.add(name, tensor)
    assert digests.digests == manifest
