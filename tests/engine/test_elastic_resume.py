"""Resuming on another number of processes with the same global batch.

Loader (in process): the global offset in the loader state, the continuation on W' ranks, and
the multiset of examples of a run whose rank count changes (2 -> 1 -> 2, 3 -> 2 -> 1 -> 3):
the same examples in every optimizer step as an uninterrupted run. Engine (in process):
engine.reshard's helpers and the counters of the torch backend. Engine (slow: torchrun,
DeepSpeed over gloo on CPU, tests/multiproc/elastic_engine.py): W ranks save, W' ranks load
and train on; the state right after the load equals the saved one exactly, and three steps
later the weights and optimizer moments equal those of the uninterrupted W-rank run to the
tolerance below.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from background_runs import BackgroundRuns, selected_params
from pretrain_support import REPO, env, torchrun_cmd
from test_engine import ADAMW, SCHEDULE, data, make_engine, mlp, mse
from test_loader import assert_batches_equal, take, write_shard_dir

from data_prep.loader import EpochPlan, PretrainingData, PretrainingLoader
from engine import reshard
from engine.state import _rescaled_micro_step

# ----------------------------------------------------------------------------- the loader


class Recording(PretrainingData):
    """Remembers every (epoch, index) it builds (num_workers=0: in this process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, int]] = []

    def __getitem__(self, key):
        self.seen.append(tuple(int(k) for k in key))
        return super().__getitem__(key)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return write_shard_dir(tmp_path_factory.mktemp("shards"))  # 100 examples


def loaders(data, batch_size: int, world: int, global_batch: int | None, state=None):
    out = [
        PretrainingLoader(
            data, batch_size, rank=r, world_size=world, global_batch_size=global_batch
        )
        for r in range(world)
    ]
    if state is not None:
        for lo in out:
            lo.load_state_dict(json.loads(json.dumps(state)), elastic=True)
    return out


def consume(data: Recording, ranks: list[PretrainingLoader], accumulation: int, steps: int):
    """``steps`` optimizer steps of ``accumulation`` micro-batches on every rank: the multiset
    of examples of each step, and the ranks' states after them."""
    iterators = [iter(lo) for lo in ranks]
    per_step = []
    for _ in range(steps):
        first = len(data.seen)
        for _ in range(accumulation):
            for it in iterators:
                next(it)
        per_step.append(Counter(data.seen[first:]))
    for it in iterators:
        it.close()
    states = [lo.state_dict() for lo in ranks]
    assert len({(s["epoch"], s["samples_in_epoch"]) for s in states}) == 1  # one position
    return per_step, states


