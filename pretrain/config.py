"""The pretraining config: one typed dataclass per recipe section.

    model:      the encoder (``model.config.EncoderConfig`` fields, ``preset:`` allowed)
    data:       shards, tokenizer, sequence length, masking, loader workers
    optimizer:  ``engine.optim.OptimizerConfig``
    schedule:   ``engine.optim.ScheduleConfig``
    engine:     ``engine.engine.EngineConfig`` (backend, ZeRO stage, precision, batch layout)
    train:      run directory, steps, logging, checkpoints, faults

Recipes live in ``configs/pretrain/``; see ``engine/recipe.py`` for the YAML and override rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from data_prep.loader import DEFAULT_GROUP_CHUNK, DEFAULT_GROUP_WINDOW, LengthGrouping
from data_prep.masking import MaskingConfig
from engine.divergence import DivergenceConfig
from engine.engine import EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig
from engine.recipe import build_config, config_dict
from engine.trackers import TRACKER_KEYS, TrackerConfig
from model.config import EncoderConfig
from pretrain.init import INIT_KEY
from pretrain.init import encoder_config as init_encoder_config


@dataclass
class DataConfig:
    """Where the examples come from and how they are masked."""

    shards: str = ""
    """Shard directory written by ``python -m data_prep shards`` (required)."""
    tokenizer: str | None = None
    """tokenizer.json used for training and copied into the release. None: the one in the
    shard directory. Its sha256 must match the shards' manifest."""
    max_seq_length: int = 128
    """Tokens per example ([CLS] A [SEP] B [SEP]); at most model.max_position_embeddings."""
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    """Dynamic MLM + SOP masking (``data_prep.masking.MaskingConfig``)."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0: load in the training process)."""
    verify_checksums: bool = True
    """Check every shard's sha256 against the manifest before training (rank 0; reads the
    whole corpus once: turn off for very large corpora that were verified already)."""
    validation_batches: int = 20
    """Micro-batches per process of the held-out validation set evaluated every
    ``train.eval_every`` steps (the same examples and masks every time; the shards need a
    validation split: ``data_prep shards --validation-fraction``)."""
    group_by_length: bool = False
    """Batch training examples of similar length, so that most batches need no padding (a
    batch without padding passes no attention mask: the fastest attention kernels) and a
    batch of short examples is only as wide as its longest. Each epoch's seeded order is cut
    into windows of ``group_by_length_window`` examples; each window is sorted by example
    length (longest first), cut into chunks of ``group_by_length_chunk`` examples, and the
    chunks are shuffled (seeded by ``train.seed``, epoch and window). The order does not
    depend on the number of processes or the micro-batch, so exact and elastic resume stay
    exact; a checkpoint saved with another setting is refused. Trade-off: a step holds either
    full-length or short examples instead of a uniform mix (short ones come in runs of a
    chunk, at a random place of each window). Off: the random order of before."""
    group_by_length_window: int = DEFAULT_GROUP_WINDOW
    """Examples of the epoch's order per length-grouping window (a multiple of
    ``group_by_length_chunk``): how far an example may move from its random position."""
    group_by_length_chunk: int = DEFAULT_GROUP_CHUNK
    """Examples per shuffled chunk of a length-grouped window. Make it a multiple of
    ``engine.micro_batch_size`` x processes, so that a micro-step of full-length examples lies
    in one chunk (no padding on any process); smaller chunks spread the short examples more
    finely over the steps."""

    def length_grouping(self) -> LengthGrouping | None:
        """The loader's ``group_by_length`` argument (None when off)."""
        if not self.group_by_length:
            return None
        return LengthGrouping(self.group_by_length_window, self.group_by_length_chunk)

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("data.shards is required: the directory written by data_prep shards")
        if self.max_seq_length < 5:
            raise ValueError(f"data.max_seq_length={self.max_seq_length} is invalid; valid: >= 5")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} is invalid; valid: >= 0")
        if self.validation_batches < 1:
            raise ValueError(
                f"data.validation_batches={self.validation_batches} is invalid; valid: >= 1"
            )
        for name in ("group_by_length_window", "group_by_length_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)} is invalid; valid: >= 1")
        if self.group_by_length_window % self.group_by_length_chunk:
            raise ValueError(
                f"data.group_by_length_window={self.group_by_length_window} is invalid; valid: "
                f"a multiple of data.group_by_length_chunk={self.group_by_length_chunk}"
            )


