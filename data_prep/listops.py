"""Long Range Arena ListOps generator (`python -m data_prep listops`).

A port of google-research/long-range-arena `lra_benchmarks/data/listops.py` without TensorFlow,
seeded, deduplicated and written atomically. The data are the official ones in every respect
that can be reproduced:

* Operators `[MIN`, `[MAX`, `[MED`, `[SM`, each closed by `]`; leaves are the digits 0-9.
  MED is the floor of the median of the argument values (the official `int(np.median(...))`,
  the same thing for non-negative values), SM is the sum mod 10.
* Generation (`generate_tree` in the official script): the root is at depth 1; a node below
  `max_depth` (10) draws `r = random()` and is an operator when `r <= 0.25` (the official leaf
  test is `r > VALUE_P`), a node at `max_depth` is always a leaf. An operator takes a uniform
  2..`max_args` (10) arguments, generated left to right, and its operator is drawn uniformly
  *after* its arguments; a leaf is a uniform digit. `generate_tree` here is a line-by-line port
  on explicit RNGs and the reference that the fast path is tested against.
* Length (the official `length`): the number of tokens other than parentheses, i.e. 1 per leaf
  and 2 per operator (the operator and its `]`). An example is kept when
  `min_length < length < max_length` (official 500 and 2000). This is also the sequence length
  a model sees once the parentheses are dropped (see `model_tokens`).
* Text (the official `to_string`): an operator is the left-nested pair
  `((((op, a1), a2), ..., ak), ])` and every pair is written `( left right )`, so an operator
  with k arguments reads

      ( ( ( [MAX 2 ) 9 ) ] )                         MAX(2, 9)
      ( ( ( ( [SM 4 ) ( ( ( [MIN 1 ) 7 ) ] ) ) 3 ) ] )  SM(4, MIN(1, 7), 3)

  i.e. k + 1 opening parentheses, the operator, then each argument followed by `)`, then
  `] )`. Rows therefore start like `( ( ( ( ( [MAX 2 ) ...` as in the released files.
  Brackets are kept: `[MIN`-style operators and `]` are separate tokens.
* Files: `{task}_train.tsv`, `{task}_val.tsv`, `{task}_test.tsv` (task `basic`), written by
  `csv.writer(f, delimiter="\\t")` exactly like the official `write_to_file`: a header row
  `Source<TAB>Target`, then `Source<TAB>Target` rows, lines ended by the csv module's default
  `\\r\\n`. No field needs quoting (no tab, quote or newline ever appears), so the files read
  the same with `csv.reader(f, delimiter="\\t", quoting=csv.QUOTE_NONE)`, with pandas or with
  `tf.data.experimental.make_csv_dataset(..., field_delim="\\t", header=True)`. A (short)
  row::

      ( ( ( ( ( [MAX 2 ) ( ( ( [MED 0 ) 8 ) ] ) ) 9 ) 4 ) ] )<TAB>9

* Splits: as in the official script, train+val+test examples are drawn together into one
  deduplicated pool, then cut train | val | test, so no Source appears twice anywhere. The
  official script iterates a Python `set` (an order that varies from run to run); here the
  pool keeps draw order, which is i.i.d., so the cut is a random split and reproducible.

Differences from the official script, none of which changes the distribution of the data:

* Seeded: two `random.Random` streams derived from `seed` (string seeds, hashed with SHA-512,
  so every integer seed, negative ones included, gives its own streams), one for the shape
  (operator-or-leaf and argument counts), one for leaf values and operators. Shape and labels
  are independent in the official script too. Uniform integers are `int(random() * n)` rather
  than `random.choice`/`randint` (3x faster; the official script is unseeded, so its stream
  cannot be reproduced anyway). Python guarantees `random()` sequences across versions, so
  the same seed gives byte-identical files on any platform and Python version.
* Fast rejection: the shape is drawn first, iteratively and without values; a draw is
  abandoned as soon as its length (a running lower bound: one token reserved per argument not
  yet drawn) reaches `max_length`, and only accepted shapes get values and text. The accepted
  examples have exactly the official conditional distribution.
* Draw order is the output order (the official script iterates a `set`).

The official input pipeline (`lra_benchmarks/listops/input_pipeline.py`) tokenizes `Source`
with `tfds.deprecated.text.Tokenizer()`, which (default `alphanum_only=True`) keeps
alphanumeric runs only and so drops `[`, `]`, `(` and `)`: the closing `]` disappears and the
expression becomes ambiguous. Downstream tokenizers should split on whitespace and keep
`[MIN`..`]` as tokens (`model_tokens`; the parentheses carry no extra information).

Rejection sampling, measured with `generate_with_stats` on the development machine (2-core
CPU, CPython 3.11, one core used):

* official 500 < length < 2000: about 8.3 % of draws are accepted (75 % of roots are bare
  leaves), 1.2 ms per accepted example with a core to itself, up to ~2 ms with both cores
  busy. The default 96000/2000/2000 run was measured end to end: 1 212 054 draws (8.25 %
  accepted, no duplicate drawn) in 168 s, 3 min 23 s wall clock including writing (the
  machine was shared; 154 s of CPU), peak memory 0.7 GB, files of 634 MB / 13 MB / 13 MB
  (mean Source ~1030 tokens without parentheses, ~6600 characters).
* mini-benchmark 100 < length < 300: about 2.5 % accepted, 0.65 ms per example with a core
  to itself (5000 in 3.3 s, ~1500 examples per second), ~1.1 ms with both cores busy.
* 10 < length < 50: about 4 % accepted, 0.09 ms per example.

The CLI prints the acceptance rate and timing of every run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from albatross.files import atomic_file

MIN = "[MIN"
MAX = "[MAX"
MED = "[MED"
SUM_MOD = "[SM"
END = "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)
VALUES = range(10)
# Probability that a node above max_depth is an operator (official: leaf iff random() > VALUE_P).
VALUE_P = 0.25

DEFAULT_TASK = "basic"
SPLITS = ("train", "val", "test")
DEFAULT_SIZES: dict[str, int] = {"train": 96000, "val": 2000, "test": 2000}
DEFAULT_MIN_LENGTH = 500
DEFAULT_MAX_LENGTH = 2000
DEFAULT_MAX_DEPTH = 10
DEFAULT_MAX_ARGS = 10
HEADER = ("Source", "Target")

_LEAF_STRINGS = tuple(str(v) for v in VALUES)
# Recursion depth of the generators is bounded by max_depth.
_MAX_SUPPORTED_DEPTH = 400


# ----------------------------------------------------------------------------------------------
# Faithful port of the official tree form (tuples), used as the reference for the fast sampler.
# ----------------------------------------------------------------------------------------------


def generate_tree(
    depth: int,
    max_depth: int,
    max_args: int,
    rng: random.Random,
    op_prob: float = VALUE_P,
    value_rng: random.Random | None = None,
) -> tuple[Any, int]:
    """The official `generate_tree` on explicit RNGs: returns (tree, length).

    A leaf is an int; an operator with arguments a1..ak is `((((op, a1), a2), ..., ak), END)`.
    Same decisions in the same order as the official code. The shape (operator or leaf,
    number of arguments) comes from `rng`, leaf values and operators from `value_rng`
    (default: `rng`, one stream as in the official script); uniform integers are drawn as
    `int(random() * n)` (see the module docstring).
    """
    vrng = rng if value_rng is None else value_rng
    r = rng.random() if depth < max_depth else 1
    if r > op_prob:
        return int(vrng.random() * 10), 1
    length = 2
    num_values = 2 + int(rng.random() * (max_args - 1))
    values = []
    for _ in range(num_values):
        sub_t, sub_l = generate_tree(depth + 1, max_depth, max_args, rng, op_prob, vrng)
        values.append(sub_t)
        length += sub_l
    op = OPERATORS[int(vrng.random() * len(OPERATORS))]
    t: Any = (op, values[0])
    for value in values[1:]:
        t = (t, value)
    return (t, END), length


def to_string(t: Any) -> str:
    """The official `to_string`: every pair is written `( left right )`."""
    if isinstance(t, str):
        return t
    if isinstance(t, int):
        return str(t)
    return "( " + to_string(t[0]) + " " + to_string(t[1]) + " )"


def _apply(op: str, args: Sequence[int]) -> int:
    if op == MIN:
        return min(args)
    if op == MAX:
        return max(args)
    if op == MED:
        s = sorted(args)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2  # floor of the median
    if op == SUM_MOD:
        return sum(args) % 10
    raise ValueError(f"unknown operator {op!r}")


def to_value(t: Any) -> int:
    """The value of a tuple tree (the official `to_value`, without the unsaturated-pair trick)."""
    if isinstance(t, int):
        return t
    # t = (inner, END); unwind the left-nested pairs to (op, [a1..ak]).
    inner = t[0]
    args = []
    while not isinstance(inner[0], str):
        args.append(to_value(inner[1]))
        inner = inner[0]
    args.append(to_value(inner[1]))
    args.reverse()
    return _apply(inner[0], args)


# ----------------------------------------------------------------------------------------------
# Fast path: shapes first (cheap, abandoned once too long), then values and text for accepted ones.
# ----------------------------------------------------------------------------------------------


def _make_shape_sampler(
    rng: random.Random, max_depth: int, max_args: int, op_prob: float, max_length: int | None
) -> Callable[[], tuple[list[int] | None, int]]:
    """Returns `shape() -> (arities in preorder or None when abandoned, length)`.

    Draws the shape of one tree (for each node in preorder: leaf, or operator and its number of
    arguments) with the `rng` calls of `generate_tree(..., rng, value_rng=other)`, in the same
    order. Iterative, and it draws no values, so rejected draws are cheap. The running count is
    a lower bound of the final length (one token reserved for every argument not yet drawn),
    so a draw is abandoned as soon as it can no longer be shorter than `max_length`; its length
    is then reported as that bound.
    """
    rand = rng.random
    arg_span = max_args - 1
    limit = max_length if max_length is not None else math.inf

    def shape() -> tuple[list[int] | None, int]:
        arities: list[int] = []
        add = arities.append
        count = 1  # lower bound of the length; final value = length
        open_ops: list[int] = []  # arguments still to draw, for each open operator
        depth = 1
        while True:
            if depth < max_depth and rand() <= op_prob:
                k = 2 + int(rand() * arg_span)
                count += 1 + k  # the operator's `]`, plus one reserved token per argument
                if count >= limit:
                    return None, count
                add(k)
                open_ops.append(k)
                depth += 1
                continue
            add(0)
            # A node is complete: close every operator whose last argument it was.
            while open_ops:
                open_ops[-1] -= 1
                if open_ops[-1]:
                    break
                open_ops.pop()
                depth -= 1
            else:
                return arities, count

    return shape


def _make_renderer(rng: random.Random) -> Callable[[list[int]], tuple[list[str], int]]:
    """Returns `render(arities) -> (tokens, value)`: draws leaf values and operators from `rng`
    (the `value_rng` calls of `generate_tree`, in the same order) and writes `to_string`'s
    tokens directly."""
    rand = rng.random
    ops = OPERATORS
    n_ops = len(OPERATORS)
    leaves = _LEAF_STRINGS

    def node(it: Iterator[int], out: list[str]) -> int:
        k = next(it)
        if k == 0:
            v = int(rand() * 10)
            out.append(leaves[v])
            return v
        out.extend(["("] * (k + 1))
        pos = len(out)
        out.append("")  # the operator, drawn after the arguments
        args = []
        for _ in range(k):
            args.append(node(it, out))
            out.append(")")
        op = ops[int(rand() * n_ops)]
        out[pos] = op
        out.append(END)
        out.append(")")
        return _apply(op, args)

    def render(arities: list[int]) -> tuple[list[str], int]:
        out: list[str] = []
        value = node(iter(arities), out)
        return out, value

    return render


def _rngs(seed: int) -> tuple[random.Random, random.Random]:
    """The shape and value streams for `seed` (string seeds: hashed with SHA-512, stable across
    platforms and Python versions, and distinct for every integer including negatives)."""
    return random.Random(f"listops:{seed}:shape"), random.Random(f"listops:{seed}:values")


def max_possible_length(max_depth: int, max_args: int) -> int:
    """The longest tree the generator can draw (every node an operator with max_args args)."""
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def model_tokens(source: str, parens: bool = False) -> list[str]:
    """Whitespace tokens of a Source string; parentheses dropped unless `parens`.

    Without parentheses the token count is the official `length` (`[MIN`..`]` kept).
    """
    toks = source.split()
    return toks if parens else [t for t in toks if t not in ("(", ")")]


def source_length(source: str) -> int:
    """The official length of a Source string: tokens other than parentheses."""
    return sum(1 for t in source.split() if t not in ("(", ")"))


@dataclass
class GenerationStats:
    """Counts of one `generate_with_stats` run. Every draw is exactly one of the outcomes."""

    draws: int = 0
    accepted: int = 0
    too_short: int = 0
    too_long: int = 0  # includes draws abandoned once they reached max_length
    duplicates: int = 0  # in range but already drawn (or in `exclude`)
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draws if self.draws else 0.0

    @property
    def ms_per_example(self) -> float:
        return 1000.0 * self.seconds / self.accepted if self.accepted else 0.0

    def summary(self) -> str:
        return (
            f"{self.accepted} examples from {self.draws} draws "
            f"(acceptance {100 * self.acceptance_rate:.2f} %: {self.too_short} too short, "
            f"{self.too_long} too long, {self.duplicates} duplicates) in {self.seconds:.1f} s "
            f"({self.ms_per_example:.3f} ms/example)"
        )


def _check_params(
    num_examples: int,
    min_length: int,
    max_length: int,
    max_depth: int,
    max_args: int,
    op_prob: float,
) -> None:
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if max_depth < 1 or max_depth > _MAX_SUPPORTED_DEPTH:
        raise ValueError(f"max_depth must be in [1, {_MAX_SUPPORTED_DEPTH}], got {max_depth}")
    if max_args < 2:
        raise ValueError(f"max_args must be >= 2 (randint(2, max_args)), got {max_args}")
    if not 0.0 <= op_prob <= 1.0:
        raise ValueError(f"op_prob must be in [0, 1], got {op_prob}")
    if max_length - min_length < 2:
        raise ValueError(
            f"need min_length < length < max_length: no integer length between "
            f"{min_length} and {max_length}"
        )
    longest = max_possible_length(max_depth, max_args) if op_prob > 0 else 1
    if longest <= min_length:
        raise ValueError(
            f"max_depth={max_depth}, max_args={max_args} cannot produce more than {longest} "
            f"tokens, so no example is longer than min_length={min_length}"
        )


def generate_with_stats(
    num_examples: int,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_args: int = DEFAULT_MAX_ARGS,
    seed: int = 0,
    *,
    op_prob: float = VALUE_P,
    exclude: Iterable[str] = (),
    max_draws: int | None = None,
    progress: Callable[[GenerationStats], None] | None = None,
    progress_every: int = 10000,
) -> tuple[list[tuple[str, int]], GenerationStats]:
    """`generate`, also returning the draw statistics (acceptance rate, timing)."""
    _check_params(num_examples, min_length, max_length, max_depth, max_args, op_prob)
    if max_draws is None:
        # Generous: the lowest acceptance of sensible settings is ~1 %. Guards against settings
        # that can (almost) never produce num_examples distinct examples.
        max_draws = 2000 * num_examples + 1_000_000
    shape_rng, value_rng = _rngs(seed)
    shape = _make_shape_sampler(shape_rng, max_depth, max_args, op_prob, max_length)
    render = _make_renderer(value_rng)
    seen = set(exclude)
    out: list[tuple[str, int]] = []
    stats = GenerationStats()
    t0 = time.perf_counter()
    while len(out) < num_examples:
        if stats.draws >= max_draws:
            stats.seconds = time.perf_counter() - t0
            raise RuntimeError(
                f"gave up after {stats.draws} draws with {len(out)}/{num_examples} examples: "
                f"{stats.summary()}; widen the length range or raise max_draws"
            )
        stats.draws += 1
        arities, length = shape()
        if arities is None:
            stats.too_long += 1
            continue
        if length <= min_length:
            stats.too_short += 1
            continue
        if length >= max_length:  # only reachable when the sampler did not abandon it
            stats.too_long += 1
            continue
        tokens, value = render(arities)
        source = " ".join(tokens)
        if source in seen:
            stats.duplicates += 1
            continue
        seen.add(source)
        out.append((source, value))
        stats.accepted += 1
        if progress is not None and stats.accepted % progress_every == 0:
            stats.seconds = time.perf_counter() - t0
            progress(stats)
    stats.seconds = time.perf_counter() - t0
    return out, stats


def generate(
    num_examples: int,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_args: int = DEFAULT_MAX_ARGS,
    seed: int = 0,
    *,
    op_prob: float = VALUE_P,
    exclude: Iterable[str] = (),
    max_draws: int | None = None,
) -> list[tuple[str, int]]:
    """`num_examples` distinct (source, target) ListOps examples, in draw order.

    Each has `min_length < length < max_length` (length = tokens other than parentheses).
    `source` is the official `to_string` form, `target` an int in 0..9. Deterministic in
    all arguments; `exclude` holds sources that must not be produced. Raises ValueError for
    settings that cannot produce any example, RuntimeError after `max_draws` draws.
    """
    examples, _ = generate_with_stats(
        num_examples,
        min_length,
        max_length,
        max_depth,
        max_args,
        seed,
        op_prob=op_prob,
        exclude=exclude,
        max_draws=max_draws,
    )
    return examples


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def split_paths(out_dir: str | os.PathLike, task: str = DEFAULT_TASK) -> dict[str, Path]:
    out = Path(out_dir)
    return {s: out / f"{task}_{s}.tsv" for s in SPLITS}


def write_tsv(f: TextIO, rows: Iterable[tuple[str, int]]) -> None:
    """The official `write_to_file`: csv.writer(delimiter='\\t'), header row first.

    `f` must be opened with `newline=""` (lines end in the csv module's `\\r\\n`).
    """
    writer = csv.writer(f, delimiter="\t")
    writer.writerow(HEADER)
    writer.writerows(rows)


def read_tsv(path: str | os.PathLike) -> list[tuple[str, int]]:
    """Reads a ListOps TSV (ours or the official one) into (source, target) pairs."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        if tuple(header) != HEADER:
            raise ValueError(f"{path}: header {header!r}, expected {list(HEADER)!r}")
        return [(src, int(tgt)) for src, tgt in reader]


def _normalize_sizes(sizes: Mapping[str, int] | Sequence[int]) -> dict[str, int]:
    if isinstance(sizes, Mapping):
        unknown = set(sizes) - set(SPLITS)
        if unknown:
            raise ValueError(f"unknown split(s) {sorted(unknown)}; expected {SPLITS}")
        out = {s: int(sizes.get(s, 0)) for s in SPLITS}
    else:
        if len(sizes) != len(SPLITS):
            raise ValueError(f"sizes must be (train, val, test), got {sizes!r}")
        out = dict(zip(SPLITS, (int(n) for n in sizes)))
    for s, n in out.items():
        if n < 0:
            raise ValueError(f"size of {s} must be >= 0, got {n}")
    return out


@dataclass
class WrittenSplits:
    paths: dict[str, Path]
    counts: dict[str, int]
    stats: GenerationStats


def write_splits(
    out_dir: str | os.PathLike,
    sizes: Mapping[str, int] | Sequence[int] = DEFAULT_SIZES,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_args: int = DEFAULT_MAX_ARGS,
    seed: int = 0,
    *,
    op_prob: float = VALUE_P,
    task: str = DEFAULT_TASK,
    overwrite: bool = False,
    progress: Callable[[GenerationStats], None] | None = None,
) -> WrittenSplits:
    """Generates one deduplicated pool and writes `{task}_{train,val,test}.tsv` in `out_dir`.

    `sizes` is {"train": n, "val": n, "test": n} or (train, val, test). Refuses (FileExistsError,
    before generating) when any of the three files exists, unless `overwrite`. Every file goes
    through a temporary file in `out_dir` (`albatross.files.atomic_file`); the three replaces happen only after
    all three files are fully written.
    """
    counts = _normalize_sizes(sizes)
    paths = split_paths(out_dir, task)
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"refusing to overwrite {', '.join(existing)} (pass --overwrite / overwrite=True)"
        )
    # Validate before creating anything.
    _check_params(sum(counts.values()), min_length, max_length, max_depth, max_args, op_prob)
    examples, stats = generate_with_stats(
        sum(counts.values()),
        min_length,
        max_length,
        max_depth,
        max_args,
        seed,
        op_prob=op_prob,
        progress=progress,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as files:  # the three replaces happen as the stack closes
        start = 0
        for split in SPLITS:
            rows = examples[start : start + counts[split]]
            start += counts[split]
            tmp = files.enter_context(atomic_file(paths[split], f"the {split} split", unique=True))
            with open(tmp, "x", newline="", encoding="utf-8") as f:
                write_tsv(f, rows)
        if not overwrite:
            existing = [str(p) for p in paths.values() if p.exists()]
            if existing:  # appeared while we were generating
                raise FileExistsError(f"refusing to overwrite {', '.join(existing)}")
    return WrittenSplits(paths=paths, counts=counts, stats=stats)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers the `listops` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "listops",
        help="generate the Long Range Arena ListOps TSV files",
        description=(
            "Generate Long Range Arena ListOps data exactly in the official format "
            "(google-research/long-range-arena lra_benchmarks/data/listops.py): "
            "{task}_train.tsv, {task}_val.tsv, {task}_test.tsv with a 'Source<TAB>Target' "
            "header. Length counts tokens other than parentheses; examples have "
            "min-length < length < max-length. Seeded and deduplicated across splits."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="output directory (created if missing)",
    )
    p.add_argument("--train", type=int, default=DEFAULT_SIZES["train"], help="train examples")
    p.add_argument("--val", type=int, default=DEFAULT_SIZES["val"], help="validation examples")
    p.add_argument("--test", type=int, default=DEFAULT_SIZES["test"], help="test examples")
    p.add_argument("--min-length", type=int, default=DEFAULT_MIN_LENGTH, help="keep length > this")
    p.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="keep length < this")
    p.add_argument(
        "--max-depth", type=int, default=DEFAULT_MAX_DEPTH, help="nodes at this depth are leaves"
    )
    p.add_argument(
        "--max-args", type=int, default=DEFAULT_MAX_ARGS, help="operators take 2..max-args args"
    )
    p.add_argument(
        "--op-prob",
        type=float,
        default=VALUE_P,
        help="probability that a node shallower than max-depth is an operator",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--task", default=DEFAULT_TASK, help="file name prefix")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """The `listops` subcommand: 0 on success, 2 (with `error: ...` on stderr) for existing
    output files or impossible settings."""

    def progress(stats: GenerationStats) -> None:
        print(
            f"listops: {stats.accepted} examples, acceptance "
            f"{100 * stats.acceptance_rate:.2f} %, {stats.seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = write_splits(
            args.out,
            {"train": args.train, "val": args.val, "test": args.test},
            min_length=args.min_length,
            max_length=args.max_length,
            max_depth=args.max_depth,
            max_args=args.max_args,
            seed=args.seed,
            op_prob=args.op_prob,
            task=args.task,
            overwrite=args.overwrite,
            progress=None if args.quiet else progress,
        )
    except (FileExistsError, ValueError, RuntimeError) as e:
        print(f"error: listops: {e}", file=sys.stderr)
        return 2
    print(f"listops: {result.stats.summary()}")
    for split in SPLITS:
        print(f"listops: wrote {result.counts[split]} rows to {result.paths[split]}")
    return 0
