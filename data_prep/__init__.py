"""Corpus readers, tokenizer training, sharded tokenization, the training-time loader and the
ListOps generator (`python -m data_prep`). Built by issue #3; today only the embedded corpus."""
