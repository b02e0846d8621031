"""Metrics on rank 0: TensorBoard events (+ a JSON-lines copy), terminal progress, and MFU.

* `MetricsWriter`: scalars, histograms, matplotlib figures and text to TensorBoard
  (``torch.utils.tensorboard.SummaryWriter``, imported lazily), and every ``scalars()`` call also
  appended as one JSON line to ``<log_dir>/metrics.jsonl`` so a run can be read without
  TensorBoard. Built with ``enabled=False`` (the other ranks) or ``log_dir=None`` it is a cheap
  no-op that imports and creates nothing.
* `read_scalars` / `read_image_tags`: the event files read back with TensorBoard's
  ``EventAccumulator`` (tests, run summaries).
* `Progress`: a tqdm bar when the stream is a terminal, else one plain line every
  ``log_every`` steps, so Slurm logs do not fill with carriage returns.
* `peak_flops` / `mfu`: the dense peak FLOP/s of the current CUDA device for a dtype, and model
  FLOPs utilisation (with `model.flops.training_flops`). The environment variable
  ``ALBATROSS_PEAK_FLOPS`` (a float, FLOP/s per device, e.g. ``989e12``) overrides the table,
  for GPUs it does not know or to report MFU against another reference.

Typical use in a training loop (only rank 0 writes):

>>> import io, tempfile
>>> with tempfile.TemporaryDirectory() as run_dir, MetricsWriter(run_dir) as tb:
...     progress = Progress(20, log_every=10, stream=io.StringIO(), force_tty=False)
...     for step in range(1, 21):
...         tb.scalars(step, {"loss/mlm": 2.0 / step, "time/step": None})
...         progress.update(step, {"loss": 2.0 / step})
...     progress.close()
...     tb.flush()
...     read_scalars(run_dir)["loss/mlm"][-1]
(20, 0.10000000149011612)
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "PEAK_FLOPS_ENV",
    "MetricsWriter",
    "Progress",
    "mfu",
    "peak_flops",
    "peak_flops_for_name",
    "read_image_tags",
    "read_scalars",
]

PEAK_FLOPS_ENV = "ALBATROSS_PEAK_FLOPS"
"""Environment variable: peak FLOP/s per device (a float > 0) that overrides `peak_flops`."""

Scalar = float | int | torch.Tensor | None


# ----------------------------------------------------------------------------- TensorBoard


def _to_float(tag: str, value: Any) -> float:
    """A Python float from a number or a one-element tensor; ValueError for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {tag!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        return float(value.detach().float().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"metric {tag!r}: expected a number or a scalar tensor, got {value!r}")


class MetricsWriter:
    """TensorBoard events plus ``metrics.jsonl`` in ``log_dir``; a no-op when disabled.

    Pass ``enabled=(rank == 0)``: on the other ranks, or with ``log_dir=None``, every method
    returns at once and nothing is imported or created. Tags are used as given (``"loss/mlm"``,
    ``"time/data"``). ``purge_step``: the first step of a resumed run; TensorBoard drops the
    events an interrupted attempt wrote from that step on. ``tensorboard=False``: only
    ``metrics.jsonl`` (histograms, figures and text are then dropped; see ``engine.trackers``
    for the other trackers). Also a context manager; `close` is idempotent, writing after it is
    a ``ValueError``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None,
        *,
        enabled: bool = True,
        flush_secs: int = 30,
        purge_step: int | None = None,
        tensorboard: bool = True,
    ):
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, int) or flush_secs < 1:
            raise ValueError(f"flush_secs={flush_secs!r} is invalid; valid: an integer >= 1")
        self.active = bool(enabled) and log_dir is not None
        """Whether this writer writes anything."""
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._writer: Any = None
        self._jsonl: IO[str] | None = None
        self._closed = False
        self.tensorboard = self.active and bool(tensorboard)
        """Whether TensorBoard event files are written (``metrics.jsonl`` is, when active)."""
        if not self.active:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch needs the tensorboard package for its writer
                raise ImportError(
                    "MetricsWriter needs the tensorboard package: pip install tensorboard"
                ) from e
            _after_the_last_event_file(self.log_dir)
            # purge_step: a resumed run rewrites the steps after its checkpoint; TensorBoard
            # hides the earlier attempt's events from that step on (one value per step).
            self._writer = SummaryWriter(
                str(self.log_dir), flush_secs=flush_secs, purge_step=purge_step
            )
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def _ready(self) -> bool:
        """True when a call should write; raises once closed."""
        if self._closed:
            raise ValueError("MetricsWriter is closed")
        return self.active

    def scalars(self, step: int, values: Mapping[str, Scalar]) -> None:
        """Writes each value under its tag at ``step``. ``None`` values are skipped; nan and inf
        are written (a blow-up must be visible), as ``null`` in the JSON line."""
        if not self._ready():
            return
        row = {tag: _to_float(tag, v) for tag, v in values.items() if v is not None}
        if not row:
            return
        if self._writer is not None:
            for tag, value in row.items():
                self._writer.add_scalar(tag, value, global_step=step)
        line = {"step": int(step), **{t: v if math.isfinite(v) else None for t, v in row.items()}}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(line, allow_nan=False) + "\n")
        self._jsonl.flush()  # one short line per log step: a crashed run keeps its metrics

    def histogram(self, tag: str, values: torch.Tensor | Any, step: int) -> None:
        """A histogram of the finite entries of ``values`` (a tensor or array); skipped if none."""
        if not self._ready() or self._writer is None:
            return
        flat = torch.as_tensor(values).detach().float().cpu().flatten()
        flat = flat[torch.isfinite(flat)]
        if flat.numel():
            self._writer.add_histogram(tag, flat.numpy(), global_step=step)

    def figure(self, tag: str, figure: Any, step: int) -> None:
        """A matplotlib figure as an image; the figure is closed afterwards (also when disabled)."""
        if not self._ready() or self._writer is None:
            pyplot = sys.modules.get("matplotlib.pyplot")  # a figure means matplotlib is loaded
            if pyplot is not None:
                pyplot.close(figure)
            return
        self._writer.add_figure(tag, figure, global_step=step, close=True)

    def text(self, tag: str, text: str, step: int) -> None:
        """A (markdown) text entry, e.g. the resolved config or a run summary."""
        if self._ready() and self._writer is not None:
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        """Writes pending events to disk now (they are also flushed every ``flush_secs``)."""
        if self._ready():
            if self._writer is not None:
                self._writer.flush()
            assert self._jsonl is not None
            self._jsonl.flush()

    def close(self) -> None:
        """Flushes and closes the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _after_the_last_event_file(log_dir: Path) -> None:
    """Waits, if needed, until the clock's second is past the newest event file's in
    ``log_dir``. TensorBoard reads a directory's event files in name order, and a name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>`` with a per-process counter that is
    not zero-padded: a writer opened in the same second by the same process could sort before
    the earlier one (counter 10 before 9), and its events, the resumed ones, would be read
    first (and purged by the older ones). A later second sorts after. Only a resume within a
    second of the previous start (tests, in-process sweeps) waits, at most a second."""
    seconds = []
    for path in log_dir.glob("events.out.tfevents.*"):
        stamp = path.name.split(".")[3]
        if stamp.isdigit():
            seconds.append(int(stamp))
    if not seconds:
        return
    while int(time.time()) <= max(seconds):
        time.sleep(0.05)


def _load_events(log_dir: str | os.PathLike) -> Any:
    """A loaded ``EventAccumulator`` over the event files of ``log_dir`` (all scalars kept)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    if not Path(log_dir).is_dir():
        raise ValueError(f"no TensorBoard log directory at {os.fspath(log_dir)!r}")
    accumulator = ea.EventAccumulator(os.fspath(log_dir), size_guidance={ea.SCALARS: 0})
    accumulator.Reload()
    return accumulator


def read_scalars(log_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``log_dir``: tag -> [(step, value), ...] in write
    order. Values come back as TensorBoard stores them (float32). After a restart that rewrote
    steps, TensorBoard's default purge keeps only the newer values."""
    accumulator = _load_events(log_dir)
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in sorted(accumulator.Tags()["scalars"])
    }


