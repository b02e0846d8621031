"""Tokenizer stage: train a SentencePiece-unigram (ALBERT) or WordPiece (BERT) tokenizer with HF
`tokenizers`, or copy and validate an existing `tokenizer.json`.

Both trained kinds get the special tokens in `format.ALBERT_SPECIAL_TOKENS` order, so
<pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4, and the post-processor `[CLS] $A [SEP] $B:1 [SEP]:1`
(token type 1 for segment B), like albert-base-v2's tokenizer.json.

* unigram: `models.Unigram` with a Metaspace pre-tokenizer/decoder ("▁" word marker) and the
  normaliser of albert-base-v2 uncased: `` and '' to ", NFKC, lowercase, runs of spaces to one
  (ALBERT's SentencePiece model uses nmt_nfkc; HF's albert-base-v2 conversion uses NFKD + strip
  accents, which loses accents: here NFKC keeps them, as the SentencePiece model does).
* wordpiece: BERT uncased: BertNormalizer (clean text, CJK spacing, lowercase, strip accents),
  BertPreTokenizer, `##` continuation prefix, WordPiece decoder.

Vocabulary size: both kinds keep every distinct character of the normalised corpus, so
--vocab-size must be at least the 5 special tokens + that alphabet (unigram: + 1 learned piece;
wordpiece: the alphabet counts each character also as a `##` continuation). The alphabet is
known only once the corpus has been read, so a smaller size is refused (ValueError naming the
minimum, exit status 2) right after the counting pass, before anything is written; the library
would otherwise fail with a bare exception (unigram) or silently return a larger vocabulary
than asked (wordpiece, and unigram just above the alphabet). A size <= 5 is refused up front.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from albatross.files import atomic_file
from data_prep import format as fmt
from data_prep.readers import DEFAULT_MAX_LINE_CHARS, ReadStats, iter_documents

log = logging.getLogger(__name__)

KINDS = ("unigram", "wordpiece")


def _post_processor() -> Any:
    from tokenizers import processors

    cls_id = fmt.ALBERT_SPECIAL_TOKENS.index("[CLS]")
    sep_id = fmt.ALBERT_SPECIAL_TOKENS.index("[SEP]")
    return processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )


def _unigram(vocab_size: int, show_progress: bool) -> tuple[Any, Any]:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Replace("``", '"'),
            normalizers.Replace("''", '"'),
            normalizers.NFKC(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.ALBERT_SPECIAL_TOKENS),
        unk_token="<unk>",
        max_piece_length=16,  # SentencePiece's default
        show_progress=show_progress,
    )
    return tok, trainer


def _wordpiece(vocab_size: int, show_progress: bool) -> tuple[Any, Any]:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.ALBERT_SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=show_progress,
    )
    return tok, trainer


_BUILDERS = {"unigram": _unigram, "wordpiece": _wordpiece}


def _sentences(
    documents: Iterable[list[str]], max_sentences: int | None, alphabet: set[str] | None = None
) -> Iterator[list[str]]:
    """Batches of sentences for `train_from_iterator`, at most `max_sentences` in all; the
    distinct characters seen are added to `alphabet` (if given)."""
    n = 0
    for doc in documents:
        if max_sentences is not None and n + len(doc) > max_sentences:
            doc = doc[: max_sentences - n]
        n += len(doc)
        if doc:
            if alphabet is not None:
                alphabet.update(*doc)
            yield doc
        if max_sentences is not None and n >= max_sentences:
            return


def _normalised_alphabet(tok: Any, raw: set[str]) -> int:
    """How many distinct characters the tokenizer's normaliser and pre-tokenizer make of the
    characters `raw` (each on its own: exact unless combining marks compose across them)."""
    chars: set[str] = set()
    for c in raw:
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(c)):
            chars.update(word)
    return len(chars)


def _vocab_too_small(kind: str, vocab_size: int, alphabet: int) -> ValueError:
    """The error for a --vocab-size below what the corpus's `alphabet` needs."""
    specials = len(fmt.ALBERT_SPECIAL_TOKENS)
    if kind == "unigram":
        minimum = specials + alphabet + 1
        parts = f"the {alphabet} distinct characters of the normalised text and 1 learned piece"
    else:
        minimum = specials + alphabet
        parts = f"{alphabet} entries for the characters of the text, alone and as ##-continuations"
    return ValueError(
        f"--vocab-size {vocab_size} is too small for this corpus: a {kind} vocabulary needs at "
        f"least {minimum} entries (the {specials} special tokens, {parts}); ALBERT and BERT use "
        "about 30000"
    )


