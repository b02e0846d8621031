"""engine.lamb: the per-tensor LAMB in foreach ops, on tensors and on flat buffers, and the
engine's deferred (no host synchronisation) steps with it.

The reference is ``pytorch_optimizer.Lamb`` as ``engine.optim`` configures it
(``implementation='torch'``). The DeepSpeed ZeRO 0/1/2 x 1/2-process comparison runs in
tests/multiproc/lamb_zero.py (slow tier).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import pytorch_optimizer
import torch
from background_runs import BackgroundRuns, selected_params
from op_log import OpLog
from torch import nn

from engine.distributed import DistEnv
from engine.engine import Engine, EngineConfig
from engine.lamb import FlatLayout, Lamb
from engine.optim import OptimizerConfig, ScheduleConfig

ONE = DistEnv.single()
SHAPES = [(5, 3), (7,), (4, 4), (2,), (3, 1, 2)]
GROUPS = [(0, 2, 0.1), (2, 5, 0.0)]  # (first, end, weight decay): a decay and a no-decay group


COMPILED = [False, pytest.param(True, marks=pytest.mark.integration, id="compiled")]
"""The foreach LAMB eagerly and with its arithmetic compiled (`optimizer.implementation:
compiled`: seconds of compilation per test, hence the integration tier)."""


def _reference(weights, grads, lr=0.01, scale=None):
    """pytorch_optimizer.Lamb (engine.optim's 'torch' configuration), one tensor at a time."""
    params = [nn.Parameter(w.clone()) for w in weights]
    groups = [{"params": params[a:b], "weight_decay": wd} for a, b, wd in GROUPS]
    opt = pytorch_optimizer.Lamb(groups, lr=lr, weight_decouple=False, adam_debias=True, eps=1e-6)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone() if scale is None else g * scale
        opt.step()
    return [p.detach() for p in params]


def _flat(tensors, pad=3):
    return torch.cat([t.flatten() for t in tensors] + [torch.zeros(pad)])


def _unflatten(buffer, like):
    out, offset = [], 0
    for t in like:
        out.append(buffer[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


@pytest.mark.parametrize("compiled", COMPILED)
def test_flat_buffers_with_a_layout_equal_per_tensor_lamb(compiled):
    torch.manual_seed(0)
    weights = [torch.randn(s) * (20.0 if i == 2 else 1.0) for i, s in enumerate(SHAPES)]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(6)]  # ^ one norm above the clamp
    expected = _reference(weights, grads)
    # DeepSpeed's layout: one flat buffer per group, tensors back to back, padding at the end.
    flats, opt_groups = [], []
    for a, b, wd in GROUPS:
        flat = nn.Parameter(_flat(weights[a:b]))
        flats.append(flat)
        opt_groups.append({"params": [flat], "weight_decay": wd})
    opt = Lamb(opt_groups, lr=0.01, eps=1e-6, compiled=compiled)
    for (a, b, _), flat in zip(GROUPS, flats):
        offsets = [0]
        for w in weights[a:b]:
            offsets.append(offsets[-1] + w.numel())
        pieces = tuple((offsets[t], weights[a + t].numel(), t) for t in range(b - a))
        opt.set_layout(flat, FlatLayout(pieces, b - a))
    for step_grads in grads:
        for (a, b, _), flat in zip(GROUPS, flats):
            flat.grad = _flat(step_grads[a:b])
        opt.step()
    got = [t for (a, b, _), f in zip(GROUPS, flats) for t in _unflatten(f.detach(), weights[a:b])]
    for g, e, w in zip(got, expected, weights):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
        assert (e - w).abs().max() > 1e-3  # the weights did move
    assert all((f.detach()[-3:] == 0).all() for f in flats)  # the padding was never touched


@pytest.mark.parametrize("compiled", COMPILED)
def test_plain_tensors_equal_the_reference_and_the_controls(compiled):
    torch.manual_seed(1)
    weights = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(4)]
    expected = _reference(weights, grads)
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(
        [{"params": params[a:b], "weight_decay": wd} for a, b, wd in GROUPS],
        lr=0.02,
        eps=1e-6,
        compiled=compiled,
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for group in opt.param_groups:
        group["initial_lr"] = 0.02
    opt.lr_multiplier = torch.tensor(0.5, dtype=torch.float64)  # 0.02 * 0.5: the reference's lr
    opt.grad_scale = torch.tensor(0.25)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g * 4.0  # grad_scale takes it back
        opt.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)
    # compiled: each of the two functions one graph per parameter group, no graph break
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == (2 * len(GROUPS) if compiled else 0), dict(torch._dynamo.utils.counters)
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("compiled", COMPILED)
def test_skip_leaves_weights_and_moments_untouched_even_with_nan_gradients(compiled):
    torch.manual_seed(2)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = Lamb(params, lr=0.01, weight_decay=0.1, compiled=compiled)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
    opt.skip = torch.tensor(True)
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    for p, (w, state) in zip(params, before):
        assert torch.equal(p.detach(), w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
    opt.skip = torch.tensor(False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(params[0].detach(), before[0][0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_step_that_may_be_skipped_equals_a_plain_one_and_copies_nothing(bad):
    """skip=False (the engine's deferred step) gives the plain step's weights and moments bit
    for bit; skip=True keeps them bit for bit whatever the gradient holds; and the step makes
    no second copy of the weights or moments: it creates 2 tensors' worth of elements per
    parameter element (the update and its denominator) and a few vectors of one element per
    tensor (norms, trust ratios); the copies made before came to 5 per parameter element."""
    torch.manual_seed(3)
    weights = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(3)]
    runs = {}
    for name, skip in (("plain", None), ("skippable", torch.tensor(False))):
        params = [nn.Parameter(w.clone()) for w in weights]
        opt = Lamb(params, lr=0.01, weight_decay=0.1)
        opt.skip = skip
        counter = OpLog()
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            with counter if step == 2 else torch.no_grad():
                opt.step()
        runs[name] = (params, opt, counter.created_elements())
    total = sum(w.numel() for w in weights)
    for p, q in zip(runs["plain"][0], runs["skippable"][0]):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(runs["plain"][1].state[p][k], runs["skippable"][1].state[q][k])
    assert runs["skippable"][2] <= 2 * total + 20 * len(SHAPES), (runs["skippable"][2], total)
    params, opt, _ = runs["skippable"]
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
    opt.skip = torch.tensor(True)
    for p in params:
        p.grad = torch.full_like(p, bad)
    opt.step()
    for p, (w, state) in zip(params, before):
        assert torch.equal(p.detach(), w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def test_a_flat_parameter_without_its_layout_is_an_error():
    flat = nn.Parameter(torch.zeros(10))
    opt = Lamb([flat], lr=0.1)
    opt.require_layouts = True
    flat.grad = torch.ones(10)
    with pytest.raises(RuntimeError, match="no flat layout"):
        opt.step()
    with pytest.raises(ValueError, match="1-D buffer of at least 12"):
        opt.set_layout(flat, FlatLayout(((0, 12, 0),), 1))


# ----------------------------------------------------------------------------- the engine


def _engine(model: nn.Module, **kw) -> Engine:
    cfg = EngineConfig(backend="torch", device="cpu", precision="fp32", gradient_clipping=0.3, **kw)
    opt = OptimizerConfig(name="lamb", lr=0.02, weight_decay=0.01)
    schedule = ScheduleConfig(warmup_steps=3, total_steps=12, decay="linear")
    return Engine(model, cfg, opt, schedule, dist=ONE)


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_deferred_steps_equal_synchronising_ones_with_a_skipped_step(accumulation):
    """The same updates bit for bit; a non-finite loss skips the update and holds the schedule
    on the device, and the host's scheduler agrees once synchronised."""
    sync = _engine(_net(), gradient_accumulation_steps=accumulation)
    deferred = _engine(_net(), gradient_accumulation_steps=accumulation)
    assert deferred.deferred and isinstance(deferred.optimizer, Lamb)
    g = torch.Generator().manual_seed(4)
    for step in range(8):
        x, y = torch.randn(4 * accumulation, 6, generator=g), torch.randn(4 * accumulation, 3)
        results = []
        for engine, defer in ((sync, False), (deferred, True)):
            for xb, yb in zip(x.chunk(accumulation), y.chunk(accumulation)):
                loss = (engine.forward(xb) - yb).pow(2).mean()
                if step == 3:
                    loss = loss * float("nan")
                engine.backward(loss, defer=defer)
            results.append(engine.step(defer=defer))
        r_sync, r_def = results[0], results[1].resolve()
        assert r_sync.skipped == r_def.skipped == (step == 3)
        assert r_sync.nonfinite_loss == r_def.nonfinite_loss == (step == 3)
        assert r_sync.grad_norm == pytest.approx(r_def.grad_norm, rel=1e-6) or step == 3
        for a, b in zip(sync.module.parameters(), deferred.module.parameters()):
            assert torch.equal(a, b), step
    deferred.sync_schedule()
    assert deferred.scheduler.last_epoch == sync.scheduler.last_epoch == 7  # 8 steps, 1 skipped
    assert [g["lr"] for g in deferred.optimizer.param_groups] == [
        g["lr"] for g in sync.optimizer.param_groups
    ]
    assert deferred.scheduler.state_dict() == sync.scheduler.state_dict()


def test_deferred_step_falls_back_where_it_cannot_defer():
    cfg = EngineConfig(backend="torch", device="cpu", precision="fp32")
    engine = Engine(
        _net(), cfg, OptimizerConfig(name="adamw"), ScheduleConfig(0, 10, "constant"), dist=ONE
    )
    assert not engine.deferred
    engine.backward(engine.forward(torch.randn(2, 6)).sum(), defer=True)
    result = engine.step(defer=True)
    assert result.skipped.device.type == "cpu" and not bool(result.skipped)
    assert math.isfinite(result.resolve().grad_norm)


# ----------------------------------------------------------------------------- DeepSpeed ZeRO


def _lamb_zero(jobs: BackgroundRuns, out: Path, nproc: int) -> dict:
    """tests/multiproc/lamb_zero.py on `nproc` ranks: its report's runs."""
    from pretrain_support import REPO, env, torchrun_cmd

    cmd = torchrun_cmd(nproc, str(REPO / "tests/multiproc/lamb_zero.py"), str(out))
    proc = jobs.run(cmd, cwd=REPO, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["runs"]


@pytest.fixture(scope="module")
def lamb_zero_runs(request, tmp_path_factory):
    """The selected rank counts' launches, side by side (`BackgroundRuns`)."""
    jobs = BackgroundRuns(workers=2)
    nprocs = selected_params(request, "test_zero_0_1_2_lamb_is_per_tensor", "nproc")
    for nproc in sorted(nprocs, reverse=True):  # the longer first
        out = tmp_path_factory.mktemp(f"lamb_zero_{nproc}") / "report.json"
        jobs.submit(nproc, _lamb_zero, jobs, out, nproc)
    yield jobs
    jobs.close()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_zero_0_1_2_lamb_is_per_tensor(lamb_zero_runs, nproc):
    """DeepSpeed ZeRO 0, 1 and 2 (flat partitions; on 2 ranks tensors split between them, and a
    partition of padding only) with the foreach LAMB (and compiled, on ZeRO 1 and 2) equal
    per-tensor LAMB to 1e-6 after 5 clipped steps, deferred steps equal synchronising ones bit
    for bit, and the control (pytorch_optimizer's LAMB on ZeRO-2's flat buffers) does not."""
    runs = lamb_zero_runs.result(nproc)
    for stage in (0, 1, 2):
        for mode in ("sync", "deferred"):
            run = runs[f"zero{stage}-{mode}"]
            assert max(run["max_diff"].values()) < 1e-6, (stage, mode, run["max_diff"])
            assert min(run["moved"].values()) > 1e-3
            if nproc == 2 and stage > 0:
                assert run["split_tensors"] >= 1  # some tensor spans both ranks' partitions
        assert runs[f"zero{stage}-sync"]["state"] == runs[f"zero{stage}-deferred"]["state"]
    assert max(runs["zero2-sync-torch"]["max_diff"].values()) > 1e-3
    # A group of one scalar: on 2 ranks one partition is padding only (no hang, still exact).
    assert max(runs["zero2-deferred-scaled"]["max_diff"].values()) < 1e-6
    # optimizer.implementation=compiled: as exact on the flat partitions
    for name in ("zero1-sync-compiled", "zero2-deferred-compiled"):
        assert max(runs[name]["max_diff"].values()) < 1e-6, (name, runs[name]["max_diff"])
        if nproc == 2:
            assert runs[name]["split_tensors"] >= 1
