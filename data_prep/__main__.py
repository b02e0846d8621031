"""`python -m data_prep {tokenizer,shards,finalize,inspect,listops} --help`.

    tokenizer  train a unigram (ALBERT) / WordPiece (BERT) tokenizer, or copy+validate one
    shards     tokenize the corpus into ALBERT example shards (+ manifest.json)
    finalize   write manifest.json after a multi-job (--num-jobs k) shards run
    inspect    counts, length histogram, decoded samples, --verify checksums
    listops    generate the LRA ListOps TSV files

User mistakes (missing input, existing output, a shard directory made with another config,
tokenizer or input content, a --vocab-size too small for the corpus, a corrupt shard) print
`error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from albatross.files import DiskFullError
from albatross.writer_lock import DirectoryBusy
from data_prep import listops
from data_prep.readers import DEFAULT_MAX_LINE_CHARS
from data_prep.sentences import MODES

log = logging.getLogger("data_prep")

_INPUT_HELP = (
    "input(s): files (.txt one sentence per line + blank line between documents, .jsonl, "
    ".parquet, each text/jsonl optionally .gz/.zst), HF save_to_disk directories, glob "
    "patterns (quote them), @list.txt (one path or glob per line), 'embedded' / "
    "'embedded:N' (the built-in corpus, or its first N documents), or a `datasets` source "
    "hf:SOURCE[@REVISION][:CONFIG[:SPLIT[:COLUMN]]] (a Hub dataset such as "
    "hf:wikimedia/wikipedia:20231101.en, a save_to_disk directory or a folder of "
    "Parquet/Arrow/JSON files; split default train, column default --text-field)"
)


def _add_input_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--input", nargs="+", required=required, metavar="INPUT", help=_INPUT_HELP)
    p.add_argument(
        "--text-field", default="text", help="JSONL field / Parquet or HF column with the text"
    )
    p.add_argument(
        "--max-line-chars",
        type=int,
        default=DEFAULT_MAX_LINE_CHARS,
        help="skip (and count) longer input lines",
    )
    p.add_argument(
        "--sentences",
        choices=MODES,
        default="auto",
        help="how a document's text becomes sentences: 'split' splits each line into sentences "
        "(nupunkt), 'lines' keeps each line as one sentence; 'auto' splits JSONL, Parquet and "
        "datasets documents and keeps the lines of plain text (one sentence per line) and of "
        "the embedded corpus",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="stream hf: sources (datasets streaming=True: nothing downloaded or converted "
        "ahead; the same documents in the same order, so the same shards)",
    )


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from data_prep.tokenizer import write_tokenizer

    path = write_tokenizer(
        args.out,
        inputs=args.input,
        kind=args.kind,
        vocab_size=args.vocab_size,
        from_tokenizer=args.from_tokenizer,
        text_field=args.text_field,
        max_line_chars=args.max_line_chars,
        max_sentences=args.max_sentences,
        overwrite=args.overwrite,
        sentences=args.sentences,
        streaming=args.streaming,
    )
    print(path)
    return 0


def _cmd_shards(args: argparse.Namespace) -> int:
    from data_prep.shards import ShardConfig, build_shards

    config = ShardConfig(
        inputs=tuple(args.input),
        num_shards=args.num_shards,
        max_seq_length=args.max_seq_length,
        short_seq_prob=args.short_seq_prob,
        seed=args.seed,
        text_field=args.text_field,
        max_line_chars=args.max_line_chars,
        truncation=args.truncation,
        validation_fraction=args.validation_fraction,
        validation_documents=args.validation_documents,
        validation_shards=args.validation_shards,
        sentences=args.sentences,
        streaming=args.streaming,
    )
    build_shards(
        config,
        args.tokenizer,
        args.out,
        workers=args.workers,
        job_index=args.job_index,
        num_jobs=args.num_jobs,
    )
    return 0


def _cmd_finalize(args: argparse.Namespace) -> int:
    from data_prep.shards import finalize

    finalize(args.out)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from data_prep.inspect_cmd import inspect

    inspect(args.dir, verify=args.verify, samples=args.samples, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Corpus -> tokenizer -> ALBERT pretraining shards; LRA ListOps generator.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    defaults = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser(
        "tokenizer",
        help="train a tokenizer (or copy and validate one) into DIR/tokenizer.json",
        description="Train a SentencePiece-unigram (ALBERT) or WordPiece (BERT) tokenizer with "
        "the special tokens <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4, or copy and validate an "
        "existing tokenizer.json (--from-tokenizer).",
        formatter_class=defaults,
    )
    _add_input_args(p, required=False)
    p.add_argument("--out", required=True, help="directory for tokenizer.json")
    p.add_argument("--kind", choices=["unigram", "wordpiece"], default="unigram")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=30000,
        help="vocabulary size; at least the 5 special tokens + the corpus's distinct characters "
        "(a smaller one is refused, naming the minimum)",
    )
    p.add_argument(
        "--max-sentences",
        type=int,
        default=None,
        help="train on at most this many sentences (the first ones; default: all)",
    )
    p.add_argument(
        "--from-tokenizer",
        default=None,
        metavar="PATH",
        help="copy this tokenizer.json instead of training (it must have pad/unk/cls/sep/mask)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    p.set_defaults(func=_cmd_tokenizer)

    p = sub.add_parser(
        "shards",
        help="tokenize the corpus into ALBERT example shards",
        description="Tokenize documents and write ALBERT sentence-order examples (segments A "
        "and B) as numpy shards: document d goes to shard d % S. Output bytes do not depend "
        "on --workers / --job-index / --num-jobs. Re-running resumes (done shards are "
        "verified and skipped); a directory made with another config, tokenizer or input (an "
        "input file whose content changed, by sha256, or a glob that now matches other files) "
        "is refused. A single-job run writes manifest.json; after a multi-job run use "
        "`finalize`. --validation-fraction / --validation-documents hold out whole documents "
        "as a validation split (valid_*.npy, the manifest's 'validation' section), chosen "
        "from --seed alone.",
        formatter_class=defaults,
    )
    _add_input_args(p, required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (copied into --out)")
    p.add_argument("--out", required=True, help="shard directory")
    p.add_argument("--num-shards", type=int, required=True, help="S, the number of shards")
    p.add_argument("--max-seq-length", type=int, default=512, help="[CLS] A [SEP] B [SEP] length")
    p.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="share of short-target examples"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--truncation",
        choices=("albert", "junction"),
        default="albert",
        help="cut over-long pairs at random ends (ALBERT) or keep the A|B junction",
    )
    held = p.add_mutually_exclusive_group()
    held.add_argument(
        "--validation-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out each document with probability F (chosen by a hash of (--seed, "
        "document index)) as a validation split: its examples go to valid_*.npy, never to "
        "training shards; 0 = no split (the directory is then exactly as without the flag)",
    )
    held.add_argument(
        "--validation-documents",
        type=int,
        default=0,
        metavar="N",
        help="hold out exactly N documents (the N smallest hashes; costs one extra read of the "
        "input, no tokenizing); 0 = no split",
    )
    p.add_argument(
        "--validation-shards",
        type=int,
        default=1,
        metavar="V",
        help="validation shards: held-out document d goes to valid_{d %% V} (more shards spread "
        "the held-out documents' tokenizing over workers and jobs)",
    )
    p.add_argument("--workers", type=int, default=1, help="processes on this machine")
    p.add_argument(
        "--job-index", type=int, default=0, help="this job's index i (shards s %% k == i)"
    )
    p.add_argument(
        "--num-jobs", type=int, default=1, help="k, the number of jobs (no manifest if > 1)"
    )
    p.set_defaults(func=_cmd_shards)

    p = sub.add_parser(
        "finalize",
        help="check all shards of a multi-job run and write manifest.json",
        description="Check that every shard's done-record exists and matches its files "
        "(sha256), that all jobs used the same tokenizer, config and input, then write "
        "manifest.json (the same bytes a single-job run writes).",
        formatter_class=defaults,
    )
    p.add_argument("--out", required=True, help="shard directory")
    p.set_defaults(func=_cmd_finalize)

    p = sub.add_parser(
        "inspect",
        help="counts, length histogram, decoded samples; --verify checksums",
        description="Describe a finished shard directory: counts, tokenizer, config, input "
        "statistics, a histogram of example lengths and decoded sample examples (A | B).",
        formatter_class=defaults,
    )
    p.add_argument("dir", help="shard directory (with manifest.json)")
    p.add_argument(
        "--verify", action="store_true", help="check sha256 of every file and array structure"
    )
    p.add_argument("--samples", type=int, default=1, help="decoded sample examples to print")
    p.add_argument("--seed", type=int, default=0, help="which samples")
    p.set_defaults(func=_cmd_inspect)

    listops.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    func: Any = args.func
    try:
        return int(func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, DiskFullError, DirectoryBusy) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
