"""The pretraining loop: loader -> engine (DeepSpeed / PyTorch) -> checkpoints, TensorBoard,
release.

Order of work, so that bad input fails before anything expensive or irreversible happens:
config (typed, validated) -> data (manifest, tokenizer, checksums) -> run directory (a different
config there is refused) -> process group and engine -> resume from the newest usable
checkpoint -> steps -> release.

Every rank runs this same code; rank 0 alone writes TensorBoard, the config and the release.
The loop itself (resume, status.json, trackers, stop requests, the cadences of logging,
evaluation and checkpoints) is ``engine.loop.RunLoop``, which fine-tuning runs too; the
``Trainer`` is the stage it drives: one optimizer step, its logging window, the validation, and
what a checkpoint holds of it.
A checkpoint (``engine/checkpoint.py`` for the directory protocol) holds:

    step_00000100/
      <DeepSpeed's files>           model, optimizer (partitioned under ZeRO), loss scaler
      rank_00000.pt, rank_00001.pt  per rank: RNG states, loader position, counters, schedule
      release/                      consolidated fp32 weights + config + tokenizer (a release)
      universal/                    only after a resume on another number of processes (ZeRO
                                    1-3): DeepSpeed's universal checkpoint, a cached conversion
      COMPLETE.json                 written last; lists every file with its size

Exit: the run returns a ``RunResult``; ``state`` is ``"completed"``, ``"stopped"`` (signal or
time budget; a checkpoint was saved, re-run the same command to resume) or raises.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import resource
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from albatross.files import write_atomically
from albatross.writer_lock import DirectoryBusy, one_writer_collectively
from data_prep.format import ShardError
from data_prep.loader import PretrainingLoader, validation_batches
from data_prep.masking import masking_budget
from engine import checkpoint as ckpt
from engine.distributed import detect
from engine.engine import DeferredStep, Engine, shutdown
from engine.loop import Health, LoopConfig, RunLoop, Stage
from engine.metrics import mfu, peak_flops
from engine.recipe import to_yaml
from engine.trackers import Trackers
from model import diagnostics
from model.config import EncoderConfig
from model.flops import counts_flops, training_flops
from model.heads import EncoderForPretraining
from model.hub.release import export_release, save_release
from pretrain.config import (
    RELEASE_DIR,
    Phase,
    PretrainConfig,
)
from pretrain.init import INIT_KEY, InitReport, load_init
from pretrain.objective import (
    PretrainingLoss,
    model_inputs,
    objective_terms,
    pretraining_loss,
)
from pretrain.setup import (  # re-exported: the run's setup, result and errors
    CONFIG_FILE,
    STATUS_FILE,
    NonFiniteLossError,
    RunResult,
    SetupError,
    check_run_dir,
    data_identity,
    nonfinite_message,
    open_phases,
    open_validation,
    rank_seed,
    resume_accumulation,
)

log = logging.getLogger("pretrain")

TIMED = ("data", "forward", "backward", "step")
"""The parts of a step the logging window times (``time/<part>``)."""


@dataclass
class TrainStep:
    """One optimizer step as ``Trainer._train_step`` ran it: the engine's result (device
    values nobody has read), the last micro-batch (for diagnostics), and its counts."""

    deferred: DeferredStep
    batch: dict[str, torch.Tensor]
    tokens: int
    """Tokens (not padding) of the step, all ranks."""
    samples: int
    """Sequences of the step, all ranks."""
    flops: float
    """Training FLOPs of the step, all ranks (0 for a family without a count)."""
    micro_batches: int
    """This rank's micro-batches."""


