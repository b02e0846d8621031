"""Per-rank state of a checkpoint: each process's RNG states (Python, numpy, torch CPU and CUDA)
and its ``rank_NNNNN.pt`` file, saved and loaded with ``weights_only`` (no pickled code)."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from albatross.files import CheckpointError, write_atomically

RANK_STATE_PATTERN = "rank_%05d.pt"
"""``%``-format of the per-rank state file inside a checkpoint directory."""


def rng_state() -> dict[str, Any]:
    """This process's RNG states, for an exact resume: Python's ``random``, numpy's global RNG,
    torch's CPU generator and (when CUDA is available) every CUDA device's generator. Holds
    only tensors, ints, floats, strings, lists, dicts and None, so it loads with
    ``torch.load(weights_only=True)``."""
    import torch

    version, internal, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(key.astype(np.int64)),  # uint32 -> int64: no uint32 tensors
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _byte_tensor(value: object, what: str) -> Any:
    import torch

    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.ndim == 1):
        raise ValueError(f"malformed RNG state: {what} must be a 1-D uint8 tensor")
    return value.cpu()


def _parse_rng_state(state: dict[str, Any]) -> tuple[tuple, tuple, Any, list[Any] | None]:
    """Check ``state`` completely (nothing is applied on a malformed dict) and convert it."""
    import torch

    if not isinstance(state, dict) or any(k not in state for k in ("python", "numpy", "torch")):
        raise ValueError("malformed RNG state: needs a dict with 'python', 'numpy', 'torch'")
    try:
        py, npy = state["python"], state["numpy"]
        python_state = (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"])
        key = npy["key"]
        key = np.asarray(key.cpu().numpy() if isinstance(key, torch.Tensor) else key)
        numpy_state = (
            str(npy["kind"]),
            key,
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed RNG state: {type(exc).__name__}: {exc}") from None
    if len(python_state[1]) != len(random.getstate()[1]):
        raise ValueError("malformed RNG state: python state has the wrong length")
    if python_state[2] is not None and not isinstance(python_state[2], float):
        raise ValueError("malformed RNG state: python gauss_next must be a float or None")
    if (
        numpy_state[0] != "MT19937"
        or key.shape != (624,)
        or key.dtype.kind not in "iu"
        or key.min() < 0
        or key.max() >= 2**32
    ):
        raise ValueError("malformed RNG state: numpy state must be MT19937 with 624 uint32 words")
    numpy_state = (numpy_state[0], key.astype(np.uint32), *numpy_state[2:])
    cpu = _byte_tensor(state["torch"], "'torch'")
    if cpu.numel() != torch.get_rng_state().numel():
        raise ValueError("malformed RNG state: 'torch' has the wrong size")
    cuda = state.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, (list, tuple)):
            raise ValueError("malformed RNG state: 'cuda' must be a list of tensors")
        cuda = [_byte_tensor(s, f"'cuda'[{i}]") for i, s in enumerate(cuda)]
    return python_state, numpy_state, cpu, cuda


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned. A CUDA part is applied when CUDA is available (to the
    devices both runs have, with a warning when the counts differ) and ignored with a warning
    otherwise. Raises ``ValueError`` for a malformed dict, before changing any generator."""
    import torch

    python_state, numpy_state, cpu, cuda = _parse_rng_state(state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is None:
        return
    if not torch.cuda.is_available():
        warnings.warn("the saved CUDA RNG state is ignored: CUDA is not available", stacklevel=2)
        return
    count = torch.cuda.device_count()
    if len(cuda) != count:
        warnings.warn(
            f"the saved CUDA RNG state has {len(cuda)} devices, this process sees {count}; "
            f"restoring the first {min(count, len(cuda))}",
            stacklevel=2,
        )
    for device, device_state in enumerate(cuda[:count]):
        torch.cuda.set_rng_state(device_state, device)


def rank_state_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """``directory/rank_00003.pt`` for rank 3."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r} is invalid; valid: an integer >= 0")
    return Path(directory) / (RANK_STATE_PATTERN % rank)


def save_rank_state(directory: str | os.PathLike[str], rank: int, state: dict[str, Any]) -> Path:
    """``torch.save`` one rank's own state (RNG, loader position, ...) into a checkpoint
    directory, atomically (tmp file + fsync + ``os.replace``). Keep it to tensors and plain
    Python containers so it loads with ``weights_only=True``. Returns the file's path."""
    import torch

    if not isinstance(state, dict):
        raise ValueError(f"rank state must be a dict, got {type(state).__name__}")
    path = rank_state_path(directory, rank)
    write_atomically(path, lambda f: torch.save(state, f))
    return path


def load_rank_state(directory: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """The state ``save_rank_state`` wrote for ``rank``, loaded with ``weights_only=True`` onto
    the CPU. Raises ``CheckpointError`` naming the file when it is missing or unreadable."""
    import torch

    path = rank_state_path(directory, rank)
    if not path.is_file():
        raise CheckpointError(path, "is missing (was the checkpoint saved with this rank?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(path, f"cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a dict")
    return state
