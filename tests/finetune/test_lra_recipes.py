"""The LRA recipes: configs/finetune/lra/{lra,skyformer}/ and configs/pretrain/lra/.

Every recipe goes through the code path its command uses (`load_recipe` + `build_config`
for `python -m finetune lra`, `load_recipe` + `pretrain_config` for `python -m pretrain`); every
model is built at its real size with the task's vocabulary and positions (the official-LRA ones
without their random initialisation, to stay fast). The values the recipes cite from their sources are checked here, so an edit that drifts
from a source fails: see the recipes' comments for the files each number comes from.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import pytest
import torch

from engine.optim import lr_multiplier
from engine.recipe import build_config, load_recipe
from finetune.lra.run import LraConfig, build_lra_model
from finetune.lra.tasks import PAD_ID, TASKS, get_task
from model.config import EncoderConfig
from pretrain.config import pretrain_config

CONFIGS = Path(__file__).parents[2] / "configs"
PROTOCOLS = ("lra", "skyformer")
FAMILIES = ("softmax", "tisa", "kernel", "transject")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is faster than two on a busy 2-core runner
    (small solves and QRs wait on the second thread). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recipes(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.stem != "base")


FINETUNE = [p for proto in PROTOCOLS for p in _recipes(CONFIGS / "finetune" / "lra" / proto)]
PRETRAIN = _recipes(CONFIGS / "pretrain" / "lra")


@functools.cache
def _cached(path: Path) -> dict:
    return load_recipe(path)


def _load(path: Path) -> dict:
    """load_recipe(path), read once per test session (a fresh copy for each caller)."""
    return copy.deepcopy(_cached(Path(path)))


def _split(stem: str) -> tuple[str, str]:
    """'listops-kernel' -> ('listops', 'kernel'); 'listops' -> ('listops', 'softmax')."""
    task, _, family = stem.partition("-")
    return task, family or "softmax"


def _finetune(protocol: str, task: str, family: str = "softmax") -> LraConfig:
    stem = task if family == "softmax" else f"{task}-{family}"
    return build_config(LraConfig, _load(CONFIGS / "finetune" / "lra" / protocol / f"{stem}.yaml"))


def _encoder(cfg: LraConfig) -> EncoderConfig:
    task = get_task(cfg.task)
    return EncoderConfig.from_dict(
        {**cfg.model, "vocab_size": task.vocab_size, "pad_token_id": PAD_ID}
    )


def _batch(cfg: LraConfig) -> tuple[int, int]:
    """(global batch on one process, eval_every)."""
    return (
        cfg.engine.micro_batch_size * cfg.engine.gradient_accumulation_steps,
        cfg.train.eval_every,
    )


# ----------------------------------------------------------------------------- fine-tuning


def test_every_protocol_task_and_family_has_a_recipe():
    have = {(p.parent.name, *_split(p.stem)) for p in FINETUNE}
    want = {(proto, task, fam) for proto in PROTOCOLS for task in TASKS for fam in FAMILIES}
    assert have == want
    assert {_split(p.stem) for p in PRETRAIN} == {(t, f) for t in TASKS for f in FAMILIES}


@pytest.mark.parametrize("path", FINETUNE, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_finetune_recipe(path):
    task_name, family = _split(path.stem)
    data = _load(path)
    cfg = build_config(LraConfig, data)
    # `python -m finetune lra --task T` adds task=T; the recipe must already say T.
    assert cfg.task == task_name
    task = get_task(cfg.task)
    enc = _encoder(cfg)
    assert enc.attention == family
    assert enc.max_position_embeddings >= task.sequence_length(cfg.data.max_length)
    assert enc.num_hidden_groups == enc.num_hidden_layers  # no sharing: as the protocols
    assert cfg.train.run_dir == f"runs/lra/{path.parent.name}/{task_name}-{family}"
    assert (cfg.engine.backend, cfg.engine.precision, cfg.engine.device) == (
        "torch",
        "bf16-mixed",
        "auto",
    )
    assert cfg.optimizer.name == "adamw"
    assert 0 <= cfg.schedule.warmup_steps <= cfg.schedule.total_steps
    assert cfg.train.steps is None  # the schedule's total_steps
    assert 0 < cfg.train.eval_every <= cfg.schedule.total_steps
    assert (cfg.train.select, cfg.train.select_split) == ("accuracy", "val")
    if task.name in ("pathfinder", "pathx"):
        assert (cfg.data.difficulty, cfg.data.split_seed) == ("hard", 0)
    if family != "softmax":  # a family recipe changes the attention family and nothing else
        base = _load(path.parent / f"{task_name}.yaml")
        family_file = _load(CONFIGS / "model" / f"lra-{family}.yaml")
        assert data["model"] == {**base["model"], **family_file}
        changed = {k for k in data if data[k] != base.get(k)}
        # train: only its run_dir (checked above)
        assert {k for k in data["train"] if data["train"][k] != base["train"].get(k)} == {"run_dir"}
        allowed = {"model", "train"} | ({"pooling"} if family == "transject" else set())
        if (task_name, family) == ("pathx", "tisa"):
            allowed.add("engine")  # smaller micro-batches: the (H, N, N) bias at 16385 tokens
        assert changed <= allowed, changed


def test_base_files_are_only_shared_sections():
    for proto in PROTOCOLS:
        base = load_recipe(CONFIGS / "finetune" / "lra" / proto / "base.yaml")
        assert "task" not in base and "run_dir" not in base.get("train", {})
        build_config(LraConfig, base)  # a valid partial recipe
    pretrain_base = load_recipe(CONFIGS / "pretrain" / "lra" / "base.yaml")
    assert "shards" not in pretrain_base["data"] and "train" in pretrain_base
    assert "run_dir" not in pretrain_base["train"]


SKYFORMER = [p for p in FINETUNE if p.parent.name == "skyformer"]


@pytest.mark.parametrize("path", SKYFORMER, ids=lambda p: p.stem)
def test_skyformer_model_builds_at_its_real_size(path):
    cfg = build_config(LraConfig, _load(path))
    task = get_task(cfg.task)
    model = build_lra_model(cfg, None, task.sequence_length(cfg.data.max_length))
    enc = model.config
    assert enc == EncoderConfig.from_dict(
        {**_encoder(cfg).to_dict(), "max_position_embeddings": enc.max_position_embeddings}
    )
    assert (enc.hidden_size, enc.num_hidden_layers, enc.vocab_size) == (64, 2, task.vocab_size)
    assert enc.max_position_embeddings == task.sequence_length(cfg.data.max_length)
    assert model.head_config()["pooling"] == cfg.pooling
    assert sum(p.numel() for p in model.parameters()) < 1.5e6


def _no_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return tensor.zero_()


def test_lra_models_build_at_their_real_size_and_keep_lra_parameter_budget():
    """Official LRA sizes, built on CPU without their random initialisation (which only costs
    time here); LRA's apples-to-apples rule (README: at most 10% more parameters than the base
    Transformer) holds for every family."""
    for task in TASKS:
        counts = {}
        for family in FAMILIES:
            cfg = _finetune("lra", task, family)
            seq_len = get_task(task).sequence_length(cfg.data.max_length)
            with pytest.MonkeyPatch.context() as patch:
                for name in ("normal_", "uniform_", "kaiming_uniform_", "orthogonal_"):
                    patch.setattr(torch.nn.init, name, _no_init)
                model = build_lra_model(cfg, None, seq_len)
            enc = model.config
            assert (enc.hidden_size, enc.attention) == (cfg.model["hidden_size"], family)
            assert enc.max_position_embeddings >= seq_len
            counts[family] = sum(p.numel() for p in model.parameters())
        for family, n in counts.items():
            assert n <= 1.10 * counts["softmax"], (task, family, counts)


@pytest.mark.parametrize(
    ("protocol", "task", "family"),
    [
        ("skyformer", "listops", "softmax"),
        ("skyformer", "listops", "tisa"),
        ("skyformer", "listops", "kernel"),
        ("skyformer", "listops", "transject"),
        ("skyformer", "retrieval", "transject"),
        ("lra", "image", "transject"),  # cls pooling on TransJect layers
        ("lra", "pathx", "kernel"),  # head width 16
    ],
)
def test_recipe_models_run_forward(protocol, task, family):
    cfg = _finetune(protocol, task, family)
    lra_task = get_task(task)
    torch.manual_seed(0)
    model = build_lra_model(cfg, None, lra_task.sequence_length(cfg.data.max_length)).eval()
    ids = torch.randint(4, lra_task.vocab_size, (2, 12))
    ids[:, 0] = 1
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        if lra_task.pair:
            out = model(ids, mask, ids.flip(0), mask.flip(0))
        else:
            out = model(ids, mask)
    assert out.logits.shape == (2, lra_task.num_labels)
    assert torch.isfinite(out.logits).all()


# ----------------------------------------------------------------------------- sourced values

# (task) -> lr, warmup, total steps, batch, eval_every, max_length: pkuzengqi/Skyformer
# code/config.py (Path-X: Pathfinder's values, no Path-X entry exists).
SKYFORMER_VALUES = {
    "listops": (1e-4, 1000, 50000, 32, 500, 2000),
    "text": (1e-4, 80, 50000, 32, 500, 4000),
    "retrieval": (2e-4, 800, 50000, 16, 1000, 4000),
    "image": (1e-4, 175, 50000, 256, 50, 1024),
    "pathfinder": (2e-4, 312, 50000, 128, 500, 1024),
    "pathx": (2e-4, 312, 50000, 128, 500, 16384),
}


@pytest.mark.parametrize("task", list(SKYFORMER_VALUES))
def test_skyformer_values_match_the_source(task):
    lr, warmup, total, batch, eval_every, max_length = SKYFORMER_VALUES[task]
    for family in FAMILIES:
        cfg = _finetune("skyformer", task, family)
        assert cfg.optimizer.lr == pytest.approx(lr)
        assert (cfg.schedule.warmup_steps, cfg.schedule.total_steps) == (warmup, total)
        assert cfg.schedule.decay == "linear"
        assert _batch(cfg) == (batch, eval_every)
        assert cfg.data.max_length == max_length
        assert cfg.optimizer.betas == (0.9, 0.999) and cfg.optimizer.eps == 1e-6
        assert cfg.optimizer.weight_decay == 0.0
        assert cfg.seeds == [0, 1, 2]  # TransJect: mean of three runs
        enc = _encoder(cfg)
        assert (enc.hidden_size, enc.embedding_size, enc.num_hidden_layers) == (64, 64, 2)
        if family != "transject":
            assert (enc.num_attention_heads, enc.intermediate_size) == (2, 128)
            assert (enc.residual, enc.hidden_act) == ("pre_ln", "gelu")
        assert enc.hidden_dropout_prob == enc.attention_probs_dropout_prob == 0.1
        # Skyformer pools by mean; TransJect (appendix B.1) by max except on text.
        want = "max" if family == "transject" and task != "text" else "mean"
        assert cfg.pooling == want


# (task) -> hidden, layers, heads, ffn, dropout, attention dropout, pooling, batch, eval_every,
# total steps, weight decay, clipping: google-research/long-range-arena per-task configs.
LRA_VALUES = {
    "listops": (512, 6, 8, 2048, 0.1, 0.1, "cls", 32, 20, 5000, 0.1, 0.0),
    "text": (256, 4, 4, 1024, 0.1, 0.1, "cls", 32, 100, 20000, 0.1, 0.0),
    "retrieval": (128, 4, 4, 512, 0.1, 0.1, "cls", 32, 100, 5000, 0.1, 0.0),
    "image": (32, 1, 1, 64, 0.3, 0.2, "cls", 256, 175, 35000, 0.0, 0.0),
    "pathfinder": (128, 1, 4, 128, 0.2, 0.1, "mean", 512, 312, 62400, 0.0, 0.0),
    "pathx": (32, 1, 2, 32, 0.1, 0.1, "mean", 64, 2500, 500000, 0.0, 1.0),
}


@pytest.mark.parametrize("task", list(LRA_VALUES))
def test_lra_values_match_the_source(task):
    hidden, layers, heads, ffn, drop, att_drop, pooling, batch, every, total, wd, clip = LRA_VALUES[
        task
    ]
    for family in FAMILIES:
        cfg = _finetune("lra", task, family)
        enc = _encoder(cfg)
        assert (enc.hidden_size, enc.embedding_size, enc.num_hidden_layers) == (
            hidden,
            hidden,
            layers,
        )
        assert (enc.num_attention_heads, enc.intermediate_size) == (heads, ffn)
        assert (enc.hidden_dropout_prob, enc.attention_probs_dropout_prob) == (drop, att_drop)
        assert cfg.pooling == pooling
        assert _batch(cfg) == (batch, every)
        assert cfg.schedule.total_steps == total
        assert cfg.optimizer.weight_decay == wd
        assert cfg.engine.gradient_clipping == clip
        assert cfg.optimizer.betas == (0.9, 0.98) and cfg.optimizer.eps == 1e-9
        assert cfg.seeds == [0]
    assert _finetune("lra", "text").data.max_length == 1000  # the released config (paper: 4000)


def _lra_rsqrt(step: int, warmup: int) -> float:
    """LRA's "constant * linear_warmup * rsqrt_decay" with constant 0.05 (train_utils.py)."""
    return 0.05 * min(1.0, step / warmup) / math.sqrt(max(step, warmup))


