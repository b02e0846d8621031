"""What content checksums cost a checkpoint: seconds per GB saved and loaded, per hash.

``engine.checkpoint.CheckpointStore`` seals a checkpoint with ``COMPLETE.json``; with
``checksum="sha256"`` (the default) rank 0 reads every file once while it fsyncs it and records
its digest, and ``verify`` re-reads and re-hashes every file. This measures that on real files
through the real store:

1. Hash speed in memory (no I/O): GB/s of every hashlib candidate over a ``--buffer-mib``
   buffer in 8 MiB updates, with zlib's crc32 and (when installed) xxhash's xxh3_128 as
   non-cryptographic references that the store does not offer, and sha256 again with the CPU's
   SHA extensions masked from OpenSSL (``OPENSSL_ia32cap``), as on CPUs without them.
2. Save: one checkpoint of ``--sizes`` MiB of random bytes in ``--files`` files (default one),
   per hash and per ``none`` (sizes only: the seal before checksums existed, i.e. writing +
   fsync). The store hashes the files of a checkpoint in ``HASH_THREADS`` threads (override:
   ``--hash-threads``), each file's fsync beside its hashing. ``write`` is writing the file
   (into the page cache), ``seal`` is ``store.commit`` (fsync + hashing + ``COMPLETE.json`` +
   renames); ``ratio`` is (write + seal) with checksums / (write + seal) without.
3. Load: ``store.verify`` of that checkpoint with sizes only, and with checksums, from a warm
   page cache and "cold": after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file (the pages
   are clean after the seal's fsync, so the kernel drops them; ``resident`` reports the share
   of pages still cached, measured with ``mincore``). ``cold read`` is reading the file without
   hashing, the disk's own speed. On a virtual machine the host may still cache the disk.

Every timing is the fastest of ``--repeats`` runs (``--stat median`` for the median): on a
machine shared with other work the fastest run is the one least disturbed by it (the load
average before and after is in the JSON). GB = 1e9 bytes. The files are
written under ``--workdir`` (default: a temporary directory in /tmp), one checkpoint at a time,
and deleted.

    python bench/bench_checkpoint_checksums.py --sizes 256 1024 --files 1 4 --repeats 5 \
        --out bench/results/checkpoint_checksums_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine.files  # noqa: E402
from engine.checkpoint import CheckpointStore  # noqa: E402
from engine.files import HASH_CHUNK_BYTES, HASH_THREADS  # noqa: E402

GB = 1e9
MIB = 1 << 20
FILES = ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_optim_states.pt" for r in range(63)]


STAT: Callable[[list[float]], float] = min
"""How the ``--repeats`` timings of one measurement are summarised (``--stat``)."""


def summary(times: list[float]) -> float:
    return STAT(times)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return summary(times)


# ----------------------------------------------------------------------------- 1. hash speed


def hash_speeds(names: list[str], buffer_mib: int, repeats: int) -> list[dict]:
    data = os.urandom(buffer_mib * MIB)
    view = memoryview(data)
    chunks = [view[i : i + HASH_CHUNK_BYTES] for i in range(0, len(data), HASH_CHUNK_BYTES)]

    def hashlib_run(name: str) -> Callable[[], object]:
        def run() -> str:
            h = hashlib.new(name)
            for chunk in chunks:
                h.update(chunk)
            return h.hexdigest()

        return run

    def crc32() -> int:
        value = 0
        for chunk in chunks:
            value = zlib.crc32(chunk, value)
        return value

    candidates: list[tuple[str, str, Callable[[], object]]] = [
        (name, "hashlib (offered by the store)", hashlib_run(name)) for name in names
    ]
    candidates.append(("crc32", "zlib (reference, not offered)", crc32))
    try:
        import xxhash

        def xxh3() -> str:
            h = xxhash.xxh3_128()
            for chunk in chunks:
                h.update(chunk)
            return h.hexdigest()

        candidates.append(
            ("xxh3_128", f"xxhash {xxhash.VERSION} (reference, not a dependency)", xxh3)
        )
    except ImportError:
        pass
    rows = []
    for name, source, run in candidates:
        run()  # warm-up
        seconds = median_time(run, repeats)
        rows.append({"hash": name, "source": source, "gb_per_s": len(data) / GB / seconds})
    if "sha256" in names and _cpu_flag("sha_ni"):
        rows.append(
            {
                "hash": "sha256",
                "source": "hashlib, SHA extensions masked (OPENSSL_ia32cap): older CPUs",
                "gb_per_s": _sha256_without_sha_extensions(buffer_mib, repeats),
            }
        )
    return rows


def _sha256_without_sha_extensions(buffer_mib: int, repeats: int) -> float | None:
    """sha256's speed where the CPU has no SHA extensions (Intel before Ice Lake): OpenSSL told
    through ``OPENSSL_ia32cap`` to ignore CPUID.7.EBX bit 29, in a subprocess."""
    code = (
        "import hashlib, os, time\n"
        f"data = memoryview(os.urandom({buffer_mib * MIB})); step = {HASH_CHUNK_BYTES}\n"
        "times = []\n"
        f"for _ in range({repeats + 1}):\n"
        "    h = hashlib.sha256(); t = time.perf_counter()\n"
        "    for i in range(0, len(data), step): h.update(data[i:i + step])\n"
        "    times.append(time.perf_counter() - t)\n"
        "print(len(data) / 1e9 / min(times[1:]))\n"
    )
    env = {**os.environ, "OPENSSL_ia32cap": ":~0x20000000"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip())
    except (subprocess.SubprocessError, ValueError):
        return None


# ----------------------------------------------------------------------------- page cache


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # already clean after the seal's fsync; DONTNEED skips dirty pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (``mincore`` on a private mapping, which
    reports the file's cached pages until they are written to). None where it cannot tell."""
    size = path.stat().st_size
    if size == 0:
        return None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            page = mmap.PAGESIZE
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)
            try:
                rc = _libc.mincore(
                    ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec
                )
            finally:
                del buf  # release the export before the mapping closes
            if rc != 0:
                return None
            return sum(v & 1 for v in vec) / pages
    except (OSError, ValueError, AttributeError):
        return None