RESUMABLE_CHANGES = (
    "train.steps",
    "train.eval_every",
    "data.validation_batches",
    "train.log_every",
    "train.diagnostics_every",
    "train.checkpoint_every",
    "train.keep_last",
    "train.time_budget_minutes",
    "train.max_nonfinite_in_a_row",
    "train.progress",
    "train.time_split",
    "train.export_at_end",
    "train.fail_at_step",
    "train.divergence",
    "train.inject_nonfinite_at",
    "data.num_workers",
    "data.verify_checksums",
    "engine.dist_timeout_minutes",
    "engine.compile",
    "engine.compile_backend",
    "engine.compile_mode",
    "engine.compile_options",
    "engine.compile_scope",
    "engine.compile_cache_dir",
    "model.kernel.inference_backend",  # forwards without a gradient only (validation)
    "model.kernel.training_backend",  # the same function as `torch`, up to rounding
    *TRACKER_KEYS,
    # These do change the order of the examples, but the loader state records them and refuses
    # a checkpoint saved with another setting (a clear error when it loads); listed here so that
    # run directories from before these keys existed (group_by_length off) still resume.
    "data.group_by_length",
    "data.group_by_length_window",
    "data.group_by_length_chunk",
)
"""Config keys a resumed run may change without the run-directory check refusing it: they do
not affect the training trajectory, except ``data.group_by_length*``, which the loader state
checks instead (see the comment above)."""

RELEASE_DIR = "release"
"""The release inside every checkpoint directory and, exported at the end, in the run directory."""

LOCATION_KEYS = ("train.run_dir", "data.shards", "data.tokenizer", "model.init_from")
"""Config keys that say where things are, not what they are: a run directory or shard
directory that was moved or copied still holds the same run. The content they point at is
compared instead (``data_identity`` in the run's config.yaml: the shards' and the tokenizer's
sha256s)."""


