"""What every section of the benchmarks page shares: reading result files, formatting numbers,
markdown tables, and the command / machine / date line under a table."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

FAMILY = {
    "softmax": "softmax",
    "tisa": "TISA",
    "kernel": "kernel (aoglu)",
    "kernel-elu": "kernel (elu+1)",
    "transject": "TransJect",
}
"""A family's name in tables."""

Section = Callable[["Results"], dict[str, str]]


class Results:
    """The result files of one folder (``bench/results``), read once each."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._cache: dict[str, dict] = {}

    def __call__(self, rel: str) -> dict:
        if rel not in self._cache:
            path = self.root / rel
            if not path.exists():
                raise FileNotFoundError(f"the benchmarks page needs {path}")
            self._cache[rel] = json.loads(path.read_text())
        return self._cache[rel]

    def glob(self, pattern: str) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.glob(pattern))


def registry() -> tuple[dict[str, Section], Callable[[Section], Section]]:
    """A module's ordered sections and the decorator that adds one (by its function's name)."""
    sections: dict[str, Section] = {}

    def add(fn: Section) -> Section:
        sections[fn.__name__] = fn
        return fn

    return sections, add


# ----------------------------------------------------------------------------- numbers


def pct(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{100 * x:.{digits}f}%"


def msec(seconds: float) -> str:
    """Milliseconds, two decimals under 10 ms."""
    value = 1e3 * seconds
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def step_ms(r: dict) -> str:
    """A throughput row's median step time and, in brackets, its fastest."""
    return f"{1e3 * r['step_s']:.1f} ({1e3 * r['step_s_min']:.1f})"


def split_ms(r: dict) -> str:
    """forward / backward / optimizer ms of a throughput row."""
    s = r["split_s"]
    return " / ".join(f"{1e3 * s[k]:.1f}" for k in ("forward", "backward", "step"))


def gib(gb: float) -> str:
    return f"{gb:.1f}"


def mb(value: float) -> str:
    return f"{value:.0f} MB"


def x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}x"


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def family_order(family: str) -> int:
    """Tables list the families in this order: softmax, TISA, kernel, TransJect."""
    return list(FAMILY).index(family) if family in FAMILY else len(FAMILY)


def prefixed(name: str, values: dict[str, str]) -> dict[str, str]:
    return {f"{name}.{k}": str(v) for k, v in values.items()}


def md_table(head: list[str], rows: Iterable[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- provenance


def gpu_name(d: dict) -> str:
    """``H100``, ``H200``: the short name of a result's GPU."""
    gpu = d["machine"].get("gpu", "")
    for word in gpu.split():
        if word[:1] in "ABHL" and word[1:].isdigit():
            return word
    return gpu or "CPU"


def machine_text(m: dict) -> str:
    """A result's machine in words."""
    if "gpu" in m:
        return (f"one {m['gpu']} ({m['cpus']} CPU cores; torch {m['torch']}, CUDA {m['cuda']}, "
                f"DeepSpeed {m['deepspeed']})")  # fmt: skip
    cpus = m.get("cpus") or m.get("cpu_count")
    arch = m.get("processor") or m.get("cpu") or "x86_64"
    parts = [f"{cpus}-core {arch} CPU" if cpus else f"{arch} CPU"]
    if "torch" in m:
        parts.append(f"torch {m['torch']}")
    if m.get("threads"):
        parts.append(f"{m['threads']} intra-op thread{'s' if m['threads'] > 1 else ''}")
    if "python" in m and "torch" not in m:
        parts.append(f"Python {m['python']}")
    return ", ".join(parts)


def _commands(d: dict) -> list[str]:
    cmd = d["command"]
    return list(cmd) if isinstance(cmd, list) else [cmd]


def sources(res: Results, rels: Iterable[str]) -> str:
    """The commands that made these results, then their machine(s), date(s) and files."""
    rels = list(rels)
    data = [res(rel) for rel in rels]
    commands = list(dict.fromkeys(c for d in data for c in _commands(d)))
    machines = list(dict.fromkeys(machine_text(d["machine"]) for d in data))
    dates = sorted({d["date"][:10] for d in data})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    files = ", ".join(f"`bench/results/{rel}`" for rel in rels)
    return (
        "```bash\n" + "\n".join(commands) + "\n```\n\n"
        f"<small>{'; '.join(machines)}; {when}. Result: {files}.</small>"
    )


def source(res: Results, rel: str) -> str:
    return sources(res, [rel])


def run_settings(d: dict) -> str:
    """A throughput result's engine settings, from its arguments."""
    a = d["args"]
    parts = [f"ZeRO-{a['zero_stage']}", f"`{a['precision']}`"]
    if a.get("accumulation", 1) != 1:
        parts.append(f"accumulation {a['accumulation']}")
    if a.get("padding"):
        parts.append({"none": "unpadded batches", "one-short-row": "one row of each batch padded"}
                     .get(a["padding"], a["padding"]))  # fmt: skip
    parts += [f"`{o}`" for o in a.get("override") or []]
    return ", ".join(parts)