def max_resident(paths: list[Path]) -> float | None:
    fractions = [resident_fraction(p) for p in paths]
    return None if None in fractions else max(fractions)


def read_all(path: Path) -> int:
    buffer = bytearray(HASH_CHUNK_BYTES)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total


# ----------------------------------------------------------------------------- 2 + 3. save, load


def write_file(path: Path, size: int, block: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        left = size
        view = memoryview(block)
        while left:
            n = min(left, len(block))
            f.write(view[:n])
            left -= n


def one_save(
    root: Path, checksum: str | None, size: int, block: bytes, files: int
) -> dict[str, float]:
    """Write and seal one checkpoint (step 1) of ``files`` files (``size`` bytes in all) in a
    fresh store under ``root``."""
    shutil.rmtree(root, ignore_errors=True)
    store = CheckpointStore(root, checksum=checksum, keep_last=1)
    staging = store.begin(1)
    os.sync()  # nothing else's dirty pages in the timed fsync
    start = time.perf_counter()
    for name in FILES[:files]:
        write_file(staging / name, size // files, block)
    written = time.perf_counter()
    store.commit(1, {"bench": True})
    sealed = time.perf_counter()
    return {"write_s": written - start, "seal_s": sealed - written}


def bench_size(
    workdir: Path, size_mib: int, modes: list[str | None], repeats: int, block: bytes, files: int
) -> tuple[list[dict], list[dict]]:
    size = size_mib * MIB
    save_rows, load_rows = [], []
    timings: dict[str | None, dict[str, float]] = {}
    one_save(workdir / "warm_up", None, size, block, files)  # first-touch costs out of the timings
    shutil.rmtree(workdir / "warm_up")
    for mode in modes:
        root = workdir / f"store_{mode or 'none'}"
        runs = [one_save(root, mode, size, block, files) for _ in range(repeats)]
        timings[mode] = {k: summary([r[k] for r in runs]) for k in runs[0]}

        store = CheckpointStore(root, checksum=mode, keep_last=1)
        tag = "step_00000001"
        paths = [root / tag / name for name in FILES[:files]]
        verify_sizes = median_time(lambda s=store, t=tag: s.verify(t, checksums=False), repeats)
        row: dict = {
            "size_mib": size_mib,
            "files": files,
            "hash": mode or "none",
            "verify_sizes_s": verify_sizes,
        }
        if mode is not None:
            store.verify(tag, checksums=True)  # warm the cache
            row["resident_warm"] = max_resident(paths)
            warm = median_time(lambda s=store, t=tag: s.verify(t, checksums=True), repeats)
            cold_times, cold_reads, resident = [], [], []
            for _ in range(repeats):
                for path in paths:
                    drop_from_page_cache(path)
                resident.append(max_resident(paths))
                start = time.perf_counter()
                store.verify(tag, checksums=True)
                cold_times.append(time.perf_counter() - start)
                for path in paths:
                    drop_from_page_cache(path)
                start = time.perf_counter()
                for path in paths:
                    read_all(path)
                cold_reads.append(time.perf_counter() - start)
            cold = summary(cold_times)
            cold_read = summary(cold_reads)
            known = [r for r in resident if r is not None]
            row.update(
                {
                    "verify_checksums_warm_s": warm,
                    "verify_checksums_warm_gb_per_s": size / GB / warm,
                    "verify_checksums_cold_s": cold,
                    "verify_checksums_cold_gb_per_s": size / GB / cold,
                    "cold_read_s": cold_read,
                    "cold_read_gb_per_s": size / GB / cold_read,
                    "resident_after_dontneed": max(known) if known else None,
                    "verify_checksums_warm_s_per_gb": warm / (size / GB),
                    "verify_checksums_cold_s_per_gb": cold / (size / GB),
                }
            )
        load_rows.append(row)
        shutil.rmtree(root, ignore_errors=True)

    plain = timings[None]
    plain_total = plain["write_s"] + plain["seal_s"]
    for mode in modes:
        t = timings[mode]
        total = t["write_s"] + t["seal_s"]
        save_rows.append(
            {
                "size_mib": size_mib,
                "files": files,
                "hash": mode or "none",
                "write_s": t["write_s"],
                "seal_s": t["seal_s"],
                "total_s": total,
                "total_s_per_gb": total / (size / GB),
                "total_gb_per_s": size / GB / total,
                "ratio_total_vs_none": total / plain_total,
                "ratio_seal_vs_none": t["seal_s"] / plain["seal_s"],
            }
        )
    return save_rows, load_rows


# ----------------------------------------------------------------------------- output


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    def fmt(value: object, spec: str) -> str:
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    cells = [[fmt(r.get(key), spec) for key, _, spec in columns] for r in rows]
    heads = [head for _, head, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="MiB per file")
    parser.add_argument(
        "--hashes",
        nargs="+",
        default=["sha256", "blake2b"],
        help="hashlib algorithms to seal and verify with (the store's checksum=)",
    )
    parser.add_argument(
        "--speed-hashes",
        nargs="+",
        default=["sha256", "blake2b", "blake2s", "sha512", "sha1", "md5", "sha3_256"],
        help="hashlib algorithms whose in-memory speed is measured",
    )
    parser.add_argument(
        "--files",
        type=int,
        nargs="+",
        default=[1],
        help="files per checkpoint, one run each (--sizes is split over them)",
    )
    parser.add_argument(
        "--hash-threads",
        type=int,
        default=None,
        help=f"engine.files.HASH_THREADS (default here: {HASH_THREADS})",
    )
    parser.add_argument("--buffer-mib", type=int, default=256, help="in-memory hash buffer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--stat", choices=["min", "median"], default="min", help="summary of the repeats"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a tmp dir in /tmp")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    if max(args.sizes) > 2048:
        parser.error("--sizes: at most 2048 MiB (one checkpoint is on disk at a time)")
    if not all(1 <= n <= len(FILES) for n in args.files):
        parser.error(f"--files: 1 to {len(FILES)}")
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    if args.hash_threads is not None:
        engine.files.HASH_THREADS = args.hash_threads

    load_before = list(os.getloadavg())
    workdir = Path(tempfile.mkdtemp(prefix="ckpt_checksums_", dir=args.workdir))
    try:
        speed = hash_speeds(args.speed_hashes, args.buffer_mib, args.repeats)
        block = os.urandom(64 * MIB)
        modes: list[str | None] = [None, *args.hashes]
        save_rows, load_rows = [], []
        for files in args.files:
            for size_mib in args.sizes:
                s, lo = bench_size(workdir, size_mib, modes, args.repeats, block, files)
                save_rows += s
                load_rows += lo
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print("\n1. hash speed in memory (8 MiB updates)")
    print(table(speed, [("hash", "hash", ""), ("gb_per_s", "GB/s", ".2f"), ("source", "", "")]))
    print(f"\n2. save: write + seal (fsync; with a hash: + hashing), {args.stat} seconds")
    print(
        table(
            save_rows,
            [
                ("size_mib", "MiB", ""),
                ("files", "files", ""),
                ("hash", "hash", ""),
                ("write_s", "write s", ".3f"),
                ("seal_s", "seal s", ".3f"),
                ("total_s_per_gb", "total s/GB", ".3f"),
                ("total_gb_per_s", "GB/s", ".2f"),
                ("ratio_seal_vs_none", "seal/none", ".2f"),
                ("ratio_total_vs_none", "total/none", ".2f"),
            ],
        )
    )
    print("\n3. load: verify with sizes only vs checksums (warm cache; cold after DONTNEED)")
    print(
        table(
            load_rows,
            [
                ("size_mib", "MiB", ""),
                ("files", "files", ""),
                ("hash", "hash", ""),
                ("verify_sizes_s", "sizes s", ".5f"),
                ("verify_checksums_warm_s_per_gb", "warm s/GB", ".3f"),
                ("verify_checksums_warm_gb_per_s", "warm GB/s", ".2f"),
                ("verify_checksums_cold_s_per_gb", "cold s/GB", ".3f"),
                ("verify_checksums_cold_gb_per_s", "cold GB/s", ".2f"),
                ("cold_read_gb_per_s", "cold read GB/s", ".2f"),
                ("resident_after_dontneed", "resident", ".2f"),
            ],
        )
    )
    meta = {
        "python": sys.version.split()[0],
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "sha_extensions": _cpu_flag("sha_ni"),
        "filesystem_of_workdir": str(workdir.parent),
        "hash_chunk_bytes": HASH_CHUNK_BYTES,
        "hash_threads": engine.files.HASH_THREADS,
        "command": " ".join(["python", *sys.argv]),
        "load_average_before_after": [load_before, list(os.getloadavg())],
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "args": vars(args),
            "meta": meta,
            "hash_speed": speed,
            "save": save_rows,
            "load": load_rows,
        }
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {args.out}")


def _cpu_info() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _cpu_info().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_flag(flag: str) -> bool | None:
    for line in _cpu_info().splitlines():
        if line.startswith("flags"):
            return flag in line.split()
    return None


if __name__ == "__main__":
    main()
