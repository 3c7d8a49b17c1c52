"""A run killed after its last checkpoint logged steps that its resumed run trains again: the
resumed run's ``metrics.jsonl`` lists every step once, and its ``start`` line says how many
records it dropped."""

from __future__ import annotations

import json
from collections import Counter

from tests.test_finetune import _config, _data, _fresh_accelerate_state, _models  # noqa: F401
from vitcompress.training.checkpoint import find_latest, load_checkpoint
from vitcompress.workflows.finetune import finetune


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    run = tmp_path / "run"
    student, teacher = _models()
    finetune(student, teacher, _data(), None, run, _config(save_every=1, keep_checkpoints=100))
    first = _records(run / "metrics.jsonl")
    last_step = max(r["step"] for r in first if r["type"] == "step")
    assert last_step >= 4
    # As if killed at the end: only the checkpoints up to step 2 survived, and the last line was
    # torn by the kill.
    resume_step = 2
    for checkpoint in (run / "checkpoints").iterdir():
        if load_checkpoint(checkpoint)["global_step"] > resume_step:
            checkpoint.unlink()
    assert load_checkpoint(find_latest(run / "checkpoints"))["global_step"] == resume_step
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"type": "step", "ste')
    undone = sum(1 for r in first if r["type"] in ("step", "epoch") and r["step"] > resume_step)

    student, teacher = _models()
    finetune(student, teacher, _data(), None, run, _config(resume=True))
    records = _records(run / "metrics.jsonl")
    steps = Counter(r["step"] for r in records if r["type"] == "step")
    assert sorted(steps) == list(range(1, last_step + 1))
    assert set(steps.values()) == {1}
    starts = [r for r in records if r["type"] == "start"]
    assert [s["step"] for s in starts] == [0, resume_step]
    assert starts[1]["records_dropped"] == undone + 1  # the torn line too
    # The records before the resume point are the first run's, untouched.
    assert [r for r in records if r["type"] == "step" and r["step"] <= resume_step] == [
        r for r in first if r["type"] == "step" and r["step"] <= resume_step
    ]
