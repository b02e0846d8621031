"""The encoder core: config validation, sharing schedule, residual styles, the attention contract
for every registered family, orthogonal caching, activation checkpointing, heads, release."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from model import (
    ATTENTION_REGISTRY,
    EncoderConfig,
    EncoderForDualClassification,
    EncoderForPretraining,
    EncoderForSequenceClassification,
)
from model.attention import LayerContext
from model.attention.softmax import SoftmaxKernel, naive_softmax_attention
from model.hub.release import load_release, save_release
from model.orthogonal import FP32Orthogonal, orthogonal_modules, orthogonality_error

FAMILIES = ATTENTION_REGISTRY.names()


def tiny(attention: str = "softmax", **kw) -> EncoderConfig:
    kw.setdefault("hidden_dropout_prob", 0.0)
    if attention == "kernel":
        kw.setdefault("kernel", {"dropout": 0.0})
    return EncoderConfig.preset("debug", attention=attention, **kw)


def batch(B=3, N=9, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    for row in range(1, B):
        mask[row, N - 2 - 3 * row :] = False  # a different amount of padding per row
    return ids, mask


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention": "sofmax"}, "unknown attention 'sofmax'"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "not divisible"),
        ({"hiden_size": 32}, "did you mean 'hidden_size'"),
        ({"residual": "postln"}, "residual"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
        ({"num_hidden_groups": 3, "num_hidden_layers": 2}, "num_hidden_groups"),
        ({"tisa": {"scope": "global"}}, "tisa.scope"),
        ({"kernel": {"feature_map": "relu"}}, "kernel.feature_map"),
        ({"transject": {"num_expert": 2}}, "did you mean 'num_experts'"),
        ({"hidden_size": "32"}, "hidden_size must be an integer"),
        ({"orthogonal": "yes"}, "orthogonal must be true or false"),
    ],
)
def test_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        EncoderConfig.preset("debug", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'albert-huge'"):
        EncoderConfig.preset("albert-huge")


@pytest.mark.parametrize(
    "name", ["debug", "albert-base", "albert-large", "albert-base-48", "albert-base-96"]
)
def test_presets_roundtrip_through_json(name):
    cfg = EncoderConfig.preset(name, attention="tisa", tisa={"scope": "per_layer"})
    again = EncoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.tisa.scope == "per_layer"


def test_albert_sizes():
    base, large = EncoderConfig.preset("albert-base"), EncoderConfig.preset("albert-large")
    assert (base.hidden_size, base.num_hidden_layers, base.num_attention_heads) == (768, 12, 12)
    assert (large.hidden_size, large.num_hidden_layers, large.intermediate_size) == (1024, 24, 4096)
    assert EncoderConfig.preset("albert-base-96").num_hidden_layers == 96


# ---------------------------------------------------------------- sharing schedule


def test_group_schedule_matches_albert():
    cfg = tiny(num_hidden_layers=6, num_hidden_groups=3, inner_group_num=2)
    assert cfg.group_schedule() == [0, 0, 1, 1, 2, 2]
    assert cfg.num_layer_applications == 12


def test_shared_layers_equal_explicitly_repeated_layers():
    """One group run 3 times == three groups holding copies of the same weights."""
    torch.manual_seed(0)
    shared = EncoderForPretraining(tiny(num_hidden_layers=3)).eval()
    explicit = EncoderForPretraining(tiny(num_hidden_layers=3, num_hidden_groups=3)).eval()
    state = shared.state_dict()
    for key, value in list(state.items()):
        if key.startswith("encoder.groups.0."):
            for g in (1, 2):
                state[key.replace("groups.0.", f"groups.{g}.")] = value
    explicit.load_state_dict(state)
    ids, mask = batch()
    a, b = shared(ids, mask), explicit(ids, mask)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    assert sum(p.numel() for p in explicit.parameters()) > sum(
        p.numel() for p in shared.parameters()
    )


def test_hidden_states_per_group_application():
    cfg = tiny(num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2)
    model = EncoderForPretraining(cfg).eval()
    ids, mask = batch()
    out = model(ids, mask, output_hidden_states=True)
    assert len(out.encoder.hidden_states) == cfg.num_hidden_layers + 1
    torch.testing.assert_close(out.encoder.hidden_states[-1], out.encoder.last_hidden_state)
    assert len(model.encoder.trace(ids, mask)) == cfg.num_layer_applications + 1


# ---------------------------------------------------------------- the attention contract


def test_softmax_kernel_equals_naive_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 9, 8) for _ in range(3))
    _, mask = batch()
    kernel = SoftmaxKernel(tiny())
    out, aux = kernel(q, k, v, LayerContext(mask_BN=mask))
    torch.testing.assert_close(out, naive_softmax_attention(q, k, v, mask), atol=1e-6, rtol=1e-5)
    assert aux == {}


@pytest.mark.filterwarnings("ignore:attention='transject' ignores")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("residual", ["post_ln", "pre_ln", "rezero"])
def test_padding_invariance_every_family(family, residual):
    """Appending padding leaves every output at real tokens unchanged."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, residual=residual, num_hidden_layers=3)).eval()
    if model.encoder.residual_gates is not None:
        torch.nn.init.uniform_(model.encoder.residual_gates, 0.5, 1.0)
    ids, _ = batch(B=2, N=7)
    padded = torch.cat([ids, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(2, 7, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)], 1)
    with torch.no_grad():
        short = model(ids, torch.ones(2, 7, dtype=torch.bool), output_hidden_states=True)
        long = model(padded, mask, output_hidden_states=True)
    torch.testing.assert_close(long.logits[:, :7], short.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(long.sop_logits, short.sop_logits, atol=1e-5, rtol=1e-5)
    for hs, hl in zip(short.encoder.hidden_states, long.encoder.hidden_states):
        torch.testing.assert_close(hl[:, :7], hs, atol=1e-5, rtol=1e-5)
    for name in short.aux_losses:
        torch.testing.assert_close(
            long.aux_losses[name], short.aux_losses[name], atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_returns_aux_in_one_field(family):
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, num_hidden_layers=2))
    ids, mask = batch()
    out = model(ids, mask)
    assert out.logits.shape == (3, 9, 512) and out.sop_logits.shape == (3, 2)
    assert isinstance(out.aux_losses, dict)
    loss = (
        out.logits.logsumexp(-1).mean()
        + out.sop_logits.sum()
        + sum(out.aux_losses.values(), torch.zeros(()))
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoder.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_weights_and_autocast_run(family):
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, orthogonal=True))
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, mask)
    assert torch.isfinite(out.logits.float()).all()
    model = model.to(torch.bfloat16)
    out = model(ids, mask)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    for _, mod, name in orthogonal_modules(model):
        weight = getattr(mod, name)
        assert weight.dtype == torch.float32  # the map runs in fp32 from bf16 free parameters
        assert orthogonality_error(weight) < 1e-5


