"""`python -m data_prep inspect DIR [--verify]`: what a finished shard directory holds.

Prints the counts (the validation split's too, where there is one), the tokenizer and config,
the input statistics, a text histogram of example lengths ([CLS] A [SEP] B [SEP]) and decoded
sample examples (A | B) of the training shards. With --verify it also checks every file (the
validation shards' too) against the manifest's sha256 (`format.verify_shards`) and the
arrays' structure (shapes, offsets, token ids below the vocabulary size); a corrupt or
truncated shard raises ShardError naming the file.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from data_prep import format as fmt


def _open(shard_dir: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return fmt.open_shard(shard_dir, name)
    except fmt.ShardError:
        raise
    except (OSError, ValueError) as e:  # missing, truncated (mmap past the end), bad header
        raise fmt.ShardError(
            f"{shard_dir / fmt.tokens_file(name)} / {fmt.index_file(name)} cannot be read "
            f"(missing, truncated or corrupt; run inspect --verify): {e}"
        ) from e


def check_structure(shard_dir: Path, manifest: dict[str, Any]) -> None:
    """ShardError if an array's shape, offsets, counts or ids disagree with the manifest (the
    validation shards' too, where the directory has a validation split)."""
    vocab = int(manifest["vocab_size"])
    max_len = int(manifest["config"]["max_seq_length"]) - 3
    shards = list(manifest["shards"])
    if fmt.VALIDATION_KEY in manifest:
        shards += fmt.split_shards(manifest, "validation", shard_dir)
    for shard in shards:
        name = shard["name"]
        tokens, index = _open(shard_dir, name)
        where = shard_dir / fmt.index_file(name)
        n = int(shard["examples"])
        if index.shape[0] != n or tokens.shape != (int(shard["tokens"]),):
            raise fmt.ShardError(
                f"{where}: {index.shape[0]} examples / {tokens.shape} tokens, the manifest says "
                f"{n} / {shard['tokens']}"
            )
        if n:
            offsets, la, lb = index[:, 0], index[:, 1], index[:, 2]
            ends = np.cumsum(la + lb)
            if offsets[0] != 0 or np.any(offsets[1:] != ends[:-1]) or ends[-1] != tokens.size:
                raise fmt.ShardError(f"{where}: offsets are not contiguous")
            if la.min() < 1 or lb.min() < 1 or (la + lb).max() > max_len:
                raise fmt.ShardError(f"{where}: a segment is empty or an example is too long")
        if tokens.size and int(tokens.max()) >= vocab:
            raise fmt.ShardError(
                f"{shard_dir / fmt.tokens_file(name)}: token id {int(tokens.max())} >= vocab {vocab}"
            )


def _histogram(lengths: np.ndarray, max_len: int, out: TextIO, bins: int = 10) -> None:
    edges = np.linspace(0, max_len, bins + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    width = 50
    top = max(int(counts.max()), 1)
    for lo, hi, c in zip(edges[:-1], edges[1:], counts):
        bar = "#" * round(width * int(c) / top)
        print(f"  {int(lo):>6}-{int(hi):<6} {int(c):>9}  {bar}", file=out)


def inspect(
    shard_dir: str | os.PathLike,
    *,
    verify: bool = False,
    samples: int = 1,
    seed: int = 0,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Prints the report to `out` (stdout); returns the manifest. ShardError on a bad dir."""
    import sys

    out = out or sys.stdout
    shard_dir = Path(shard_dir)
    manifest = fmt.read_manifest(shard_dir)
    totals, cfg = manifest["totals"], manifest["config"]
    print(f"shard directory {shard_dir}", file=out)
    print(
        f"  {manifest['num_shards']} shards, {totals['examples']} examples, {totals['tokens']} "
        f"tokens, {totals['documents']} documents, {totals.get('dropped_tokens', 0)} tokens "
        "dropped (truncation)",
        file=out,
    )
    print(
        f"  tokenizer: {manifest['tokenizer_kind']}, vocab {manifest['vocab_size']}, special "
        f"{manifest['special_tokens']}, sha256 {manifest['tokenizer_sha256'][:12]}...",
        file=out,
    )
    valid = manifest.get(fmt.VALIDATION_KEY)
    if valid is not None:
        vt = valid["totals"]
        print(
            f"  validation: {valid['num_shards']} shard(s), {vt['examples']} examples, "
            f"{vt['tokens']} tokens, {vt['documents']} held-out documents "
            f"({valid['selection']['rule']}: "
            f"{valid['selection'].get('fraction', valid['selection'].get('documents'))}, "
            f"seed {valid['seed']})",
            file=out,
        )
    print(f"  config: {cfg}", file=out)
    print(f"  input: {manifest['input']}", file=out)
    if verify:
        fmt.verify_shards(shard_dir, manifest)
        fmt.verify_tokenizer(shard_dir, shard_dir / fmt.TOKENIZER)
        check_structure(shard_dir, manifest)
        print("  verify: OK (sha256 of every file, tokenizer, array structure)", file=out)

    lengths = []
    for shard in manifest["shards"]:
        _, index = _open(shard_dir, shard["name"])
        lengths.append(np.asarray(index[:, 1] + index[:, 2]) + 3)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    max_len = int(cfg["max_seq_length"])
    if all_lengths.size:
        print(
            f"example length with [CLS]/[SEP] (max {max_len}): mean {all_lengths.mean():.1f}, "
            f"median {int(np.median(all_lengths))}, {(all_lengths == max_len).mean():.1%} full",
            file=out,
        )
        _histogram(all_lengths, max_len, out)

    if samples > 0 and all_lengths.size:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(shard_dir / fmt.TOKENIZER))
        rng = random.Random(seed)
        nonempty = [s["name"] for s in manifest["shards"] if s["examples"]]
        for _ in range(samples):
            name = rng.choice(nonempty)
            tokens, index = _open(shard_dir, name)
            i = rng.randrange(index.shape[0])
            off, la, lb = (int(x) for x in index[i])
            a = tok.decode(tokens[off : off + la].tolist())
            b = tok.decode(tokens[off + la : off + la + lb].tolist())
            print(f"sample {name}[{i}] ({la} + {lb} tokens):", file=out)
            print(f"  A: {a}", file=out)
            print(f"  B: {b}", file=out)
    return manifest
