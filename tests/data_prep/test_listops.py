"""Tests for the LRA ListOps generator (data_prep/listops.py).

Labels are checked with an evaluator written here (a recursive-descent parser over the token
list that also checks the official parenthesised layout), not with the generator's own code.
"""

from __future__ import annotations

import argparse
import collections
import csv
import math
import os
import random
import statistics
from pathlib import Path

import pytest

from data_prep import listops

# ---------------------------------------------------------------------------------------------
# Independent evaluator
# ---------------------------------------------------------------------------------------------

_FUNCS = {
    "[MIN": min,
    "[MAX": max,
    "[MED": lambda a: math.floor(statistics.median(a)),
    "[SM": lambda a: sum(a) % 10,
}
_DIGITS = {str(d) for d in range(10)}


class ParseError(Exception):
    pass


def evaluate(tokens: list[str]) -> int:
    """Strict parser of the official `to_string` layout.

    node := DIGIT | "("^(k+1) OP node ")" node ")" ... node ")" "]" ")"   (k nodes, k >= 2)
    """
    pos = 0

    def expect(tok: str) -> None:
        nonlocal pos
        if pos >= len(tokens) or tokens[pos] != tok:
            got = tokens[pos] if pos < len(tokens) else "<end>"
            raise ParseError(f"expected {tok!r} at {pos}, got {got!r}")
        pos += 1

    def node() -> int:
        nonlocal pos
        if pos >= len(tokens):
            raise ParseError("unexpected end")
        if tokens[pos] in _DIGITS:
            pos += 1
            return int(tokens[pos - 1])
        opens = 0
        while pos < len(tokens) and tokens[pos] == "(":
            opens += 1
            pos += 1
        if pos >= len(tokens) or tokens[pos] not in _FUNCS:
            raise ParseError(f"expected an operator at {pos}")
        func = _FUNCS[tokens[pos]]
        pos += 1
        nargs = opens - 1
        if nargs < 2:
            raise ParseError(f"operator with {nargs} arguments at {pos}")
        args = []
        for _ in range(nargs):
            args.append(node())
            expect(")")
        expect("]")
        expect(")")
        return func(args)

    value = node()
    if pos != len(tokens):
        raise ParseError(f"trailing tokens from {pos}")
    return value


def evaluate_prefix(tokens: list[str]) -> int:
    """Second evaluator: parentheses dropped, prefix notation closed by `]` (what a model that
    keeps the brackets sees)."""
    toks = [t for t in tokens if t not in ("(", ")")]
    pos = 0

    def node() -> int:
        nonlocal pos
        tok = toks[pos]
        pos += 1
        if tok in _DIGITS:
            return int(tok)
        func = _FUNCS[tok]
        args = []
        while toks[pos] != "]":
            args.append(node())
        pos += 1
        return func(args)

    value = node()
    assert pos == len(toks)
    return value


def length_without_parens(tokens: list[str]) -> int:
    return sum(1 for t in tokens if t not in ("(", ")"))


def check_example(source: str, target: int, min_length: int, max_length: int) -> None:
    tokens = source.split(" ")
    assert " ".join(tokens) == source and "" not in tokens  # single spaces, no padding
    assert set(tokens) <= _DIGITS | set(_FUNCS) | {"(", ")", "]"}
    assert min_length < length_without_parens(tokens) < max_length
    # Brackets kept: one `]` per operator; parentheses balanced.
    assert sum(t in _FUNCS for t in tokens) == tokens.count("]")
    depth = 0
    for t in tokens:
        depth += (t == "(") - (t == ")")
        assert depth >= 0
    assert depth == 0
    assert isinstance(target, int) and 0 <= target <= 9
    assert evaluate(tokens) == target
    assert evaluate_prefix(tokens) == target


# ---------------------------------------------------------------------------------------------
# The evaluator and the official text form on hand-written cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("7", 7),
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("( ( ( [MIN 2 ) 9 ) ] )", 2),
        ("( ( ( [MED 1 ) 2 ) ] )", 1),  # floor(1.5)
        ("( ( ( ( ( [MED 4 ) 1 ) 3 ) 2 ) ] )", 2),  # floor(2.5)
        ("( ( ( ( [MED 9 ) 0 ) 5 ) ] )", 5),
        ("( ( ( ( [SM 9 ) 8 ) 7 ) ] )", 4),
        ("( ( ( ( [SM 4 ) ( ( ( [MIN 1 ) 7 ) ] ) ) 3 ) ] )", 8),
        ("( ( ( ( ( [MAX 2 ) ( ( ( [MED 0 ) 8 ) ] ) ) 9 ) 4 ) ] )", 9),
    ],
)
def test_evaluators_on_hand_written_cases(source: str, value: int) -> None:
    assert evaluate(source.split()) == value
    assert evaluate_prefix(source.split()) == value


