"""Loads exported directories with `transformers` alone, in a process that cannot import this
project; run by tests/hub/test_hf_export.py as

    python -I -S tests/hf_fresh_load.py SITE_PACKAGES JOB.json

``-I -S``: no PYTHONPATH, no user site, and no ``site`` module, so the virtual environment's
``.pth`` files (among them the editable install of this project) are not run; only
SITE_PACKAGES (where torch and transformers are) is put on ``sys.path``. The script checks that
none of this project's packages is importable, then, for each export in the job: AutoTokenizer,
AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification (3 labels) and, when asked,
the fill-mask pipeline and a few HF Trainer steps. Tensors go to one safetensors file per
export, the rest to JSON (``JOB["out"]``).
"""

import json
import sys

sys.path.append(sys.argv[1])

import importlib.util

PROJECT_PACKAGES = ("model", "pretrain", "finetune", "engine", "data_prep", "study", "slurm")


def main() -> None:
    with open(sys.argv[2]) as f:
        job = json.load(f)
    importable = [p for p in PROJECT_PACKAGES if importlib.util.find_spec(p) is not None]
    assert not importable, f"the project is importable here: {importable}"
    outside = [p for p in sys.path if p and p != sys.argv[1] and p.startswith(job["repo"])]
    assert not outside, f"sys.path holds the project: {outside}"

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoModel,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    torch.manual_seed(0)
    inputs = load_file(job["inputs"])
    report = {"sys_path": sys.path, "modules": {}, "exports": {}}
    for name, spec in job["exports"].items():
        path, remote = spec["path"], spec["remote"]
        kw = {"trust_remote_code": True} if remote else {}
        row = {}
        tok = AutoTokenizer.from_pretrained(path)
        row["tokenizer"] = {
            "class": type(tok).__name__,
            "is_fast": tok.is_fast,
            **{
                role: getattr(tok, role)
                for role in ("cls_token", "sep_token", "mask_token", "pad_token", "unk_token")
            },
            "encoded": tok("a b", "c")["input_ids"],
        }
        base = AutoModel.from_pretrained(path, **kw).eval()
        mlm = AutoModelForMaskedLM.from_pretrained(path, **kw).eval()
        clf = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, **kw).eval()
        row["classes"] = [type(m).__name__ for m in (base, mlm, clf)]
        out = {}
        with torch.no_grad():
            enc = base(**inputs, output_hidden_states=True)
            out["last_hidden_state"] = enc.last_hidden_state
            out["pooler_output"] = enc.pooler_output
            for i, h in enumerate(enc.hidden_states):
                out[f"hidden_state_{i}"] = h
            out["mlm_logits"] = mlm(**inputs).logits
            out["classifier_logits"] = clf(**inputs).logits
        save_file(
            {k: v.clone().contiguous() for k, v in out.items()}, f"{job['out']}.{name}.safetensors"
        )
        if spec.get("pipeline"):
            from transformers import pipeline

            fill = pipeline("fill-mask", model=path, **kw)
            row["fill_mask"] = fill(f"the {tok.mask_token} of the")
        if spec.get("trainer"):
            row["trainer"] = train_a_few_steps(path, kw, tok)
        report["exports"][name] = row
    report["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_PACKAGES)
    with open(job["out"] + ".json", "w") as f:
        json.dump(report, f, default=str)


def train_a_few_steps(path, kw, tok):
    """A few HF Trainer steps of sequence classification on the export (the example in docs/hub.md)."""
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

    texts = [("the cat sat", 0), ("a dog ran off", 1), ("the cat ran", 0), ("a dog sat", 1)] * 4

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(texts)

        def __getitem__(self, i):
            enc = tok(texts[i][0], truncation=True, max_length=16)
            return {**enc, "labels": texts[i][1]}

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            use_cpu=True,
        )
        from transformers import DataCollatorWithPadding

        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Data(),
            data_collator=DataCollatorWithPadding(tok),
        )
        result = trainer.train()
        trainer.save_model(out + "/saved")
        reloaded = AutoModelForSequenceClassification.from_pretrained(out + "/saved", **kw)
        same = all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())
    changed = sum(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {
        "steps": result.global_step,
        "losses": losses,
        "tensors_changed": changed,
        "reloaded_equal": same,
    }


if __name__ == "__main__":
    main()
