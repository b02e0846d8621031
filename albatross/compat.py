"""Every private name of torch, DeepSpeed or Python the project uses, in one place.

Each is something no public API offers (the reason is given where it is used); each was checked
against the versions in `CHECKED` (`tests/albatross/test_compat.py` names them and fails when the
installed ones are not among them, and greps the packages for a private name used anywhere
else). An upgrade of torch or DeepSpeed is checked here, not across a dozen files. It sits
below every package (it imports nothing of the project), so the model, which may not import the
engine, takes its one private name from here too (`orthogonal_parametrization`).

Imports torch and DeepSpeed lazily: the commands' exit (`engine.process_exit`) uses this module
without loading either.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

CHECKED = {"torch": ("2.11", "2.13"), "deepspeed": ("0.19",), "python": ("3.10", "3.11", "3.12")}
"""The versions (major.minor) every function here was checked against."""


# ----------------------------------------------------------------------------- torch's compiler


def dynamo_config() -> Any:
    """``torch._dynamo.config`` (``recompile_limit``, ``accumulated_recompile_limit``)."""
    from torch._dynamo import config

    return config


def inductor_config() -> Any:
    """``torch._inductor.config`` (its keys: ``engine.compile_options``;
    ``unsafe_marked_cacheable_functions``)."""
    from torch._inductor import config

    return config


def functorch_config() -> Any:
    """``torch._functorch.config`` (``autograd_cache_allow_custom_autograd_functions``, 2.7+)."""
    from torch._functorch import config

    return config


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor options a ``torch.compile`` mode stands for."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode)


def inductor_default_cache_dir() -> str:
    """Where Inductor caches compiled graphs when ``TORCHINDUCTOR_CACHE_DIR`` is not set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def compiler_counters() -> Any:
    """TorchDynamo's process-wide counters (the FX-graph and AOTAutograd cache hits)."""
    from torch._dynamo.utils import counters

    return counters


# ----------------------------------------------------------------------------- torch's optimizers


def foreach_ops() -> SimpleNamespace:
    """torch's multi-tensor ops (``torch._foreach_*``, those torch's own optimizers use): the
    foreach LAMB's and the flat gradient norm's building blocks."""
    import torch

    names = ("add_", "addcmul_", "div", "mul_", "norm", "sqrt")
    return SimpleNamespace(**{n: getattr(torch, f"_foreach_{n}") for n in names})


def set_scheduler_step_count(scheduler: Any, count: int) -> None:
    """What ``count`` calls of ``scheduler.step()`` leave in its private counter (a scheduler
    brought to the device's step count without stepping it)."""
    scheduler._step_count = count


def wrap_optimizer_step(optimizer: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Replaces ``optimizer.step`` on this instance only (the class untouched) by
    ``wrap(optimizer.step)``: the engine's veto of an update DeepSpeed steps around."""
    optimizer.step = wrap(optimizer.step)


# ----------------------------------------------------------------------------- torch.distributed


def all_gather_with_autograd(part: Any, group: Any) -> Any:
    """All ranks' ``part`` concatenated along dim 0, differentiable: its backward is a
    reduce-scatter that sums (torch's functional collectives)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_single_autograd(part, 0, group))


# ----------------------------------------------------------------------------- DeepSpeed ZeRO 1-2


def zero_reduced_gradients(zero: Any) -> Iterator[tuple[list[Any], Any]]:
    """Per parameter group of a ZeRO stage 1/2 optimizer: its reduced gradient partitions
    (``averaged_gradients``, without DeepSpeed's alignment padding) and the group's
    data-parallel process group."""
    for i in range(len(zero.bit16_groups)):
        grads = [
            g
            for g in (zero.averaged_gradients.get(i) or [])
            if not getattr(g, "_zero_padding", False)
        ]
        yield grads, zero.real_dp_process_group[i]


def zero_partitions(zero: Any) -> Iterator[tuple[Any, Any, list[Any], list[Any], list[Any]]]:
    """Per parameter group of a ZeRO stage 1/2 optimizer: (this rank's flat fp32 partition,
    the data-parallel group, every rank's bit16 partition, the offsets and the shapes of the
    group's tensors in its flat buffer)."""
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        yield (
            flat,
            zero.real_dp_process_group[i],
            zero.parallel_partitioned_bit16_groups[i],
            zero.round_robin_bit16_offsets[i],
            zero.round_robin_bit16_meta[i],
        )


# ----------------------------------------------------------------------------- DeepSpeed's engine


@contextlib.contextmanager
def universal_checkpoint_loading(ds_engine: Any) -> Iterator[None]:
    """Inside, ``ds_engine.load_checkpoint`` reads a universal checkpoint (its config's
    ``load_universal_checkpoint``, which the public config only sets at start-up)."""
    config = ds_engine._config
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


@contextlib.contextmanager
def spawned_process_pools(module: Any) -> Iterator[None]:
    """Inside, ``module.ProcessPoolExecutor`` starts its workers with ``spawn``."""
    original = module.ProcessPoolExecutor
    module.ProcessPoolExecutor = functools.partial(
        original, mp_context=multiprocessing.get_context("spawn")
    )
    try:
        yield
    finally:
        module.ProcessPoolExecutor = original


DEEPSPEED_GROUPS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                    "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP")  # fmt: skip
DEEPSPEED_GROUP_CACHES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                          "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
                          "_ALL_TO_ALL_GROUP")  # fmt: skip


def forget_deepspeed_groups() -> None:
    """Forgets the process groups ``deepspeed.utils.groups`` cached (a later engine in the same
    process joins a new group instead of failing on a destroyed one)."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in DEEPSPEED_GROUPS:
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in DEEPSPEED_GROUP_CACHES:
        cached = getattr(groups, name, None)
        if isinstance(cached, dict):
            cached.clear()


# ----------------------------------------------------------------------------- Python


@contextlib.contextmanager
def module_hidden(name: str) -> Iterator[None]:
    """Inside, ``import <name>`` raises ImportError (``sys.modules[name] = None``), unless it is
    imported already."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]


def run_exit_handlers() -> None:
    """Runs the ``atexit`` handlers now, as the interpreter's exit would."""
    import atexit

    atexit._run_exitfuncs()


def orthogonal_parametrization() -> tuple[type, Any]:
    """torch's orthogonal parametrisation module and its map enum (``_Orthogonal``,
    ``_OrthMaps``): ``model.orthogonal.FP32Orthogonal`` subclasses it to evaluate the map in
    fp32 with its own Cayley inverse."""
    from torch.nn.utils.parametrizations import _OrthMaps, _Orthogonal

    return _Orthogonal, _OrthMaps
