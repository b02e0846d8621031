"""The orthogonal maps evaluated once per optimizer step (``model.orthogonal_step_cache``,
``model.orthogonal_step.OrthogonalStepCache``, the engine's step hooks): with gradient accumulation the weights after a step
equal those of the per-micro-batch evaluation (fp32 round-off), with and without activation
checkpointing, on the torch backend and DeepSpeed ZeRO 0-2; ZeRO-3 keeps the per-forward maps;
evaluation forwards, non-finite micro-batches and checkpoints leave the step alone."""

from __future__ import annotations

import itertools

import pytest
import torch
from pretrain_support import one_process_rendezvous
from test_engine import ONE  # the one-process DistEnv
from test_model_core import count_map_evaluations, orthogonal_matrices
from torch import nn

from engine.distributed import detect
from engine.engine import Engine, EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig
from model import EncoderConfig, EncoderForPretraining
from model.orthogonal import Linear, make_orthogonal
from model.orthogonal_step import DataParallelMapSharding, OrthogonalMapHooks, OrthogonalStepCache

ATOL, RTOL = 1e-6, 1e-5
ADAMW = OptimizerConfig(name="adamw", lr=1e-3)
LAMB = OptimizerConfig(name="lamb", lr=1e-3)  # the recipes' optimizer (foreach)


def tiny(family: str = "transject", **kw) -> EncoderConfig:
    kw.setdefault("hidden_dropout_prob", 0.0)
    if family == "transject":
        kw.setdefault("transject", {"num_experts": 2})
    return EncoderConfig.preset("debug", attention=family, **kw)


MODELS = {
    "transject": lambda **kw: tiny("transject", num_hidden_layers=3, **kw),
    "orthogonal-softmax": lambda **kw: tiny("softmax", orthogonal=True, intermediate_size=32, **kw),
}


def step_cache(engine: Engine) -> OrthogonalStepCache | None:
    """The orthogonal maps' step cache among the engine's step hooks, or None."""
    hooks = [h for h in engine.step_hooks if isinstance(h, OrthogonalMapHooks)]
    return hooks[0].steps if hooks else None


def make_engine(
    family: str = "transject",
    *,
    cache: bool = True,
    accumulation: int = 2,
    checkpointing: bool = False,
    optimizer: OptimizerConfig = ADAMW,
    dist=ONE,
    **engine_options,
) -> Engine:
    torch.manual_seed(0)
    model = EncoderForPretraining(MODELS[family](orthogonal_step_cache=cache))
    options = {"backend": "torch", "precision": "fp32", **engine_options}
    cfg = EngineConfig(
        device="cpu",
        micro_batch_size=2,
        gradient_accumulation_steps=accumulation,
        activation_checkpointing=checkpointing,
        **options,
    )
    return Engine(model, cfg, optimizer, ScheduleConfig(warmup_steps=0, total_steps=8), dist=dist)


def micro_batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(4, 512, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.bool)
        mask[1, 8:] = False
        out.append((ids, mask))
    return out


def loss_of(out) -> torch.Tensor:
    aux = sum(out.aux_losses.values(), torch.zeros(()))
    return out.logits.square().mean() + out.sop_logits.square().mean() + aux


def train(engine: Engine, steps: int = 2, seed: int = 0, poison: set[int] = frozenset(), **kw):
    """`steps` optimizer steps; micro-batches whose global index is in `poison` get a NaN loss."""
    n = engine.cfg.gradient_accumulation_steps
    results = []
    for i, (ids, mask) in enumerate(micro_batches(steps * n, seed)):
        loss = loss_of(engine.forward(ids, mask))
        if i in poison:
            loss = loss * float("nan")
        engine.backward(loss, **kw)
        if engine.at_boundary:
            results.append(engine.step(**kw))
    return results


