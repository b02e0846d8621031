"""engine.metrics: TensorBoard events read back, metrics.jsonl, progress output, peak FLOPs."""

from __future__ import annotations

import io
import json
import math
import sys

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing import event_accumulator

from engine.metrics import (
    PEAK_FLOPS_ENV,
    MetricsWriter,
    Progress,
    mfu,
    peak_flops,
    peak_flops_for_name,
    read_image_tags,
    read_scalars,
)


def _figure():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return fig


def test_scalars_figure_text_histogram_round_trip(tmp_path) -> None:
    fig = _figure()
    with MetricsWriter(tmp_path) as tb:
        # Values exactly representable in float32 (TensorBoard stores float32).
        tb.scalars(1, {"loss/mlm": 2.5, "time/data": torch.tensor(0.125), "lr": 3, "skip": None})
        tb.scalars(2, {"loss/mlm": float("nan"), "grad/norm": float("inf")})
        tb.scalars(5, {"loss/mlm": 1.75})
        tb.figure("tisa/curves", fig, step=5)
        tb.text("config", "lr: 0.001", step=0)
        tb.histogram("weights/ffn", torch.tensor([0.0, 1.0, float("nan"), 2.0]), step=5)
    assert not plt.fignum_exists(fig.number)

    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["grad/norm", "loss/mlm", "lr", "time/data"]
    assert scalars["time/data"] == [(1, 0.125)]
    assert scalars["lr"] == [(1, 3.0)]
    steps, values = zip(*scalars["loss/mlm"])
    assert steps == (1, 2, 5)
    assert values[0] == 2.5 and math.isnan(values[1]) and values[2] == 1.75
    assert scalars["grad/norm"] == [(2, math.inf)]
    assert read_image_tags(tmp_path) == ["tisa/curves"]

    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert "weights/ffn" in accumulator.Tags()["histograms"]
    (histogram,) = accumulator.Histograms("weights/ffn")
    assert histogram.histogram_value.num == 3  # the nan was dropped
    assert "config/text_summary" in accumulator.Tags()["tensors"]

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss/mlm": 2.5, "time/data": 0.125, "lr": 3.0},
        {"step": 2, "loss/mlm": None, "grad/norm": None},
        {"step": 5, "loss/mlm": 1.75},
    ]


def test_a_resumed_run_appends(tmp_path) -> None:
    with MetricsWriter(tmp_path) as tb:
        tb.scalars(10, {"loss": 1.0})
    with MetricsWriter(tmp_path) as tb:
        tb.scalars(20, {"loss": 0.5})
    assert read_scalars(tmp_path)["loss"] == [(10, 1.0), (20, 0.5)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_disabled_writer_creates_nothing(tmp_path) -> None:
    log_dir = tmp_path / "tb"
    fig = _figure()
    for tb in (MetricsWriter(log_dir, enabled=False), MetricsWriter(None)):
        assert not tb.active
        tb.scalars(1, {"loss": 1.0})
        tb.histogram("w", torch.ones(3), 1)
        tb.text("t", "x", 1)
        tb.flush()
        tb.close()
        tb.close()
    MetricsWriter(log_dir, enabled=False).figure("f", fig, 1)
    assert not plt.fignum_exists(fig.number)  # closed even though nothing was written
    assert not log_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_disabled_writer_imports_no_tensorboard(monkeypatch) -> None:
    # A None entry in sys.modules makes any import of that module fail.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsWriter("unused")
    tb = MetricsWriter("unused", enabled=False)
    tb.scalars(1, {"a": 1.0})
    tb.close()


def test_bad_values_and_closed_writer_raise(tmp_path) -> None:
    tb = MetricsWriter(tmp_path)
    with pytest.raises(ValueError, match="scalar"):
        tb.scalars(1, {"vec": torch.ones(2)})
    with pytest.raises(ValueError, match="number"):
        tb.scalars(1, {"name": "fast"})
    tb.close()
    tb.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        tb.scalars(2, {"loss": 1.0})
    with pytest.raises(ValueError, match="flush_secs"):
        MetricsWriter(tmp_path, flush_secs=0)
    with pytest.raises(ValueError, match="no TensorBoard log directory"):
        read_scalars(tmp_path / "missing")


def test_progress_plain_lines_every_log_every_steps() -> None:
    out = io.StringIO()
    progress = Progress(35, log_every=10, stream=out, force_tty=False)
    assert not progress.tty
    for step in range(1, 36):
        progress.update(step, {"loss": 0.5, "lr": "1e-3"})
    progress.write("saved checkpoint")
    progress.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" |")[0] for line in lines[:-1]] == [
        "train 10/35 (29%)",
        "train 20/35 (57%)",
        "train 30/35 (86%)",
        "train 35/35 (100%)",  # the last step is always logged
    ]
    assert all("| loss 0.5 | lr 1e-3 |" in line and "it/s" in line for line in lines[:-1])
    assert lines[-1] == "saved checkpoint"