def train_tokenizer(
    documents: Iterable[list[str]],
    kind: str = "unigram",
    vocab_size: int = 30000,
    max_sentences: int | None = None,
    show_progress: bool = False,
) -> Any:
    """A trained `tokenizers.Tokenizer` with the ALBERT special tokens at ids 0..4."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {list(_BUILDERS)}")
    specials = len(fmt.ALBERT_SPECIAL_TOKENS)
    if vocab_size <= specials:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: the {specials} special tokens alone take "
            f"{specials} ids, and every distinct character of the corpus needs one more"
        )
    tok, trainer = _BUILDERS[kind](vocab_size, show_progress)
    # Unigram fails when the alphabet exceeds the vocabulary: the characters seen give the
    # minimum to report then (collecting them runs at ~150 M characters/s, <1% of training).
    raw_chars: set[str] | None = set() if kind == "unigram" else None
    try:
        tok.train_from_iterator(_sentences(documents, max_sentences, raw_chars), trainer=trainer)
    except Exception as e:
        if raw_chars is None or "not large enough to contain all chars" not in str(e):
            raise
        # The library's check is alphabet > vocab_size: the alphabet is at least vocab_size + 1.
        alphabet = max(_normalised_alphabet(tok, raw_chars), vocab_size + 1)
        raise _vocab_too_small(kind, vocab_size, alphabet) from None
    if tok.get_vocab_size() > vocab_size:  # the library kept the whole alphabet regardless
        if kind == "unigram":  # every single-character piece is a character of the alphabet
            alphabet = sum(len(t) == 1 for t in tok.get_vocab())
        else:
            alphabet = tok.get_vocab_size() - specials
        raise _vocab_too_small(kind, vocab_size, alphabet)
    tok.post_processor = _post_processor()
    for i, token in enumerate(fmt.ALBERT_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    fmt.SpecialTokens.from_tokenizer(tok)
    if tok.get_vocab_size() < vocab_size:
        log.warning(
            "the trained vocabulary has %d entries, fewer than --vocab-size %d: the corpus is "
            "too small for that size",
            tok.get_vocab_size(),
            vocab_size,
        )
    return tok


def tokenizer_kind(tokenizer_json: str | os.PathLike) -> str:
    """'unigram', 'wordpiece', 'bpe', ... from a tokenizer.json's model type."""
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    return str(data.get("model", {}).get("type", "unknown")).lower()


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json, validated for pretraining (ValueError)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a valid HF tokenizers tokenizer.json: {e}") from e
    try:
        fmt.SpecialTokens.from_tokenizer(tok)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return tok


def write_tokenizer(
    out_dir: str | os.PathLike,
    *,
    inputs: list[str] | None = None,
    kind: str = "unigram",
    vocab_size: int = 30000,
    from_tokenizer: str | os.PathLike | None = None,
    text_field: str = "text",
    max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
    max_sentences: int | None = None,
    overwrite: bool = False,
    sentences: str = "auto",
    streaming: bool = False,
) -> Path:
    """Trains (or copies `from_tokenizer`) and writes `out_dir/tokenizer.json`; returns its path.

    Refuses (FileExistsError) to replace an existing tokenizer.json unless `overwrite`."""
    out_dir = Path(out_dir)
    target = out_dir / fmt.TOKENIZER
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass --overwrite to replace it")
    if from_tokenizer is not None:
        if inputs:
            log.warning("--input is ignored with --from-tokenizer (nothing is trained)")
        load_tokenizer(from_tokenizer)  # validates
        out_dir.mkdir(parents=True, exist_ok=True)
        if Path(from_tokenizer).resolve() != target.resolve():
            with atomic_file(target, "the tokenizer") as tmp:
                shutil.copyfile(from_tokenizer, tmp)  # byte copy: its sha256 stays the source's
        log.info("copied %s to %s", from_tokenizer, target)
        return target
    if not inputs:
        raise ValueError("give --input (to train a tokenizer) or --from-tokenizer")
    stats = ReadStats()
    docs = iter_documents(
        inputs,
        text_field=text_field,
        stats=stats,
        max_line_chars=max_line_chars,
        sentences=sentences,
        streaming=streaming,
    )
    tok = train_tokenizer(
        docs, kind, vocab_size, max_sentences=max_sentences, show_progress=sys.stderr.isatty()
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fmt.atomic_write_text(target, tok.to_str(pretty=True))
    log.info(
        "trained a %s tokenizer (vocab %d) on %d documents, %d sentences (%d replaced "
        "characters, skipped %s); wrote %s",
        kind,
        tok.get_vocab_size(),
        stats.documents,
        stats.sentences,
        stats.replaced_characters,
        stats.skipped,
        target,
    )
    return target
