"""The engine's backends behind one interface (`engine.backends.base.Backend`): DeepSpeed
(`engine.backends.deepspeed`) and plain PyTorch (`engine.backends.torch`). `backend_class` is
the one place that maps ``engine.backend`` to one; the `Engine` asks it once, at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.backends.base import Backend
    from engine.config import EngineConfig


def backend_class(cfg: EngineConfig) -> type[Backend]:
    """The backend ``cfg.backend`` names (`engine.config.BACKENDS`; the config checked it).
    DeepSpeed's module imports DeepSpeed only when the backend starts."""
    from engine.backends.deepspeed import DeepSpeedBackend
    from engine.backends.torch import TorchBackend

    by_name = {cls.name: cls for cls in (DeepSpeedBackend, TorchBackend)}
    return by_name[cfg.backend]


__all__ = ["backend_class"]
