"""The engine's settings (`EngineConfig`, the ``engine`` section of every recipe) and their checks,
with no I/O: backends, precisions, ZeRO, batch layout, compilation, the fast paths. The
engine itself: `engine/engine.py`."""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engine import ds_config

BACKENDS = ("deepspeed", "torch")
PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
"""``torch.compile``'s modes (``EngineConfig.compile_mode``)."""

COMPILE_SCOPES = ("encoder", "layers")
"""What ``engine.compile`` compiles as one graph (``EngineConfig.compile_scope``)."""


def check_compile_scope(scope: str) -> None:
    """A ValueError naming ``engine.compile_scope`` unless ``scope`` is one of `COMPILE_SCOPES`."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(
            f"engine.compile_scope={scope!r} is invalid; valid: " + ", ".join(COMPILE_SCOPES)
        )


@dataclass
class EngineConfig:
    """How the model is trained across processes: backend, ZeRO, precision, batch layout."""

    backend: str = "deepspeed"
    """``"deepspeed"`` (ZeRO 0-3) or ``"torch"`` (plain PyTorch; DDP across processes)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 (data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
    3 (+ parameters). ``backend="torch"`` accepts only 0."""
    precision: str = "bf16-mixed"
    """``"fp32"``, ``"bf16-mixed"`` (autocast, fp32 weights), ``"bf16"`` (DeepSpeed bf16 weights
    with fp32 master copies) or ``"fp16"`` (dynamic loss scaling; CUDA only)."""
    micro_batch_size: int = 32
    """Sequences per process per forward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Global batch = micro_batch_size x this x processes."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    activation_checkpointing: bool = False
    """Recompute each layer application in backward (torch non-reentrant checkpoint); memory
    then grows with depth by one hidden state per layer application instead of all
    activations. Works with shared layers and ZeRO-3."""
    compile: bool | Literal["auto"] = False
    """``torch.compile`` the model's encoder (``model.encoder``; the model itself when it has
    none) in place, before training, and in pretraining the objective's loss terms beside it
    (``pretrain.objective.objective_terms``, through ``Engine.compile_beside``: fused, they
    read the bf16 MLM logits a few times where the eager terms upcast them and pass over them
    in fp32 operator by operator: docs/benchmarks.md#the-loss-terms-compiled); the heads stay
    eager and state-dict keys do not change.
    Every attention family compiles without graph breaks, with activation checkpointing too.
    Shapes: batches padded to a fixed length (the pretraining loader's ``static_shapes``, on
    with ``data.masking.static_masked_positions``) compile once; batches padded to their longest
    example (fine-tuning) recompile once, at the second length, with dynamic shapes, then not
    again. Eval mode and no-grad (evaluation) compile one more graph. Unused parameters (e.g.
    the pooler under mean pooling) get zero gradients instead of None. What a model's step
    hooks evaluate before each training forward (TransJect's orthogonal maps,
    ``model.orthogonal_step_cache``) runs eagerly before the compiled encoder and enters its
    graph as inputs: the Cayley maps run as the eager block inverse, not as the LU solve a
    traced map would be.
    Not with ZeRO-3. ``auto``: compile where it was measured to pay, i.e. on a GPU, for an
    attention family whose ``AttentionFamily.compile_auto`` is true (every shipped family, each
    measured faster compiled on a GPU, the first step paying the compilation:
    docs/benchmarks.md#compiled-against-eager; a family added from outside runs eager until
    measured), never on CPU (where it gains too little to pay for the compile: the same
    section) nor under ZeRO-3; what the ALBERT recipes set. A run prints what it resolved to."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend: ``"inductor"`` (generates fused kernels), or a debugging
    backend such as ``"aot_eager"`` (traces forward and backward, runs them eagerly: isolates
    a compiler problem from a tracing one; the tests use it, inductor's C++ build being slow)."""
    compile_mode: str = "default"
    """``torch.compile``'s ``mode`` for Inductor: ``"default"``; ``"max-autotune-no-cudagraphs"``
    (Inductor times candidate kernels for each matrix product, Triton templates among them, and
    may fuse the element-wise work around a product into it: a longer first compilation,
    minutes per family on a GPU); ``"max-autotune"`` (the same with CUDA graphs);
    ``"reduce-overhead"`` (CUDA graphs, which cut the launch cost of small kernels but keep a
    static copy of every input and output). Only ``default`` has been measured with this
    engine on a GPU; the CUDA-graph modes have not run with it (DeepSpeed's hooks and the
    orthogonal maps evaluated before the graph are untested under them). Any other value than
    ``default`` needs ``compile_backend: inductor``."""
    compile_options: dict[str, Any] = field(default_factory=dict)
    """Inductor options (keys of ``torch._inductor.config``, as ``torch.compile(options=...)``
    takes them) applied over ``compile_mode``'s, for the encoder and the loss terms alike. A
    dotted key may be written nested: ``{triton: {cudagraphs: true}}`` is
    ``triton.cudagraphs``. For instance ``{max_autotune_gemm: true}`` autotunes the matrix
    products only (cuBLAS against Inductor's Triton templates, each timed with the element-wise
    work after it fused into the template, such as a bias and GELU), without the tuning of
    every other kernel (pointwise configurations, coordinate descent) that
    ``max-autotune-no-cudagraphs`` adds: that mode did not finish compiling ALBERT-base on an
    H100 (docs/benchmarks.md#the-recipes-compiled). An unknown key or a value of the wrong type
    is refused at start-up, naming the key. Needs ``compile_backend: inductor``. A resumed run
    may change it."""
    compile_scope: str = "encoder"
    """What is compiled as one graph. ``"encoder"``: the whole encoder, every layer application
    unrolled (embeddings to pooler), so its compilation grows with the depth. ``"layers"``:
    each distinct layer module on its own, compiled once and reused by every application of it
    (ALBERT's shared layer: once, whatever the depth); the rest of the encoder (embeddings, the
    per-forward work such as TISA's scores or TransJect's maps, the pooler) runs eagerly. A new
    process's first step compiles much faster, the more so the deeper the model; later steps
    run about as fast, a little slower with activation checkpointing (the recomputation runs
    the compiled layer again instead of inside the compiled backward), with less peak memory
    at depth (measured on the CPU: docs/benchmarks.md#at-depth-each-layer-once; not on a
    GPU). Distinct layers (``num_hidden_groups`` > 1, as TransJect's recipes) are each
    compiled (alike, their graphs come from Inductor's cache after the first); the engine
    raises TorchDynamo's recompile limits of the process to 8 per distinct layer, so that none
    runs eagerly for want of room. A resumed run may change it."""
    compile_cache_dir: str | None = None
    """Where the compiler keeps what it has compiled, for the next process to load instead of
    compiling again: Inductor's compiled graphs (its FX-graph and AOTAutograd caches) and
    Triton's GPU kernels (in ``<dir>/triton``). Null: torch's own place, which is
    ``TORCHINDUCTOR_CACHE_DIR`` when that is set and otherwise a folder under ``/tmp`` of each
    machine, so a run that starts on another node (a requeued or resumed Slurm job, the next
    phase, each GLUE task) compiles everything again. A path (``~`` and ``$VARS`` expanded;
    created if missing) on storage that every node sees lets those runs load the graphs: the
    same model, shapes, options and torch version load them, anything else compiles and adds
    its own. A new process's first step, cold against warm, on the CPU:
    docs/benchmarks.md#across-processes-the-compilers-cache (not measured on a GPU). Every
    process of the run points its
    compiler there at start-up (the environment variables ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` of the
    process, which this overrides); a path that cannot be created or written is refused at
    start-up. Nothing in it is ever deleted by the project: it grows with each new model or
    torch version, and may be removed whole at any time. A resumed run may change it."""
    device: str = "auto"
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``."""
    fp16_initial_scale_power: int = 16
    """fp16: the initial loss scale is 2 ** this."""
    fp16_loss_scale_window: int = 1000
    """fp16: steps without overflow before the loss scale doubles."""
    fp16_hysteresis: int = 2
    """fp16: overflows tolerated before the loss scale is lowered (DeepSpeed)."""
    fp16_min_loss_scale: float = 1.0
    """fp16: the loss scale never goes below this."""
    dist_timeout_minutes: float = 30.0
    """Timeout of collective operations (process-group init and every collective)."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config merged over the generated one (and over ``deepspeed_config``'s
    file), e.g. ``{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}``. Keys this
    config sets (batch sizes, clipping, precision, ZeRO stage) may repeat its values or be
    ``"auto"``; a different value is an error (``engine/ds_config.py``)."""
    deepspeed_config: str | None = None
    """A DeepSpeed config file (JSON, e.g. a tuned ``ds_config.json``) merged over the generated
    config, with ``deepspeed`` over it. ``"auto"`` values take the recipe's; keys that
    contradict the recipe (batch sizes, gradient clipping, ZeRO stage, bf16 / fp16 vs
    ``precision``, optimizer and scheduler sections with values) are one error listing each
    with both values (``engine/ds_config.py``). ``backend="deepspeed"`` only."""

    def __post_init__(self) -> None:
        _choice("engine.backend", self.backend, BACKENDS)
        _choice("engine.precision", self.precision, PRECISIONS)
        _choice("engine.device", self.device, DEVICES)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"engine.zero_stage={self.zero_stage!r} is invalid; valid: 0, 1, 2, 3")
        if self.backend == "torch" and self.zero_stage != 0:
            raise ValueError(
                f"engine.zero_stage={self.zero_stage} needs engine.backend='deepspeed' "
                "(the torch backend is plain data parallel)"
            )
        if self.backend == "torch" and self.precision == "bf16":
            raise ValueError(
                "engine.precision='bf16' (bf16 weights + fp32 master copies) is DeepSpeed's "
                "mode; with engine.backend='torch' use 'bf16-mixed'"
            )
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine.{name}={value!r} is invalid; valid: an integer >= 1")
        if not (isinstance(self.gradient_clipping, (int, float)) and self.gradient_clipping >= 0):
            raise ValueError(
                f"engine.gradient_clipping={self.gradient_clipping!r} is invalid; valid: >= 0"
            )
        if self.dist_timeout_minutes <= 0:
            raise ValueError("engine.dist_timeout_minutes must be > 0")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise ValueError(
                f"engine.compile={self.compile!r} is invalid; valid: true, false, auto"
            )
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(
                f"engine.compile_backend={self.compile_backend!r} is invalid; valid: a "
                "torch.compile backend name such as 'inductor' or 'aot_eager'"
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"engine.compile_mode={self.compile_mode!r} is invalid; valid: "
                + ", ".join(COMPILE_MODES)
            )
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(
                f"engine.compile_mode={self.compile_mode!r} needs engine.compile_backend="
                f"inductor (got {self.compile_backend!r}): the modes are Inductor's"
            )
        check_compile_scope(self.compile_scope)
        inductor_options(self)  # checks engine.compile_options now: a typo fails at start-up
        cache = self.compile_cache_dir
        if cache is not None and (not isinstance(cache, str) or not cache.strip()):
            raise ValueError(
                f"engine.compile_cache_dir={cache!r} is invalid; valid: a directory path, or "
                "null for torch's own cache folder"
            )
        if self.compile is True and self.zero3:
            raise ValueError(
                "engine.compile=true with engine.zero_stage=3 is not supported: ZeRO-3 "
                "gathers parameters in hooks on every submodule, where the compiled encoder "
                "breaks its graph (27 graphs for the debug model instead of 1), so compiling "
                "gains nothing. Use zero_stage 0-2 (ALBERT-size models gain little from "
                "ZeRO-3) or engine.compile=false"
            )
        if not isinstance(self.deepspeed, dict):
            raise ValueError(
                f"engine.deepspeed={self.deepspeed!r} is invalid; valid: a mapping of DeepSpeed "
                "config keys"
            )
        if self.deepspeed_config is not None:
            if not isinstance(self.deepspeed_config, str) or not self.deepspeed_config:
                raise ValueError(
                    f"engine.deepspeed_config={self.deepspeed_config!r} is invalid; valid: the "
                    "path of a DeepSpeed config JSON file, or null"
                )
            if self.backend != "deepspeed":
                raise ValueError(
                    f"engine.deepspeed_config={self.deepspeed_config!r} needs "
                    f"engine.backend='deepspeed' (it is {self.backend!r})"
                )
        # The file read and reconciled with this config now: a conflict fails at start-up.
        self._deepspeed_extra = ds_config.resolve(self)

    def deepspeed_overrides(self, world_size: int | None = None) -> dict[str, Any]:
        """What ``deepspeed_config`` (the file) and ``deepspeed`` add to the generated DeepSpeed
        config, reconciled with this config (``engine/ds_config.py``). ``world_size``: checks a
        given ``train_batch_size`` against micro-batch x accumulation x processes (ValueError)
        and leaves it out; without it, a given ``train_batch_size`` stays in."""
        extra = copy.deepcopy(self._deepspeed_extra)
        if world_size is not None and "train_batch_size" in extra:
            value = extra.pop("train_batch_size")
            want = self.micro_batch_size * self.gradient_accumulation_steps * world_size
            if value != want:
                raise ValueError(
                    f"the DeepSpeed config's train_batch_size={value} vs "
                    f"engine.micro_batch_size x engine.gradient_accumulation_steps x processes "
                    f"= {self.micro_batch_size} x {self.gradient_accumulation_steps} x "
                    f"{world_size} = {want}: set the batch layout in the recipe, or write "
                    '"auto" in the DeepSpeed config'
                )
        return extra

    def resolved(self) -> EngineConfig:
        """This config with the DeepSpeed file folded into ``deepspeed`` (already reconciled):
        a copy that does not read the file again, e.g. to change the accumulation for a resume
        on another number of processes (``dataclasses.replace`` of it)."""
        return dataclasses.replace(
            self, deepspeed_config=None, deepspeed=self.deepspeed_overrides()
        )

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO-3: parameters partitioned over the ranks (gathered in hooks)."""
        return self.backend == "deepspeed" and self.zero_stage == 3

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward runs under ``torch.autocast`` in, or None."""
        if self.precision == "bf16-mixed":
            return torch.bfloat16
        if self.precision == "fp16" and self.backend == "torch":
            return torch.float16
        return None


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is invalid; valid: {list(valid)}")


def inductor_options(cfg: EngineConfig) -> dict[str, Any]:
    """``engine.compile_options`` as flat Inductor option names (nested mappings joined with
    dots, as OmegaConf's dotted overrides nest them), each checked against
    ``torch._inductor.config``: an unknown key (with the nearest known ones) or a value of the
    wrong type is a ValueError naming ``engine.compile_options``."""
    options = cfg.compile_options
    if not isinstance(options, dict):
        raise ValueError(
            f"engine.compile_options={options!r} is invalid; valid: a mapping of Inductor "
            "options (torch._inductor.config keys), e.g. {max_autotune_gemm: true}"
        )
    if not options:
        return {}
    if cfg.compile_backend != "inductor":
        raise ValueError(
            f"engine.compile_options needs engine.compile_backend=inductor (got "
            f"{cfg.compile_backend!r}): the options are Inductor's"
        )
    import difflib

    from albatross import compat

    inductor_config = compat.inductor_config()
    known = inductor_config.get_config_copy()
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix not in known:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        name = prefix.replace("-", "_")
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ValueError(
                f"engine.compile_options: {prefix!r} is not an Inductor option "
                f"(torch._inductor.config){hint}"
            )
        get_type = getattr(inductor_config, "get_type", None)  # older torch: no type check
        expected = get_type(name) if get_type is not None else None
        plain = isinstance(expected, type) and typing.get_origin(expected) is None
        if plain and not isinstance(value, expected):
            raise ValueError(
                f"engine.compile_options: {prefix}={value!r} is a {type(value).__name__}; "
                f"Inductor wants a {expected.__name__}"
            )
        flat[name] = value

    walk("", options)
    return flat