@dataclass
class TrainConfig(TrackerConfig):
    """The run: where it writes, how long it goes, what it logs (the trackers: `TrackerConfig`,
    ``engine/trackers.py``) and saves."""

    run_dir: str = "runs/pretrain"
    """Directory for config.yaml, checkpoints/, tensorboard/, release/, status.json. Re-running
    with the same config resumes from its latest checkpoint; a different config is refused."""
    steps: int | None = None
    """Optimizer steps to train for. None: schedule.total_steps."""
    seed: int = 0
    """Seeds model initialisation (identical on every rank), dropout (per rank) and the data
    order and masking."""
    log_every: int = 10
    """Steps between TensorBoard scalars / progress lines. Between logging steps a training
    step never waits for the GPU (no host synchronisation): losses, accuracies, gradient norms
    and skip counts stay on the device and are read once per window; a run of
    ``max_nonfinite_in_a_row`` non-finite steps is noticed at the window's end."""
    eval_every: int = 0
    """Steps between evaluations on the shards' held-out validation split (MLM loss and
    accuracy, SOP accuracy; TensorBoard ``eval/...``, status.json); 0: none."""
    diagnostics_every: int = 0
    """Steps between model diagnostics (activation factors, entropy, expert and residual
    weights, orthogonality error, TISA curves); 0 turns them off."""
    checkpoint_every: int = 1000
    """Steps between checkpoints (0: only at the end and when stopped)."""
    keep_last: int = 3
    """Complete checkpoints kept on disk (older ones are deleted after a new one is complete)."""
    time_budget_minutes: float | None = None
    """Stop (with a checkpoint) after this much wall-clock time; None: no budget."""
    max_nonfinite_in_a_row: int = 20
    """Steps skipped in a row for a non-finite loss before the run saves and stops (checked at
    the end of each logging window, checkpoint and evaluation; the skipped steps leave weights,
    optimizer and schedule as they were)."""
    time_split: bool = False
    """Log ``time/forward``, ``time/backward`` and ``time/step`` on a GPU: the device is
    synchronised 3-4 times per micro-batch to measure them, which slows training; off, they are
    logged on the CPU only (where they cost nothing). ``time/data`` and ``time/step_total`` are
    always logged."""
    export_at_end: bool = True
    """Write the release (run_dir/release) when the run reaches its last step."""
    progress: bool = True
    """A progress bar on rank 0 when stderr is a terminal; false (and in batch jobs): one plain
    log line every log_every steps."""
    fail_at_step: int | None = None
    """Testing aid: raise an error after this step (to exercise crash recovery)."""
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    """Roll back to the last good checkpoint when the loss diverges: after ``bad_steps``
    non-finite steps in a row (fewer than ``max_nonfinite_in_a_row``) or spiking logging windows
    in a row, load the newest complete checkpoint before them, skip their data, optionally
    scale the learning rate, and stop with an error after ``max_rollbacks`` (see
    ``engine/divergence.py``; TensorBoard ``divergence/*``, status.json ``rollbacks``). Off by
    default and in the debug recipes; on in the albert-* recipes (the GPU runs)."""
    inject_nonfinite_at: list[int] = field(default_factory=list)
    """Testing aid: the losses of these steps are made non-finite, once each (the first time
    the step runs in this process), to exercise the non-finite handling and the divergence
    guard on a real run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps={self.steps} is invalid; valid: >= 1 or null")
        if not isinstance(self.time_split, bool):
            raise ValueError(f"train.time_split={self.time_split!r} is invalid; valid: true, false")
        for name in ("log_every", "keep_last", "max_nonfinite_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} is invalid; valid: >= 1")
        for name in ("diagnostics_every", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} is invalid; valid: >= 0")
        if self.time_budget_minutes is not None and self.time_budget_minutes <= 0:
            raise ValueError("train.time_budget_minutes must be > 0 or null")
        if self.divergence.enabled and self.divergence.bad_steps >= self.max_nonfinite_in_a_row:
            raise ValueError(
                f"train.divergence.bad_steps={self.divergence.bad_steps} must be below "
                f"train.max_nonfinite_in_a_row={self.max_nonfinite_in_a_row} (which stops the run)"
            )


@dataclass
class PhaseConfig:
    """One phase of a multi-phase run: BERT and ALBERT train about 90% of the steps on
    sequences of 128 tokens and the rest on 512 (the attention cost grows with N^2). Phases run
    one after the other in one run: one optimizer, one learning-rate schedule
    (``schedule.total_steps`` spans all phases), one run directory; a checkpoint anywhere,
    also at a boundary, resumes exactly."""

    steps: int = 0
    """Optimizer steps of this phase (>= 1)."""
    name: str = ""
    """A label for logs and TensorBoard (default ``phase_<i>``)."""
    shards: str | None = None
    """This phase's shard directory (None: ``data.shards``). Every phase's shards must come
    from the same tokenizer."""
    max_seq_length: int | None = None
    """Tokens per example in this phase (None: ``data.max_seq_length``)."""
    micro_batch_size: int | None = None
    """Sequences per process and micro-batch in this phase (None: ``engine.micro_batch_size``);
    ``engine.gradient_accumulation_steps`` stays the same in every phase."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"phases[].steps={self.steps} is invalid; valid: >= 1")
        if self.max_seq_length is not None and self.max_seq_length < 5:
            raise ValueError(f"phases[].max_seq_length={self.max_seq_length}; valid: >= 5")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"phases[].micro_batch_size={self.micro_batch_size}; valid: >= 1")


@dataclass(frozen=True)
class Phase:
    """A phase resolved against the data and engine sections."""

    index: int
    name: str
    start: int
    """Steps done before it."""
    end: int
    """The step it ends at (exclusive of the next phase's first)."""
    shards: str
    max_seq_length: int
    micro_batch_size: int