def test_progress_resumed_and_disabled() -> None:
    out = io.StringIO()
    progress = Progress(40, initial=25, log_every=10, stream=out, force_tty=False, desc="ft")
    for step in range(26, 41):
        progress.update(step, {})
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "ft 30/40 (75%)",
        "ft 40/40 (100%)",
    ]
    quiet = io.StringIO()
    progress = Progress(40, enabled=False, stream=quiet, force_tty=True)
    progress.update(10, {"loss": 1.0})
    progress.write("hidden")
    progress.close()
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="log_every"):
        Progress(10, log_every=0)


def test_progress_tty_uses_tqdm() -> None:
    out = io.StringIO()
    progress = Progress(30, stream=out, force_tty=True, desc="pretrain")
    assert progress.tty
    for step in range(1, 31):
        progress.update(step, {"loss": 0.25})
        if step == 15:
            progress.write("halfway")
    progress.close()
    text = out.getvalue()
    assert "\r" in text  # a redrawn bar, not log lines
    assert "pretrain: 100%" in text and "30/30" in text and "loss=0.25" in text
    assert "\rhalfway\n" in text  # tqdm.write clears the bar line first


def test_peak_flops_cpu_none_and_env_override(monkeypatch) -> None:
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert peak_flops("cpu", torch.bfloat16) is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv(PEAK_FLOPS_ENV, "1.5e14")
    assert peak_flops("cpu", torch.bfloat16) == 1.5e14
    monkeypatch.setenv(PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match=PEAK_FLOPS_ENV):
        peak_flops("cpu", torch.bfloat16)


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),  # SXM
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
        ("NVIDIA H100 NVL", torch.float16, 835.5e12),
        ("NVIDIA H200", torch.bfloat16, 989.5e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A10G", torch.bfloat16, 125e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA L40S", torch.bfloat16, 362.05e12),
        ("Tesla V100-SXM2-32GB", torch.float16, 125e12),
        ("Tesla V100-SXM2-32GB", torch.bfloat16, None),  # Volta has no bf16 tensor cores
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2e12),
        ("NVIDIA GeForce RTX 3090", torch.float16, 71e12),
        ("NVIDIA GeForce RTX 3090 Ti", torch.float16, None),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
        ("NVIDIA A100-SXM4-80GB", torch.float64, None),
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_flops_table(name: str, dtype: torch.dtype, expected: float | None) -> None:
    assert peak_flops_for_name(name, dtype) == expected


def test_peak_flops_on_a_cuda_device_reads_its_name(monkeypatch) -> None:
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops("cuda", torch.bfloat16) == 756.5e12
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert peak_flops("cuda:0", torch.float32) == 378e12
        torch.set_float32_matmul_precision("highest")
        assert peak_flops("cuda:0", torch.float32) == 51e12
    finally:
        torch.set_float32_matmul_precision(precision)


def test_mfu_arithmetic() -> None:
    assert mfu(494.75e12, 989.5e12) == 0.5
    assert mfu(0.0, 312e12) == 0.0
    assert mfu(1e12, None) is None
    with pytest.raises(ValueError, match="flops_per_second"):
        mfu(-1.0, 312e12)
    with pytest.raises(ValueError, match="peak"):
        mfu(1e12, 0.0)


def test_read_jsonl_merges_a_step_and_skips_a_partial_line(tmp_path):
    from engine.metrics import read_jsonl

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 1, "diag": 5.0}\n{"step": 2, "loss": 1.5}\n{"step": 2, "lo'
    )
    assert read_jsonl(tmp_path) == {
        1: {"step": 1, "loss": 2.0, "diag": 5.0},
        2: {"step": 2, "loss": 1.5},
    }