def read_jsonl(log_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``log_dir/metrics.jsonl`` by step: the rows of one step (e.g. losses and diagnostics)
    merged, a later row's values winning (a resumed run rewrites steps). A line that does not
    parse (one being written right now) is skipped."""
    rows: dict[int, dict[str, Any]] = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows.setdefault(row["step"], {}).update(row)
    return rows


def read_image_tags(log_dir: str | os.PathLike) -> list[str]:
    """The tags of the images (e.g. `MetricsWriter.figure`) in the event files of ``log_dir``."""
    return sorted(_load_events(log_dir).Tags()["images"])


# ----------------------------------------------------------------------------- progress


def _format_value(value: float | str) -> str:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return f"{float(value):.4g}"


class Progress:
    """Progress on rank 0: a tqdm bar when stderr is a terminal, else one plain log line every
    ``log_every`` steps (batch jobs: Slurm logs must not fill with carriage returns).

    ``stream`` defaults to ``sys.stderr``; ``force_tty`` overrides the ``isatty()`` test.
    ``initial`` is the step a resumed run starts from. Steps passed to `update` are absolute.
    A plain line reads ``train 20/100 (20%) | loss 2.31 | lr 0.001 | 3.5 it/s | eta 0:00:22``.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        enabled: bool = True,
        log_every: int = 10,
        desc: str = "train",
        stream: IO[str] | None = None,
        force_tty: bool | None = None,
    ):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total={total!r} is invalid; valid: an integer >= 0")
        if not 0 <= initial <= total:
            raise ValueError(f"initial={initial!r} is invalid; valid: an integer in [0, {total}]")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every={log_every!r} is invalid; valid: an integer >= 1")
        self.total, self.desc, self.log_every = total, desc, log_every
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        isatty = getattr(self._stream, "isatty", None)
        self.tty = force_tty if force_tty is not None else bool(isatty and isatty())
        """True: a tqdm bar; False: plain lines."""
        self._start_step, self._start_time = initial, time.monotonic()
        self._next_log = (initial // log_every + 1) * log_every
        self._bar: Any = None
        self._closed = not enabled
        if enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, file=self._stream, dynamic_ncols=True
            )

    def update(self, step: int, postfix: Mapping[str, float | str] | None = None) -> None:
        """Moves to absolute ``step`` and shows ``postfix`` (numbers to 4 significant digits)."""
        if self._closed:
            return
        shown = {key: _format_value(value) for key, value in (postfix or {}).items()}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            return
        if step >= self._next_log or step == self.total:
            self._next_log = (step // self.log_every + 1) * self.log_every
            self._print(self._line(step, shown))

    def rewind(self, step: int) -> None:
        """Back to ``step`` (a rollback): the next updates show the steps again."""
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()
        self._next_log = (step // self.log_every + 1) * self.log_every

    def _line(self, step: int, shown: Mapping[str, str]) -> str:
        parts = [f"{self.desc} {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%)"]
        parts += [f"{key} {value}" for key, value in shown.items()]
        elapsed = time.monotonic() - self._start_time
        done = step - self._start_step
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            eta = timedelta(seconds=round(max(0, self.total - step) / rate))
            parts += [f"{rate:.3g} it/s", f"eta {eta}"]
        return " | ".join(parts)

    def _print(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()

    def write(self, message: str) -> None:
        """A message that does not break the bar (``tqdm.write``), or a plain line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            self._print(message)

    def close(self) -> None:
        """Closes the bar (idempotent)."""
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ----------------------------------------------------------------------------- MFU


@dataclass(frozen=True)
class _DevicePeak:
    """Dense (no structured sparsity) peak FLOP/s of one GPU model from its NVIDIA datasheet.

    ``bf16``/``fp16`` are the tensor-core rates with FP32 accumulate (what PyTorch uses);
    ``tf32`` the tensor-core rate for float32 matmuls when TF32 is allowed; None: not supported.
    Datasheets print sparse figures with an asterisk: dense is half of those.
    """

    pattern: str
    """Regular expression searched in the lower-cased ``torch.cuda.get_device_name()``."""
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


# First match wins, so the more specific names come first (H100 NVL before H100, L40S before L4).
_PEAKS: tuple[_DevicePeak, ...] = (
    # NVIDIA H200 datasheet, "H200 NVL" column: BF16/FP16 Tensor Core 1,671* TF, TF32 835*, FP32 60.
    _DevicePeak(r"h200 nvl", 835.5e12, 835.5e12, 417.5e12, 60e12),
    # NVIDIA H200 datasheet, "H200 SXM": BF16/FP16 Tensor Core 1,979* TF, TF32 989*, FP32 67.
    _DevicePeak(r"h200", 989.5e12, 989.5e12, 494.5e12, 67e12),
    # NVIDIA H100 datasheet, "H100 NVL": BF16/FP16 Tensor Core 1,671* TF, TF32 835*, FP32 60.
    _DevicePeak(r"h100 nvl", 835.5e12, 835.5e12, 417.5e12, 60e12),
    # NVIDIA H100 datasheet, "H100 PCIe": BF16/FP16 Tensor Core 1,513* TF, TF32 756*, FP32 51.
    _DevicePeak(r"h100.*pcie", 756.5e12, 756.5e12, 378e12, 51e12),
    # NVIDIA H100 datasheet, "H100 SXM" ("NVIDIA H100 80GB HBM3"): BF16/FP16 1,979* TF, TF32
    # 989*, FP32 67.
    _DevicePeak(r"h100", 989.5e12, 989.5e12, 494.5e12, 67e12),
    # NVIDIA A100 datasheet (SXM and PCIe): BF16/FP16 Tensor Core 312 | 624* TF, TF32 156 | 312*,
    # FP32 19.5.
    _DevicePeak(r"a100", 312e12, 312e12, 156e12, 19.5e12),
    # NVIDIA A10 datasheet: BF16/FP16 Tensor Core 125 | 250* TF, TF32 62.5 | 125*, FP32 31.2.
    # The A10G (AWS) has no NVIDIA datasheet; we assume the A10's figures: set
    # ALBATROSS_PEAK_FLOPS if you have a better number.
    _DevicePeak(r"\ba10g?\b", 125e12, 125e12, 62.5e12, 31.2e12),
    # NVIDIA L40S datasheet: BF16/FP16 Tensor Core 362.05 | 733* TF, TF32 183 | 366*, FP32 91.6.
    _DevicePeak(r"l40s", 362.05e12, 362.05e12, 183e12, 91.6e12),
    # NVIDIA L4 datasheet: BF16/FP16 Tensor Core 242* TF, TF32 120*, FP32 30.3.
    _DevicePeak(r"\bl4\b", 121e12, 121e12, 60e12, 30.3e12),
    # NVIDIA V100 datasheet: Tensor Performance (FP16) 130 (V100S PCIe), 112 (PCIe), 125 (SXM2)
    # TF; FP32 16.4 / 14 / 15.7. No BF16 and no TF32 on Volta.
    _DevicePeak(r"v100s", None, 130e12, None, 16.4e12),
    _DevicePeak(r"v100.*pcie", None, 112e12, None, 14e12),
    _DevicePeak(r"v100", None, 125e12, None, 15.7e12),
    # NVIDIA Ada GPU architecture whitepaper (RTX 4090): Peak FP16/BF16 Tensor TFLOPS with FP32
    # Accumulate 165.2 | 330.4*, TF32 82.6 | 165.2*, FP32 82.6.
    _DevicePeak(r"rtx 4090", 165.2e12, 165.2e12, 82.6e12, 82.6e12),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090): Peak FP16/BF16 Tensor TFLOPS
    # with FP32 Accumulate 71 | 142*, TF32 35.6 | 71*, FP32 35.6. (Not the 3090 Ti.)
    _DevicePeak(r"rtx 3090(?!\s*ti)", 71e12, 71e12, 35.6e12, 35.6e12),
)


def _env_peak() -> float | None:
    raw = os.environ.get(PEAK_FLOPS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{PEAK_FLOPS_ENV}={raw!r} is invalid; valid: peak FLOP/s per device as a float > 0 "
            "(e.g. 989e12)"
        )
    return value


def peak_flops_for_name(name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` (as ``torch.cuda.get_device_name`` says) for
    matmuls in ``dtype``; float32 uses the TF32 rate when ``tf32``. None when unknown."""
    lowered = name.lower()
    peak = next((p for p in _PEAKS if re.search(p.pattern, lowered)), None)
    if peak is None:
        return None
    if dtype == torch.bfloat16:
        return peak.bf16
    if dtype == torch.float16:
        return peak.fp16
    if dtype == torch.float32:
        return peak.tf32 if tf32 and peak.tf32 is not None else peak.fp32
    return None


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of the CUDA ``device`` (its index, else the current device) for matmuls
    in ``dtype`` (bf16/fp16: tensor cores; float32: TF32 tensor cores when
    ``torch.get_float32_matmul_precision()`` allows them, else FP32).

    ``ALBATROSS_PEAK_FLOPS`` (a float) overrides the lookup on every device. Otherwise None on
    a CPU, without CUDA, or for a GPU or dtype the table does not know: MFU is then not reported.
    """
    override = _env_peak()
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device if device.index is not None else None)
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak_flops_for_name(name, dtype, tf32=tf32)


def mfu(flops_per_second: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s (e.g. `model.flops.training_flops` x
    sequences per second per device) over the device's peak; None when the peak is unknown."""
    if not (math.isfinite(flops_per_second) and flops_per_second >= 0):
        raise ValueError(f"flops_per_second={flops_per_second!r} is invalid; valid: a number >= 0")
    if peak is None:
        return None
    if not (math.isfinite(peak) and peak > 0):
        raise ValueError(f"peak={peak!r} is invalid; valid: None or a number > 0")
    return flops_per_second / peak