@pytest.mark.parametrize(
    ("task", "warmup", "tolerance"), [("listops", 1000, 0.057), ("text", 8000, 0.035)]
)
def test_lra_rsqrt_schedule_approximation(task, warmup, tolerance):
    """The recipes' polynomial decay stays within `tolerance` x peak of LRA's rsqrt decay, as
    their comments say, and is exact in warmup and at the last step."""
    cfg = _finetune("lra", task)
    peak = 0.05 / math.sqrt(warmup)
    assert cfg.optimizer.lr == pytest.approx(peak, rel=1e-5)
    total = cfg.schedule.total_steps
    worst = 0.0
    for step in range(0, total + 1, 10):
        ours = cfg.optimizer.lr * lr_multiplier(step, cfg.schedule)
        worst = max(worst, abs(ours - _lra_rsqrt(step, warmup)) / peak)
        if step <= warmup or step == total:
            assert ours == pytest.approx(_lra_rsqrt(step, warmup), rel=1e-5, abs=1e-12)
    assert worst <= tolerance


def test_lra_retrieval_schedule_is_exact():
    """Retrieval's 8000 warmup steps outlast its 5000 steps: a plain linear ramp."""
    cfg = _finetune("lra", "retrieval")
    for step in range(0, 5001, 50):
        ours = cfg.optimizer.lr * lr_multiplier(step, cfg.schedule)
        assert ours == pytest.approx(_lra_rsqrt(step, 8000), rel=1e-5, abs=1e-12)


