"""A run started by an earlier version resumes under today's code when all that differs are
config fields added since at their default (pretrain/setup.py): the default of a new field
keeps the old behaviour, so it changes nothing; the same field at another value is a real change
and is refused, naming it. (tests/pretrain/test_previous_version.py resumes a real pinned run.)"""

from __future__ import annotations

import copy

import pytest
import yaml

from model.config import EncoderConfig
from pretrain.config import pretrain_config
from pretrain.setup import CONFIG_FILE, check_run_dir


def resolved_config() -> dict:
    cfg = pretrain_config(
        {"model": {"preset": "debug", "attention": "transject"}, "data": {"shards": "/data/shards"}}
    )
    resolved = cfg.to_dict()
    resolved["model"] = EncoderConfig.preset(
        "debug", attention="transject", vocab_size=300
    ).to_dict()
    return resolved


def saved_run(tmp_path, saved: dict):
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(saved))
    return tmp_path


def test_fields_added_since_at_their_default_resume(tmp_path):
    now = resolved_config()
    old = copy.deepcopy(now)
    del old["model"]["transject"]["residual_stream"]  # a field the earlier version lacked
    del old["model"]["kernel"]  # a whole section added since
    del old["engine"]["deepspeed_config"]
    assert check_run_dir(saved_run(tmp_path, old), now) is True


def test_a_field_added_since_at_another_value_is_refused(tmp_path):
    now = resolved_config()
    old = copy.deepcopy(now)
    del old["model"]["transject"]["residual_stream"]
    now["model"]["transject"]["residual_stream"] = "changed"
    with pytest.raises(ValueError, match=r"model\.transject\.residual_stream"):
        check_run_dir(saved_run(tmp_path, old), now)


def test_a_changed_field_is_refused(tmp_path):
    now = resolved_config()
    old = copy.deepcopy(now)
    old["model"]["hidden_size"] = now["model"]["hidden_size"] * 2
    with pytest.raises(ValueError, match=r"model\.hidden_size"):
        check_run_dir(saved_run(tmp_path, old), now)
