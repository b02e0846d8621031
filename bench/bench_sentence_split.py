"""Sentence splitters for `data_prep --sentences split`: boundary quality and speed.

Quality: bench/data/sentence_gold.txt holds hand-checked sentences (one per line, a blank line
between paragraphs). Each paragraph's sentences joined by one space is the input; a boundary is
the position of a sentence start after the first, counted in non-space characters (so a splitter
that normalises whitespace is not penalised). Reported: boundary precision and recall, F1, and
the paragraphs split exactly right.

Speed: one core (the process pinned to one thread), on the embedded corpus's prose paragraphs
(CPython's pydoc topics, line wraps joined), repeated until each measurement takes at least
`--min-seconds`; the best of `--repeat` runs. Reported: characters/s and sentences/s of the
splitter's own output, and the whole corpus's time through `data_prep.sentences.split_document`
with the chosen splitter (what `--sentences split` costs per core).

Pipeline (`--pipeline-mb N`): the embedded paragraphs, one paragraph per line and repeated to
N MB, as a folder of Parquet files read as `hf:DIR`; `python -m data_prep shards --workers 1`
(one process, imports included) with `--sentences split` and with `--sentences lines`, and
`python -m data_prep tokenizer` with `--sentences split`, each timed as a whole process:
characters/s per core, the rate the estimates for real corpora in docs/data.md are made from.

Candidates: blingfire (Microsoft, a compiled finite-state model), pysbd (rule-based, Golden
Rules), syntok (rule-based tokenizer + segmenter), and a naive regex (split after . ! ? followed
by a space and an upper-case letter) as the floor. A splitter that is not installed is skipped.

    pip install blingfire pysbd syntok
    python -m bench.bench_sentence_split --pipeline-mb 20 --out bench/results/sentence_split_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import write_result

GOLD = Path(__file__).resolve().parent / "data" / "sentence_gold.txt"


def load_gold(path: Path = GOLD) -> list[list[str]]:
    """The gold paragraphs, each a list of sentences."""
    paragraphs: list[list[str]] = []
    current: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            continue
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def boundaries(sentences: list[str]) -> set[int]:
    """Start positions (in non-space characters) of every sentence after the first."""
    out, pos = set(), 0
    for s in sentences[:-1]:
        pos += len(re.sub(r"\s+", "", s))
        out.add(pos)
    return out


def splitters() -> dict[str, Callable[[str], list[str]]]:
    found: dict[str, Callable[[str], list[str]]] = {}
    try:
        import blingfire

        found["blingfire"] = lambda t: blingfire.text_to_sentences(t).split("\n")
    except ImportError:
        pass
    try:
        import pysbd

        seg = pysbd.Segmenter(language="en", clean=False)
        found["pysbd"] = seg.segment
    except ImportError:
        pass
    try:
        import syntok.segmenter as syntok_seg

        def syntok_split(t: str) -> list[str]:
            return [
                "".join(tok.spacing + tok.value for tok in sentence).strip()
                for paragraph in syntok_seg.process(t)
                for sentence in paragraph
            ]

        found["syntok"] = syntok_split
    except ImportError:
        pass
    try:
        import sentencex

        found["sentencex"] = lambda t: sentencex.segment("en", t)
    except ImportError:
        pass
    try:
        import nupunkt

        found["nupunkt"] = nupunkt.sent_tokenize
    except ImportError:
        pass
    naive = re.compile(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z])")
    found["regex"] = lambda t: naive.split(t)
    return found


def quality(split: Callable[[str], list[str]], gold: list[list[str]]) -> dict:
    tp = fp = fn = exact = 0
    errors = []
    for sentences in gold:
        text = " ".join(sentences)
        predicted = [s for s in split(text) if s.strip()]
        want, got = boundaries(sentences), boundaries(predicted)
        tp += len(want & got)
        fp += len(got - want)
        fn += len(want - got)
        if want == got:
            exact += 1
        else:
            errors.append(predicted)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    return {
        "boundaries": tp + fn,
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "paragraphs_exact": exact,
        "paragraphs": len(gold),
        "wrong_paragraphs": errors,
    }


def embedded_paragraphs() -> list[str]:
    """The embedded corpus's paragraphs (blank-line separated), wraps joined, code skipped."""
    from data_prep.corpus import embedded_documents

    out = []
    for doc in embedded_documents():
        for block in re.split(r"\n\s*\n", doc):
            lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
            if lines:
                out.append(" ".join(lines))
    return out


def speed(
    split: Callable[[str], list[str]], paragraphs: list[str], min_seconds: float, repeat: int
) -> dict:
    chars = sum(len(p) for p in paragraphs)
    best = float("inf")
    sentences = 0
    for _ in range(repeat):
        rounds, start = 0, time.perf_counter()
        while True:
            n = 0
            for p in paragraphs:
                n += len(split(p))
            rounds += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / rounds)
        sentences = n
    return {
        "seconds_per_pass": best,
        "characters": chars,
        "sentences": sentences,
        "chars_per_s": chars / best,
        "sentences_per_s": sentences / best,
    }