def weights(engine: Engine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def assert_same_weights(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------- torch backend


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("accumulation", [2, 3])
@pytest.mark.parametrize("family", list(MODELS))
def test_step_cache_gives_the_per_micro_batch_weights(
    family, accumulation, checkpointing, monkeypatch
):
    """Two optimizer steps: the same weights with the maps once per step as with the maps once
    per micro-batch, and the maps really evaluated once per step (forward + backward +
    checkpoint recompute)."""
    calls = count_map_evaluations(monkeypatch)
    finals, counts = [], []
    for cache in (False, True):
        calls.clear()
        engine = make_engine(
            family, cache=cache, accumulation=accumulation, checkpointing=checkpointing
        )
        assert (step_cache(engine) is not None) == cache
        results = train(engine, steps=2)
        assert not any(r.skipped for r in results)
        finals.append(weights(engine))
        counts.append(len(calls))
        maps = orthogonal_matrices(engine.module)
    assert_same_weights(*finals)
    assert counts == [2 * accumulation * maps, 2 * maps], (counts, maps)
    assert step_cache(engine).evaluations == 2 * maps
    assert step_cache(engine).empty  # nothing kept past the step


def test_step_cache_with_bf16_autocast_and_deferred_lamb():
    """bf16-mixed (the recipes' precision) with the foreach LAMB and ``defer=True`` (the
    pretraining loop's step): the step cache gives the per-micro-batch weights."""
    finals = []
    for cache in (False, True):
        engine = make_engine(
            cache=cache, accumulation=3, optimizer=LAMB, precision="bf16-mixed", checkpointing=True
        )
        assert engine.deferred
        results = train(engine, steps=2, defer=True)
        assert not any(bool(r.skipped) for r in results)
        finals.append(weights(engine))
    assert_same_weights(*finals)


def test_two_forwards_of_one_micro_batch_share_the_step_matrices():
    """A micro-batch may run the model more than once (an encoder applied to both texts of a
    pair): every forward of it sees the same matrices, and the last micro-batch hands the
    earlier gradient on once, not once per forward."""
    finals = []
    for cache in (False, True):
        engine = make_engine(cache=cache, accumulation=2, checkpointing=True)
        for step in range(2):
            for ids, mask in micro_batches(2, seed=step):
                loss = loss_of(engine.forward(ids, mask)) + 0.5 * loss_of(
                    engine.forward(ids.flip(1), mask)
                )
                engine.backward(loss)
            assert not engine.step().skipped
        finals.append(weights(engine))
    assert_same_weights(*finals)


def test_evaluation_forward_mid_step_leaves_the_step_alone(monkeypatch):
    """An evaluation (eval mode, no gradients) between the micro-batches of a step sees the
    maps of the current parameters and does not disturb the step: same weights as a step
    without it, and the step's maps still evaluated once."""
    batches = micro_batches(2)
    probe = micro_batches(1, seed=7)[0]
    reference = make_engine(cache=False)
    reference.train(False)
    with torch.no_grad():
        expected = reference.forward(*probe).logits.clone()
    reference.train(True)
    train(reference, steps=1)

    engine = make_engine(cache=True)
    calls = count_map_evaluations(monkeypatch)
    engine.backward(loss_of(engine.forward(*batches[0])))
    assert not step_cache(engine).empty
    engine.train(False)
    with torch.no_grad():
        seen = engine.forward(*probe).logits
    engine.train(True)
    torch.testing.assert_close(seen, expected, atol=0, rtol=0)
    engine.backward(loss_of(engine.forward(*batches[1])))
    assert not engine.step().skipped
    maps = orthogonal_matrices(engine.module)
    assert len(calls) == 2 * maps  # the step's maps once, the evaluation's once
    assert_same_weights(weights(engine), weights(reference))


@pytest.mark.parametrize("defer", [False, True], ids=["sync", "defer"])
@pytest.mark.parametrize("poisoned", [0, 1], ids=["first", "last"])
def test_nonfinite_micro_batch_leaks_nothing_into_the_next_step(poisoned, defer):
    """A step with a NaN loss in one micro-batch is skipped; the next step is the same as
    without the cache (no gradient of the skipped step carried over)."""
    finals = []
    for cache in (False, True):
        engine = make_engine(cache=cache, accumulation=2, optimizer=LAMB)
        results = [
            r.resolve() if defer else r for r in train(engine, 2, poison={poisoned}, defer=defer)
        ]
        assert [r.skipped for r in results] == [True, False]
        finals.append(weights(engine))
        if cache:
            assert step_cache(engine).empty
    assert_same_weights(*finals)


def test_checkpoint_mid_step_is_unaffected(tmp_path):
    """The cache is not state: a checkpoint written between two micro-batches holds the same
    tensors as without the cache, the step goes on unchanged, and a run resumed from a
    checkpoint trains as the uninterrupted one. Loading one mid-step is refused."""
    batches = micro_batches(4)
    engines = {cache: make_engine(cache=cache) for cache in (False, True)}
    for cache, engine in engines.items():
        engine.backward(loss_of(engine.forward(*batches[0])))
        (tmp_path / f"mid-{cache}").mkdir()
        engine.save(tmp_path / f"mid-{cache}")
        engine.backward(loss_of(engine.forward(*batches[1])))
        engine.step()
        (tmp_path / f"step-{cache}").mkdir()
        engine.save(tmp_path / f"step-{cache}")
        for ids, mask in batches[2:]:
            engine.backward(loss_of(engine.forward(ids, mask)))
        engine.step()
    saved = [
        torch.load(tmp_path / f"mid-{c}" / "engine.pt", weights_only=True) for c in (False, True)
    ]
    assert saved[0]["model"].keys() == saved[1]["model"].keys()
    for key, value in saved[0]["model"].items():
        torch.testing.assert_close(saved[1]["model"][key], value, atol=0, rtol=0)
    assert_same_weights(weights(engines[False]), weights(engines[True]))
    resumed = make_engine(cache=True)
    resumed.backward(loss_of(resumed.forward(*batches[0])))
    with pytest.raises(RuntimeError, match="between two micro-batches"):
        resumed.load(tmp_path / "step-True")  # its gradients so far would meet other weights
    resumed = make_engine(cache=True)
    resumed.load(tmp_path / "step-True")
    for ids, mask in batches[2:]:
        resumed.backward(loss_of(resumed.forward(ids, mask)))
    resumed.step()
    assert_same_weights(weights(resumed), weights(engines[True]))


class TwoMaps(nn.Module):
    """Two orthogonal maps, the second used only when asked (not an encoder: the maps are
    taken from the step's cache by their own forward)."""

    def __init__(self, cache: bool = True) -> None:
        super().__init__()
        self.config = EncoderConfig(orthogonal_step_cache=cache)  # where the setting is read
        self.a = make_orthogonal(Linear(4, 4))
        self.b = make_orthogonal(Linear(4, 4))

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def test_map_missing_from_the_last_micro_batch_is_an_error():
    """A map whose gradient from earlier micro-batches cannot be handed on (the last
    micro-batch does not use it) is an error, not a silently lost gradient; a map used in
    every micro-batch outside an encoder is cached and exact."""
    x = torch.randn(4, 4)
    finals = []
    for cache in (False, True):
        torch.manual_seed(0)
        cfg = EngineConfig(
            backend="torch",
            device="cpu",
            precision="fp32",
            gradient_accumulation_steps=2,
        )
        engine = Engine(
            TwoMaps(cache), cfg, ADAMW, ScheduleConfig(warmup_steps=0, total_steps=4), ONE
        )
        for half in x.chunk(2):
            engine.backward(engine.forward(half).square().sum())
        engine.step()
        finals.append(weights(engine))
        if cache:
            assert step_cache(engine).evaluations == 2
            engine.backward(engine.forward(x[:2]).square().sum())
            with pytest.raises(RuntimeError, match="orthogonal_step_cache=false"):
                engine.backward(engine.forward(x[2:], use_b=False).square().sum())
            assert step_cache(engine).empty
    assert_same_weights(*finals)


def test_where_the_step_cache_is_off():
    assert step_cache(make_engine(cache=False)) is None
    assert make_engine(cache=False).hooks_summary is None
    on = make_engine(accumulation=3).hooks_summary
    assert on == "orthogonal maps once per optimizer step (3 micro-batches)"
    assert step_cache(make_engine(accumulation=1)) is None  # nothing to share
    torch.manual_seed(0)
    plain = EncoderForPretraining(tiny("softmax"))
    cfg = EngineConfig(backend="torch", device="cpu", gradient_accumulation_steps=2)
    assert EncoderConfig().orthogonal_step_cache  # on by default
    engine = Engine(plain, cfg, ADAMW, ScheduleConfig(warmup_steps=0, total_steps=2), ONE)
    assert step_cache(engine) is None  # no orthogonal maps
    with pytest.raises(ValueError, match="orthogonal_step_cache"):
        tiny(orthogonal_step_cache="yes")


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_step_cache_under_compile(monkeypatch, checkpointing, backend):
    """`engine.compile`: the engine evaluates the step's maps eagerly before the compiled
    encoder, which takes them as inputs: the maps are evaluated once per step and never inside
    the graph (a map traced into it would count here), one graph without a break, and the
    weights are those of the eager run without the cache."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = make_engine(cache=False, accumulation=3, checkpointing=checkpointing)
    train(eager, steps=2)
    torch._dynamo.reset()
    counters.clear()
    calls = count_map_evaluations(monkeypatch)
    compiled = make_engine(
        accumulation=3, checkpointing=checkpointing, compile=True, compile_backend=backend
    )
    assert step_cache(compiled) is not None
    train(compiled, steps=2)
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, breaks
    assert graphs == 1, graphs
    assert len(calls) == 2 * orthogonal_matrices(compiled.module)  # once per step, eagerly
    tol = {} if backend == "aot_eager" else {"atol": 1e-4, "rtol": 1e-4}
    for x, y in zip(weights(compiled), weights(eager), strict=True):
        torch.testing.assert_close(x, y, **({"atol": ATOL, "rtol": RTOL} | tol))


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_engine_maps_eagerly_without_accumulation(monkeypatch, backend):
    """`engine.compile` at accumulation 1 on one process (no step cache, no sharding): the
    engine still evaluates the maps eagerly before the compiled encoder, once per forward, so
    they run as the eager block inverse and never inside the graph (a map traced into it would
    count once, at tracing, not once per step); one graph, and the weights of the eager run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = make_engine(accumulation=1)
    train(eager, steps=3)
    torch._dynamo.reset()
    counters.clear()
    calls = count_map_evaluations(monkeypatch)
    compiled = make_engine(accumulation=1, compile=True, compile_backend=backend)
    assert step_cache(compiled) is None
    train(compiled, steps=3)
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, breaks
    assert graphs == 1, graphs
    assert len(calls) == 3 * orthogonal_matrices(compiled.module)  # every step, eagerly
    tol = {} if backend == "aot_eager" else {"atol": 1e-4, "rtol": 1e-4}
    for x, y in zip(weights(compiled), weights(eager), strict=True):
        torch.testing.assert_close(x, y, **({"atol": ATOL, "rtol": RTOL} | tol))


def test_map_shares_cover_each_batch_once():
    """`model.orthogonal_shard_maps`: the shares of a batch of maps are contiguous, in rank
    order, cover it once and differ by at most one; a batch smaller than the ranks is not
    split; one process never shards."""
    for world in (2, 3, 8):
        for total in range(1, 30):
            shares = [DataParallelMapSharding(r, world).bounds(total, (8, 8)) for r in range(world)]
            if total < world:
                assert shares == [None] * world
                continue
            assert shares[0][0] == 0 and shares[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
            sizes = [hi - lo for lo, hi in shares]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="world_size"):
        DataParallelMapSharding(0, 1)
    large = DataParallelMapSharding(1, 2, min_size=256)  # small matrices: mapped by every rank
    assert large.bounds(11, (768, 768)) == (6, 11) and large.bounds(11, (768, 255)) is None
    with pytest.raises(ValueError, match="orthogonal_shard_min_size"):
        tiny(orthogonal_shard_min_size=-1)
    assert step_cache(make_engine(accumulation=1)) is None  # one rank: nothing to share
    assert EncoderConfig().orthogonal_shard_maps  # on by default
    with pytest.raises(ValueError, match="orthogonal_shard_maps"):
        tiny(orthogonal_shard_maps=1)


def test_step_cache_resets_when_a_new_step_begins_without_reset():
    """Driven without the engine: a micro-batch index lower than the last one starts a new
    step, whose matrices are evaluated afresh."""
    steps = OrthogonalStepCache()
    lin = make_orthogonal(Linear(3, 3))
    x = torch.randn(2, 3)
    with steps.micro_batch(0, last=False):
        lin(x).sum().backward()
    with steps.micro_batch(1, last=True):
        first = lin.weight
    with torch.no_grad():
        lin.parametrizations.weight.original.mul_(0.5)
    with steps.micro_batch(0, last=False):
        again = lin.weight
    assert steps.evaluations == 2
    with torch.no_grad():
        assert not torch.equal(first, again)
        torch.testing.assert_close(
            again, lin.parametrizations.weight[0].evaluate(lin.parametrizations.weight.original)
        )


# ----------------------------------------------------------------------- DeepSpeed


@pytest.fixture
def one_process(monkeypatch):
    pytest.importorskip("deepspeed")
    one_process_rendezvous(monkeypatch)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_step_cache_under_deepspeed_zero(one_process, zero_stage, checkpointing):
    """DeepSpeed ZeRO 0-2 on CPU (one process, gloo): the same weights with the step cache as
    without, the foreach LAMB reading ZeRO's layout on stages 1-2."""
    finals = []
    for cache in (False, True):
        engine = make_engine(
            cache=cache,
            accumulation=3,
            checkpointing=checkpointing,
            optimizer=LAMB,
            backend="deepspeed",
            zero_stage=zero_stage,
            dist=detect(),
        )
        assert (step_cache(engine) is not None) == cache
        results = train(engine, steps=2)
        assert not any(r.skipped for r in results)
        finals.append(
            [t.detach().float().clone() for t in engine.consolidated_state_dict().values()]
        )
    assert_same_weights(*finals)


def test_zero3_keeps_the_per_forward_maps(one_process, monkeypatch):
    """ZeRO-3 (partitioned parameters) has no step cache: the maps are evaluated in every
    micro-batch, as before."""
    calls = count_map_evaluations(monkeypatch)
    engine = make_engine(
        accumulation=2, checkpointing=True, backend="deepspeed", zero_stage=3, dist=detect()
    )
    assert step_cache(engine) is None
    results = train(engine, steps=1)
    assert not results[0].skipped
    with engine.gathered_parameters():
        maps = orthogonal_matrices(engine.module)
    assert len(calls) == 2 * maps, (len(calls), maps)


@pytest.mark.slow
def test_step_cache_and_map_sharding_across_two_processes(tmp_path):
    """2 ranks (gloo): DDP (whose all-reduce runs in the last micro-batch's backward only) and
    DeepSpeed ZeRO 0-2 train to the same weights with the step cache, with the maps sharded
    over the ranks (each micro-batch, or once per step with the cache) as with neither; sharded,
    each rank maps about half of the matrices. DDP with both under engine.compile too."""
    import json
    import subprocess

    from pretrain_support import REPO, env, torchrun_cmd

    pytest.importorskip("deepspeed")
    out = tmp_path / "report.json"
    cmd = torchrun_cmd(2, str(REPO / "tests/multiproc/orthogonal_step_cache.py"), str(out))
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert set(report["runs"]) == {
        "torch-zero0",
        "deepspeed-zero0",
        "deepspeed-zero1",
        "deepspeed-zero2",
    }
    for name, run in report["runs"].items():
        assert run["moved"] > 1e-3, (name, run)
        assert not run["off"]["active"], name
        for way in ("cache", "shard", "both"):
            assert run[way]["active"], (name, way)
            assert run[way]["sharded"] == (way != "cache"), (name, way)
            assert run[way]["max_diff"] < ATOL, (name, way, run[way])
        whole = run["cache"]["mapped_per_rank"]  # every rank maps every matrix, once per step
        assert whole[0] == whole[1] > 0, (name, whole)
        both = run["both"]["mapped_per_rank"]  # shared: about half each, nothing left out
        assert sum(both) >= whole[0] and max(both) < 0.6 * whole[0], (name, both, whole)
        per_micro_batch = run["shard"]["mapped_per_rank"]  # 3 micro-batches per step
        assert per_micro_batch == [3 * n for n in both], (name, per_micro_batch, both)
    compiled = report["runs"]["torch-zero0"]["compiled"]  # both on, engine.compile
    assert compiled["sharded"] and compiled["max_diff"] < ATOL, compiled
    assert compiled["mapped_per_rank"] == report["runs"]["torch-zero0"]["both"]["mapped_per_rank"]


@pytest.mark.slow
def test_sharded_maps_through_the_pretraining_trainer(tmp_path):
    """`python -m pretrain` on 2 ranks, TransJect, DeepSpeed ZeRO-2, accumulation 2, the maps
    shared out (every size), diagnostics every 2 steps (forwards outside the step): the losses
    equal the unsharded run's to fp32 round-off, and a run stopped at step 3 and resumed to 6
    equals the uninterrupted one exactly."""
    from background_runs import BackgroundRuns
    from pretrain_support import FAMILY, base_overrides, make_shards, run_pretrain

    from engine.metrics import read_jsonl

    shards = make_shards(tmp_path / "data")

    def run(run_dir, steps, shard):
        overrides = [
            *base_overrides(shards, run_dir, steps),
            *FAMILY["transject"],
            "model.hidden_dropout_prob=0.0",
            "engine.zero_stage=2",
            "engine.micro_batch_size=2",
            "engine.gradient_accumulation_steps=2",
            f"model.orthogonal_shard_maps={str(shard).lower()}",
            "model.orthogonal_shard_min_size=0",
            "train.diagnostics_every=2",
            "train.checkpoint_every=3",
        ]
        proc = run_pretrain(overrides, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = "orthogonal maps once per optimizer step (2 micro-batches), shared out over 2 ranks"
        assert (said in proc.stdout + proc.stderr) == shard
        rows = read_jsonl(run_dir / "tensorboard")
        return [rows[s]["loss/total"] for s in range(1, steps + 1)]

    def halves():  # stopped at step 3, resumed to 6
        run(tmp_path / "halves", 3, True)
        return run(tmp_path / "halves", 6, True)

    # The three independent runs two at a time (each 2-rank launch is mostly start-up).
    jobs = BackgroundRuns(workers=2)
    jobs.submit("halves", halves)
    jobs.submit("sharded", run, tmp_path / "sharded", 6, True)
    jobs.submit("plain", run, tmp_path / "plain", 6, False)
    try:
        sharded, plain, resumed = (jobs.result(k) for k in ("sharded", "plain", "halves"))
    finally:
        jobs.close()
    assert sharded == pytest.approx(plain, rel=1e-5, abs=1e-6)
    assert resumed == sharded