# ---------------------------------------------------------------- orthogonal parametrization


def count_map_evaluations(monkeypatch) -> list:
    """Instruments FP32Orthogonal.evaluate (the map itself) to record one entry per matrix it
    maps: an (E, d, d) tensor counts E, and a batched evaluation of several maps
    (`evaluate_orthogonal_maps`) counts every matrix of every one of them."""
    calls = []
    original = FP32Orthogonal.evaluate

    def counting(self, X):
        calls.extend([self] * X.shape[:-2].numel())
        return original(self, X)

    monkeypatch.setattr(FP32Orthogonal, "evaluate", counting)
    return calls


def orthogonal_matrices(model) -> int:
    """How many matrices the model's orthogonal tensors hold (an (E, d, d) tensor holds E)."""
    return sum(
        mod.parametrizations[name].original.shape[:-2].numel()
        for _, mod, name in orthogonal_modules(model)
    )


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_orthogonal_maps_evaluated_once_per_forward(family, checkpointing, monkeypatch):
    """Under sharing each orthogonal map runs once per forward + backward, not once per layer
    application, also when activation checkpointing recomputes the layers in backward."""
    cfg = tiny(family, orthogonal=True, num_hidden_layers=6)
    model = EncoderForPretraining(cfg)
    if checkpointing:
        model.encoder.enable_activation_checkpointing()
    found = orthogonal_modules(model)
    assert found, "the orthogonal option parameterised nothing"
    calls = count_map_evaluations(monkeypatch)
    ids, mask = batch()
    out = model(ids, mask)
    (out.logits.sum() + sum(out.aux_losses.values(), torch.zeros(()))).backward()
    matrices = orthogonal_matrices(model)
    assert len(calls) == matrices, f"{len(calls)} matrices evaluated, the model holds {matrices}"