@pytest.mark.parametrize(
    ("task", "lr", "warmup"),
    [
        ("image", 5e-4, 175),
        ("pathfinder", 1e-3, 312),
        ("pathx", 1e-3, 2500),
    ],
)
def test_lra_image_tasks_cosine(task, lr, warmup):
    cfg = _finetune("lra", task)
    assert cfg.optimizer.lr == pytest.approx(lr)
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay) == (warmup, "cosine")


def test_family_settings():
    kernel = _encoder(_finetune("skyformer", "text", "kernel")).kernel
    assert (kernel.feature_map, kernel.num_stacked, kernel.gate_rank_divisor) == ("aoglu", 3, 4)
    assert kernel.orthogonality_penalty == 0.0 and kernel.dropout == 0.1
    transject = _encoder(_finetune("skyformer", "listops", "transject")).transject
    assert (transject.num_experts, transject.eigenvalues) == (4, "approx")
    assert transject.reconstruction_weight == pytest.approx(1e-3)
    tisa_enc = _encoder(_finetune("lra", "listops", "tisa"))
    assert tisa_enc.position_embedding == "absolute"  # the paper's main setting
    assert (tisa_enc.tisa.num_kernels, tisa_enc.tisa.scope) == (5, "per_layer")


def test_skyformer_model_sections_differ_only_in_positions():
    sections = {t: dict(_finetune("skyformer", t).model) for t in TASKS}
    positions = {t: s.pop("max_position_embeddings") for t, s in sections.items()}
    assert all(s == sections["listops"] for s in sections.values())
    shared = _load(CONFIGS / "model" / "lra-skyformer.yaml")
    assert sections["listops"] == shared
    for task, n in positions.items():
        assert n == get_task(task).sequence_length(SKYFORMER_VALUES[task][5])


