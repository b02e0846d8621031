"""The model's files outside the process: the release directory and Hugging Face `transformers`.

    release.py       save / load a release (config.json, model.safetensors, tokenizer.json)
    hf_export.py     a release -> a directory `transformers` loads (native ALBERT or remote code,
                     the remote code being hf_remote/, copied into the export) and back
    hf_import.py     a local HF ALBERT checkpoint -> a release (``python -m model.hub.hf_import``)
    albert_names.py  the ALBERT checkpoint format: config fields and the one tensor-name table

Above the rest of `model` (it builds models with `model.heads.build_model`), except
`albert_names`, which builds no model: the softmax family's native export uses it.
"""