@pytest.mark.parametrize(
    "source",
    [
        "( ( [MAX 2 ) 9 ) ] )",  # one opening parenthesis short
        "( ( ( [MAX 2 ) 9 ) )",  # `]` missing
        "( ( ( [MAX 2 9 ) ] )",  # `)` after an argument missing
        "( ( [MAX 2 ) ] )",  # one argument
    ],
)
def test_evaluator_rejects_malformed(source: str) -> None:
    with pytest.raises(ParseError):
        evaluate(source.split())


def test_official_to_string_and_to_value() -> None:
    # (((op, a1), a2), ...), END) as built by the official generate_tree.
    t_max = ((("[MAX", 2), 9), "]")
    assert listops.to_string(t_max) == "( ( ( [MAX 2 ) 9 ) ] )"
    t_min = ((("[MIN", 1), 7), "]")
    t_sm = (((("[SM", 4), t_min), 3), "]")
    assert listops.to_string(t_sm) == "( ( ( ( [SM 4 ) ( ( ( [MIN 1 ) 7 ) ] ) ) 3 ) ] )"
    assert listops.to_value(t_sm) == 8
    # A 4-argument root reads like the released basic_train.tsv rows.
    t = ((((("[MAX", 2), 5), 9), 4), "]")
    assert listops.to_string(t).startswith("( ( ( ( ( [MAX 2 )")
    assert listops.to_value(((((("[MED", 4), 1), 3), 2), "]")) == 2


# ---------------------------------------------------------------------------------------------
# Generated examples
# ---------------------------------------------------------------------------------------------


def test_generated_examples_are_correct_short() -> None:
    examples = listops.generate(400, min_length=30, max_length=300, seed=3)
    assert len(examples) == 400
    for source, target in examples:
        check_example(source, target, 30, 300)


def test_generated_examples_are_correct_official_lengths() -> None:
    examples, stats = listops.generate_with_stats(60, seed=11)  # 500 < length < 2000
    assert len(examples) == 60
    for source, target in examples:
        check_example(source, target, 500, 2000)
    # The official generator (root at depth 1, operator w.p. 0.25, randint(2, 10) arguments,
    # depth 10) accepts about 8.3 % of its draws for 500 < length < 2000 (measured with a
    # copy of the official code): a wrong operator probability or arity range moves this.
    assert stats.draws == stats.accepted + stats.too_short + stats.too_long + stats.duplicates
    assert 0.05 < stats.acceptance_rate < 0.12


def test_lengths_respect_custom_bounds_and_depth() -> None:
    examples = listops.generate(200, min_length=5, max_length=40, max_depth=3, max_args=4, seed=5)
    for source, target in examples:
        check_example(source, target, 5, 40)
        tokens = source.split()
        # max_depth 3: operators nest at most 2 deep; max_args 4: an operator has 2..4
        # arguments, i.e. 3..5 opening parentheses right before it.
        depth, deepest, run = 0, 0, 0
        for t in tokens:
            if t == "(":
                run += 1
                continue
            if t in _FUNCS:
                assert 3 <= run <= 5
                depth += 1
                deepest = max(deepest, depth)
            elif t == "]":
                depth -= 1
            run = 0
        assert deepest <= 2


def test_label_distribution_covers_all_digits() -> None:
    examples = listops.generate(1000, min_length=100, max_length=300, seed=0)
    counts = collections.Counter(t for _, t in examples)
    assert set(counts) == set(range(10))
    # MIN and MAX push mass to 0 and 9, as in the released data.
    assert counts[0] > counts[5] and counts[9] > counts[5]


def test_shape_statistics_match_the_official_process() -> None:
    rng = random.Random(0)
    shape = listops._make_shape_sampler(rng, 10, 10, listops.VALUE_P, None)
    n = 20000
    roots_leaf = 0
    arities: list[int] = []
    for _ in range(n):
        ar, length = shape()
        assert ar is not None and length == sum(2 if k else 1 for k in ar)
        roots_leaf += ar[0] == 0
        arities.extend(k for k in ar if k)
    # Leaf root with probability 1 - 0.25; arities uniform on 2..10.
    assert abs(roots_leaf / n - 0.75) < 0.015
    assert set(arities) == set(range(2, 11))
    assert abs(statistics.mean(arities) - 6.0) < 0.15


