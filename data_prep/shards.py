"""Shards stage: tokenize documents and write ALBERT pretraining examples as numpy shards.

Examples (ALBERT's `create_instances_from_document`, google-research/albert
create_pretraining_data.py, for sentence-order prediction):

    per document, with max_num_tokens = max_seq_length - 3 ([CLS] A [SEP] B [SEP]):
    target = max_num_tokens, or with probability short_seq_prob a uniform length in [2, max_num_tokens]
    accumulate consecutive sentences into a chunk until it holds >= target tokens (or the
    document ends); split the chunk at a random sentence boundary into A and B; truncate the
    longer side one token at a time, from the front or the back at random, until
    len(A) + len(B) <= max_num_tokens.

Decisions where this differs from ALBERT's code (MLM masking and the SOP swap are done at
training time by the loader, so none of that happens here):

* **Target drawn per example.** ALBERT draws `target` once per document; here it is drawn again
  for every chunk, so the share of short examples is `short_seq_prob` whatever the document
  lengths (with ALBERT's rule one long short-target document makes many short examples).
* **A sentence longer than the target is cut** into pieces: the first fills the open chunk up to
  the target exactly, the rest are handled like the next sentences (so they become target-size
  pieces). Long JSONL lines lose nothing to truncation.
* **A one-sentence chunk is split inside the sentence** at a random token, so A and B stay
  consecutive text of one document (ALBERT takes B from a random other document there, which
  would make SOP's "not swapped" label wrong). A one-token chunk has no A/B split and is
  dropped (counted in `dropped_tokens`).
* No `dupe_factor`: masking is dynamic, so one pass over the corpus gives one set of A/B splits.

Determinism: document d (0-based, `iter_documents` order) goes to shard d % S, and all its
randomness comes from `random.Random(f"{seed}:{d}")`; nothing depends on --workers,
--job-index or --num-jobs, so the bytes of every file are the same however the work is split
(for one Python and `tokenizers` version).

Validation split (--validation-fraction F / --validation-documents N; format.py has the rule):
every worker reads every document anyway, so each decides for itself, from (seed, d) alone,
whether d is held out (one blake2b per document, ~1 us); a held-out document goes, with the
same examples, to validation shard d % V instead of training shard d % S. Validation shard v is
built by job v % k, like training shard v; the done-records carry the selection and the
held-out count, which `finalize` checks agree. --validation-documents N first reads the input
once more, without tokenizing, to find the N smallest keys (`choose_validation`). Without a
flag nothing changes: no key in the config, no file, the same bytes as before the option.

Writing: each shard streams its tokens and index rows to hidden `.partial` files (memory stays
bounded whatever the corpus and the number of shards a worker holds), then writes the two .npy
arrays (temp file + rename), then its done-record (`format.done_file`) last. A shard with a
valid done-record is complete; anything else is rebuilt. The manifest is written by `finalize`
(at the end of a single-job run, or explicitly after a multi-job run) from the done-records.

Changed input: every done-record (and the manifest) lists the input files with their size,
mtime and sha256 (`readers.fingerprint_inputs`, the whole file is hashed: ~0.05 s per 100 MB,
against ~35 s to tokenize it). A run whose inputs differ in content from those records (a file
edited under the same path, whatever its size and mtime; a glob or @list that now names other
files) is refused, naming the file: every shard depends on every input (document d goes to
shard d % S), so no old shard can be kept, and mixing old and new shards would be silent.
A file that was only touched or copied (same bytes, new mtime) is the same input.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albatross.writer_lock import one_writer
from data_prep import datasets_source
from data_prep import format as fmt
from data_prep.examples import (
    ValidationSplit,
    build_examples,
    choose_validation,
    document_rng,
)
from data_prep.readers import expand_inputs, fingerprint_inputs
from data_prep.shard_config import TRUNCATIONS, ShardConfig
from data_prep.shard_worker import (
    Progress,
    Task,
    init_worker,
    run_task,
    run_task_in_pool,
)
from data_prep.shard_writer import ShardWriter, atomic_copy, atomic_write_json
from data_prep.tokenizer import load_tokenizer, tokenizer_kind

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the stage


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise fmt.ShardError(f"{path} cannot be read: {e}") from e


def _config_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(
        f"{k}: {old.get(k)!r} there vs {new.get(k)!r} now" for k in keys if old.get(k) != new.get(k)
    )


def _input_change(
    recorded: list[dict[str, Any]] | None, current: list[dict[str, Any]] | None
) -> str:
    """How the `current` input fingerprints (`readers.fingerprint_inputs`) differ from the
    `recorded` ones: '' if the same files, in the same order, have the same size and sha256
    (mtimes are not compared: a copy or `touch` is the same input). '' too if either is None
    (a record made before fingerprints were kept cannot tell)."""
    if recorded is None or current is None:
        return ""
    old = {f["path"]: f for f in recorded}
    new = {f["path"]: f for f in current}

    def shown(paths: list[str]) -> str:
        return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")

    added = [p for p in new if p not in old]
    removed = [p for p in old if p not in new]
    if added or removed:
        lists = (("added", added), ("removed", removed))
        return "input files " + "; ".join(f"{w}: {shown(ps)}" for w, ps in lists if ps)
    changed = [
        p for p in new if (old[p]["size"], old[p]["sha256"]) != (new[p]["size"], new[p]["sha256"])
    ]
    if changed:
        a, b = old[changed[0]], new[changed[0]]
        if a["size"] == b["size"]:
            size = f"the same size, {a['size']} bytes"
        else:
            size = f"size {a['size']} there vs {b['size']} bytes now"
        more = f" (and {shown(changed[1:])})" if changed[1:] else ""
        return (
            f"input file {changed[0]}{more} has changed: sha256 {a['sha256'][:12]}... there vs "
            f"{b['sha256'][:12]}... now, {size}"
        )
    if list(old) != list(new):
        return f"input files in another order: {shown(list(old))} there vs {shown(list(new))} now"
    return ""


def _check_same_origin(
    path: Path,
    record: dict[str, Any],
    config: dict[str, Any],
    tok_sha: str,
    input_files: list[dict[str, Any]] | None,
) -> None:
    """ShardError unless `record` (a done-record or manifest) was made with this config,
    tokenizer and input (`input_files`: fingerprints; None: not checked)."""
    if record.get("config") != config:
        raise fmt.ShardError(
            f"{path.parent} holds shards made with a different config ({path.name}: "
            f"{_config_diff(record.get('config') or {}, config)}); use another --out "
            "directory or delete this one"
        )
    if record.get("tokenizer_sha256") != tok_sha:
        raise fmt.ShardError(
            f"{path.parent} holds shards made with a different tokenizer ({path.name}: sha256 "
            f"{str(record.get('tokenizer_sha256'))[:12]}... vs {tok_sha[:12]}... now); use "
            "another --out directory or delete this one"
        )
    change = _input_change(record.get("input_files"), input_files)
    if change:
        raise fmt.ShardError(
            f"{path.parent} holds shards made from other input ({path.name}: {change}); every "
            "shard depends on every input file, so none of them can be kept: use another --out "
            "directory, or delete this one to rebuild it from the current input"
        )


def _check_unchanged_while_read(input_files: list[dict[str, Any]], out: Path) -> None:
    """ShardError if an input file's size or mtime differs from its fingerprint, taken before
    it was read (a download or an edit still going on): the shards just built may mix old and
    new text, and no manifest is written. (Their done-records hold the old sha256, so a re-run
    refuses the directory too.) A stat per file: nothing is read again."""
    for f in input_files:
        if f["mtime_ns"] is None or not os.path.isfile(f["path"]):
            continue  # the embedded corpus; HF directories are checked by the next run's hash
        st = os.stat(f["path"])
        if (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"]):
            raise fmt.ShardError(
                f"input file {f['path']} changed while it was being read (size {f['size']} -> "
                f"{st.st_size} bytes, or a new mtime): the shards in {out} may mix old and new "
                "text; delete the directory and rebuild it once the file is final"
            )


def _shard_is_done(out_dir: Path, name: str) -> bool:
    """True if the done-record exists and the arrays match it; False (with a warning for a
    stale record) if the shard must be (re)built."""
    done = out_dir / fmt.done_file(name)
    if not done.is_file():
        return False
    record = _read_json(done)
    for fname, digest in record.get("sha256", {}).items():
        path = out_dir / fname
        if not path.is_file() or fmt.sha256_file(path) != digest:
            log.warning("%s does not match %s: rebuilding %s", path, done.name, name)
            return False
    return True


def _clean_shard(out_dir: Path, name: str) -> None:
    (out_dir / fmt.done_file(name)).unlink(missing_ok=True)  # first: never a record without files
    for p in (out_dir / fmt.tokens_file(name), out_dir / fmt.index_file(name)):
        p.unlink(missing_ok=True)
    for p in out_dir.glob(f".{name}.*"):  # .partial files, temp files of a killed writer
        p.unlink(missing_ok=True)


def build_shards(
    config: ShardConfig,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    workers: int = 1,
    job_index: int = 0,
    num_jobs: int = 1,
) -> dict[str, Any]:
    """Builds the shards s with s % num_jobs == job_index that are not already done (resume),
    in `workers` processes; a single-job run then writes manifest.json. Returns a summary.
    One process per (directory, job index): a second is refused (``DirectoryBusy``) naming
    the first."""
    if num_jobs < 1 or not 0 <= job_index < num_jobs:
        raise ValueError(f"need 0 <= --job-index < --num-jobs, got {job_index} and {num_jobs}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tok = load_tokenizer(tokenizer_path)
    out = Path(out_dir)
    with one_writer(
        out,
        f"shard build (job {job_index} of {num_jobs})",
        lock_name=f".writer-job{job_index}-of{num_jobs}.lock",
    ):
        return _build_shards(config, tokenizer_path, tok, out, workers, job_index, num_jobs)


def _build_shards(
    config: ShardConfig,
    tokenizer_path: str | os.PathLike,
    tok: Any,
    out: Path,
    workers: int,
    job_index: int,
    num_jobs: int,
) -> dict[str, Any]:
    tok_sha = fmt.sha256_file(tokenizer_path)
    cfg_dict = config.to_dict()

    # An existing directory must come from the same config and tokenizer: never overwrite.
    out_tok = out / fmt.TOKENIZER
    if out_tok.exists() and fmt.sha256_file(out_tok) != tok_sha:
        raise fmt.ShardError(
            f"{out} holds a different tokenizer.json than {tokenizer_path}; use another --out "
            "directory or delete this one"
        )
    hash_start = time.perf_counter()
    input_files = fingerprint_inputs(expand_inputs(config.inputs))
    log.info(
        "input: %d file(s), %.1f MB, hashed in %.1f s",
        len(input_files),
        sum(f["size"] for f in input_files) / 1e6,
        time.perf_counter() - hash_start,
    )
    for path in [*_done_records(out), out / fmt.MANIFEST]:
        if path.is_file():
            _check_same_origin(path, _read_json(path), cfg_dict, tok_sha, input_files)
    if not out_tok.exists():
        atomic_copy(Path(tokenizer_path), out_tok)

    # Units of work: training shard s and validation shard v both go to job (s or v) % k.
    mine = [_Unit(False, s) for s in range(config.num_shards) if s % num_jobs == job_index]
    if config.has_validation:
        mine += [
            _Unit(True, v) for v in range(config.validation_shards) if v % num_jobs == job_index
        ]
    todo = [u for u in mine if not _shard_is_done(out, u.name)]
    n_valid = sum(u.validation for u in mine)
    log.info(
        "shards: %d of %d for job %d/%d%s, %d already done, %d to build with %d worker(s)",
        len(mine) - n_valid,
        config.num_shards,
        job_index,
        num_jobs,
        f" (+ {n_valid} of {config.validation_shards} validation)" if n_valid else "",
        len(mine) - len(todo),
        len(todo),
        min(workers, max(len(todo), 1)),
    )
    start = time.perf_counter()
    if todo:
        if not config.streaming and min(workers, len(todo)) > 1:
            for item in config.inputs:  # download/convert once, not in every worker at once
                if datasets_source.is_spec(item):
                    datasets_source.prepare(datasets_source.parse(item))
        split = choose_validation(config)  # --validation-documents: one read of the input
        (out / fmt.MANIFEST).unlink(missing_ok=True)  # a manifest only lists complete shards
        for u in todo:
            _clean_shard(out, u.name)
        _run(config, str(tokenizer_path), tok_sha, out, todo, workers, input_files, split)
        _check_unchanged_while_read(input_files, out)
    seconds = time.perf_counter() - start
    records = [_read_json(out / fmt.done_file(u.name)) for u in todo]
    tokens = sum(r["tokens"] for r in records)
    summary = {
        "built": len(todo),
        "skipped": len(mine) - len(todo),
        "examples": sum(r["examples"] for r in records),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if todo and seconds > 0 else None,
        "manifest": None,
    }
    if todo:
        chars = records[0]["input"]["characters"]
        log.info(
            "built %d shard(s): %d examples, %d tokens in %.1f s (%.0f tokens/s; read %.1f M "
            "characters per worker, %.2f M characters/s)",
            len(todo),
            summary["examples"],
            tokens,
            seconds,
            tokens / seconds,
            chars / 1e6,
            chars / 1e6 / seconds,
        )
    del tok
    if num_jobs == 1:
        finalize(out)
        summary["manifest"] = str(out / fmt.MANIFEST)
    else:
        log.info(
            "job %d/%d done; run `python -m data_prep finalize --out %s` after all jobs",
            job_index,
            num_jobs,
            out,
        )
    return summary


@dataclass(frozen=True)
class _Unit:
    """One shard to build: training shard `index`, or validation shard `index`."""

    validation: bool
    index: int

    @property
    def name(self) -> str:
        return fmt.valid_name(self.index) if self.validation else fmt.shard_name(self.index)


def _done_records(out: Path) -> list[Path]:
    """The done-records in `out`: training shards, then validation shards."""
    return [*sorted(out.glob("shard_*.done.json")), *sorted(out.glob("valid_*.done.json"))]


def _run(
    config: ShardConfig,
    tokenizer_path: str,
    tok_sha: str,
    out: Path,
    todo: list[_Unit],
    workers: int,
    input_files: list[dict[str, Any]],
    split: ValidationSplit | None = None,
) -> None:
    workers = min(workers, len(todo))
    tasks = [
        Task(
            config,
            tokenizer_path,
            tok_sha,
            str(out),
            tuple(u.index for u in todo[w::workers] if not u.validation),
            w,
            tuple(input_files),
            tuple(u.index for u in todo[w::workers] if u.validation),
            split,
        )
        for w in range(workers)
    ]
    bar = Progress("shards", "tok")
    try:
        if workers == 1:
            run_task(tasks[0], lambda docs, toks: bar.update(toks, docs=docs))
            return
        ctx = mp.get_context("spawn")  # fresh interpreters: no forked tokenizers thread pools
        counters = ctx.Array("q", 2 * workers, lock=False)
        threads = max(1, (os.cpu_count() or 1) // workers)
        with ctx.Pool(workers, init_worker, (counters, threads, logging.getLogger().level)) as pool:
            result = pool.map_async(run_task_in_pool, tasks, chunksize=1)
            while not result.ready():
                result.wait(0.5)
                bar.update(sum(counters[1::2]), docs=min(counters[0::2]))
            result.get()  # re-raises a worker's exception here
    finally:
        bar.close()


# ----------------------------------------------------------------------------- finalize


def finalize(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Checks that every shard's done-record exists and matches its files (sha256) and that all
    come from one config, tokenizer and input (the same input statistics and, where recorded,
    the same input file contents), and the validation shards' too where the config has a
    validation split (and the same held-out documents); then writes manifest.json.
    Byte-identical to the manifest of a single-job run. ShardError (naming the file) otherwise."""
    out = Path(out_dir)
    done_paths = sorted(out.glob("shard_*.done.json"))
    if not done_paths:
        raise fmt.ShardError(
            f"{out}: no shard done-records (shard_*.done.json); nothing to finalize"
        )
    first = _read_json(done_paths[0])
    config, tok_sha, input_stats, input_files = (
        first.get("config"),
        first.get("tokenizer_sha256"),
        first.get("input"),
        first.get("input_files"),  # None in records made before fingerprints were kept
    )
    if not isinstance(config, dict) or "num_shards" not in config:
        raise fmt.ShardError(f"{done_paths[0]} has no config: not a done-record of this format")
    num_shards = int(config["num_shards"])
    has_validation = bool(config.get("validation_fraction") or config.get("validation_documents"))
    num_valid = int(config.get("validation_shards", 1)) if has_validation else 0
    split_meta = first.get("validation")
    names = [fmt.shard_name(s) for s in range(num_shards)]
    names += [fmt.valid_name(v) for v in range(num_valid)]
    records = []
    missing = []
    for name in names:
        path = out / fmt.done_file(name)
        if not path.is_file():
            missing.append(name)
            continue
        record = _read_json(path)
        _check_same_origin(path, record, config, tok_sha, input_files)
        if record.get("input") != input_stats:
            raise fmt.ShardError(
                f"{path} was made from different input than {done_paths[0].name} (input stats "
                "differ: did the input files change between jobs?); rebuild the directory"
            )
        if record.get("validation") != split_meta:
            raise fmt.ShardError(
                f"{path} holds out other validation documents than {done_paths[0].name} "
                f"({record.get('validation')} vs {split_meta}); rebuild the directory"
            )
        records.append(record)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        valid = f" and {num_valid} validation shards" if num_valid else ""
        raise fmt.ShardError(
            f"{out}: {len(missing)} of {num_shards} shards{valid} are not done ({shown}); run "
            "the job(s) that make them (with --num-jobs k, shard s is made by job s % k, "
            "validation shard v by job v % k), then finalize"
        )
    tok_path = out / fmt.TOKENIZER
    if not tok_path.is_file() or fmt.sha256_file(tok_path) != tok_sha:
        raise fmt.ShardError(
            f"{tok_path} is missing or is not the tokenizer the shards were made with"
        )
    for record in records:
        for fname, digest in record["sha256"].items():
            path = out / fname
            if not path.is_file():
                raise fmt.ShardError(
                    f"{path} is missing (listed in {fmt.done_file(record['name'])})"
                )
            if fmt.sha256_file(path) != digest:
                raise fmt.ShardError(
                    f"{path} is corrupt or truncated: its sha256 does not match "
                    f"{fmt.done_file(record['name'])}; delete that done-record and re-run the "
                    "shards command to rebuild it"
                )
    if any("split_sentences" in r for r in records):
        # Each worker split only its own documents: the sentences of the whole input are those
        # read as they were plus those each shard split.
        input_stats = dict(input_stats)
        input_stats["sentences"] += sum(r.get("split_sentences", 0) for r in records)
    tok = load_tokenizer(tok_path)
    empty = [r["name"] for r in records if r["examples"] == 0]
    if empty:
        log.warning(
            "%d shard(s) hold no example (more shards than documents?): %s",
            len(empty),
            ", ".join(empty[:10]),
        )
    train, valid = records[:num_shards], records[num_shards:]
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer_sha256": tok_sha,
        "tokenizer_kind": tokenizer_kind(tok_path),
        "special_tokens": fmt.SpecialTokens.from_tokenizer(tok).to_dict(),
        "vocab_size": tok.get_vocab_size(),
        "token_dtype": fmt.token_dtype(tok.get_vocab_size()).name,
        **({"layout": config["layout"]} if "layout" in config else {}),
        "config": config,
        "num_shards": num_shards,
        "shards": _shard_entries(train),
        "totals": _totals(train),
        **({fmt.VALIDATION_KEY: _validation_section(config, split_meta, valid)} if valid else {}),
        "input": input_stats,
        **({"input_files": input_files} if input_files is not None else {}),
    }
    atomic_write_json(out / fmt.MANIFEST, manifest)
    log.info(
        "wrote %s: %d shards, %d examples, %d tokens%s",
        out / fmt.MANIFEST,
        num_shards,
        manifest["totals"]["examples"],
        manifest["totals"]["tokens"],
        (
            f"; validation: {num_valid} shard(s), {manifest['validation']['totals']['examples']} "
            f"examples, {manifest['validation']['totals']['tokens']} tokens, "
            f"{manifest['validation']['totals']['documents']} documents"
            if valid
            else ""
        ),
    )
    return manifest


