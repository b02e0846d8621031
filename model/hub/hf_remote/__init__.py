"""The Hugging Face side of an export: source files copied into an exported directory.

Nothing here is imported by the project. `configuration_albatross.py` and
`modeling_albatross.py` are written into every export that `transformers` loads as remote code
(``trust_remote_code=True``), beside ``albatross_family.py``, a copy of the attention family's
own HF-side file (``model/attention/<family>_hf.py``, named by its ``AttentionFamily.hf_export``
hook). They import ``torch`` and ``transformers`` only, so the export loads where this project is
not installed. See ``model/hub/hf_export.py`` for the export itself.
"""
