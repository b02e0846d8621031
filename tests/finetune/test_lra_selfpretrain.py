"""LRA self-pretraining: a task's inputs as single-layout shards (finetune/lra/shards.py), read by
the real pretraining loader, pretrained by ``python -m pretrain`` and fine-tuned from the
release; the synthetic Text task; the mini-LRA driver at its tiny scale."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from data_prep import format as fmt
from data_prep.listops import write_splits
from data_prep.loader import PretrainingData
from data_prep.masking import IGNORE_INDEX, MaskingConfig
from finetune.__main__ import main as finetune_main
from finetune.lra import mini
from finetune.lra.data import load_split, read_aclimdb
from finetune.lra.shards import lra_tokenizer, write_lra_shards
from finetune.lra.synthetic import NEGATIVE, POSITIVE, write_synthetic_imdb
from finetune.lra.tasks import CLS_ID, LISTOPS_VOCAB, MASK_ID, OFFSET, TASKS, get_task
from model.hub.release import load_release
from pretrain.__main__ import main as pretrain_main

pytestmark = pytest.mark.integration  # runs the stages end to end


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    write_splits(out, {"train": 120, "val": 20, "test": 20}, min_length=20, max_length=60, seed=3)
    return out


def test_tokenizer_ids_are_the_task_ids():
    for task in TASKS.values():
        tok = lra_tokenizer(task)
        assert tok.get_vocab_size() == task.vocab_size
        specials = fmt.SpecialTokens.from_tokenizer(tok)
        assert (specials.pad, specials.cls, specials.mask, specials.unk) == (
            0,
            CLS_ID,
            MASK_ID,
            None,
        )
    listops = lra_tokenizer("listops")
    assert listops.encode(" ".join(LISTOPS_VOCAB)).ids == [v + OFFSET for v in range(15)]
    assert lra_tokenizer("text").token_to_id("<0x41>") == ord("A") + OFFSET
    assert lra_tokenizer("image").token_to_id("<g000>") == OFFSET  # black is not padding


def test_listops_shards_hold_the_finetuning_inputs(listops_dir, tmp_path):
    out = tmp_path / "shards"
    manifest = write_lra_shards("listops", listops_dir, out, max_length=40, num_shards=2)
    assert manifest["layout"] == "single" and manifest["vocab_size"] == 19
    assert manifest["special_tokens"]["unk"] is None
    train, _ = load_split("listops", listops_dir, "train", 40)
    assert manifest["totals"]["examples"] == len(train) == 120

    masking = MaskingConfig(whole_word=False)
    data = PretrainingData(out, max_seq_length=41, masking=masking, verify_checksums=True)
    seen = 0
    for d in range(len(train)):  # document d went to shard d % 2
        local = d // 2 + (0 if d % 2 == 0 else manifest["shards"][0]["examples"])
        item = data[local]
        ids = train[d]["input_ids"]  # [CLS] + values + OFFSET, what fine-tuning sees
        original = np.where(item["labels"] != IGNORE_INDEX, item["labels"], item["input_ids"])
        assert original.tolist() == ids.tolist()
        assert item["sop_label"] == IGNORE_INDEX and not item["token_type_ids"].any()
        masked = item["labels"] != IGNORE_INDEX
        assert masked.sum() == max(1, int(np.floor(0.15 * (len(ids) - 1) + 0.5)))
        assert not masked[0]  # [CLS] is never predicted
        replaced = item["input_ids"][masked]
        assert ((replaced == MASK_ID) | (replaced >= OFFSET)).all()  # no other special id
        seen += int((item["input_ids"] == 2).any())
    assert seen == 0  # no [SEP]: the single layout is [CLS] doc


def test_retrieval_pairs_give_two_examples(tmp_path):
    data = tmp_path / "aan"
    data.mkdir()
    rows = [("1", "a", "b", "first doc", "second"), ("0", "c", "d", "third", "fourth doc")]
    for split in ("train", "eval", "test"):
        with open(data / f"new_aan_pairs.{split}.tsv", "w") as f:
            f.writelines("\t".join(r) + "\n" for r in rows)
    manifest = write_lra_shards("retrieval", data, tmp_path / "shards", max_length=6)
    assert manifest["totals"]["examples"] == 4
    tokens = np.load(tmp_path / "shards" / "shard_00000.tokens.npy")
    expected = [b"first ", b"second", b"third", b"fourth"]  # pairwise, cut to 6 bytes
    assert tokens.tolist() == [b + OFFSET for doc in expected for b in doc]


def test_shard_dir_is_reused_or_refused(listops_dir, tmp_path):
    out = tmp_path / "shards"
    write_lra_shards("listops", listops_dir, out, max_length=40)
    before = (out / "shard_00000.tokens.npy").stat().st_mtime_ns
    write_lra_shards("listops", listops_dir, out, max_length=40)  # same settings: reused
    assert (out / "shard_00000.tokens.npy").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match=r"other settings \(differing: \['max_length'\]\)"):
        write_lra_shards("listops", listops_dir, out, max_length=30)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        write_lra_shards("listops", listops_dir, foreign, max_length=40)
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="unknown LRA task"):
        write_lra_shards("lisops", listops_dir, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        write_lra_shards("listops", tmp_path / "missing", tmp_path / "y")


def test_self_pretrain_then_finetune_from_the_release(listops_dir, tmp_path):
    shards = tmp_path / "shards"
    args = ["lra-shards", "--task", "listops", "--data", str(listops_dir), "--out", str(shards)]
    assert finetune_main([*args, "--max-length", "60"]) == 0
    pre = tmp_path / "pretrain"
    args = ["--config", "configs/pretrain/debug-lra-listops.yaml", f"data.shards={shards}"]
    args += [f"train.run_dir={pre}", "data.max_seq_length=61", "train.progress=false"]
    args += ["schedule.total_steps=6", "schedule.warmup_steps=1", "engine.micro_batch_size=8"]
    assert pretrain_main(args) == 0
    release = load_release(pre / "release")
    assert release.config.vocab_size == get_task("listops").vocab_size
    rows = [
        json.loads(line)
        for line in (pre / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("loss/mlm" in r for r in rows)

    run_dir = tmp_path / "ft"
    args = ["lra", "--task", "listops", "--data", str(listops_dir), "--init", str(pre / "release")]
    args += ["data.max_length=60", "schedule.total_steps=4", "schedule.warmup_steps=0"]
    args += ["train.eval_every=4", "train.eval_at_start=true", f"train.run_dir={run_dir}"]
    args += ["engine.precision=fp32", "engine.micro_batch_size=8"]
    assert finetune_main(args) == 0
    row = json.loads((run_dir / "results.json").read_text())["runs"][0]
    assert row["init"] == str(pre / "release") and 0.0 <= row["test_accuracy"] <= 1.0


def test_synthetic_imdb(tmp_path):
    root = write_synthetic_imdb(tmp_path / "a", train=40, test=10, seed=1)
    again = write_synthetic_imdb(tmp_path / "b", train=40, test=10, seed=1)
    files = sorted(p.relative_to(root) for p in root.rglob("*.txt"))
    assert files == sorted(p.relative_to(again) for p in again.rglob("*.txt"))
    assert all((root / f).read_bytes() == (again / f).read_bytes() for f in files)
    split, stats = read_aclimdb(root, "train")
    assert len(split) == 40 and stats.label_counts == {0: 20, 1: 20}
    for path in root.rglob("*.txt"):
        words = re.findall(r"[a-z]+", path.read_text().lower())
        pos = sum(w in POSITIVE for w in words)
        neg = sum(w in NEGATIVE for w in words)
        assert pos + neg == 3 and (pos >= 2) == (path.parent.name == "pos")
        rating = int(path.stem.split("_")[1])
        assert (rating >= 7) == (path.parent.name == "pos")
    with pytest.raises(FileExistsError):
        write_synthetic_imdb(tmp_path / "a", train=4, test=2)
    with pytest.raises(ValueError, match="odd"):
        write_synthetic_imdb(tmp_path / "c", num_cues=2)


def test_mini_lra_tiny(tmp_path):
    rows = mini.run(tmp_path, ["text"], ["kernel"], [0], mini.SCALES["tiny"], jobs=2)
    assert sorted(r["init"] for r in rows) == ["scratch", "self-pretrained"]
    release = load_release(tmp_path / "pretrain" / "text-kernel" / "release")
    assert release.config.attention == "kernel" and release.config.vocab_size == 260
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("| model | init | text | text − shortcut | text gain | average |")
    assert "| kernel | scratch |" in table and "| kernel | self-pretrained |" in table
    assert "| bag-of-tokens | baseline |" in table and "| text: step | 4 | 8 |" in table
