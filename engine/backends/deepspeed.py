"""The DeepSpeed backend (``engine.backend: deepspeed``): ``deepspeed.initialize`` with ZeRO
stage 0-3, the engine's config turned into a DeepSpeed config dict (`deepspeed_config`; a
DeepSpeed JSON file and ``engine.deepspeed`` merged over it once reconciled,
`engine/ds_config.py`). Runs on CUDA (NCCL) and on CPU (gloo; DeepSpeed's CPU accelerator).

Clipping: on ZeRO-0 in fp32 / bf16-mixed the reduced gradients sit on the parameters and the
engine clips them itself (one norm, kept on the device); on ZeRO 1-2 in fp32 / bf16-mixed with
the project's LAMB the engine measures the norm on DeepSpeed's reduced partitions and the LAMB
scales the gradients as it steps (`DeepSpeedBackend.clip_flat_gradients`); elsewhere DeepSpeed
clips. Checkpoints are DeepSpeed's own files (loaded with a full unpickle: see
`engine/engine.py`), converted to a universal checkpoint to load on another world size."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch import nn

from albatross import compat
from engine.backends.base import AnyRank, Backend, State
from engine.config import EngineConfig
from engine.extensions import import_deepspeed, prepare_extensions
from engine.lamb import Lamb, attach_zero_layouts
from model.typed_config import deep_merge

if TYPE_CHECKING:
    from engine.step import StepGuard


def clips_flat(cfg: EngineConfig, optimizer: Any) -> bool:
    """True when the engine measures the gradient norm on DeepSpeed's ZeRO 1-2 partitions
    and the ``foreach`` LAMB applies the clipping (fp32 / bf16-mixed)."""
    return (
        cfg.zero_stage in (1, 2)
        and cfg.precision in ("fp32", "bf16-mixed")
        and isinstance(optimizer, Lamb)
    )


def deepspeed_config(cfg: EngineConfig, world_size: int, optimizer: Any) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` on ``world_size`` processes with ``optimizer``
    (the engine's optimizer: whether it is the project's LAMB decides who clips)."""
    flat = clips_flat(cfg, optimizer)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        # ZeRO-0 in fp32 / bf16-mixed: the gradients sit on the parameters and the engine
        # clips them itself (one norm, kept on the device), so DeepSpeed does not.
        "gradient_clipping": (
            0.0
            if DeepSpeedBackend.gradients_on_parameters(cfg) or flat
            else float(cfg.gradient_clipping)
        ),
        "zero_optimization": {"stage": cfg.zero_stage},
        # Our LAMB / AdamW are ordinary torch optimizers: ZeRO partitions their state fine.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,  # the trainer logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and step
        # (a host stall twice per step on a GPU); the trainer measures throughput itself.
        "timers": {"throughput": {"enabled": False}},
    }
    if flat:
        # ZeRO 1-2 with the foreach LAMB: the engine measures the norm (on the device) and
        # the LAMB scales the gradients; DeepSpeed's own norm check reads it on the host.
        config["zero_optimization"]["compute_grad_norm"] = False
    if cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif cfg.precision == "bf16-mixed":
        # DeepSpeed's forward turns an autocast that it did not configure OFF on CUDA
        # (deepspeed.runtime.torch_autocast.autocast_if_enabled): without this section the
        # "mixed" forward ran in fp32 on a GPU (on an H100 several times slower than a bf16
        # step). No lower-precision modules: gradients are
        # reduced in fp32, as the parameters are fp32 (the LAMB's flat layout stays one dtype).
        config["torch_autocast"] = {
            "enabled": True,
            "dtype": "bfloat16",
            "lower_precision_safe_modules": [],
        }
    elif cfg.precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": cfg.fp16_initial_scale_power,
            "loss_scale_window": cfg.fp16_loss_scale_window,
            "hysteresis": cfg.fp16_hysteresis,
            "min_loss_scale": cfg.fp16_min_loss_scale,
        }
    return deep_merge(config, cfg.deepspeed_overrides(world_size))


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO 0-3 (module docstring)."""

    name = "deepspeed"

    @classmethod
    def check_available(cls) -> None:
        try:
            import_deepspeed()
        except ImportError as e:
            raise RuntimeError(
                "engine.backend='deepspeed' but DeepSpeed is not importable "
                f"({e}); pip install deepspeed, or use engine.backend='torch'"
            ) from e

    @classmethod
    def gradients_on_parameters(cls, cfg: EngineConfig) -> bool:
        # ZeRO 1-3 partition the gradients, DeepSpeed's bf16 / fp16 modes flatten them.
        return cfg.zero_stage == 0 and cfg.precision in ("fp32", "bf16-mixed")

    def prepare(self) -> None:
        self.cfg.deepspeed_overrides(self.dist.world_size)  # a train_batch_size for another world
        # DeepSpeed JIT-builds ops in init_distributed (CPU: shm collectives) and
        # build_optimizer (CUDA: fused LAMB): never wait forever on a killed build's lock.
        prepare_extensions()

    def needs_process_group(self) -> bool:
        return True  # DeepSpeed always wants a group, even of one

    def init_process_group(self, backend: str, timeout: timedelta) -> None:
        import_deepspeed().init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, timeout=timeout, verbose=False
        )

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, guard: StepGuard) -> None:
        deepspeed = import_deepspeed()
        self.module, self.optimizer, self.guard = model, optimizer, guard
        self.lamb = optimizer if isinstance(optimizer, Lamb) else None
        # DeepSpeed's ZeRO calls an API torch deprecated, once per step: not the user's
        # business, and it would flood every log.
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
            category=FutureWarning,
        )
        self.ds, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(self.cfg, self.dist.world_size, optimizer),
            dist_init_required=False,
        )
        """The DeepSpeed engine (``deepspeed.initialize``'s)."""
        self.clips_flat = clips_flat(self.cfg, optimizer)
        if self.lamb is not None and self.cfg.zero_stage in (1, 2):
            zero_optimizer = self.ds.optimizer
            if type(zero_optimizer).__name__ == "DeepSpeedZeroOptimizer":
                self.flat_layouts = attach_zero_layouts(self.lamb, zero_optimizer)
        if self.clips_flat and not self.flat_layouts:  # DeepSpeed's clipping is off
            raise RuntimeError(
                f"ZeRO-{self.cfg.zero_stage} gave the optimizer a "
                f"{type(self.ds.optimizer).__name__}, not the DeepSpeedZeroOptimizer whose "
                "layout the LAMB reads"
            )

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], last: bool) -> Any:
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.ds.backward(loss)
        # DeepSpeed counts micro-steps in its step(), which updates only at the boundary; the
        # boundary's step() is the engine's (`step`), so the update can be vetoed.
        if not last:
            self.ds.step()

    def clip_gradients(self) -> torch.Tensor | None:
        if self.gradients_on_parameters(self.cfg):
            return self.clip_parameter_gradients()
        if self.clips_flat:
            return self.clip_flat_gradients()
        return None

    def clip_flat_gradients(self) -> torch.Tensor:
        """ZeRO 1-2 with the foreach LAMB: the global norm of the reduced gradient partitions
        (DeepSpeed's ``averaged_gradients``, summed over the data-parallel group: what its own
        norm reads), kept on the device; the LAMB scales the gradients by
        ``min(1, gradient_clipping / (norm + 1e-6))`` as it steps (DeepSpeed's formula)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for grads, group in compat.zero_reduced_gradients(self.ds.optimizer):
            squares = (
                torch.stack(compat.foreach_ops().norm(grads)).float().pow(2).sum()
                if grads
                else torch.zeros((), dtype=torch.float32, device=self.device)
            )  # every rank joins the all-reduce, with or without gradients here
            if self.collective and torch_dist.get_world_size(group) > 1:
                torch_dist.all_reduce(squares, group=group)
            total = total + squares
        norm = total.sqrt()
        if self.cfg.gradient_clipping > 0 and self.lamb is not None:
            self.lamb.grad_scale = (self.cfg.gradient_clipping / (norm + 1e-6)).clamp(max=1.0)
        return norm

    def step(self, poisoned: bool) -> tuple[float | None, bool]:
        # The engine set the guard to `poisoned`; DeepSpeed zeroes the gradients itself.
        norm = self.clip_gradients()
        grad_norm = None if norm is None else float(norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.guard.skip = True  # as DeepSpeed skips a non-finite gradient norm
        self.ds.step()
        applied = not self.guard.skip and bool(self.ds.was_step_applied())
        if grad_norm is None:
            norm = self.ds.get_global_grad_norm()
            grad_norm = None if norm is None else float(norm)
        return grad_norm, applied

    def deferred_step(
        self, ok: torch.Tensor, grad_norm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ds.step()
        if self.cfg.zero_stage > 0:  # DeepSpeed checked the norm itself (on the host)
            if not self.ds.was_step_applied():
                ok = torch.zeros_like(ok)
            norm = self.ds.get_global_grad_norm()
            if norm is not None:
                grad_norm = norm if torch.is_tensor(norm) else torch.tensor(float(norm))
        return ok, grad_norm

    def loss_scale(self) -> float:
        if self.cfg.precision != "fp16":
            return 1.0
        opt = self.ds.optimizer
        return float(getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", 1.0))

    # -- state ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        if self.cfg.zero_stage != 3:
            yield self.module
            return
        deepspeed = import_deepspeed()
        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield self.module

    def master_weights(self) -> dict[str, torch.Tensor]:
        # fp32 master weights where DeepSpeed keeps them (ZeRO 1-3, bf16, fp16).
        if self.cfg.zero_stage == 0 and self.cfg.precision not in ("bf16", "fp16"):
            return {}
        from deepspeed.utils import safe_get_full_fp32_param

        master: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:  # every rank calls this in the same order (collective)
                full = safe_get_full_fp32_param(p)
                if full is None:
                    raise RuntimeError(f"DeepSpeed returned no fp32 master weights for {name}")
                by_id[id(p)] = full.detach().float().cpu().clone()
            master[name] = by_id[id(p)]
        return master

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        self.ds.save_checkpoint(
            str(directory.parent),
            tag=directory.name,
            client_state={"albatross": extra},
            save_latest=False,
        )

    def load(self, directory: Path, universal: Path | None, any_failed: AnyRank) -> State:
        from engine import reshard

        saved_world = reshard.saved_world_size(directory)
        if saved_world is not None and saved_world != self.dist.world_size:
            return self._load_universal(directory, universal, any_failed)
        path, client = self.ds.load_checkpoint(
            str(directory.parent),
            tag=directory.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None or client is None or "albatross" not in client:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
        return client["albatross"]

    def _load_universal(
        self, directory: Path, universal: Path | None, any_failed: AnyRank
    ) -> State:
        """Collective: convert (rank 0; cached) and load ``directory`` in DeepSpeed's universal
        mode. Returns the ``"albatross"`` client state."""
        from engine import reshard

        target = reshard.universal_path(directory) if universal is None else universal
        error: Exception | None = None
        if self.dist.rank == 0:
            try:
                reshard.to_universal(directory, target)
            except Exception as exc:  # reported on every rank below, not left in a barrier
                error = exc
        failed = any_failed(error is not None)
        if error is not None:
            raise error
        if failed:
            raise reshard.ReshardError(
                f"{directory}: the conversion to a universal checkpoint failed on rank 0"
            )
        with compat.universal_checkpoint_loading(self.ds):
            path, client = self.ds.load_checkpoint(
                str(target.parent),
                tag=target.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        if self.cfg.zero_stage == 3:
            reshard.repair_zero3_load(self.ds.optimizer, target)
        if path is None or client is None or "albatross" not in client:
            raise RuntimeError(
                f"DeepSpeed could not load the universal checkpoint in {target} "
                f"(converted from {directory})"
            )
        return client["albatross"]
