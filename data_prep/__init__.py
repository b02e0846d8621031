"""Data preparation for pretraining and LRA (`python -m data_prep --help`).

readers      text / JSONL / Parquet / HF dirs, gz / zst, globs, @lists, the embedded corpus
tokenizer    SentencePiece-unigram or WordPiece training with HF tokenizers
shards       deterministic, resumable, multi-job ALBERT example shards (+ manifest)
format       the shard directory contract shared with the loader
loader       the training loader: memmapped shards, per-rank, exact resume
masking      dynamic ALBERT n-gram / whole-word MLM masking and SOP
listops      the Long Range Arena ListOps generator
"""