def _shard_entries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": r["name"],
            "examples": r["examples"],
            "tokens": r["tokens"],
            "documents": r["documents"],
            "sha256": r["sha256"],
        }
        for r in records
    ]


def _totals(records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "examples": sum(r["examples"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "dropped_tokens": sum(r["dropped_tokens"] for r in records),
    }


def _validation_section(
    config: dict[str, Any], meta: dict[str, Any] | None, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest's "validation" section (format.py) from the validation done-records."""
    if not isinstance(meta, dict) or "selection" not in meta:
        raise fmt.ShardError(
            f"{records[0]['name']}: its done-record does not say how the validation documents "
            "were chosen; rebuild the directory"
        )
    sel = meta["selection"]
    threshold = sel["threshold"] if sel["rule"] == "fraction" else tuple(sel["threshold"])
    requested = sel["fraction"] if sel["rule"] == "fraction" else sel["documents"]
    split = ValidationSplit(int(config["seed"]), sel["rule"], threshold, requested)
    totals = _totals(records)
    if totals["documents"] != meta["documents"]:
        raise fmt.ShardError(
            f"the validation shards hold {totals['documents']} documents, but "
            f"{meta['documents']} were held out; rebuild the directory"
        )
    return {
        "selection": sel,
        "how": split.describe(len(records)),
        "seed": int(config["seed"]),
        "num_shards": len(records),
        "shards": _shard_entries(records),
        "totals": totals,
    }


__all__ = [  # the stage, and what it is made of (examples.py, shard_config.py, shard_writer.py)
    "TRUNCATIONS",
    "ShardConfig",
    "ShardWriter",
    "ValidationSplit",
    "build_examples",
    "build_shards",
    "choose_validation",
    "document_rng",
    "finalize",
]