def test_inference_reuses_orthogonal_maps_across_forwards(monkeypatch):
    """Eval mode with gradients off: a second forward evaluates no map and gives the same
    outputs; a change to the free parameters (even through `.data`, which leaves the version
    counter alone) is seen; training mode and gradient-recording forwards always evaluate."""
    cfg = tiny("transject", num_hidden_layers=3, transject={"residual_init": 0.5})
    model = EncoderForPretraining(cfg).eval()
    found = orthogonal_modules(model)
    matrices = orthogonal_matrices(model)
    calls = count_map_evaluations(monkeypatch)
    ids, mask = batch()
    with torch.no_grad():
        first = model(ids, mask).logits
        assert len(calls) == matrices
        again = model(ids, mask).logits
        assert len(calls) == matrices, "the second inference forward re-evaluated maps"
        torch.testing.assert_close(again, first, rtol=0, atol=0)

        basis = model.encoder.family_state.parametrizations.eigenbasis.original
        version = basis._version
        basis.data.add_(0.05)  # what DeepSpeed does to parameters: through .data
        assert basis._version == version
        changed = model(ids, mask).logits
        assert len(calls) == matrices + 1  # the eigenbasis only
        fresh = copy.deepcopy(model)
        for _, mod, _ in orthogonal_modules(fresh):
            for orth in mod.parametrizations.values():
                orth[0]._inference = None
        torch.testing.assert_close(fresh(ids, mask).logits, changed, rtol=0, atol=0)
        assert not torch.equal(changed, first)

    calls.clear()
    model(ids, mask)  # eval mode, gradients on: evaluates, keeps nothing new
    assert len(calls) == matrices
    model.train()
    assert all(
        orth[0]._inference is None for _, m, _ in found for orth in m.parametrizations.values()
    )
    calls.clear()
    with torch.no_grad():
        model(ids, mask)
        model(ids, mask)
    assert len(calls) == 2 * matrices, "training mode must evaluate the maps every forward"


def test_orthogonal_option_covers_square_projections():
    model = EncoderForPretraining(tiny(orthogonal=True, intermediate_size=32))
    names = {q for q, _, _ in orthogonal_modules(model)}
    attn = "encoder.groups.0.0.attention"
    assert {f"{attn}.{p}" for p in ("query", "key", "value", "output")} <= names
    assert {"encoder.groups.0.0.ffn_in", "encoder.groups.0.0.ffn_out", "encoder.pooler"} <= names
    for _, mod, name in orthogonal_modules(model):
        assert orthogonality_error(getattr(mod, name)) < 1e-5


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
def test_orthogonal_maps(orthogonal_map):
    model = EncoderForPretraining(tiny(orthogonal=True, orthogonal_map=orthogonal_map))
    w = model.encoder.groups[0][0].attention.query.weight
    assert orthogonality_error(w) < 1e-5
    assert (w - torch.eye(w.shape[0])).abs().max() > 0.1  # a random rotation, not ~identity


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("orthogonal", [False, True])
def test_activation_checkpointing_gives_same_gradients(family, orthogonal):
    torch.manual_seed(0)
    cfg = tiny(family, num_hidden_layers=3, orthogonal=orthogonal)
    ref = EncoderForPretraining(cfg)
    ckpt = copy.deepcopy(ref)
    ckpt.encoder.enable_activation_checkpointing()
    ids, mask = batch()
    grads = []
    for model in (ref, ckpt):
        if model.encoder.residual_gates is not None:
            torch.nn.init.constant_(model.encoder.residual_gates, 0.7)
        out = model(ids, mask)
        (out.logits.square().mean() + sum(out.aux_losses.values(), torch.zeros(()))).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- heads and release


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_classification_pooling_is_masked(pooling):
    torch.manual_seed(0)
    model = EncoderForSequenceClassification(tiny(), num_labels=3, pooling=pooling).eval()
    ids, _ = batch(B=2, N=6)
    padded = torch.cat(
        [ids, torch.full((2, 4), 7)], 1
    )  # real ids under the padding: must not matter
    mask = torch.cat([torch.ones(2, 6, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool)], 1)
    a = model(ids, torch.ones(2, 6, dtype=torch.bool)).logits
    b = model(padded, mask).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert a.shape == (2, 3)