@dataclass
class LogWindow:
    """What the steps since the last logging step add up. Loss parts, counts and gradient
    norms stay on the training device and are read once, at the logging step (with the skip
    counters): no host synchronisation between. Timers and counts are the host's."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    timers: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMED, 0.0))
    steps: int = 0
    micro_batches: int = 0
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def add(self, done: TrainStep) -> None:
        """Counts one step in (its losses and counts are in ``sums`` already)."""
        self.steps += 1
        self.micro_batches += done.micro_batches
        self.tokens += done.tokens
        self.samples += done.samples
        self.flops += done.flops
        if done.deferred.grad_norm is not None:
            norm = done.deferred.grad_norm.detach().to(torch.float64)
            self.sums["grad_norm"] = (
                norm if "grad_norm" not in self.sums else self.sums["grad_norm"] + norm
            )


# ---------------------------------------------------------------------------- the run


class Trainer(Stage):
    """One pretraining run on this rank. ``Trainer(cfg).run()``."""

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.dist = detect()
        self.rank = self.dist.rank
        self.run_dir = Path(cfg.train.run_dir)
        # Everything that can be wrong with the input is checked before the process group.
        self.phases = cfg.resolved_phases()
        self.datas, self.tokenizer = open_phases(cfg, self.rank)
        self.data = self.datas[0]
        self.valid_datas = open_validation(cfg) if cfg.train.eval_every else []
        self._valid_batches: dict[int, list[dict[str, torch.Tensor]]] = {}
        self.last_eval: dict[str, float] = {}
        self.model_cfg: EncoderConfig = cfg.encoder_config(
            self.data.vocab_size, self.data.special.pad
        )
        resolved = cfg.to_dict()
        resolved["model"] = {k: v for k, v in self.model_cfg.to_dict().items()}
        resolved["data"]["tokenizer"] = str(self.tokenizer)
        resolved["data_identity"] = data_identity(
            self.datas, self.tokenizer, cfg.model.get(INIT_KEY), cfg.engine.deepspeed_config
        )
        self.resolved = resolved
        self.resuming = check_run_dir(self.run_dir, resolved)
        self.accumulation = cfg.engine.gradient_accumulation_steps
        """Micro-batches per optimizer step on this world size: the config's, or what keeps
        the checkpoint's global batch when resuming on another number of processes."""
        if self.resuming:
            self.accumulation = resume_accumulation(cfg, self.run_dir, self.dist)

        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        model = EncoderForPretraining(self.model_cfg)
        self.init_report: InitReport | None = None
        if INIT_KEY in cfg.model and not self.resuming:  # a resume loads its checkpoint instead
            self.init_report = load_init(model, cfg.model)
        # resolved(): the DeepSpeed file (engine.deepspeed_config) was checked against the
        # recipe's accumulation; a resume on another number of processes changes it.
        engine_cfg = dataclasses.replace(
            cfg.engine.resolved(), gradient_accumulation_steps=self.accumulation
        )
        self.engine = Engine(model, engine_cfg, cfg.optimizer, cfg.schedule, self.dist)
        # The loss terms compiled with the encoder: fused, they read the bf16 logits a few
        # times instead of upcasting them and passing over them in fp32 op by op.
        self.objective_terms = self.engine.compile_beside(objective_terms)
        self._configured_lrs = [
            group.get("initial_lr", group["lr"]) for group in self.engine.optimizer.param_groups
        ]
        """The schedule's base learning rates as configured (a rollback may scale them)."""
        self._faults = set(cfg.train.inject_nonfinite_at)
        torch.manual_seed(rank_seed(cfg.train.seed, self.rank))  # dropout differs per rank
        self.phase = self.phases[0]
        self.loader = self._make_loader(self.phase)
        self.store = ckpt.CheckpointStore(
            self.run_dir / "checkpoints",
            rank=self.rank,
            world_size=self.dist.world_size,
            keep_last=cfg.train.keep_last,
            barrier=self.engine.barrier,
        )
        self.step = 0
        self.tokens = 0
        self.samples = 0
        self.skipped = 0
        self.nonfinite_in_a_row = 0
        self._pending: torch.Tensor | None = None
        """Device: (steps skipped, non-finite steps in a row at the end, most in a row) since
        the host last read them (``_resolve_counters``)."""
        self._worst_run = 0  # the most non-finite steps in a row the host has seen, unhandled
        self.diag_model: EncoderForPretraining | None = None
        self.is_main = self.rank == 0
        self.count_flops = counts_flops(self.model_cfg)
        if not self.count_flops and self.is_main:
            warnings.warn(
                f"attention={self.model_cfg.attention!r} gives no FLOP count (its "
                "AttentionFamily has no mixing_flops / layer_flops): throughput/mfu is not "
                "logged",
                stacklevel=2,
            )
        # The run, as the loop's stage: its window, the last step and what the run produced.
        self._batches: Iterator[dict[str, torch.Tensor]] = iter(())
        self._window = LogWindow()
        self._last_step: DeferredStep | None = None
        self._last_batch: dict[str, torch.Tensor] = {}
        self._peak: float | None = None
        self.last: dict[str, float] = {}
        """The last logged averages (``loss/mlm``, ...)."""
        self.release: Path | None = None

    def _make_loader(self, phase: Phase) -> PretrainingLoader:
        """A fresh loader over ``phase``'s data (its position: the phase's first batch)."""
        accumulation = self.engine.cfg.gradient_accumulation_steps
        return PretrainingLoader(
            self.datas[phase.index],
            phase.micro_batch_size,
            rank=self.rank,
            world_size=self.dist.world_size,
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.engine.device.type == "cuda",
            # Epochs end on optimizer-step boundaries, so a resume on another number of
            # processes gives every step the examples an uninterrupted run gives it.
            global_batch_size=phase.micro_batch_size * accumulation * self.dist.world_size,
            group_by_length=self.cfg.data.length_grouping(),
        )

    # -- checkpoints -------------------------------------------------------------------------

    def _rank_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "samples": self.samples,
            "skipped": self.skipped,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "phase": self.phase.index,
            "loader": self.loader.state_dict(),
            "rng": ckpt.rng_state(),
        }

    def save_state(self, staging: Path, reason: str) -> dict[str, Any]:
        """Collective (``RunLoop.save_checkpoint``): engine state, per-rank state and a
        consolidated release into the checkpoint's staging directory; returns its metadata."""
        self._resolve_counters()
        self.engine.save(staging)
        ckpt.save_rank_state(staging, self.rank, self._rank_state())
        weights = self.engine.consolidated_state_dict()
        if self.is_main:
            save_release(
                staging / RELEASE_DIR,
                self.engine.module,
                tokenizer_file=self.tokenizer,
                state_dict=weights,
                extra={"step": self.step, "tokens": self.tokens},
            )
        return {
            "reason": reason,
            "world_size": self.dist.world_size,
            "tokens": self.tokens,
            "zero_stage": self.cfg.engine.zero_stage,
            "backend": self.cfg.engine.backend,
            "micro_batches_per_step": self.engine.cfg.gradient_accumulation_steps
            * self.dist.world_size,
            "gradient_accumulation_steps": self.engine.cfg.gradient_accumulation_steps,
        }

    def restore_state(self, path: Path, record: dict[str, Any]) -> None:
        """Loads a checkpoint (the loop's resume); on another number of processes than
        ``record``'s the engine re-partitions the state (`engine.reshard`), every rank
        continues the data at rank 0's global position, and dropout is reseeded per rank (it
        cannot match an uninterrupted run's anyway)."""
        self.engine.load(path)
        elastic = int(record["world_size"]) != self.dist.world_size
        state = ckpt.load_rank_state(path, 0 if elastic else self.rank)
        # The phase of the next step. A checkpoint at a phase's last step holds that phase's
        # loader position: the next phase starts at its own first batch.
        self.phase = self.cfg.phase_at(int(state["step"]))
        self.loader = self._make_loader(self.phase)
        if int(state.get("phase", 0)) == self.phase.index:
            self.loader.load_state_dict(state["loader"], elastic=elastic)
        if elastic:
            seed = int(
                np.random.SeedSequence(
                    [self.cfg.train.seed, self.rank, int(state["step"])]
                ).generate_state(1)[0]
            )
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
        else:
            ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.samples = int(state["samples"])
        self.skipped = int(state["skipped"])
        self.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])

    # -- validation --------------------------------------------------------------------------

    def evaluate(self, writer: Trackers) -> dict[str, float]:
        """Collective. MLM loss and accuracy and SOP loss and accuracy on the current phase's
        fixed validation batches (the same examples and masks every time, each rank its own
        share), summed over ranks; logged as ``eval/...`` at this step. Eval mode, no
        gradients, no draw from the training RNG streams."""
        start = time.perf_counter()
        phase = self.phase
        if phase.index not in self._valid_batches:
            self._valid_batches[phase.index] = validation_batches(
                self.valid_datas[phase.index],
                phase.micro_batch_size,
                max_batches=self.cfg.data.validation_batches,
                rank=self.rank,
                world_size=self.dist.world_size,
            )
        batches = self._valid_batches[phase.index]
        # The fewest batches any rank has: every rank runs as many forwards (collective
        # under ZeRO-3).
        (fewest,) = self.engine.all_reduce_max([-float(len(batches))])
        sums = torch.zeros(6, dtype=torch.float64, device=self.engine.device)
        self.engine.train(False)
        with torch.no_grad():  # summed on the device, read once
            for cpu_batch in batches[: int(-fewest)]:
                batch = self.engine.to_device(cpu_batch)
                inputs = model_inputs(batch, self.max_masked(phase))
                out = self.engine.forward(**inputs)
                loss = pretraining_loss(out, batch, self.objective_terms)
                c = {k: v.double() for k, v in loss.counts.items()}
                sums += torch.stack(
                    [
                        loss.parts["mlm"].double() * c["mlm_total"],
                        c["mlm_total"],
                        c["mlm_correct"],
                        loss.parts["sop"].double() * c["sop_total"],
                        c["sop_total"],
                        c["sop_correct"],
                    ]
                )
        self.engine.train(True)
        mlm_sum, mlm_n, mlm_ok, sop_sum, sop_n, sop_ok = (
            self.engine.all_reduce_mean(sums) * self.dist.world_size
        ).tolist()
        values = {
            "eval/loss/mlm": mlm_sum / max(mlm_n, 1.0),
            "eval/accuracy/mlm": mlm_ok / max(mlm_n, 1.0),
            "eval/masked_tokens": mlm_n,
            "eval/seconds": time.perf_counter() - start,
        }
        if sop_n:
            values["eval/loss/sop"] = sop_sum / sop_n
            values["eval/accuracy/sop"] = sop_ok / sop_n
        writer.scalars(self.step, values)
        self.last_eval = {"step": float(self.step), **values}
        return values

    # -- logging -----------------------------------------------------------------------------

    def diagnostics(self, writer: Trackers, batch: dict[str, torch.Tensor]) -> None:
        """Collective (weights are consolidated); rank 0 computes on a fp32 copy of the model,
        so the training model, its hooks and its partitions are not touched."""
        weights = self.engine.consolidated_state_dict()
        if not self.is_main:
            return
        if self.diag_model is None:
            # Built under a forked RNG: its initialisation must not draw from the global
            # stream, or dropout after the first diagnostics would depend on whether the run
            # was resumed since (the copy is built anew after a resume).
            with torch.random.fork_rng(devices=[]):
                self.diag_model = EncoderForPretraining(self.model_cfg).eval()
        model = self.diag_model
        model.load_state_dict(weights)
        ids = batch["input_ids"][:8].cpu()
        mask = batch["attention_mask"]  # None: no padding (Engine.to_device)
        mask = torch.ones_like(ids) if mask is None else mask[:8].cpu()
        writer.scalars(self.step, diagnostics.scalars(model, ids, mask))
        for tag, figure in diagnostics.family_figures(model).items():
            writer.figure(tag, figure, self.step)

    # -- the stage the loop drives (engine/loop.py) ----------------------------------------------

    def run(self) -> RunResult:
        """The run, as the run directory's one writer (a second job in it is refused:
        ``albatross.writer_lock``): the resolved config into the run directory (a fresh run), then
        ``engine.loop.RunLoop`` (resume, steps, evaluations, checkpoints, stop requests,
        status.json); rank 0 says how it ended."""
        with one_writer_collectively(
            self.run_dir, "pretraining run", self.is_main, self.engine.any_rank
        ):
            return self._run()

    def _run(self) -> RunResult:
        if self.is_main and not self.resuming:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(
                self.run_dir / CONFIG_FILE,
                lambda f: f.write(to_yaml(self.resolved).encode()),
                "the run's config",
            )
        self.engine.barrier()
        train = self.cfg.train
        outcome = RunLoop(
            self,
            LoopConfig(
                name="pretrain",
                run_dir=self.run_dir,
                total_steps=self.cfg.total_steps,
                trackers=train,
                tracker_config=self.resolved,
                log_every=train.log_every,
                eval_every=train.eval_every,
                eval_at_end=bool(train.eval_every),
                checkpoint_every=train.checkpoint_every,
                checkpoint_at_end=True,
                time_budget_minutes=train.time_budget_minutes,
                status_file=STATUS_FILE,
                progress_tty=None if train.progress else False,
                divergence=train.divergence,
            ),
        ).run()
        release, reason = self.release, outcome.reason
        if self.is_main:
            message = (
                f"pretrain: {outcome.state} at step {self.step}"
                + (f" ({reason}); re-run the same command to resume" if reason else "")
                + (f"; release in {release}" if release else "")
            )
            log.info(message)
            print(message, flush=True)
        return RunResult(outcome.state, self.step, self.run_dir, release, self.last, reason)

    def begin(self, loop: RunLoop) -> None:
        """What the run is (rank 0), the data iterator, the first logging window."""
        if self.is_main:
            self._announce(loop)
        self._peak = peak_flops(self.engine.device, _compute_dtype(self.cfg))
        self._batches = iter(self.loader)
        self._window = LogWindow()
        self.engine.train()

    def _announce(self, loop: RunLoop) -> None:
        cfg = self.cfg
        loop.say(
            f"pretrain: {self.model_cfg.attention} encoder, "
            f"{sum(p.numel() for p in self.engine.module.parameters()):,} parameters, "
            f"{self.dist.world_size} process(es) on {self.engine.device.type}, "
            f"global batch {self.engine.global_batch_size}, ZeRO-{cfg.engine.zero_stage}, "
            f"{cfg.engine.precision}, backend {cfg.engine.backend}; "
            + (f"resumed from {loop.resumed_from}" if loop.resumed_from else "fresh start")
        )
        if self.init_report is not None:
            loop.say(f"pretrain: {self.init_report.summary()}")
        if self.engine.hooks_summary is not None:
            loop.say(f"pretrain: {self.engine.hooks_summary}")
        if self.engine.compiled:
            loop.say(
                "pretrain: encoder and loss terms compiled "
                f"(engine.compile={str(cfg.engine.compile).lower()}, "
                f"{cfg.engine.compile_backend}, mode {cfg.engine.compile_mode}, "
                f"scope {cfg.engine.compile_scope}"
                + (f", options {cfg.engine.compile_options}" if cfg.engine.compile_options else "")
                + "): the first "
                "steps pay the compilation (tens of seconds per family: docs/benchmarks.md) unless "
                f"the compiler's cache has it ({self.engine.compile_cache}); "
                "engine.compile=false turns it off"
            )
        elif cfg.engine.compile == "auto":
            loop.say(
                "pretrain: encoder not compiled (engine.compile=auto compiles only on a "
                "GPU, for attention families measured to gain there)"
            )
        if not self.resuming and loop.trackers is not None:
            loop.trackers.text("config", "```\n" + to_yaml(self.resolved) + "\n```", self.step)

    def train_step(self, loop: RunLoop) -> None:
        """One optimizer step (``_train_step``), on the next phase's data where one begins;
        its counts go to the host's counters and the logging window."""
        if self.step >= self.phase.end:  # the next phase: its data, its first batch
            self.phase = self.cfg.phase_at(self.step)
            self.loader = self._make_loader(self.phase)
            self._batches = iter(self.loader)
            if self.is_main:
                loop.say(
                    f"pretrain: step {self.step}: phase {self.phase.name} "
                    f"({self.phase.max_seq_length} tokens, micro-batch "
                    f"{self.phase.micro_batch_size}, until step {self.phase.end})"
                )
        done = self._train_step(self._batches, self._window)
        self._faults.discard(self.step + 1)  # each injected fault fires once
        self.step += 1
        self.tokens += done.tokens
        self.samples += done.samples
        self._window.add(done)
        self._track(done.deferred)
        self._last_step, self._last_batch = done.deferred, done.batch

    def log_step(self, loop: RunLoop) -> dict[str, float]:
        assert loop.trackers is not None and self._last_step is not None
        self.last = self._log(loop.trackers, self._last_step, self._window)
        self._window = LogWindow()
        return {
            "mlm": self.last.get("loss/mlm", math.nan),
            "lr": self._last_step.lr,
            "tok/s": self.last.get("throughput/tokens_per_s", 0.0),
        }

    def evaluate_now(self, loop: RunLoop) -> None:
        assert loop.trackers is not None
        evaluation = self.evaluate(loop.trackers)
        if self.is_main:
            loop.say(
                f"pretrain: step {self.step}: validation mlm "
                f"{evaluation['eval/loss/mlm']:.4f} "
                f"(accuracy {evaluation['eval/accuracy/mlm']:.3f}), "
                f"{evaluation['eval/seconds']:.1f} s"
            )

    def after_step(self, loop: RunLoop, checkpoint_due: bool) -> None:
        """Diagnostics at their cadence; the non-finite counters, read at logging steps and
        before checkpoints (the device skipped the bad steps already): too many bad steps in a
        row save a checkpoint and raise ``NonFiniteLossError``; ``train.fail_at_step``."""
        train = self.cfg.train
        if train.diagnostics_every and self.step % train.diagnostics_every == 0:
            assert loop.trackers is not None
            self.diagnostics(loop.trackers, self._last_batch)
        if checkpoint_due:  # the checkpoint holds the host's counters: read them now
            self._resolve_counters()
        if self._worst_run >= train.max_nonfinite_in_a_row:
            path = loop.save_checkpoint("non-finite loss")
            raise NonFiniteLossError(
                nonfinite_message(
                    self._worst_run, self.step, self.skipped, path, self.engine.compiled
                )
            )
        if train.fail_at_step is not None and self.step == train.fail_at_step:
            raise RuntimeError(f"train.fail_at_step={self.step}: failing on purpose")

    def health(self) -> Health:
        """The window ``log_step`` just read (engine.loop's divergence guard)."""
        return Health(self.last.get("loss/total", math.nan), self.nonfinite_in_a_row)

    def skip_data(self, steps: int) -> None:
        """After a rollback: the data continues ``steps`` optimizer steps further on, and the
        counters of the diverged stretch are dropped."""
        self._batches = iter(self.loader)
        for _ in range(steps * self.engine.cfg.gradient_accumulation_steps):
            next(self._batches)
        self._window = LogWindow()
        self._pending = None
        self._worst_run = 0

    def scale_learning_rate(self, factor: float) -> None:
        """The schedule's base learning rates: the configured ones times ``factor`` (host
        scheduler, the optimizer's groups, and what the device-side schedule multiplies)."""
        sched = self.engine.scheduler
        sched.base_lrs = [lr * factor for lr in self._configured_lrs]
        position = max(sched.last_epoch, 0)
        for group, base, fn in zip(
            self.engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
        ):
            group["initial_lr"] = base
            group["lr"] = base * fn(position)

    def complete(self, loop: RunLoop, checkpoint: Path | None) -> None:
        """The release of the last checkpoint (``train.export_at_end``, rank 0)."""
        if self.cfg.train.export_at_end and self.is_main and checkpoint is not None:
            self.release = export_release(checkpoint / RELEASE_DIR, self.run_dir / RELEASE_DIR)

    def status(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "skipped_steps": self.skipped,
            "last": self.last,
            "validation": self.last_eval or None,
            "release": None if self.release is None else str(self.release),
        }

    def max_masked(self, phase: Phase) -> int | None:
        """The MLM head's slots per row (``pretrain.objective.model_inputs``): the masking
        budget of a full-length row, which no row exceeds; None in the loader's static mode
        (the batches bring their own ``masked_positions``)."""
        masking = self.cfg.data.masking
        if masking.static_masked_positions is not None:
            return None
        return masking_budget(phase.max_seq_length, masking)

    def _train_step(
        self, batches: Iterator[dict[str, torch.Tensor]], window: LogWindow
    ) -> TrainStep:
        """One optimizer step, without a host synchronisation: the losses and counts are added
        to ``window.sums`` on the device, the engine decides skips there
        (``step(defer=True)``), the host counts come from the CPU batch. ``train.time_split``
        synchronises around forward, backward and step to time them (on a GPU; on the CPU they
        are timed anyway)."""
        engine = self.engine
        sync = _synchronizer(engine.device) if self.cfg.train.time_split else _no_sync
        max_masked = self.max_masked(self.phase)
        sums, timers = window.sums, window.timers
        tokens = samples = micro = 0
        flops = 0.0
        batch: dict[str, torch.Tensor] = {}
        for _ in range(self.engine.cfg.gradient_accumulation_steps):
            t0 = time.perf_counter()
            cpu_batch = next(batches)  # time/data: the wait for the batch and its copy only
            batch = engine.to_device(cpu_batch)
            sync()
            t1 = time.perf_counter()
            out = engine.forward(**model_inputs(batch, max_masked))
            loss = pretraining_loss(out, batch, self.objective_terms)
            if self.step + 1 in self._faults:  # train.inject_nonfinite_at: a testing aid
                loss = _poisoned(loss)
            sync()
            t2 = time.perf_counter()
            engine.backward(loss.total, defer=True)
            sync()
            t3 = time.perf_counter()
            # Counts from the CPU batch, in numpy: host data, no device involved.
            b, n = cpu_batch["input_ids"].shape
            masked = int(np.count_nonzero(cpu_batch["mlm_labels"].numpy() != -100))
            tokens += int(cpu_batch["attention_mask"].numpy().sum())
            samples += b
            micro += 1
            if self.count_flops:
                flops += training_flops(self.model_cfg, n, masked_tokens=max(1, masked // b)) * b
            timers["data"] += t1 - t0
            timers["forward"] += t2 - t1
            timers["backward"] += t3 - t2
            for name, value in {**loss.parts, **loss.counts}.items():
                value = value.detach().to(torch.float64)  # stays on the device
                sums[name] = value if name not in sums else sums[name] + value
        t0 = time.perf_counter()
        result = engine.step(defer=True)
        sync()
        timers["step"] += time.perf_counter() - t0
        world = engine.world_size
        return TrainStep(result, batch, tokens * world, samples * world, flops * world, micro)

    def _track(self, result: DeferredStep) -> None:
        """Adds a step's skip and non-finite flags to the pending device counters."""
        skipped = result.skipped.to(torch.float64)
        bad = result.nonfinite_loss.to(torch.float64)
        pending = self._pending
        if pending is None:  # (skipped, run at the end, longest run), continuing the host's run
            pending = torch.zeros(3, dtype=torch.float64, device=bad.device)
            if self.nonfinite_in_a_row:
                pending[1].add_(float(self.nonfinite_in_a_row))
        run = (pending[1] + 1.0) * bad
        self._pending = torch.stack([pending[0] + skipped, run, torch.maximum(pending[2], run)])

    def _resolve_counters(self, values: list[float] | None = None) -> None:
        """Pending device counters -> the host's (``values``: already read, the three counters
        and the engine's schedule position, else they are read here: one synchronisation), and
        the engine's schedule brought to the device's count."""
        position = self.engine.unsynced_schedule
        if values is None and (self._pending is not None or position is not None):
            parts = [] if self._pending is None else [self._pending.to(torch.float64)]
            if position is not None:
                parts.append(position.to(parts[0].device if parts else position.device))
            values = torch.cat([t.to(torch.float64).reshape(-1) for t in parts]).tolist()
        values = list(values or [])
        if self._pending is not None:
            skipped, run, longest = values[:3]
            values = values[3:]
            self._pending = None
            self.skipped += round(skipped)
            self.nonfinite_in_a_row = round(run)
            self._worst_run = max(self._worst_run, round(longest))
        self.engine.sync_schedule(round(values[0]) if position is not None and values else None)

    def _log(self, writer: Trackers, result: DeferredStep, window: LogWindow) -> dict[str, float]:
        """Averages over the logging window and over ranks -> TensorBoard (rank 0). The device
        sums and the skip counters are read in one go."""
        elapsed = time.perf_counter() - window.start
        steps, sums = window.steps, window.sums
        device = self.engine.device
        names = sorted(sums)
        parts = [sums[n].to(device=device, dtype=torch.float64).reshape(1) for n in names]
        # The skip counters and the schedule position are the same on every rank: their mean
        # is themselves. One read for everything.
        if self._pending is not None:
            parts.append(self._pending.to(device))
        position = self.engine.unsynced_schedule
        if position is not None:
            parts.append(position.to(device=device, dtype=torch.float64).reshape(1))
        averaged = self.engine.all_reduce_mean(torch.cat(parts)).tolist()
        avg = dict(zip(names, averaged[: len(names)]))
        self._resolve_counters(averaged[len(names) :])
        if avg.get("mlm_dropped", 0.0) > 0:
            raise RuntimeError(
                f"the MLM head decoded {self.max_masked(self.phase)} positions per row, but some "
                "row had more masked tokens (its masking budget should bound them): a bug"
            )
        micro = max(float(window.micro_batches), 1.0)
        values: dict[str, float | None] = {}
        counts = ("mlm_correct", "mlm_total", "mlm_dropped", "sop_correct", "sop_total")
        for name, total in avg.items():
            if name in (*counts, "grad_norm"):
                continue
            values[f"loss/{name}"] = total / micro
        values["loss/total"] = sum(v for k, v in values.items() if v is not None)
        values["accuracy/mlm"] = avg["mlm_correct"] / max(avg["mlm_total"], 1.0)
        values["accuracy/sop"] = avg["sop_correct"] / max(avg["sop_total"], 1.0)
        values["optim/lr"] = result.lr
        values["optim/grad_norm"] = avg.get("grad_norm", 0.0) / max(steps, 1)
        values["optim/loss_scale"] = result.loss_scale
        values["optim/skipped_steps"] = float(self.skipped)
        if len(self.phases) > 1:
            values["train/phase"] = float(self.phase.index)
            values["train/max_seq_length"] = float(self.phase.max_seq_length)
        values["throughput/tokens_per_s"] = window.tokens / elapsed
        values["throughput/samples_per_s"] = window.samples / elapsed
        values["throughput/tokens_seen"] = float(self.tokens)
        # Without synchronisation a GPU's forward / backward / step times would be the host's
        # launch times: logged on the CPU, and on a GPU with train.time_split.
        timed = ("data", "forward", "backward", "step")
        if device.type == "cuda" and not self.cfg.train.time_split:
            timed = ("data",)
        for name in timed:
            values[f"time/{name}"] = window.timers.get(name, 0.0) / max(steps, 1)
        values["time/step_total"] = elapsed / max(steps, 1)
        values["memory/cpu_max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if device.type == "cuda":
            values["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            values["memory/cuda_max_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        achieved = None
        if self.count_flops:
            achieved = mfu(window.flops / elapsed / self.engine.world_size, self._peak)
        if achieved is not None:
            values["throughput/mfu"] = achieved
        writer.scalars(self.step, values)
        return {k: float(v) for k, v in values.items() if v is not None}


def _poisoned(loss: PretrainingLoss) -> PretrainingLoss:
    """``loss`` made non-finite (``train.inject_nonfinite_at``)."""
    nan = torch.tensor(float("nan"), device=loss.total.device)
    return dataclasses.replace(
        loss,
        total=loss.total * nan,
        parts={name: value * nan for name, value in loss.parts.items()},
    )


def _no_sync() -> None:
    return None


def _synchronizer(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _compute_dtype(cfg: PretrainConfig) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16}.get(cfg.engine.precision, torch.bfloat16)


def run(cfg: PretrainConfig) -> RunResult:
    """Pretraining on this process (one rank of the job), the one entry every launcher uses
    (``python -m pretrain``, the Slurm launcher): checks, trains, leaves the process group.
    Raises ``SetupError`` when the config, the data or the run directory are wrong (nothing
    was trained or written)."""
    try:
        try:
            trainer = Trainer(cfg)  # checks data, run dir and config before any training
        except (ValueError, ShardError) as e:
            raise SetupError(str(e)) from e
        try:
            return trainer.run()
        except DirectoryBusy as e:  # a second job in the same run directory
            raise SetupError(str(e)) from e
    finally:
        shutdown()