@pytest.mark.parametrize(
    ("batch", "global_batch", "worlds", "steps"),
    [
        (4, 8, (2, 1, 2), (5, 9, 6)),  # 12 steps an epoch: the epoch ends on 1 rank
        (2, 12, (3, 2, 1, 3), (3, 5, 4, 3)),  # 8 steps an epoch: ends on 1 rank
        (4, 8, (1, 2, 1), (13, 4, 2)),  # starts again on 2 ranks mid-epoch
    ],
)
def test_changing_ranks_consumes_what_an_uninterrupted_run_does(
    shard_dir, batch, global_batch, worlds, steps
):
    """With the global batch fixed (accumulation = global / (batch x ranks)), every optimizer
    step gets the same examples as in an uninterrupted run on the first rank count: none lost,
    none repeated, across epoch boundaries."""
    total = sum(steps)
    ref_data = Recording(shard_dir, max_seq_length=64, seed=3)
    first = worlds[0]
    ref, _ = consume(
        ref_data,
        loaders(ref_data, batch, first, global_batch),
        global_batch // (batch * first),
        total,
    )
    got_data = Recording(shard_dir, max_seq_length=64, seed=3)
    got, state = [], None
    for world, count in zip(worlds, steps):
        ranks = loaders(got_data, batch, world, global_batch, state)
        done, states = consume(got_data, ranks, global_batch // (batch * world), count)
        got += done
        state = states[-1]  # any rank's state: the last one's here
    assert got == ref
    assert Counter(got_data.seen) == Counter(ref_data.seen)
    epoch_length = 100 // global_batch * global_batch
    assert total * global_batch > epoch_length  # the run crossed an epoch boundary
    by_epoch = Counter(e for e, _ in got_data.seen)
    assert by_epoch[0] == epoch_length  # epoch 0 complete: a prefix of its order, once each
    perm = EpochPlan(100, batch, 0, 1, 3, True).permutation(0)
    assert sorted(i for e, i in got_data.seen if e == 0) == sorted(perm(np.arange(epoch_length)))


def test_without_a_global_batch_every_epoch_is_a_prefix_of_its_order(shard_dir):
    """Without global_batch_size an epoch's length follows the micro-step of the layout that
    finishes it (here 1 rank x 4 = all 100 examples, where 2 ranks would stop at 96), but the
    examples of each epoch are still a prefix of its order, each at most once."""
    data = Recording(shard_dir, max_seq_length=64, seed=5)
    state = None
    for world, steps in ((2, 5), (1, 30), (2, 3)):
        _, states = consume(data, loaders(data, 4, world, None, state), 2 // world, steps)
        state = states[0]
    plan = EpochPlan(100, 4, 0, 1, 5, True)
    for epoch in (0, 1):
        got = [i for e, i in data.seen if e == epoch]
        assert len(got) == len(set(got))
        assert sorted(got) == sorted(plan.permutation(epoch)(np.arange(len(got))))
    assert sum(1 for e, _ in data.seen if e == 0) == 100  # finished on 1 rank: nothing dropped


def test_the_continuation_starts_at_the_global_offset(shard_dir):
    """After k batches of b on W ranks the state's offset is k*b*W; W' ranks continue there,
    interleaved: rank r's batch j holds positions k*b*W + r + W'*(j*b .. j*b+b-1)."""
    data = PretrainingData(shard_dir, max_seq_length=64, seed=1)
    two = loaders(data, 4, 2, None)
    for lo in two:
        take(lo, 3)
    state = two[1].state_dict()
    assert (state["epoch"], state["batch_in_epoch"], state["samples_in_epoch"]) == (0, 3, 24)
    three = loaders(data, 4, 3, None, state)
    assert [lo.samples_in_epoch for lo in three] == [24, 24, 24]
    perm = three[0].plan.permutation(0)
    for r, lo in enumerate(three):
        batches = take(lo, 2)
        for j, batch in enumerate(batches):
            positions = 24 + r + 3 * np.arange(4 * j, 4 * j + 4)
            expected = lo.collate([data[(0, int(i))] for i in perm(positions)])
            assert_batches_equal([batch], [expected])
    state = three[0].state_dict()
    assert (state["start_in_epoch"], state["batch_in_epoch"]) == (24, 2)
    assert state["samples_in_epoch"] == 24 + 2 * 4 * 3
    # The epoch ends where 3 ranks of 4 run out: (96 - 24) // 3 = 24 positions each, 6 batches.
    assert three[0].plan.batches_from(24) == 6


def test_same_rank_count_resume_after_an_elastic_one_is_exact(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=2)
    two = loaders(data, 4, 2, 8)
    for lo in two:
        take(lo, 5)
    (one,) = loaders(data, 4, 1, 8, two[0].state_dict())
    ref = take(one, 16)  # 14 batches of 4 are left of the 96 positions: crosses into epoch 1
    (again,) = loaders(data, 4, 1, 8, two[0].state_dict())
    take(again, 4)
    saved = json.loads(json.dumps(again.state_dict()))
    assert saved["start_in_epoch"] == 40 and saved["batch_in_epoch"] == 4
    resumed = PretrainingLoader(data, 4, global_batch_size=8)
    resumed.load_state_dict(saved)  # same rank count: exact, no elastic needed
    assert_batches_equal(take(resumed, 12), ref[4:])
    assert (resumed.epoch, resumed.batch_in_epoch, resumed.start_in_epoch) == (1, 2, 0)


def test_elastic_load_refusals(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=1)
    two = PretrainingLoader(data, 4, rank=1, world_size=2)
    take(two, 2)
    state = two.state_dict()
    with pytest.raises(ValueError, match=r"world_size .*elastic=True"):
        PretrainingLoader(data, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PretrainingLoader(data, 2).load_state_dict(state, elastic=True)
    with pytest.raises(ValueError, match="seed"):
        PretrainingLoader(PretrainingData(shard_dir, 64, seed=2), 4).load_state_dict(
            state, elastic=True
        )
    with pytest.raises(ValueError, match="rank"):  # same rank count: still this rank's own
        PretrainingLoader(data, 4, rank=0, world_size=2).load_state_dict(state, elastic=True)
    bad = dict(state, samples_in_epoch=17)
    with pytest.raises(ValueError, match="inconsistent"):
        PretrainingLoader(data, 4).load_state_dict(bad, elastic=True)
    with pytest.raises(ValueError, match="multiple of batch_size x world_size = 8"):
        PretrainingLoader(data, 4, world_size=2, global_batch_size=12)
    with pytest.raises(ValueError, match="drop_last"):
        PretrainingLoader(data, 4, drop_last=False, global_batch_size=8)


def test_a_version_1_state_still_loads(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=4)
    first = PretrainingLoader(data, 4, rank=1, world_size=2)
    take(first, 3)
    old = first.state_dict()
    for key in ("start_in_epoch", "samples_in_epoch", "global_batch_size"):
        del old[key]
    old["version"] = 1
    same = PretrainingLoader(data, 4, rank=1, world_size=2)
    same.load_state_dict(old)
    assert_batches_equal(take(same, 2), take(first, 2))
    other = PretrainingLoader(data, 4)
    other.load_state_dict(old, elastic=True)
    assert other.samples_in_epoch == 3 * 4 * 2


# ----------------------------------------------------------------------------- the engine


def test_gradient_accumulation_for():
    assert reshard.gradient_accumulation_for(64, 4, 2) == 8
    assert reshard.gradient_accumulation_for(64, 4, 16) == 1
    with pytest.raises(ValueError, match=r"must divide 16 .* valid: \[1, 2, 4, 8, 16\]"):
        reshard.gradient_accumulation_for(64, 4, 3)
    with pytest.raises(ValueError, match="must divide 16"):
        reshard.gradient_accumulation_for(64, 4, 32)
    with pytest.raises(ValueError, match="not a multiple of the micro-batch"):
        reshard.gradient_accumulation_for(64, 6, 1)


def test_saved_world_size_from_the_rank_files(tmp_path):
    assert reshard.saved_world_size(tmp_path) is None  # ZeRO-0 / torch: any world size
    assert not reshard.needs_conversion(tmp_path, 3)
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    for r in range(3):
        (tmp_path / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
    assert reshard.saved_world_size(tmp_path) == 3
    assert reshard.needs_conversion(tmp_path, 2) and not reshard.needs_conversion(tmp_path, 3)
    (tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(reshard.ReshardError, match="some are missing"):
        reshard.saved_world_size(tmp_path)


def test_to_universal_refuses_a_state_that_is_not_partitioned(tmp_path):
    (tmp_path / "engine.pt").touch()
    with pytest.raises(reshard.ReshardError, match="not partitioned"):
        reshard.to_universal(tmp_path)
    assert not (tmp_path / "universal").exists()


def _fake_rank_files(directory: Path, per_param: dict, stage: int = 2, world: int = 2) -> None:
    """ZeRO rank files shaped like DeepSpeed's (only what the check reads)."""
    for r in range(world):
        if stage == 3:
            optim = {"optimizer_state_dict": {"state": {0: per_param}}, "fp32_flat_groups": []}
        else:
            optim = {"base_optimizer_state": {"state": {0: per_param}}, "zero_stage": stage}
        torch.save(
            {"optimizer_state_dict": optim},
            directory / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_state_the_conversion_cannot_carry_is_refused_before_converting(tmp_path, stage):
    """pytorch-optimizer's LAMB keeps 0-dim weight_norm/adam_norm per parameter and its step in
    the group: DeepSpeed 0.19.8's conversion crashes on it (ZeRO-1/2: narrow() of a 0-dim
    tensor; ZeRO-3: KeyError 'step', both seen with the real engine), so it is refused first."""
    moments = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    lamb = {**moments, "weight_norm": torch.tensor(1.0), "adam_norm": torch.tensor(2.0)}
    _fake_rank_files(tmp_path, lamb, stage)
    with pytest.raises(reshard.ReshardError, match=r"\['adam_norm', 'weight_norm'\].*ZeRO-0"):
        reshard.to_universal(tmp_path)
    assert not (tmp_path / "universal").exists()
    _fake_rank_files(tmp_path, {**moments, "step": torch.tensor(3.0)}, stage)
    assert reshard.check_convertible(tmp_path) == 2  # AdamW's state: fine
    if stage == 3:
        _fake_rank_files(tmp_path, moments, stage)
        with pytest.raises(reshard.ReshardError, match="ZeRO-3 needs a per-parameter 'step'"):
            reshard.check_convertible(tmp_path)


def test_micro_step_keeps_the_optimizer_steps():
    layout = {"gradient_accumulation_steps": 2}
    assert _rescaled_micro_step(6, layout, 4) == 12  # 3 steps
    assert _rescaled_micro_step(7, layout, 4) == 13  # and one micro-batch into the 4th
    assert _rescaled_micro_step(6, layout, 2) == 6
    assert _rescaled_micro_step(6, None, 4) == 6  # saved before layouts were recorded


def test_torch_backend_loads_on_another_accumulation(tmp_path):
    """engine.pt holds the whole state: a load with another accumulation (another world size,
    the same global batch) restores it all and converts the micro-step counter."""
    x, y = data(8)
    engine = make_engine(mlp(), micro_batch_size=4, gradient_accumulation_steps=2)
    for _ in range(3):
        for i in range(2):
            engine.backward(mse(engine, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]))
        engine.step()
    engine.save(tmp_path)
    saved = torch.load(tmp_path / "engine.pt", weights_only=True)
    assert saved["albatross"]["layout"] == {
        "world_size": 1,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "backend": "torch",
        "zero_stage": 0,
        "precision": "fp32",
    }
    other = make_engine(mlp(), ADAMW, SCHEDULE, micro_batch_size=2, gradient_accumulation_steps=4)
    other.load(tmp_path)
    assert other.micro_step == 12 and other.scheduler.last_epoch == 3
    for a, b in zip(engine.module.parameters(), other.module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- DeepSpeed

TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
"""Three steps after the load, the resumed run's weights and moments against the uninterrupted
one's: max |difference| over a kind (weights, exp_avg, exp_avg_sq) / max |value| of that kind.
The update is mathematically the same (every sample has as many masked tokens: the per-micro-
batch means weigh them alike); the order of the floating-point sums is not (W ranks x GA
micro-batches averaged by an all-reduce vs W' x GA' accumulated, the samples grouped into other
micro-batches). Measured on CPU: fp32 at most 1.8e-7 (ZeRO 0-3 and the torch backend, 2 -> 1
and 1 -> 2); bf16 and bf16-mixed at most 5.7e-3 (exp_avg; bf16 rounding of activations and,
with bf16, of gradients)."""


def _run(runs: BackgroundRuns, nproc: int, jobs: list[str]) -> None:
    script = str(REPO / "tests/multiproc/elastic_engine.py")
    proc = runs.run(torchrun_cmd(nproc, script, *jobs), cwd=REPO, env=env(), timeout=600)
    assert proc.returncode == 0, f"elastic_engine.py {jobs} failed:\n{proc.stderr[-4000:]}"


def _state(out: Path, name: str, step: int) -> dict:
    return torch.load(out / "states" / name / f"step_{step}.pt", weights_only=False)


def _relative_difference(a: dict, b: dict, kind: str) -> float:
    keys = [k for k in a if kind == "weights" or k.endswith(f":{kind}")]
    assert keys
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in keys)
    scale = max(a[k].float().abs().max().item() for k in keys)
    return diff / scale


def _assert_same_run(saved: dict, resumed: dict, tolerance: float) -> None:
    assert sorted(saved["weights"]) == sorted(resumed["weights"])
    assert sorted(saved["moments"]) == sorted(resumed["moments"])
    for kind, part in (("weights", "weights"), ("exp_avg", "moments"), ("exp_avg_sq", "moments")):
        value = _relative_difference(saved[part], resumed[part], kind)
        assert value <= tolerance, f"{kind}: relative difference {value:.3g} > {tolerance}"
    assert saved["optimizer_steps"] == resumed["optimizer_steps"]
    assert saved["scheduler"] == resumed["scheduler"]
    assert saved["lr"] == resumed["lr"]
    assert saved["groups"] == resumed["groups"]  # weight decay per group, LAMB's step, ...


CASES = {
    # stage:precision:W->W'  (ZeRO-2 fp32 also goes back: 2 -> 1 -> 2)
    "2:fp32:2-1-2": ("2", "fp32", (2, 1, 2)),
    "1:fp32:2-1": ("1", "fp32", (2, 1)),
    "3:fp32:2-1": ("3", "fp32", (2, 1)),
    "3:fp32:1-2": ("3", "fp32", (1, 2)),
    "1:bf16:2-1": ("1", "bf16", (2, 1)),  # DeepSpeed's bf16 optimizer (ZeRO-1 + bf16)
    "2:bf16-mixed:1-2": ("2", "bf16-mixed", (1, 2)),
    "0:fp32:2-1": ("0", "fp32", (2, 1)),  # not partitioned: loaded as it is
    "torch:fp32:2-1": ("torch", "fp32", (2, 1)),  # engine.pt
}


PHASES = (("run",), ("resume", "3"), ("resume", "5"))
"""What a case's i-th world size does: W ranks train and save, W' resume from step 3 (and W''
from the resumed run's step 5)."""


def _chain(runs: BackgroundRuns, launches: list[tuple[int, list[str]]]) -> None:
    for nproc, jobs in launches:
        _run(runs, nproc, jobs)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The selected cases' launches: the cases that start on the same world size share their
    processes (one torchrun per phase and world size), each case in a folder of its own. The
    two chains (starting on 2 ranks and on 1) run side by side (`BackgroundRuns`); a test
    waits for its case's chain and returns its folder."""
    runs = BackgroundRuns(workers=2)
    selected = selected_params(request, "test_deepspeed_resumes_on_another_world_size", "case")
    folders, chains = {}, {}  # chains: first world size -> (phase, world size) -> jobs
    for case in sorted(selected):
        stage, precision, worlds = CASES[case]
        folders[case] = tmp_path_factory.mktemp(case.replace(":", "_"))
        chain = chains.setdefault(worlds[0], {})
        for phase, world in enumerate(worlds):
            job = ",".join([str(folders[case]), stage, precision, *PHASES[phase]])
            chain.setdefault((phase, world), []).append(job)
    for first, chain in sorted(chains.items(), reverse=True):  # the longer chain first
        runs.submit(
            first, _chain, runs, [(world, jobs) for (_, world), jobs in sorted(chain.items())]
        )

    def folder(case: str) -> Path:
        runs.result(CASES[case][2][0])
        return folders[case]

    yield folder
    runs.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_resumes_on_another_world_size(launched, case):
    stage, precision, worlds = CASES[case]
    first = worlds[0]
    tmp_path = launched(case)
    name = f"w{worlds[1]}-from-3"
    report = json.loads((tmp_path / "states" / name / "report.json").read_text())
    assert report["accumulation"] == 8 // (2 * worlds[1])
    loaded, saved = _state(tmp_path, name, 3), _state(tmp_path, f"w{first}", 3)
    _assert_same_run(saved, loaded, 0.0)  # the load itself is exact
    assert loaded["micro_step"] == 3 * report["accumulation"]
    partitioned = stage in ("1", "2", "3")
    assert ("universal" in report) == partitioned
    if partitioned:
        assert report["universal"]["source_world_size"] == first
    tolerance = TOLERANCE["bf16" if "bf16" in precision else "fp32"]
    _assert_same_run(_state(tmp_path, f"w{first}", 6), _state(tmp_path, name, 6), tolerance)
    if len(worlds) == 3:  # and back: the checkpoint of step 5 written by the resumed run
        back = f"w{worlds[2]}-from-5"
        _assert_same_run(_state(tmp_path, name, 5), _state(tmp_path, back, 5), 0.0)
        _assert_same_run(_state(tmp_path, f"w{first}", 6), _state(tmp_path, back, 6), tolerance)
