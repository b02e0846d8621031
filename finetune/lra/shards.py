"""``python -m finetune lra-shards``: a task's own inputs as pretraining shards (self-pretraining).

Self-pretraining (Amos, Berant & Gupta 2023, "Never Train from Scratch", arXiv 2310.02980):
masked-LM on the inputs of the task's training split, then fine-tuning from that release. This
module writes those inputs as a shard directory in the project's format
(`data_prep/format.py`), so the pretraining itself is the ordinary ``python -m pretrain``:

    python -m finetune lra-shards --task listops --data DIR --out runs/lra-shards/listops
    python -m pretrain --config configs/pretrain/lra/listops.yaml data.shards=runs/lra-shards/listops
    python -m finetune lra --task listops --data DIR --init runs/lra-pretrain/listops/release

What it writes:

* ``tokenizer.json``: a closed word-level vocabulary equal to the LRA ids of
  `finetune.lra.tasks` (``<pad>`` 0, ``[CLS]`` 1, ``[SEP]`` 2, ``[MASK]`` 3, then one token
  per data value: the ListOps tokens, ``<0xNN>`` for bytes, ``<gNNN>`` for grey levels). No
  ``[UNK]``: every value has its token. So the release's vocabulary is the task's, and
  ``--init`` accepts it.
* Shards of layout ``single``: one example per document (both documents of a Retrieval pair
  are examples, one after the other), the data values as ids, no special tokens; the loader builds ``[CLS] doc``
  and masks it (no [SEP], no sentence-order label). Documents are cut to ``--max-length``
  data tokens, as fine-tuning cuts them, and document d goes to shard d % S.

Labels are never written: pretraining sees inputs only. By default only the training split is
used (``--splits`` adds others; the test split's inputs are not meant for it).

An existing directory is reused when it was made with the same task, data and settings, and
refused otherwise (nothing is overwritten).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import format as fmt
from data_prep.shards import ShardWriter, finalize
from finetune.lra.data import load_split
from finetune.lra.tasks import (
    BYTES,
    LISTOPS,
    LISTOPS_VOCAB,
    OFFSET,
    PATHFINDER_DIFFICULTIES,
    SPECIAL_TOKENS,
    LraTask,
    get_task,
)

log = logging.getLogger(__name__)

LAYOUT = "single"


def data_token_names(task: LraTask) -> list[str]:
    """The token of each data value (value v has id v + OFFSET)."""
    if task.input_kind == LISTOPS:
        return list(LISTOPS_VOCAB)
    if task.input_kind == BYTES:
        return [f"<0x{v:02X}>" for v in range(256)]
    return [f"<g{v:03d}>" for v in range(256)]


def lra_tokenizer(task: str | LraTask) -> Any:
    """A `tokenizers.Tokenizer` whose ids are the task's LRA ids (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    task = get_task(task)
    tokens = [*SPECIAL_TOKENS, *data_token_names(task)]
    assert len(tokens) == task.vocab_size and len(SPECIAL_TOKENS) == OFFSET
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tok


