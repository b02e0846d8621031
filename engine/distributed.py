"""Where this process sits in a distributed job, learned from its environment.

This is the single place that reads launcher variables. Three launchers are recognised, in
this order:

1. ``torchrun`` (and the DeepSpeed launcher, which sets the same variables): ``RANK``,
   ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (DeepSpeed: ``LOCAL_SIZE``),
   ``MASTER_ADDR``, ``MASTER_PORT`` and ``GROUP_RANK`` / ``NODE_RANK`` when present.
2. Slurm, inside an ``srun`` task (``SLURM_PROCID`` is set): ``SLURM_PROCID``,
   ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_NTASKS_PER_NODE`` or
   ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``), the master address is the first host of
   ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` and the port is ``MASTER_PORT`` or
   derived from ``SLURM_JOB_ID``.
3. Otherwise a single process: rank 0 of 1 on 127.0.0.1. An sbatch script shell (Slurm job
   variables but no ``SLURM_PROCID``) is a single process too.

``export_torch_env`` writes the torchrun variables so ``torch.distributed``'s ``env://``
initialisation works under ``srun``. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from itertools import product
from typing import Literal

__all__ = [
    "DistEnv",
    "detect",
    "expand_nodelist",
    "export_torch_env",
    "lost_peer",
    "lost_peer_message",
    "parse_tasks_per_node",
    "report_lost_peer",
]

Launcher = Literal["torchrun", "slurm", "single"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Ports derived from SLURM_JOB_ID fall in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN):
# above the well-known/registered low ports and below the usual ephemeral range (32768+).
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a (possibly single-process) distributed job."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    local_rank: int
    """Rank on this node, ``0 <= local_rank < local_world_size``; selects the GPU."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node in the job."""
    master_addr: str
    """Host of rank 0, for the ``env://`` rendezvous."""
    master_port: int
    """TCP port of the rendezvous on ``master_addr``."""
    launcher: Launcher
    """Who started the process: ``"torchrun"``, ``"slurm"`` or ``"single"``."""

    @classmethod
    def single(cls, master_addr: str = "127.0.0.1", master_port: int = 29500) -> DistEnv:
        """A process alone in its job (rank 0 of 1), rendezvous at ``master_addr:master_port``."""
        return cls(
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            master_addr=master_addr,
            master_port=master_port,
            launcher="single",
        )

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that logs and writes)."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one process."""
        return self.world_size > 1

    def describe(self, environ: Mapping[str, str] | None = None, *, short: bool = False) -> str:
        """One line for the job log: which process this is, where, and how it meets the others,
        e.g. ``rank 3/4 on node albatross-node2 (node 1, local rank 1/2), rendezvous
        albatross-node1:12817 (slurm)``. The node name is Slurm's (``SLURMD_NODENAME``) or
        the host name."""
        environ = os.environ if environ is None else environ
        node = environ.get("SLURMD_NODENAME") or socket.gethostname()
        if short:  # "rank 3/4 on node albatross-node2"
            return f"rank {self.rank}/{self.world_size} on node {node}"
        return (
            f"rank {self.rank}/{self.world_size} on node {node} (node {self.node_rank}, "
            f"local rank {self.local_rank}/{self.local_world_size}), rendezvous "
            f"{self.master_addr}:{self.master_port} ({self.launcher})"
        )