@dataclass
class PretrainConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "debug"})
    """Encoder config (``EncoderConfig`` fields; ``preset:`` starts from a named preset).
    vocab_size and pad_token_id default to the tokenizer's. ``init_from: DIR`` (a release or a
    local HF ALBERT checkpoint) continues pretraining from its weights, with its architecture
    (see ``pretrain/init.py``)."""
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    phases: list[PhaseConfig] = field(default_factory=list)
    """Sequence-length phases (see `PhaseConfig`); empty: one phase from ``data`` and
    ``engine``. ``train.steps`` defaults to the sum of the phases' steps and may be smaller (a
    run that stops at a boundary, e.g. one job per phase)."""

    def __post_init__(self) -> None:
        if INIT_KEY in self.model:  # checked against the checkpoint when the run starts
            if not isinstance(self.model[INIT_KEY], str) or not self.model[INIT_KEY]:
                raise ValueError(f"model.{INIT_KEY} must be a directory path")
        else:
            try:
                EncoderConfig.from_dict(self.model)  # validate the section now
            except (TypeError, ValueError) as e:
                raise ValueError(f"model: {e}") from e
        if self.train.steps is None:
            self.train.steps = (
                sum(p.steps for p in self.phases) if self.phases else self.schedule.total_steps
            )
        if self.phases and self.train.steps > sum(p.steps for p in self.phases):
            raise ValueError(
                f"train.steps={self.train.steps} exceeds the phases' "
                f"{sum(p.steps for p in self.phases)} steps; add steps to the last phase"
            )

    def resolved_phases(self) -> list[Phase]:
        """The run's phases with their step ranges, shards, lengths and micro-batches."""
        given = self.phases or [PhaseConfig(steps=max(self.total_steps, 1))]
        out, start = [], 0
        for i, phase in enumerate(given):
            out.append(
                Phase(
                    index=i,
                    name=phase.name or f"phase_{i}",
                    start=start,
                    end=start + phase.steps,
                    shards=phase.shards or self.data.shards,
                    max_seq_length=phase.max_seq_length or self.data.max_seq_length,
                    micro_batch_size=phase.micro_batch_size or self.engine.micro_batch_size,
                )
            )
            start += phase.steps
        if not self.phases:  # one open-ended phase: a later run may raise train.steps
            out[0] = dataclasses.replace(out[0], end=10**18)
        return out

    def phase_at(self, step: int) -> Phase:
        """The phase the step after ``step`` steps belongs to (the last one past the end)."""
        phases = self.resolved_phases()
        return next((p for p in phases if step < p.end), phases[-1])

    @property
    def total_steps(self) -> int:
        assert self.train.steps is not None
        return self.train.steps

    def encoder_config(self, vocab_size: int, pad_token_id: int) -> EncoderConfig:
        """The model config with the tokenizer's vocabulary size and pad id filled in; a
        conflicting explicit value is an error. With ``model.init_from``: the checkpoint's
        architecture, which the tokenizer must match."""
        if INIT_KEY in self.model:
            cfg = init_encoder_config(self.model, vocab_size, pad_token_id)
            self._check_lengths(cfg)
            return cfg
        model = dict(self.model)
        for key, value in (("vocab_size", vocab_size), ("pad_token_id", pad_token_id)):
            if key in model and model[key] != value:
                raise ValueError(
                    f"model.{key}={model[key]} but the tokenizer of data.shards has {value}; "
                    f"drop model.{key} to use the tokenizer's"
                )
            model[key] = value
        cfg = EncoderConfig.from_dict(model)
        self._check_lengths(cfg)
        return cfg

    def _check_lengths(self, cfg: EncoderConfig) -> None:
        for phase in self.resolved_phases():
            if cfg.max_position_embeddings < phase.max_seq_length:
                where = f"phases[{phase.index}]." if self.phases else "data."
                raise ValueError(
                    f"{where}max_seq_length={phase.max_seq_length} exceeds "
                    f"model.max_position_embeddings={cfg.max_position_embeddings}"
                )

    def to_dict(self) -> dict[str, Any]:
        return config_dict(self)


def pretrain_config(data: dict[str, Any]) -> PretrainConfig:
    """PretrainConfig from a (recipe) dict; ``ValueError`` names the bad key."""
    return build_config(PretrainConfig, data)
