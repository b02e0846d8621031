"""Reading W&B offline runs and MLflow stores back, for the tracker tests.

W&B's offline run (``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``) is its transaction
log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB-log records in 32 KiB
blocks (a 7-byte record header: CRC32, length, type 1 full / 2 first / 3 middle / 4 last; a
block's tail shorter than a header is padding), each record a ``wandb_internal.Record``
protobuf. The Python reader W&B used to ship (``wandb.sdk.internal.datastore``) is gone from
wandb 0.2x on (the Go core reads the file), so this reads the documented format directly and
parses the records with the protobuf classes wandb still ships.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def _chunks(data: bytes):
    """The records' payloads of a W&B transaction log."""
    if data[:4] != b":W&B":
        raise ValueError(f"not a W&B transaction log (starts with {data[:7]!r})")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding at the end of a block
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zero-filled rest of a block
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def wandb_offline_runs(run_dir: Path) -> list[Path]:
    """The ``.wandb`` files of every offline attempt under ``run_dir/wandb``, oldest first."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return sorted(files, key=lambda p: (p.parent.name, p.stat().st_mtime))


def read_wandb_offline(run_dir: Path) -> dict[str, Any]:
    """Every offline attempt of the W&B run in ``run_dir``: ``{"ids": [run id per attempt],
    "names": [...], "config": {...} (the first attempt's), "history": {tag: [(step, value),
    ...]} (all attempts, in order)}``. W&B's own ``_step``, ``_runtime``, ``_timestamp`` left
    out."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"ids": [], "names": [], "config": {}, "history": {}}
    for path in wandb_offline_runs(run_dir):
        for chunk in _chunks(path.read_bytes()):
            record = pb.Record()
            record.ParseFromString(chunk)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(record.run.run_id)
                out["names"].append(record.run.display_name)
                if not out["config"]:
                    for item in record.run.config.update:
                        out["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if key.startswith("_"):
                        continue
                    value = json.loads(item.value_json)
                    out["history"].setdefault(key, []).append((step, float(value)))
    return out


def read_mlflow(tracking_uri: str, experiment: str = "albatross") -> list[dict[str, Any]]:
    """Every run of ``experiment`` in the store: ``{"id", "name", "status", "params",
    "history": {tag: [(step, value), ...] by step}}``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    runs = []
    for run in client.search_runs([found.experiment_id]):
        history = {
            key: sorted(
                ((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)),
                key=lambda x: x[0],
            )
            for key in run.data.metrics
        }
        runs.append(
            {
                "id": run.info.run_id,
                "name": run.info.run_name,
                "status": run.info.status,
                "params": dict(run.data.params),
                "history": history,
            }
        )
    return runs


def same(a: float, b: float, rel: float = 1e-6) -> bool:
    """Equal within ``rel`` (TensorBoard stores float32), nan equal to nan."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def assert_same_history(
    got: dict[str, list[tuple[int, float]]],
    want: dict[str, list[tuple[int, float]]],
    what: str,
    tags: set[str] | None = None,
) -> None:
    """``got`` holds exactly ``want``'s tags, each with the same steps and values (``tags``:
    compare the values of these only; the steps of all)."""
    assert sorted(got) == sorted(want), f"{what}: tags {sorted(got)} != {sorted(want)}"
    for tag in want:
        got_steps = [s for s, _ in got[tag]]
        want_steps = [s for s, _ in want[tag]]
        assert got_steps == want_steps, f"{what} {tag}: steps {got_steps} != {want_steps}"
        if tags is not None and tag not in tags:
            continue
        for (step, x), (_, y) in zip(got[tag], want[tag]):
            assert same(x, y), f"{what} {tag} at step {step}: {x} != {y}"
