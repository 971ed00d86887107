"""Reads a run's TensorBoard event files with TensorBoard's own EventAccumulator (orphaned data
purged, as the TensorBoard UI does) and compares train/loss and valid/loss with metrics.jsonl.

    /tmp/venv/bin/pip install tensorboard && /tmp/venv/bin/python scripts/tensorboard_check.py RUN_DIR
"""
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
run = sys.argv[1]
acc = EventAccumulator(run + "/tensorboard", purge_orphaned_data=True)
acc.Reload()
tags = acc.Tags()["scalars"]
print("tags:", sorted(tags))
loss = {e.step: e.value for e in acc.Scalars("train/loss")}
val = {e.step: e.value for e in acc.Scalars("valid/loss")}
recs = [json.loads(l) for l in open(run + "/metrics.jsonl")]
want = {r["step"]: r["loss"] for r in recs if "loss" in r}
wval = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
print("steps:", sorted(loss), "valid:", sorted(val))
bad = [s for s in want if abs(loss[s] - want[s]) > 1e-6 * abs(want[s])]
badv = [s for s in wval if abs(val[s] - wval[s]) > 1e-6 * abs(wval[s])]
print("train/loss equal to metrics.jsonl at", len(want), "steps; mismatches:", bad, badv)