# ----------------------------------------------------------------------------- self-pretraining


@pytest.mark.parametrize("path", PRETRAIN, ids=lambda p: p.stem)
def test_pretrain_recipe(path):
    task_name, family = _split(path.stem)
    task = get_task(task_name)
    cfg = pretrain_config(_load(path))
    enc = cfg.encoder_config(vocab_size=task.vocab_size, pad_token_id=PAD_ID)
    assert enc.attention == family
    # [CLS] data..., as long as the Skyformer recipe fine-tunes.
    finetune = _finetune("skyformer", task_name, family)
    assert cfg.data.max_seq_length == task.sequence_length(finetune.data.max_length)
    assert cfg.data.shards == f"runs/lra-shards/{task_name}"
    assert cfg.train.run_dir == f"runs/lra-pretrain/{task_name}-{family}"
    masking = cfg.data.masking
    assert (masking.whole_word, masking.max_ngram, masking.mlm_probability) == (False, 1, 0.5)
    assert cfg.optimizer.name == "adamw" and cfg.schedule.decay == "constant"
    assert 0 < cfg.schedule.warmup_steps < cfg.total_steps == cfg.schedule.total_steps
    assert (cfg.engine.backend, cfg.engine.precision) == ("deepspeed", "bf16-mixed")
    assert cfg.engine.micro_batch_size * cfg.engine.gradient_accumulation_steps == 32


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_pretrain_and_finetune_models_agree(task, family):
    """The release of configs/pretrain/lra/<task>-<family>.yaml is what
    configs/finetune/lra/skyformer/<task>-<family>.yaml describes, and `--init` accepts it."""
    stem = task if family == "softmax" else f"{task}-{family}"
    pre = _load(CONFIGS / "pretrain" / "lra" / f"{stem}.yaml")
    fine = _load(CONFIGS / "finetune" / "lra" / "skyformer" / f"{stem}.yaml")
    assert pre["model"] == fine["model"]
    lra_task = get_task(task)
    released = pretrain_config(pre).encoder_config(lra_task.vocab_size, PAD_ID)
    fine_cfg = build_config(LraConfig, fine)
    assert released == _encoder(fine_cfg)
    # build_lra_model's checks on a release: the task's vocabulary, enough positions.
    assert released.vocab_size == lra_task.vocab_size
    assert released.max_position_embeddings >= lra_task.sequence_length(fine_cfg.data.max_length)