def pipeline(size_mb: int, workdir: Path) -> dict:
    """Whole-process timings of the tokenizer and shards stages on an `hf:` Parquet folder."""
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.corpus import embedded_documents

    docs = []
    for doc in embedded_documents():
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
        docs.append("\n".join(p for p in paragraphs if p))
    folder = workdir / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    texts, chars, r = [], 0, 0
    while chars < size_mb * 1e6:
        for d in docs:
            texts.append(f"Copy {r}.\n{d}")
            chars += len(texts[-1])
        r += 1
    half = len(texts) // 2
    pq.write_table(pa.table({"text": texts[:half]}), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": texts[half:]}), folder / "train-00001-of-00002.parquet")
    spec = f"hf:{folder}"
    env = dict(os.environ, HF_DATASETS_CACHE=str(workdir / "cache"))

    def timed(*args: str) -> float:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "data_prep", *args],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return time.perf_counter() - start

    tok_dir = workdir / "tok"
    out = {"characters": chars, "documents": len(texts)}
    out["tokenizer_split_s"] = timed(
        "tokenizer",
        "--input",
        spec,
        "--out",
        str(tok_dir),
        "--vocab-size",
        "8000",
        "--overwrite",
    )
    for mode in ("split", "lines"):
        out[f"shards_{mode}_s"] = timed(
            "shards",
            "--input",
            spec,
            "--tokenizer",
            str(tok_dir / "tokenizer.json"),
            "--out",
            str(workdir / f"shards-{mode}"),
            "--num-shards",
            "4",
            "--max-seq-length",
            "512",
            "--workers",
            "1",
            "--sentences",
            mode,
        )
    for key in ("tokenizer_split_s", "shards_split_s", "shards_lines_s"):
        out[key[: -len("_s")] + "_chars_per_s"] = chars / out[key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--show-errors", action="store_true", help="print wrongly split paragraphs")
    ap.add_argument(
        "--pipeline-mb", type=int, default=0, help="also time the stages on an N MB corpus"
    )
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with contextlib.suppress(AttributeError, OSError):  # one core: the figures are per core
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    gold = load_gold()
    paragraphs = embedded_paragraphs()
    print(
        f"gold: {len(gold)} paragraphs, {sum(len(p) for p in gold)} sentences, "
        f"{sum(len(p) - 1 for p in gold)} boundaries; speed corpus: {len(paragraphs)} "
        f"paragraphs, {sum(len(p) for p in paragraphs) / 1e6:.2f} M characters (embedded)"
    )
    results = {}
    for name, split in splitters().items():
        q = quality(split, gold)
        s = speed(split, paragraphs, args.min_seconds, args.repeat)
        results[name] = {"quality": q, "speed": s}
        if args.show_errors:
            for wrong in q["wrong_paragraphs"]:
                print(f"  {name}: {wrong}")

    from data_prep import sentences as sentences_mod

    whole = speed(
        lambda t: sentences_mod.split_document(t, "split"),
        ["\n".join(p.splitlines()) for p in paragraphs],
        args.min_seconds,
        args.repeat,
    )

    print(
        f"\n{'splitter':10} {'precision':>9} {'recall':>7} {'F1':>6} {'exact':>7} "
        f"{'sent/s':>9} {'Mchar/s':>7}"
    )
    for name, r in results.items():
        q, s = r["quality"], r["speed"]
        print(
            f"{name:10} {q['precision']:9.3f} {q['recall']:7.3f} {q['f1']:6.3f} "
            f"{q['paragraphs_exact']:3d}/{q['paragraphs']:<3d} {s['sentences_per_s']:9.0f} "
            f"{s['chars_per_s'] / 1e6:7.2f}"
        )
    print(
        f"\ndata_prep.sentences.split_document ({sentences_mod.SPLITTER}): "
        f"{whole['sentences_per_s']:.0f} sentences/s, {whole['chars_per_s'] / 1e6:.2f} M chars/s "
        "per core"
    )
    piped = None
    if args.pipeline_mb:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            piped = pipeline(args.pipeline_mb, Path(tmp))
        print(
            f"\npipeline, {piped['characters'] / 1e6:.1f} M characters, one process each: "
            f"tokenizer (split) {piped['tokenizer_split_s']:.1f} s "
            f"({piped['tokenizer_split_chars_per_s'] / 1e6:.2f} M chars/s); shards split "
            f"{piped['shards_split_s']:.1f} s ({piped['shards_split_chars_per_s'] / 1e6:.2f} M "
            f"chars/s), lines {piped['shards_lines_s']:.1f} s "
            f"({piped['shards_lines_chars_per_s'] / 1e6:.2f} M chars/s)"
        )
    if args.out:
        for r in results.values():
            r["quality"].pop("wrong_paragraphs")
        payload = {
            "versions": sentences_mod.splitter_versions(),
            "results": results,
            "split_document": whole,
            "pipeline": piped,
        }
        write_result(args.out, payload)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
