"""A stand-in stage for the local executor's tests (``python -m study_probe OUT``): records the
GPUs it was given and when it ran, holding them for a moment. Imports nothing heavy."""

import json
import os
import sys
import time

if __name__ == "__main__":
    start = time.monotonic()
    time.sleep(0.3)
    record = {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start,
              "end": time.monotonic()}  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(record, f)
