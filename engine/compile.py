"""Compilation: whether the encoder is compiled (``engine.compile``, ``auto`` per family and
device), compiling it (the whole encoder or each distinct layer once), the compiler's options
and caches (``engine.compile_cache_dir``), and the process-wide limits and flags TorchDynamo and
AOTAutograd need for it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from albatross import compat
from engine.config import EngineConfig, check_compile_scope
from model.forward_cache import name_forward_cache_keys


def compile_wanted(cfg: EngineConfig, model: nn.Module, device_type: str) -> bool:
    """Whether the engine compiles ``model``: ``engine.compile`` itself when true or false;
    for ``auto``, on CUDA only, not under ZeRO-3, and only when the model says its attention
    family compiles well there (``model.compile_auto``, from ``AttentionFamily.compile_auto``;
    a model without it is not compiled)."""
    if cfg.compile != "auto":
        return bool(cfg.compile)
    if device_type != "cuda" or cfg.zero3:
        return False
    return bool(getattr(model, "compile_auto", False))


def compile_encoder(
    model: nn.Module,
    backend: str = "inductor",
    mode: str = "default",
    options: dict[str, Any] | None = None,
    scope: str = "encoder",
) -> nn.Module:
    """Compiles ``model.encoder`` (or ``model`` when it has no encoder) in place with
    ``nn.Module.compile``: parameters and state-dict keys stay as they are (no ``_orig_mod.``
    prefix), so optimizers, DeepSpeed, checkpoints and releases see the same module. ``mode``:
    one of `COMPILE_MODES` (``EngineConfig.compile_mode``, which checks it; torch itself names
    the valid modes for a direct caller); ``options``: Inductor options over the mode's
    (`inductor_options`); ``scope``: `COMPILE_SCOPES` (``EngineConfig.compile_scope``):
    ``"layers"`` compiles each distinct module of the encoder's ``layer_applications()``
    instead of the encoder. Returns the encoder. With `compile_function`, the one place the
    project applies ``torch.compile``."""
    check_compile_scope(scope)
    target = getattr(model, "encoder", model)
    modules = [target]
    if scope == "layers":
        modules = distinct_layers(target)
        _allow_recompiles(len(modules))
    kwargs = _compile_kwargs(mode, options)
    _widen_autograd_cache(backend)
    # Stable keys of the forward's cache: what the compiled graphs read from it becomes part
    # of their key in AOTAutograd's cache (model.forward_cache, `forward_cache_key`).
    name_forward_cache_keys(model)
    with _named_backend(backend):
        for module in modules:
            module.compile(backend=backend, **kwargs)
    return target


def distinct_layers(encoder: nn.Module) -> list[nn.Module]:
    """The distinct layer modules of ``encoder``'s ``layer_applications()``, in the order of
    their first application (ALBERT's shared layer once). A ValueError naming
    ``engine.compile_scope`` when the module has no layers to compile."""
    applications = getattr(encoder, "layer_applications", None)
    if applications is None:
        raise ValueError(
            f"engine.compile_scope=layers: {type(encoder).__name__} has no layer_applications() "
            "to compile layer by layer; use engine.compile_scope=encoder"
        )
    return list({id(layer): layer for _, layer in applications()}.values())


COMPILES_PER_LAYER = 8
"""TorchDynamo's own recompile limit (``recompile_limit``) for one compiled function: the
variants a compiled layer may need (training and evaluation, padded batches and not, ...)."""


def _allow_recompiles(layers: int) -> None:
    """Raises TorchDynamo's per-function and total recompile limits of this process to
    `COMPILES_PER_LAYER` times ``layers`` where they are lower. Distinct layers of one class
    run one ``forward`` whose compiled entries TorchDynamo counts together, and each layer
    needs an entry of its own (the per-forward caches of the encoder are looked up by module,
    so each entry is guarded on its layer's modules): with torch's limit of 8 the ninth
    distinct layer would run eagerly, silently."""
    dynamo_config = compat.dynamo_config()
    wanted = COMPILES_PER_LAYER * layers
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, wanted)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 2 * wanted
    )


AUTOCAST_REGION_FUNCTIONS = (
    "torch.amp.autocast_mode._enter_autocast",
    "torch.amp.autocast_mode._exit_autocast",
)
"""What a ``with torch.autocast(...)`` inside a compiled region becomes in TorchDynamo's graph
(kernel attention's and TransJect's fp32 products switch autocast off so)."""


def _widen_autograd_cache(backend: str) -> None:
    """Lets AOTAutograd's cache keep two kinds of graph that torch 2.13 leaves out, so that a
    new process loads them instead of tracing and partitioning them again. Set, never unset,
    for the process; only for Inductor (the other backends have no such cache).

    * Graphs that switch autocast on or off inside (`AUTOCAST_REGION_FUNCTIONS`; kernel
      attention's warm first step on the CPU, albert-base at seq 128: 13.3 s before, 3.9 s
      with it; cold 38 s). Sound because the cache key holds what these calls depend on: each
      call's arguments (device, dtype, on or off) are constants of the hashed graph, and the
      key records the autocast state around the graph. Inductor's
      ``unsafe_marked_cacheable_functions`` is torch's way to mark a function so; added to,
      never replaced (a user's own entries stay).
    * Graphs with custom autograd Functions inside
      (``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``, torch 2.7+):
      TransJect's encoder (its gate's `PooledAt`, its eigen-state's `Bf16x3Product`; with the
      forward cache's keys by name, `model.forward_cache.forward_cache_key`, its warm first step
      15.7 -> 8.8 s). Sound because TorchDynamo traces a Function's forward and backward into
      subgraphs of the hashed graph (the higher-order operator ``autograd_function_apply``,
      pure in its inputs): a changed forward or backward is a new key (tested).
    """
    if backend != "inductor":
        return
    functorch_config, inductor_config = compat.functorch_config(), compat.inductor_config()
    marked = inductor_config.unsafe_marked_cacheable_functions
    missing = {name: torch.__version__ for name in AUTOCAST_REGION_FUNCTIONS if name not in marked}
    if missing:
        inductor_config.unsafe_marked_cacheable_functions = {**marked, **missing}
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True


def compile_function(
    fn: Callable,
    backend: str = "inductor",
    mode: str = "default",
    options: dict[str, Any] | None = None,
) -> Callable:
    """``fn`` compiled (``torch.compile``) with the encoder's backend, mode and options: for a
    function of tensors that runs beside the model, such as the pretraining objective's loss
    terms (``pretrain.objective.objective_terms``). Compiled lazily, at its first call."""
    _widen_autograd_cache(backend)
    with _named_backend(backend):
        return torch.compile(fn, backend=backend, **_compile_kwargs(mode, options))


def _compile_kwargs(mode: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """``torch.compile``'s ``mode`` alone, or, with options, the mode's Inductor options with
    ``options`` over them (torch refuses a mode and options together; it merges them the same
    way itself)."""
    if not options:
        return {"mode": None if mode == "default" else mode}
    base = {} if mode == "default" else compat.inductor_mode_options(mode)
    return {"options": {**base, **options}}


def use_compile_cache(path: str | None) -> Path:
    """Points this process's compiler caches at ``path`` (``engine.compile_cache_dir``): sets
    ``TORCHINDUCTOR_CACHE_DIR`` to it and ``TRITON_CACHE_DIR`` to its ``triton`` folder, before
    anything is compiled (Inductor reads both when it compiles; the compile workers it starts
    inherit them). ``None`` leaves torch's choice alone. Returns the cache folder in use.
    A path that cannot be created or written is a ValueError naming the key, at start-up rather
    than at the first compilation."""
    if path is None:  # where torch will put it (without creating it: nothing may compile)
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or compat.inductor_default_cache_dir()
        return Path(cache).absolute()
    folder = Path(os.path.expandvars(os.path.expanduser(path))).absolute()
    try:
        (folder / "triton").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"engine.compile_cache_dir={path!r}: cannot create {folder}: {e.strerror or e}"
        ) from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"engine.compile_cache_dir={path!r}: {folder} is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return folder


def compile_cache_counts() -> dict[str, int]:
    """Process-wide counts of Inductor's compiled graphs so far: ``loaded`` from its FX-graph
    cache, ``compiled`` (looked up and missed), ``uncached`` (not cacheable, compiled); and of
    AOTAutograd's joint graphs (forward and backward of one compiled region): ``joint_loaded``
    from its cache, ``joint_traced`` traced again (missed, or left out of the cache)."""
    counters = compat.compiler_counters()
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "loaded": int(inductor["fxgraph_cache_hit"]),
        "compiled": int(inductor["fxgraph_cache_miss"]),
        "uncached": int(inductor["fxgraph_cache_bypass"]),
        "joint_loaded": int(aot["autograd_cache_hit"]),
        "joint_traced": int(aot["autograd_cache_miss"] + aot["autograd_cache_bypass"]),
    }


@contextlib.contextmanager
def _named_backend(backend: str) -> Iterator[None]:
    """Turns torch's InvalidBackend (a RuntimeError) for an unknown backend into a ValueError
    that names the config key and the valid backends."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "InvalidBackend":
            raise
        valid = torch.compiler.list_backends(exclude_tags=())
        raise ValueError(f"engine.compile_backend={backend!r} is invalid; valid: {valid}") from e