# ---------------------------------------------------------------------------------------------
# Slurm hostlist and tasks-per-node syntax


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside brackets; checks bracket balance."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(s):
        if ch == "[":
            if depth:
                raise ValueError(f"malformed Slurm node list {s!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"malformed Slurm node list {s!r}: unbalanced ']'")
            depth = 0
        elif ch == "," and not depth:
            parts.append(s[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"malformed Slurm node list {s!r}: unbalanced '['")
    parts.append(s[start:])
    return parts


def _expand_bracket(body: str, whole: str) -> list[str]:
    """Expand the inside of one ``[...]`` group, e.g. ``"01-03,07"``, keeping zero padding."""
    out: list[str] = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if m is None:
            raise ValueError(f"malformed Slurm node list {whole!r}: bad range {item!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if lo > hi:
            raise ValueError(
                f"malformed Slurm node list {whole!r}: bad range {item!r} (start > end)"
            )
        width = len(lo_s)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def expand_nodelist(s: str) -> list[str]:
    """Expand Slurm's compact host list syntax (what ``scontrol show hostnames`` prints).

    ``"node[01-03,07]"`` -> ``node01 node02 node03 node07`` (zero padding kept);
    ``"a[1-2]-b[3-4]"`` -> ``a1-b3 a1-b4 a2-b3 a2-b4`` (several groups: cartesian product, the
    leftmost group varying slowest, as Slurm does); ``"a[1-2],b3"`` -> ``a1 a2 b3`` (commas
    inside brackets do not separate hosts). Raises ``ValueError`` on malformed input.
    """
    if not isinstance(s, str):
        raise ValueError(f"Slurm node list must be a string, got {type(s).__name__}")
    text = s.strip()
    if not text:
        raise ValueError("empty Slurm node list")
    hosts: list[str] = []
    for part in _split_top_level(text):
        if not part or part.isspace():
            raise ValueError(f"malformed Slurm node list {s!r}: empty host name")
        pieces: list[list[str]] = []
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", part):
            if literal:
                pieces.append([literal])
            if body:
                pieces.append(_expand_bracket(body, s))
        if "[]" in part:
            raise ValueError(f"malformed Slurm node list {s!r}: empty brackets")
        hosts.extend("".join(combo) for combo in product(*pieces))
    return hosts


def parse_tasks_per_node(s: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` syntax: ``"4(x2),3"`` -> ``[4, 4, 3]`` (one entry per node)."""
    counts: list[int] = []
    for item in s.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE: cannot parse {s!r} (item {item!r})")
        n, reps = int(m.group(1)), int(m.group(2) or 1)
        if n < 1 or reps < 1:
            raise ValueError(f"SLURM_TASKS_PER_NODE: counts must be >= 1 in {s!r}")
        counts.extend([n] * reps)
    return counts


# ---------------------------------------------------------------------------------------------
# detection


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = environ[name]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _opt_int(environ: Mapping[str, str], *names: str, minimum: int = 0) -> int | None:
    for name in names:
        if environ.get(name, "").strip():
            return _int(environ, name, minimum=minimum)
    return None


def _port(environ: Mapping[str, str]) -> int | None:
    port = _opt_int(environ, "MASTER_PORT", minimum=1)
    if port is not None and port > 65535:
        raise ValueError(f"MASTER_PORT={environ['MASTER_PORT']!r} must be <= 65535")
    return port


def _require(environ: Mapping[str, str], name: str, launcher: str) -> None:
    if not environ.get(name, "").strip():
        raise ValueError(f"{name} is not set but other {launcher} variables are")


def _check(env: DistEnv, names: Mapping[str, str]) -> DistEnv:
    """Cross-field consistency; ``names`` maps field -> the variable it came from."""
    if env.rank >= env.world_size:
        raise ValueError(
            f"{names['rank']}={env.rank} must be < {names['world_size']}={env.world_size}"
        )
    if env.local_rank >= env.local_world_size:
        raise ValueError(
            f"{names['local_rank']}={env.local_rank} must be < "
            f"{names['local_world_size']}={env.local_world_size}"
        )
    if env.local_world_size > env.world_size:
        raise ValueError(
            f"{names['local_world_size']}={env.local_world_size} must be <= "
            f"{names['world_size']}={env.world_size}"
        )
    return env


def _detect_torchrun(environ: Mapping[str, str]) -> DistEnv:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        _require(environ, name, "torchrun")
    rank = _int(environ, "RANK")
    world_size = _int(environ, "WORLD_SIZE", minimum=1)
    local_rank = _int(environ, "LOCAL_RANK")
    lws_name = "LOCAL_WORLD_SIZE" if environ.get("LOCAL_WORLD_SIZE", "").strip() else "LOCAL_SIZE"
    local_world_size = _opt_int(environ, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", minimum=1)
    if local_world_size is None:  # older DeepSpeed launchers: assume one node
        lws_name, local_world_size = "WORLD_SIZE", world_size
    node_rank = _opt_int(environ, "GROUP_RANK", "NODE_RANK", "CROSS_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size
    port = _port(environ)
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR", "").strip() or DEFAULT_MASTER_ADDR,
        master_port=DEFAULT_MASTER_PORT if port is None else port,
        launcher="torchrun",
    )
    names = {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": lws_name,
    }
    return _check(env, names)


def _detect_slurm(environ: Mapping[str, str]) -> DistEnv:
    for name in ("SLURM_PROCID", "SLURM_NTASKS"):
        _require(environ, name, "Slurm srun")
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_NTASKS", minimum=1)
    local_rank = _opt_int(environ, "SLURM_LOCALID")
    node_rank = _opt_int(environ, "SLURM_NODEID")
    local_rank = 0 if local_rank is None else local_rank
    node_rank = 0 if node_rank is None else node_rank

    lws_name = "SLURM_NTASKS_PER_NODE"
    local_world_size = _opt_int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
    if local_world_size is None:
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if environ.get(name, "").strip():
                lws_name = name
                counts = parse_tasks_per_node(environ[name])
                if node_rank >= len(counts):
                    raise ValueError(
                        f"SLURM_NODEID={node_rank} is out of range for {name}="
                        f"{environ[name]!r} ({len(counts)} nodes)"
                    )
                local_world_size = counts[node_rank]
                break
    if local_world_size is None:
        nnodes = _opt_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", minimum=1)
        if nnodes not in (None, 1):
            raise ValueError(
                "SLURM_TASKS_PER_NODE is not set and the job has several nodes: "
                "cannot tell how many tasks run on this node"
            )
        lws_name, local_world_size = "SLURM_NTASKS", world_size

    nodelist_name = next(
        (
            n
            for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if environ.get(n, "").strip()
        ),
        None,
    )
    master_addr = environ.get("MASTER_ADDR", "").strip()
    if not master_addr:
        if nodelist_name is None:
            if world_size > local_world_size:
                raise ValueError(
                    "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST are not set: cannot find the "
                    "master host of a multi-node job (set MASTER_ADDR)"
                )
            master_addr = DEFAULT_MASTER_ADDR
        else:
            master_addr = expand_nodelist(environ[nodelist_name])[0]

    port = _port(environ)
    if port is None:
        job_id = _opt_int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        port = DEFAULT_MASTER_PORT if job_id is None else SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=port,
        launcher="slurm",
    )
    names = {
        "rank": "SLURM_PROCID",
        "world_size": "SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "local_world_size": lws_name,
    }
    return _check(env, names)


_SINGLE_PORT: int | None = None
"""The rendezvous port of this process when it runs alone and MASTER_PORT is unset: a free one,
picked once per process, so two single-process runs on one machine do not collide."""


def _single_process_port() -> int:
    global _SINGLE_PORT
    if _SINGLE_PORT is None:
        import socket

        with socket.socket() as s:
            s.bind((DEFAULT_MASTER_ADDR, 0))
            _SINGLE_PORT = s.getsockname()[1]
    return _SINGLE_PORT


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Learn this process's place in the job from ``environ`` (default ``os.environ``).

    torchrun/DeepSpeed variables win over Slurm ones (``srun torchrun ...`` is a common
    pattern); Slurm counts only inside an ``srun`` task; anything else is a single process.
    Inconsistent or non-integer values raise ``ValueError`` naming the variable.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(n, "").strip() for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _detect_torchrun(environ)
    if environ.get("SLURM_PROCID", "").strip():
        return _detect_slurm(environ)
    port = _port(environ)
    return DistEnv.single(
        environ.get("MASTER_ADDR", "").strip() or DEFAULT_MASTER_ADDR,
        _single_process_port() if port is None else port,
    )


def export_torch_env(env: DistEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the variables ``torch.distributed``'s ``env://`` init reads (in ``os.environ`` by
    default). A variable already set to the same value is left alone; one set to a different
    value raises ``ValueError`` (nothing is written in that case)."""
    environ = os.environ if environ is None else environ
    wanted = {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }
    for name, value in wanted.items():
        current = environ.get(name)
        if current is not None and current.strip() != value:
            raise ValueError(f"{name} is already set to {current!r}, which differs from {value!r}")
    for name, value in wanted.items():
        if environ.get(name) is None:
            environ[name] = value


# ---------------------------------------------------------------------------------------------
# A lost peer: what a collective raises when another process of the job died

# What gloo, NCCL and the TCP store say when the other side of a collective went away (a node
# died, a task was killed, the network broke) or never answered within the group's timeout.
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused"
    r"|remote process exited|NCCL communicator was aborted|ncclRemoteError|ncclSystemError"
    r"|Timed out waiting|timed out after|Watchdog caught collective operation timeout"
    r"|DistNetworkError|DistBackendError",
    re.IGNORECASE,
)


def lost_peer(exc: BaseException) -> bool:
    """True when ``exc`` (raised in a run of several processes) says that another process of
    the job is gone or unreachable, as opposed to a bug or bad input in this one."""
    if not detect().is_distributed:  # (the group itself may be torn down by now)
        return False
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # the cause chain too
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (RuntimeError, OSError)) and _PEER_FAILURE.search(text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def lost_peer_message(exc: BaseException, program: str, checkpoint: str | None) -> str:
    """The one paragraph a job log ends with when ``lost_peer(exc)``: who noticed, what the
    backend said (its first line), and where the run resumes from."""
    env = detect()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    resume = (
        f"the last complete checkpoint is {checkpoint}; requeue or resubmit the job to resume "
        "from it"
        if checkpoint
        else "requeue or resubmit the job: it resumes from the run's last checkpoint, if any"
    )
    return (
        f"{program}: {env.describe(short=True)} lost contact with another process of the job (a node "
        f"or task died, or the network between them failed): {first}\n{program}: {resume}."
    )


def report_lost_peer(exc: BaseException, program: str, checkpoint: str | None = None) -> bool:
    """When ``lost_peer(exc)``: prints the traceback, then ``lost_peer_message`` last, on
    stderr, and returns True (the caller exits 1); else False (the caller re-raises)."""
    if not lost_peer(exc):
        return False
    traceback.print_exception(exc)
    print(lost_peer_message(exc, program, checkpoint), file=sys.stderr, flush=True)
    return True
