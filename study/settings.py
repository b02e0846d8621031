"""A user's own settings for studies: where their data sets live and which Slurm partition and
account their jobs go to. Never in a study spec (a spec is shared; paths and accounts are not).

    # ~/.config/albatross/settings.yaml (or the file $ALBATROSS_SETTINGS names)
    data:
      glue: /datasets/glue_data                 # a GLUE root (any layout finetune glue reads)
      lra: /datasets/lra_release                # the Long Range Arena release root
      albert-base-v2: /models/albert-base-v2    # a local Hugging Face ALBERT directory
      corpus-128: /data/shards-128              # pretraining shards (python -m data_prep shards)
      corpus-512: /data/shards-512
    slurm:
      partition: gpu
      account: my-project
      sbatch: {qos: normal}                     # any other sbatch option (KEY: VALUE)

On the command line, ``--data NAME=PATH`` and ``--partition`` / ``--account`` override the
file. A study names the data it needs (``scales.<scale>.data.<name>.setting``); a missing one
is an error naming the setting and both ways to give it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model.typed_config import config_from_dict

DEFAULT_FILE = Path("~/.config/albatross/settings.yaml")
ENV = "ALBATROSS_SETTINGS"


@dataclass
class SlurmSettings:
    """Where a user's jobs go."""

    partition: str | None = None
    """The partition (``sbatch --partition``); None: the cluster's default."""
    account: str | None = None
    """The account charged (``sbatch --account``); None: the user's default."""
    sbatch: dict[str, Any] = field(default_factory=dict)
    """Other sbatch options for every job, e.g. ``{qos: normal, constraint: h100}``."""


@dataclass
class Settings:
    """The settings file."""

    data: dict[str, str] = field(default_factory=dict)
    """Data set name -> local path (GLUE root, LRA release, an HF ALBERT dir, shards)."""
    slurm: SlurmSettings = field(default_factory=SlurmSettings)


def settings_path() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_FILE).expanduser()


def load_settings(
    data: list[str] = (), partition: str | None = None, account: str | None = None
) -> Settings:
    """The settings file (absent: empty settings) with the command line's ``--data NAME=PATH``,
    ``--partition`` and ``--account`` on top. ValueError naming the file on a bad one."""
    path = settings_path()
    raw: Any = {}
    if path.is_file():
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"settings file {path} is not valid YAML: {e}") from e
    elif os.environ.get(ENV):
        raise ValueError(f"${ENV}={os.environ[ENV]}: no such file")
    try:
        settings = config_from_dict(Settings, raw)
    except ValueError as e:
        raise ValueError(f"settings file {path}: {e}") from e
    for item in data:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"--data {item!r}: expected NAME=PATH (e.g. glue=/datasets/glue)")
        settings.data[name] = value
    if partition is not None:
        settings.slurm.partition = partition
    if account is not None:
        settings.slurm.account = account
    return settings
