"""engine.process_exit: a command's process ends without the interpreter's teardown, yet with
what that teardown must do (atexit handlers run, output flushed), and exits normally while a
thread that Python would wait for is still running."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from engine.process_exit import exit_process

    out = Path(sys.argv[1])

    class Noisy:
        def __del__(self):
            print("finalised", flush=True)

    keep = Noisy()  # alive until the interpreter's teardown
    atexit.register(lambda: out.joinpath("atexit").write_text("ran"))

    def late_writer():
        time.sleep(0.3)
        out.joinpath("thread").write_text("done")

    if sys.argv[3] == "thread":  # not a daemon: Python waits for it
        threading.Thread(target=late_writer).start()
    if sys.argv[3] == "pool":  # a pool's idle worker, stopped by Python's threading hooks
        from concurrent.futures import ThreadPoolExecutor
        ThreadPoolExecutor(1).submit(late_writer).result()
    print("to stdout, buffered")  # stdout is a pipe: block-buffered, not yet written
    sys.stderr.write("to stderr\\n")
    exit_process(int(sys.argv[2]))
    """
)


def run_script(
    tmp_path: Path, code: int, threads: str = "none", **env: str
) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k != "ALBATROSS_FULL_EXIT"}
    environ.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(code), threads],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


def test_exit_keeps_the_status_the_output_and_the_atexit_handlers(tmp_path):
    proc = run_script(tmp_path, 3)
    assert proc.returncode == 3
    assert proc.stdout == "to stdout, buffered\n"  # flushed; the finaliser did not run
    assert proc.stderr == "to stderr\n"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert run_script(tmp_path, 0).returncode == 0


def test_a_running_thread_is_waited_for(tmp_path):
    """A non-daemon thread still running: the normal exit (Python waits for the thread; the
    finaliser runs). A thread pool's idle worker: the normal exit too, which stops the pool
    through Python's threading hooks (joining the worker without them would hang)."""
    for threads in ("thread", "pool"):
        (tmp_path / "thread").unlink(missing_ok=True)
        proc = run_script(tmp_path, 5, threads)
        assert proc.returncode == 5, proc.stderr
        assert proc.stdout.startswith("to stdout, buffered\n")
        assert (tmp_path / "thread").read_text() == "done"
        assert (tmp_path / "atexit").read_text() == "ran"
        if threads == "thread":
            assert proc.stdout == "to stdout, buffered\nfinalised\n"


def test_full_exit_on_request(tmp_path):
    """ALBATROSS_FULL_EXIT=1: the normal exit, teardown (and the finaliser) included."""
    proc = run_script(tmp_path, 4, ALBATROSS_FULL_EXIT="1")
    assert proc.returncode == 4
    assert proc.stdout == "to stdout, buffered\nfinalised\n"
    assert (tmp_path / "atexit").read_text() == "ran"