def test_fast_path_matches_reference_port() -> None:
    """The shape sampler + renderer reproduce the line-by-line port of the official
    generate_tree/to_string (same RNG calls in the same order) when nothing is abandoned."""
    for max_depth, max_args in [(10, 10), (6, 4), (3, 10)]:
        shape_rng, value_rng = random.Random(7), random.Random(8)
        ref_rng, ref_vrng = random.Random(7), random.Random(8)
        shape = listops._make_shape_sampler(shape_rng, max_depth, max_args, 0.25, None)
        render = listops._make_renderer(value_rng)
        n_ops = 0
        for _ in range(300):
            ar, length = shape()
            tokens, value = render(ar)
            tree, ref_length = listops.generate_tree(
                1, max_depth, max_args, ref_rng, 0.25, value_rng=ref_vrng
            )
            assert " ".join(tokens) == listops.to_string(tree)
            assert length == ref_length == listops.source_length(" ".join(tokens))
            assert value == listops.to_value(tree) == evaluate(tokens)
            n_ops += length > 1
        assert n_ops > 30


def test_no_duplicates_and_dedup_is_exercised() -> None:
    # 3 < length < 6: only 2- and 3-leaf operators (4 * 10**2 + 4 * 10**3 distinct trees), so
    # duplicates are drawn often and must be skipped.
    examples, stats = listops.generate_with_stats(300, min_length=3, max_length=6, seed=0)
    sources = [s for s, _ in examples]
    assert len(set(sources)) == len(sources) == 300
    assert stats.duplicates > 0
    for s, t in examples:
        check_example(s, t, 3, 6)
    # `exclude` keeps given sources out.
    again = listops.generate(50, min_length=3, max_length=6, seed=0, exclude=sources[:20])
    assert not set(sources[:20]) & {s for s, _ in again}


def test_impossible_settings_fail_fast() -> None:
    with pytest.raises(ValueError):
        listops.generate(1, min_length=10, max_length=11)  # no integer in between
    with pytest.raises(ValueError):
        listops.generate(1, min_length=10, max_length=100, max_depth=2, max_args=2)  # max 4
    with pytest.raises(ValueError):
        listops.generate(1, max_args=1)
    # Only 400 distinct 2-leaf trees have 3 < length < 5.
    with pytest.raises(RuntimeError):
        listops.generate(500, min_length=3, max_length=5, seed=0, max_draws=50000)


def test_generate_is_deterministic() -> None:
    a = listops.generate(50, min_length=20, max_length=200, seed=42)
    b = listops.generate(50, min_length=20, max_length=200, seed=42)
    c = listops.generate(50, min_length=20, max_length=200, seed=43)
    assert a == b
    assert a != c
    # Pinned output: changes to the sampler or the RNG use show up here.
    first = listops.generate(2, min_length=10, max_length=40, seed=0)
    assert first[1] == (
        "( ( ( ( ( ( [MAX 3 ) ( ( ( ( [MAX 8 ) 5 ) 1 ) ] ) ) 8 ) 8 ) 9 ) ] )",
        9,
    )


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

SMALL = {"train": 60, "val": 15, "test": 15}
SMALL_KW = {"min_length": 20, "max_length": 120}


def _write(out: Path, seed: int = 0, **kw) -> listops.WrittenSplits:
    return listops.write_splits(out, SMALL, seed=seed, **SMALL_KW, **kw)


def test_tsv_format_like_official(tmp_path: Path) -> None:
    result = _write(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "basic_test.tsv",
        "basic_train.tsv",
        "basic_val.tsv",
    ]  # no temporary files left
    umask = os.umask(0)
    os.umask(umask)
    # Permissions as for any new file (a bare mkstemp would leave 0600).
    assert (tmp_path / "basic_train.tsv").stat().st_mode & 0o777 == 0o666 & ~umask
    for split, n in SMALL.items():
        path = tmp_path / f"basic_{split}.tsv"
        assert result.paths[split] == path
        raw = path.read_bytes()
        assert raw.startswith(b"Source\tTarget\r\n")
        lines = raw.split(b"\r\n")
        assert lines[-1] == b"" and len(lines) == n + 2
        assert b'"' not in raw and b"\n" not in raw.replace(b"\r\n", b"")
        for line in lines[1:-1]:
            src, tgt = line.split(b"\t")
            assert src.startswith(b"( ( (") and src.endswith(b"] )")
            assert tgt in {str(d).encode() for d in range(10)}
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        assert rows[0] == ["Source", "Target"]
        assert len(rows) == n + 1
        for src, tgt in rows[1:]:
            check_example(src, int(tgt), SMALL_KW["min_length"], SMALL_KW["max_length"])
        assert listops.read_tsv(path) == [(s, int(t)) for s, t in rows[1:]]