# (task) -> lr, weight decay, warmup, total steps: IdoAmos/not-from-scratch
# configs/experiment/lra/transformer-lra-*-mlm.yaml (listops/text/retrieval lr: this project's
# choice, 1e-3, where the configs say 0.05; steps = epochs x training examples / batch 32).
AMOS_VALUES = {
    "listops": (1e-3, 0.0, 2000, 100 * 96000 // 32),
    "text": (1e-3, 0.1, 5000, 32 * 25000 // 32),
    "retrieval": (1e-3, 0.0, 2000, 32 * 2 * 147086 // 32),
    "image": (1e-3, 0.0, 2500, math.ceil(50 * 45000 / 32)),
    "pathfinder": (5e-4, 0.0, 2500, 250000),
    "pathx": (5e-4, 0.0, 5000, 200 * 160000 // 32),
}


@pytest.mark.parametrize("task", list(AMOS_VALUES))
def test_pretrain_values(task):
    lr, wd, warmup, total = AMOS_VALUES[task]
    for family in FAMILIES:
        stem = task if family == "softmax" else f"{task}-{family}"
        cfg = pretrain_config(_load(CONFIGS / "pretrain" / "lra" / f"{stem}.yaml"))
        assert cfg.optimizer.lr == pytest.approx(lr)
        assert cfg.optimizer.weight_decay == wd
        assert (cfg.schedule.warmup_steps, cfg.schedule.total_steps) == (warmup, total)
