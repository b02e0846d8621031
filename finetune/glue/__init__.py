"""GLUE: task definitions, data loading, metrics and the server's submission files.

    tasks.py       one frozen `GlueTask` per task (labels, TSV columns, HF columns, metrics, the
                   server's file names); `get_task(name)`
    data.py        the original GLUE TSV distribution, HF `datasets` DatasetDict directories and
                   Hub snapshots of nyu-mll/glue (Parquet) -> `Example`s (`load_split`);
                   tokenisation (`encode`) and batching (`collate`)
    metrics.py     GLUE's metrics with scikit-learn / scipy (`compute_metrics`) and the GLUE
                   score (`glue_average`)
    submission.py  test-set predictions as the GLUE server wants them (`write_predictions`,
                   `write_submission_dir`) and whether a submission is complete
                   (`check_submission_dir`)

The modules import their heavy dependencies (datasets, sklearn, scipy, torch) where used, so
`import finetune.glue.tasks` stays cheap.
"""
