"""Optimizers (LAMB, AdamW) and learning-rate schedules shared by pretraining and fine-tuning.

Parameters are split into two groups: ``decay`` (matrices, embeddings) and ``no_decay`` (biases,
LayerNorm weights and every other 1-D parameter), as BERT and ALBERT do.

LAMB has five implementations, picked by ``OptimizerConfig.implementation``:

- ``"foreach"``: ``engine.lamb.Lamb``, this project's, in ``torch._foreach_*`` (multi-tensor)
  ops on any device. Per-tensor trust ratios also on DeepSpeed's flat ZeRO 1-2 partitions (the
  engine tells it where the tensors lie), and no host synchronisation (the engine can skip a
  step and keep the schedule on the device). The formula is ``pytorch_optimizer.Lamb``'s;
- ``"compiled"``: the same ``engine.lamb.Lamb`` with its arithmetic compiled by torch.compile
  (Inductor fuses the foreach operators into a few kernels; the first step of each parameter
  group compiles), with everything ``"foreach"`` has (flat ZeRO 1-2 buffers, no host
  synchronisation);
- ``"torch"``: ``pytorch_optimizer.Lamb`` (the ``pytorch-optimizer`` package, any device; pinned
  to >=3.11,<4 because 3.0 steps differently, see tests/engine/test_optim.py): the reference the
  tests compare ``"foreach"`` with. It reads every trust ratio back to the host (one
  synchronisation per tensor on a GPU);
- ``"deepspeed"``: ``deepspeed.ops.lamb.FusedLamb`` (CUDA only);
- ``"apex"``: NVIDIA apex ``apex.optimizers.FusedLAMB`` (CUDA only; NVIDIA apex is built from
  source; the PyPI package called ``apex`` is an unrelated web toolkit and is not accepted);
- ``"auto"``: ``"foreach"``.

All are configured like ALBERT's original (TensorFlow) LAMB: no Adam bias correction, weight decay
added to the update inside the trust ratio (You et al. 2019, Algorithm 2). Remaining differences:
``foreach`` and ``pytorch_optimizer.Lamb`` clamp the weight norm at 10 in the trust ratio, DeepSpeed
clamps the trust ratio to [0.01, 10], apex clips the global gradient norm at 1.0 (a no-op when the
engine already clips at <= 1.0). Gradient clipping is the engine's job, not the optimizer's. Only
``foreach`` and ``compiled`` stay per tensor on flat buffers (ZeRO 1-2); the engine refuses the
others there (``engine.engine.check_compatible``).

Example: ALBERT's pretraining recipe (Lan et al. 2020: LAMB, lr 0.00176, batch 4096, 125k steps,
3125 warmup steps, linear decay). The batch size is the engine/data config's business; the
optimizer and schedule parts are the defaults:

>>> import torch
>>> net = torch.nn.Linear(4, 4)
>>> opt_cfg = OptimizerConfig(name="lamb", lr=0.00176, weight_decay=0.01)
>>> sched_cfg = ScheduleConfig(warmup_steps=3125, total_steps=125_000, decay="linear")
>>> opt = build_optimizer(net, opt_cfg, device_type="cpu")
>>> sched = build_scheduler(opt, sched_cfg)
>>> [g["name"] for g in opt.param_groups], type(opt).__module__
(['decay', 'no_decay'], 'engine.lamb')
>>> round(lr_multiplier(3125, sched_cfg) * opt_cfg.lr, 6), lr_multiplier(125_000, sched_cfg)
(0.00176, 0.0)
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

OPTIMIZERS = ("lamb", "adamw")
LAMB_IMPLEMENTATIONS = ("auto", "foreach", "compiled", "torch", "apex", "deepspeed")
DECAYS = ("linear", "polynomial", "cosine", "constant")

# Normalization layers whose parameters are never weight-decayed, whatever their names.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


@dataclass
class OptimizerConfig:
    """Which optimizer to build and its hyperparameters (ALBERT's values are the defaults)."""

    name: str = "lamb"
    """``"lamb"`` (large-batch pretraining, ALBERT) or ``"adamw"`` (``torch.optim.AdamW``, fused on
    CUDA; the usual choice for fine-tuning)."""
    lr: float = 0.00176
    """Peak learning rate (reached at the end of warmup). ALBERT: 0.00176 at batch 4096."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/LAMB moment coefficients (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-6
    """Denominator term added to sqrt(v) for numerical stability (> 0)."""
    weight_decay: float = 0.01
    """Weight-decay coefficient for the ``decay`` group (>= 0); the ``no_decay`` group gets 0."""
    no_decay: tuple[str, ...] = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    """Substrings of parameter names excluded from weight decay (BERT's ``bias`` /
    ``LayerNorm.weight``). Parameters of normalization modules and every parameter with fewer
    than 2 dimensions are excluded too, whatever their names."""
    implementation: str = "auto"
    """LAMB implementation: ``"auto"`` (= ``"foreach"``), ``"foreach"`` (``engine.lamb.Lamb``:
    multi-tensor ops, per-tensor trust ratios also on ZeRO 1-2's flat buffers, no host
    synchronisation), ``"compiled"`` (the same, its arithmetic compiled by torch.compile into a few
    fused kernels: fewer passes over the weights and moments; the first step compiles, which needs
    Inductor's compiler: Triton on a GPU, a C++ compiler on the CPU), ``"torch"``
    (``pytorch_optimizer.Lamb``, the reference), ``"apex"`` or ``"deepspeed"`` (fused CUDA kernels;
    ZeRO-0 only; fail if not usable). Ignored by AdamW."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.name!r} is invalid; valid: {list(OPTIMIZERS)}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"optimizer.lr={self.lr!r} is invalid; valid: a number > 0")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(
            isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas
        ):
            raise ValueError(
                f"optimizer.betas={self.betas!r} is invalid; valid: two numbers in [0, 1)"
            )
        self.betas = (float(betas[0]), float(betas[1]))
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"optimizer.eps={self.eps!r} is invalid; valid: a number > 0")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(
                f"optimizer.weight_decay={self.weight_decay!r} is invalid; valid: a number >= 0"
            )
        if isinstance(self.no_decay, str) or not all(isinstance(s, str) for s in self.no_decay):
            raise ValueError(
                f"optimizer.no_decay={self.no_decay!r} is invalid; valid: a list of name substrings"
            )
        self.no_decay = tuple(self.no_decay)
        if self.implementation not in LAMB_IMPLEMENTATIONS:
            raise ValueError(
                f"optimizer.implementation={self.implementation!r} is invalid; "
                f"valid: {list(LAMB_IMPLEMENTATIONS)}"
            )
        if self.name != "lamb" and self.implementation != "auto":
            warnings.warn(
                f"optimizer.implementation={self.implementation!r} is ignored for "
                f"optimizer.name={self.name!r} (it only selects the LAMB implementation)",
                stacklevel=2,
            )


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup from 0 to the peak lr, then decay to
    ``min_lr_ratio * lr`` at ``total_steps``, held after that."""

    warmup_steps: int = 3125
    """Steps of linear warmup from 0 to the peak lr (>= 0, <= total_steps). ALBERT: 3125."""
    total_steps: int = 125_000
    """Step at which the decay reaches its end value (>= 1). ALBERT: 125000."""
    decay: str = "linear"
    """After warmup: ``"linear"``, ``"polynomial"`` (``(1 - progress) ** power``), ``"cosine"``
    (half cosine) or ``"constant"`` (hold the peak lr). ALBERT/BERT: linear."""
    power: float = 1.0
    """Exponent of the polynomial decay (> 0); 1.0 is linear (ALBERT/BERT)."""
    min_lr_ratio: float = 0.0
    """End lr as a fraction of the peak lr, in [0, 1]. Unused by ``"constant"``."""

    def __post_init__(self) -> None:
        for field_name in ("warmup_steps", "total_steps"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"schedule.{field_name}={value!r} is invalid; valid: an integer")
        if self.total_steps < 1:
            raise ValueError(
                f"schedule.total_steps={self.total_steps} is invalid; valid: an integer >= 1"
            )
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"schedule.warmup_steps={self.warmup_steps} is invalid; valid: an integer in "
                f"[0, total_steps={self.total_steps}]"
            )
        if self.decay not in DECAYS:
            raise ValueError(f"schedule.decay={self.decay!r} is invalid; valid: {list(DECAYS)}")
        if not (isinstance(self.power, (int, float)) and self.power > 0):
            raise ValueError(f"schedule.power={self.power!r} is invalid; valid: a number > 0")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(
                f"schedule.min_lr_ratio={self.min_lr_ratio!r} is invalid; valid: a number in [0, 1]"
            )
        if self.decay == "constant" and self.min_lr_ratio != 0.0:
            warnings.warn(
                "schedule.min_lr_ratio is ignored by schedule.decay='constant'", stacklevel=2
            )
        if self.decay != "polynomial" and self.power != 1.0:
            warnings.warn(
                f"schedule.power is ignored by schedule.decay={self.decay!r}", stacklevel=2
            )


# ----------------------------------------------------------------------------- parameters


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """The ``decay`` and ``no_decay`` parameter groups of ``model`` (trainable parameters only;
    shared parameters appear once). Empty groups are kept so the layout is always the same."""
    norm_params: set[int] = set()
    for module in model.modules():
        if isinstance(module, _NORM_TYPES):
            norm_params.update(id(p) for p in module.parameters(recurse=False))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        excluded = (
            p.ndim < 2 or id(p) in norm_params or any(pattern in name for pattern in cfg.no_decay)
        )
        (no_decay if excluded else decay).append(p)
    return [
        {"name": "decay", "params": decay, "weight_decay": cfg.weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------- LAMB backends


def _deepspeed_fused_lamb() -> type | None:
    try:
        return importlib.import_module("deepspeed.ops.lamb").FusedLamb
    except Exception:  # not installed, or installed without its ops: unusable either way
        return None


def _apex_fused_lamb() -> type | None:
    try:
        return importlib.import_module("apex.optimizers").FusedLAMB  # NVIDIA apex only
    except Exception:  # missing, or the unrelated PyPI `apex` web toolkit
        return None


def _torch_lamb() -> type | None:
    try:
        return importlib.import_module("pytorch_optimizer").Lamb
    except Exception:
        return None


def resolve_lamb_implementation(implementation: str, device_type: str) -> str:
    """The LAMB implementation that ``implementation`` means on ``device_type``; raises
    ``RuntimeError`` saying what is missing when an explicitly requested one is not usable."""
    cuda = device_type == "cuda"
    if implementation == "auto":
        return "foreach"
    if implementation == "deepspeed":
        if not cuda:
            raise RuntimeError(
                f"optimizer.implementation='deepspeed' needs CUDA (device_type={device_type!r}); "
                "use 'foreach' or 'auto'"
            )
        if _deepspeed_fused_lamb() is None:
            raise RuntimeError(
                "optimizer.implementation='deepspeed' but deepspeed.ops.lamb.FusedLamb is not "
                "importable: install DeepSpeed (pip install deepspeed), or use 'foreach' or 'auto'"
            )
    elif implementation == "apex":
        if not cuda:
            raise RuntimeError(
                f"optimizer.implementation='apex' needs CUDA (device_type={device_type!r}); "
                "use 'foreach' or 'auto'"
            )
        if _apex_fused_lamb() is None:
            raise RuntimeError(
                "optimizer.implementation='apex' but NVIDIA apex (apex.optimizers.FusedLAMB) is "
                "not importable: build NVIDIA apex from source with its CUDA extensions "
                "(the PyPI package named 'apex' is an unrelated web toolkit), or use 'foreach' "
                "or 'auto'"
            )
    elif implementation == "torch" and _torch_lamb() is None:
        raise RuntimeError(
            "optimizer.implementation='torch' needs the pytorch-optimizer package: "
            "pip install 'pytorch-optimizer>=3.11,<4'; or use 'foreach' or 'auto'"
        )
    return implementation


# ----------------------------------------------------------------------------- builders


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device_type: str = "cpu"
) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over ``model``'s parameters, in two groups (``decay`` then
    ``no_decay``). ``device_type`` (``"cpu"``, ``"cuda"``, ...) selects fused kernels; the model
    must already be on that device."""
    groups = param_groups(model, cfg)
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=device_type == "cuda" and torch.cuda.is_available(),
        )
    impl = resolve_lamb_implementation(cfg.implementation, device_type)
    common = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if impl in ("foreach", "compiled"):
        from engine.lamb import Lamb

        return Lamb(groups, compiled=impl == "compiled", **common)
    try:
        if impl == "deepspeed":
            cls = _deepspeed_fused_lamb()
            assert cls is not None
            return cls(groups, bias_correction=False, **common)
        if impl == "apex":
            cls = _apex_fused_lamb()
            assert cls is not None
            # adam_w_mode=True: weight decay is added to the update inside the trust ratio.
            return cls(groups, bias_correction=False, adam_w_mode=True, **common)
    except Exception as e:  # a fused kernel that imports but does not build (JIT) or load
        hint = (
            " (DeepSpeed's JIT builder cannot parse arch suffixes such as 9.0a in "
            "TORCH_CUDA_ARCH_LIST: set it to e.g. 9.0)"
            if "TORCH_CUDA_ARCH_LIST" in os.environ
            else ""
        )
        raise RuntimeError(
            f"optimizer.implementation={cfg.implementation!r}: the fused LAMB could not be "
            f"built: {type(e).__name__}: {e}{hint}; or use 'foreach' or 'auto'"
        ) from e
    cls = _torch_lamb()
    assert cls is not None
    # weight_decouple=False: decay inside the trust ratio (You et al. 2019), as apex/DeepSpeed.
    # adam_debias=True: otherwise pytorch_optimizer divides the step size by 1 - beta1**t after
    # the trust ratio, which makes early updates up to 1/(1 - beta1) = 10x larger than LAMB's.
    return cls(groups, weight_decouple=False, adam_debias=True, **common)


def lr_multiplier(step: int, cfg: ScheduleConfig) -> float:
    """The factor applied to the peak lr after ``step`` optimizer steps: ``step / warmup`` during
    warmup, then ``min + (1 - min) * f(progress)`` with ``progress`` going 0 -> 1 from the end of
    warmup to ``total_steps`` (and held at 1 after)."""
    if step < cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.decay == "linear":
        f = 1.0 - progress
    elif cfg.decay == "polynomial":
        f = (1.0 - progress) ** cfg.power
    else:  # cosine
        f = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * f


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier`; call ``scheduler.step()`` after each
    ``optimizer.step()`` (the first update uses lr 0 when there is warmup). The lambda is a plain
    function, so ``state_dict()`` holds only step counters (safe for ``weights_only`` loads)."""

    def multiplier(step: int) -> float:
        return lr_multiplier(step, cfg)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