def _documents(split: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """(codes, offsets) of each document stream of a split (two for pair tasks)."""
    streams = [(split.codes, split.offsets)]
    if split.pair:
        streams.append((split.codes_b, split.offsets_b))
    return streams


def write_lra_shards(
    task: str | LraTask,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_length: int | None = None,
    num_shards: int = 1,
    splits: Sequence[str] = ("train",),
    difficulty: str | None = None,
    split_seed: int = 0,
) -> dict[str, Any]:
    """Writes the shard directory (see the module docstring); returns its manifest."""
    task = get_task(task)
    if num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {num_shards}")
    if not splits:
        raise ValueError("--splits: at least one split")
    for split in splits:
        task.check_split(split)
    if difficulty is not None and difficulty not in PATHFINDER_DIFFICULTIES:
        raise ValueError(
            f"unknown difficulty {difficulty!r}; valid: {list(PATHFINDER_DIFFICULTIES)}"
        )
    data_dir, out = Path(data_dir), Path(out_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"--data {data_dir}: no such directory")
    max_length = task.resolve_max_length(max_length)
    config = {
        "producer": "finetune.lra.shards",
        "layout": LAYOUT,
        "task": task.name,
        "data": str(data_dir.resolve()),
        "splits": list(splits),
        "max_length": max_length,
        "difficulty": difficulty,
        "split_seed": split_seed,
        "num_shards": num_shards,
    }
    existing = _existing(out, config)
    if existing is not None:
        return existing
    out.mkdir(parents=True, exist_ok=True)

    options: dict[str, Any] = {}
    if task.name in ("pathfinder", "pathx"):
        options = {"difficulty": difficulty, "split_seed": split_seed}
    loaded = [
        load_split(task, data_dir, split, max_length, cls=False, **options)[0] for split in splits
    ]
    tok_path = out / fmt.TOKENIZER
    fmt.atomic_write_text(tok_path, lra_tokenizer(task).to_str(pretty=True))
    input_stats = {
        "splits": {name: len(split) for name, split in zip(splits, loaded)},
        "documents": sum(len(s) * (2 if s.pair else 1) for s in loaded),
    }
    extra = {
        "config": config,
        "tokenizer_sha256": fmt.sha256_file(tok_path),
        "input": input_stats,
    }
    writers = [
        ShardWriter(out, s, fmt.token_dtype(task.vocab_size), 1 << 24) for s in range(num_shards)
    ]
    d = 0
    for split in loaded:
        streams = _documents(split)
        for i in range(len(split)):
            for codes, offsets in streams:  # a pair's two documents one after the other
                doc = codes[offsets[i] : offsets[i + 1]].astype(np.int64) + OFFSET
                if len(doc):
                    writers[d % num_shards].add([(doc.tolist(), [])], 0)
                else:  # an empty document has nothing to mask
                    writers[d % num_shards].add([], 0)
                d += 1
    for writer in writers:
        writer.finish(extra)
    manifest = finalize(out)
    log.info(
        "wrote %s: %d examples, %d tokens (%s, layout single)",
        out,
        manifest["totals"]["examples"],
        manifest["totals"]["tokens"],
        task.name,
    )
    return manifest


def _existing(out: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of a finished directory made with `config`; ValueError if `out` holds
    anything else (nothing is overwritten); None if `out` is missing or empty."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if (out / fmt.MANIFEST).is_file():
        manifest = fmt.read_manifest(out)
        if manifest.get("config") == config:
            log.info("%s already holds these shards; reusing them", out)
            return manifest
        old = manifest.get("config") or {}
        diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        raise ValueError(
            f"--out {out} holds shards made with other settings (differing: {diff}); choose "
            "another --out or delete it"
        )
    # An interrupted run of this command leaves its own files only: those are rebuilt.
    for path in out.iterdir():
        ours = path.name == fmt.TOKENIZER or (
            path.name.lstrip(".").startswith("shard_") and path.is_file()
        )
        if not ours:
            raise ValueError(
                f"--out {out} is not empty and holds no finished shards (no {fmt.MANIFEST}; "
                f"found {path.name}); choose another --out or delete it"
            )
        if path.name.endswith(".done.json"):
            record = json.loads(path.read_text())
            if record.get("config") != config:
                raise ValueError(
                    f"--out {out} holds unfinished shards made with other settings "
                    f"({path.name}); choose another --out or delete it"
                )
    return None


def main(args: Any) -> int:
    manifest = write_lra_shards(
        args.task,
        args.data,
        args.out,
        max_length=args.max_length,
        num_shards=args.num_shards,
        splits=args.splits,
        difficulty=args.difficulty,
        split_seed=args.split_seed,
    )
    totals = manifest["totals"]
    print(
        f"{args.out}: {totals['examples']} examples, {totals['tokens']} tokens, "
        f"vocab {manifest['vocab_size']} (layout single)"
    )
    return 0
