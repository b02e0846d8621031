"""``python -m study.make_data GENERATOR --out DIR --options JSON``: the data a scale makes
itself (``DataSource.generate``), in the official formats the stages read:

    embedded    a SentencePiece-unigram tokenizer and ALBERT sentence-pair shards from the
                embedded corpus (CPython's documentation text): DIR/tokenizer/tokenizer.json,
                DIR/shards/ (options: vocab_size, max_seq_length, num_shards,
                validation_fraction, seed; tokenizer: another source's instead of a new one)
    listops     ListOps in the LRA TSV format (``python -m data_prep listops``; options: train,
                val, test, min_length, max_length, max_depth, max_args, op_prob, seed)
    glue        tiny GLUE TSVs of every task (``study/tiny_data.py``)
    lra         tiny Long Range Arena tasks (``study/tiny_data.py``; options: tasks, sizes)
    hf-albert   a tiny Hugging Face ALBERT directory (options: tokenizer_file, sizes)

A directory left by a killed run (its node not marked done) is removed first: it is the
study's own, never a user's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def _embedded(out: Path, options: dict[str, Any]) -> None:
    from data_prep.shards import ShardConfig, build_shards
    from data_prep.tokenizer import write_tokenizer

    if "tokenizer_file" in options:  # another source's tokenizer: every phase reads one
        (out / "tokenizer").mkdir(parents=True)
        tok = out / "tokenizer" / "tokenizer.json"
        shutil.copyfile(options["tokenizer_file"], tok)
    else:
        tok = write_tokenizer(
            out / "tokenizer", inputs=["embedded"], vocab_size=int(options.get("vocab_size", 2000))
        )
    config = ShardConfig(
        inputs=("embedded",),
        num_shards=int(options.get("num_shards", 2)),
        max_seq_length=int(options.get("max_seq_length", 64)),
        seed=int(options.get("seed", 0)),
        validation_fraction=float(options.get("validation_fraction", 0.0)),
    )
    build_shards(config, tok, out / "shards", workers=1)


def _listops(out: Path, options: dict[str, Any]) -> None:
    from data_prep.__main__ import main as data_prep_main

    args = ["listops", "--out", str(out), "--quiet"]
    for key, value in sorted(options.items()):
        args += [f"--{key.replace('_', '-')}", str(value)]
    if data_prep_main(args) != 0:
        raise RuntimeError(f"python -m data_prep {' '.join(args)} failed")


def _glue(out: Path, options: dict[str, Any]) -> None:
    from study.tiny_data import write_glue

    write_glue(out, **options)


def _lra(out: Path, options: dict[str, Any]) -> None:
    from study.tiny_data import write_lra

    write_lra(out, **options)


def _hf_albert(out: Path, options: dict[str, Any]) -> None:
    from study.tiny_data import write_hf_albert

    options = dict(options)
    write_hf_albert(out, Path(options.pop("tokenizer_file")), **options)


GENERATE = {
    "embedded": _embedded,
    "listops": _listops,
    "glue": _glue,
    "lra": _lra,
    "hf-albert": _hf_albert,
}


def make_data(generator: str, out: Path, options: dict[str, Any]) -> Path:
    if generator not in GENERATE:
        raise ValueError(f"unknown generator {generator!r}; valid: {sorted(GENERATE)}")
    if out.exists():
        shutil.rmtree(out)  # a killed run's leftovers (a finished node is never run again)
    out.parent.mkdir(parents=True, exist_ok=True)
    GENERATE[generator](out, options)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m study.make_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("generator", choices=sorted(GENERATE))
    parser.add_argument("--out", required=True, help="the directory to write (replaced)")
    parser.add_argument("--options", default="{}", help="the generator's options, as JSON")
    args = parser.parse_args(argv)
    make_data(args.generator, Path(args.out), json.loads(args.options))
    print(f"study.make_data {args.generator}: {args.out}")
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
