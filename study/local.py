"""The local executor: every stage of a study as a process on this machine, each as soon as the
stages it reads are done, at most ``jobs`` CPU slots busy (a stage of N processes, run under
``torchrun``, takes N). A stage that asks for GPUs (``resources.gpus_per_node``) also takes that
many of this machine's GPUs, given to it alone through ``CUDA_VISIBLE_DEVICES``; on a machine
without GPUs it runs on the CPU. Logs go to ``<out>/logs/<node>.log``.

A failed stage stops the stages that need it (they are reported, not run); the others go on. A
second ``run`` starts from the markers: only what is not done runs again. Ctrl-C (SIGINT) or
SIGTERM ends the running stages with SIGTERM: training stages save a checkpoint and the next
``run`` resumes them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from study.graph import Graph, Node, write_done, write_stage_files
from study.ledger import record
from study.spec import REPO


def succeeded(node: Node, returncode: int) -> tuple[bool, str]:
    """(whether the stage did its work, why not): exit 0, and for pretraining a run that
    ``status.json`` says completed (exit 0 also means stopped with a checkpoint)."""
    if returncode != 0:
        return False, f"exit status {returncode}"
    if node.module == "pretrain":
        import json

        status = node.run_dir / "status.json"
        try:
            state = json.loads(status.read_text()).get("state")
        except (OSError, ValueError):
            return False, f"no {status}"
        if state != "completed":
            return False, f"pretraining {state} (run again to resume)"
    return True, ""


def local_command(node: Node) -> list[str]:
    tasks = node.resources.tasks()
    if tasks > 1 and node.module in ("pretrain", "finetune"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={tasks}", "-m", node.module, *node.args]  # fmt: skip
    return [sys.executable, "-m", node.module, *node.args]


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` entries (those already visible)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in given.split(",") if i.strip()] if given else []
    return ids[:count] if ids else [str(i) for i in range(count)]


class LocalExecutor:
    def __init__(self, graph: Graph, jobs: int | None = None, echo: bool = True,
                 gpus: list[str] | None = None):  # fmt: skip
        self.graph = graph
        self.slots = max(1, jobs or os.cpu_count() or 1)
        self.echo = echo
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        self.free_gpus = visible_gpus() if gpus is None else list(gpus)
        self.total_gpus = len(self.free_gpus)

    def gpus_needed(self, node: Node) -> int:
        """GPUs a stage takes here: one per process when it asks for GPUs and there are any."""
        if not node.resources.gpus_per_node or not self.total_gpus:
            return 0
        return min(node.resources.tasks(), self.total_gpus)

    def log_path(self, node: Node) -> Path:
        return self.graph.out / "logs" / f"{node.id}.log"

    def _run_node(self, node: Node, gpus: list[str]) -> tuple[bool, str]:
        write_stage_files(self.graph, [node])
        node.run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = local_command(node)
        log = self.log_path(node)
        log.parent.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // self.slots)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        elif self.total_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU stage stays off the GPUs others hold
        with open(log, "a") as f:
            f.write(f"$ {' '.join(node.command())}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            self.procs[node.id] = proc
            record(self.graph.out, node.id, "all", {"executor": "local", "state": "running",
                                                    "pid": proc.pid, "log": str(log)})  # fmt: skip
            rc = proc.wait()
            self.procs.pop(node.id, None)
        ok, why = succeeded(node, rc)
        if ok:
            for element in node.elements:
                write_done(node, element.key, {"executor": "local"})
        state = "done" if ok else ("stopped" if self.stopping else "failed")
        record(self.graph.out, node.id, "all", {"executor": "local", "state": state,
                                                "returncode": rc, "why": why, "log": str(log)})  # fmt: skip
        return ok, why

    def run(self, nodes: list[Node]) -> dict[str, str]:
        """Runs ``nodes`` (a subset of the graph, in its order); returns node id -> "done",
        "failed: why" or "not run: X failed"."""
        todo = {n.id: n for n in nodes}
        outcome: dict[str, str] = {}
        running: dict[Future, Node] = {}
        holding: dict[Future, list[str]] = {}
        busy = 0
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def stop(signum, frame):
            self.stopping = True
            for proc in list(self.procs.values()):
                proc.send_signal(signal.SIGTERM)

        for s in previous:
            signal.signal(s, stop)
        try:
            with ThreadPoolExecutor(max_workers=self.slots) as pool:
                while todo or running:
                    for node in list(todo.values()):
                        if self.stopping:
                            break
                        blocked = [d for d in node.deps if d in outcome and outcome[d] != "done"]
                        if blocked:
                            outcome[node.id] = f"not run: {blocked[0]} did not finish"
                            del todo[node.id]
                            continue
                        if any(
                            d in todo or d in {n.id for n in running.values()} for d in node.deps
                        ):
                            continue
                        need = min(node.resources.tasks(), self.slots)
                        gpus = self.gpus_needed(node)
                        if busy + need > self.slots or gpus > len(self.free_gpus):
                            continue
                        busy += need
                        held = [self.free_gpus.pop(0) for _ in range(gpus)]
                        del todo[node.id]
                        if self.echo:
                            print(f"study: {node.id}: running ({self.log_path(node)})", flush=True)
                        future = pool.submit(self._run_node, node, held)
                        running[future] = node
                        holding[future] = held
                    if self.stopping and not running:
                        break
                    if not running:
                        break
                    finished, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in finished:
                        node = running.pop(future)
                        busy -= min(node.resources.tasks(), self.slots)
                        self.free_gpus += holding.pop(future)
                        ok, why = future.result()
                        outcome[node.id] = "done" if ok else f"failed: {why}"
                        if self.echo:
                            print(f"study: {node.id}: {outcome[node.id]}", flush=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        for node_id in todo:
            outcome.setdefault(node_id, "not run: stopped")
        return outcome


def run_local(graph: Graph, nodes: list[Node], jobs: int | None) -> dict[str, str]:
    start = time.perf_counter()
    outcome = LocalExecutor(graph, jobs).run(nodes)
    print(f"study: {len(nodes)} stage(s) in {time.perf_counter() - start:.0f} s", flush=True)
    return outcome