def test_no_duplicates_across_splits(tmp_path: Path) -> None:
    # Short lengths, where duplicates are frequent: the pool must still be disjoint.
    listops.write_splits(tmp_path, (200, 50, 50), min_length=3, max_length=7, seed=1)
    sources: list[str] = []
    for split in listops.SPLITS:
        sources += [s for s, _ in listops.read_tsv(tmp_path / f"basic_{split}.tsv")]
    assert len(sources) == 300
    assert len(set(sources)) == 300


def test_files_deterministic(tmp_path: Path) -> None:
    _write(tmp_path / "a", seed=5)
    _write(tmp_path / "b", seed=5)
    _write(tmp_path / "c", seed=6)
    for split in listops.SPLITS:
        name = f"basic_{split}.tsv"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write(out, seed=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError):
        _write(out, seed=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # One existing file is enough to refuse.
    other = tmp_path / "other"
    other.mkdir()
    (other / "basic_val.tsv").write_text("keep me")
    with pytest.raises(FileExistsError):
        _write(other, seed=0)
    assert (other / "basic_val.tsv").read_text() == "keep me"
    assert sorted(p.name for p in other.iterdir()) == ["basic_val.tsv"]
    # overwrite=True replaces all three.
    _write(out, seed=1, overwrite=True)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before)
    assert all(after[n] != before[n] for n in before)


def test_failed_write_leaves_old_files_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, seed=0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_write = listops.write_tsv
    calls = []

    def failing_write(f, rows):
        calls.append(1)
        if len(calls) == 2:  # the val file, after train was written to its temporary file
            raise OSError("disk full")
        real_write(f, rows)

    monkeypatch.setattr(listops, "write_tsv", failing_write)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path, seed=1, overwrite=True)
    # Nothing replaced, no temporary file left behind.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_task_prefix_and_empty_split(tmp_path: Path) -> None:
    result = listops.write_splits(
        tmp_path, {"train": 5, "val": 0, "test": 2}, task="mini", **SMALL_KW
    )
    assert result.counts == {"train": 5, "val": 0, "test": 2}
    assert (tmp_path / "mini_val.tsv").read_bytes() == b"Source\tTarget\r\n"
    assert len(listops.read_tsv(tmp_path / "mini_train.tsv")) == 5
    with pytest.raises(ValueError):
        listops.write_splits(tmp_path / "x", {"train": 1, "dev": 1})


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data_prep")
    sub = parser.add_subparsers(dest="command", required=True)
    listops.add_parser(sub)
    return parser


def test_cli_defaults_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["listops", "--out", "somewhere"])
    assert args.func is listops.run
    assert (args.train, args.val, args.test) == (96000, 2000, 2000)
    assert (args.min_length, args.max_length) == (500, 2000)
    assert (args.max_depth, args.max_args, args.seed) == (10, 10, 0)
    assert args.overwrite is False
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["listops", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--out", "--train", "--min-length", "--max-depth", "--max-args", "--seed"):
        assert flag in help_text
    assert "ListOps" in help_text


def test_cli_writes_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "listops",
        "--out",
        str(tmp_path / "lo"),
        "--train",
        "20",
        "--val",
        "5",
        "--test",
        "4",
        "--min-length",
        "20",
        "--max-length",
        "80",
        "--seed",
        "1",
        "--quiet",
    ]
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "acceptance" in out
    for split, n in (("train", 20), ("val", 5), ("test", 4)):
        rows = listops.read_tsv(tmp_path / "lo" / f"basic_{split}.tsv")
        assert len(rows) == n
        for s, t in rows:
            check_example(s, t, 20, 80)
    # Same output as the library call.
    assert (
        listops.read_tsv(tmp_path / "lo" / "basic_train.tsv")
        == listops.generate(29, min_length=20, max_length=80, seed=1)[:20]
    )
    # Second run refuses, --overwrite replaces.
    args = _parser().parse_args(argv)
    assert args.func(args) == 2
    assert "error: listops: refusing to overwrite" in capsys.readouterr().err
    args = _parser().parse_args([*argv, "--overwrite", "--seed", "2"])
    assert args.func(args) == 0
    # Impossible settings: an error code, not a traceback.
    args = _parser().parse_args(
        ["listops", "--out", str(tmp_path / "bad"), "--min-length", "10", "--max-length", "11"]
    )
    assert args.func(args) == 2