def test_regression_head_and_dual_encoder():
    reg = EncoderForSequenceClassification(tiny(), num_labels=1)
    ids, mask = batch()
    assert reg(ids, mask).logits.shape == (3,)
    dual = EncoderForDualClassification(tiny(), num_labels=2).eval()
    ids2, mask2 = batch(seed=1)
    out = dual(ids, mask, ids2, mask2)
    assert out.logits.shape == (3, 2)
    swapped = dual(ids2, mask2, ids, mask)  # [u, v, u*v, u-v] is not symmetric: order matters
    assert not torch.allclose(out.logits, swapped.logits)


def test_sparse_mlm_decoding_equals_dense():
    model = EncoderForPretraining(tiny()).eval()
    ids, mask = batch()
    picked = torch.zeros_like(mask)
    picked[0, [1, 4]] = True
    picked[2, 2] = True
    full = model(ids, mask).logits
    dense = full[picked]
    sparse = model(ids, mask, masked_positions=picked).logits
    torch.testing.assert_close(sparse, dense)
    # Static shapes: (B, K) indices (the loader's masked_positions, 0 as padding) -> (B, K, V).
    index = torch.tensor([[1, 4, 0], [0, 0, 0], [2, 0, 0]])
    static = model(ids, mask, masked_positions=index).logits
    assert static.shape == (3, 3, full.shape[-1])
    torch.testing.assert_close(
        static, full.gather(1, index[..., None].expand(-1, -1, full.shape[-1]))
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_release_roundtrip_is_exact(tmp_path, family):
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, orthogonal=True)).eval()
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    save_release(tmp_path / "rel", model, tokenizer_file=tok)
    assert sorted(p.name for p in (tmp_path / "rel").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    again = load_release(tmp_path / "rel").eval()
    ids, mask = batch()
    torch.testing.assert_close(again(ids, mask).logits, model(ids, mask).logits, rtol=0, atol=0)


def test_release_refuses_to_overwrite_and_reports_bad_dirs(tmp_path):
    model = EncoderForPretraining(tiny())
    save_release(tmp_path / "rel", model)
    with pytest.raises(FileExistsError, match="already exists"):
        save_release(tmp_path / "rel", model)
    with pytest.raises(FileNotFoundError, match="not a release directory"):
        load_release(tmp_path / "missing")
    (tmp_path / "rel" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_release(tmp_path / "rel")


def test_release_into_a_new_head_keeps_the_encoder(tmp_path):
    torch.manual_seed(0)
    pre = EncoderForPretraining(tiny()).eval()
    save_release(tmp_path / "rel", pre)
    clf = load_release(
        tmp_path / "rel", head={"type": "sequence_classification", "num_labels": 3}
    ).eval()
    ids, mask = batch()
    torch.testing.assert_close(
        clf.encoder(ids, mask).pooled_output, pre.encoder(ids, mask).pooled_output
    )
    assert clf(ids, mask).logits.shape == (3, 3)


def test_orthogonality_at_albert_base_width():
    """The default map (cayley, fp32) stays orthogonal to 1e-5 at d = 768, every TransJect weight."""
    cfg = EncoderConfig.preset(
        "albert-base", attention="transject", vocab_size=300, num_hidden_layers=1
    )
    model = EncoderForPretraining(cfg)
    errors = [orthogonality_error(getattr(m, n)) for _, m, n in orthogonal_modules(model)]
    assert len(errors) >= 5 and max(errors) <= 1e-5


def test_batched_cayley_survives_set_num_threads():
    """Regression: after torch.set_num_threads(), oneMKL's batched solve fails on CPU; the
    TransJect experts (a batch of E orthogonal matrices) must still evaluate. A subprocess, since
    the thread setting is process-wide."""
    code = (
        "import torch; torch.set_num_threads(torch.get_num_threads());"
        "from model import Encoder, EncoderConfig;"
        "cfg = EncoderConfig.preset('debug', hidden_size=256, num_attention_heads=4,"
        " num_hidden_layers=1, attention='transject', transject={'num_experts': 4});"
        "out = Encoder(cfg)(torch.randint(4, 500, (1, 16)));"
        "assert torch.isfinite(out.last_hidden_state).all(); print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_settings_transject_ignores_are_warned_about():
    with pytest.warns(UserWarning, match="ignores residual='pre_ln'"):
        EncoderConfig.preset("debug", attention="transject", residual="pre_ln")
