"""Compiles the project's Triton kernels for NVIDIA GPUs without one: shared memory, registers,
spills (for tests/model/test_triton_kernels.py).

Triton compiles to a cubin for a named target with no GPU present (its wheel brings ptxas), so a
CPU machine can check what a launch on an H100 (sm_90) or an A100 (sm_80) would need: a kernel
that does not compile, asks for more shared memory than a block may have, or spills registers to
local memory is found here rather than on a GPU.

Kernels: TISA's split backend (`row_lse`, `diagonal_grad`; bf16 inputs, padded and unpadded,
head width 64), the Cayley map's Gauss-Jordan leaves (`gauss_jordan_inverse`, 96 and 128
wide), kernel attention's inference kernels (`key_summary`, `query_output`; bf16, the
albert-base and LRA feature maps and elu+1) and its training backward kernels (`query_grad`,
`summary_grad`, `key_grad`; bf16, head widths 64 and 32), each with its shipped options.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
"""Shared memory one block may use (opt-in maximum): H100 227 KB, A100 163 KB."""


def split_configs() -> list[dict]:
    """The split backend's kernels at albert-base's head width (64), bf16, shipped options."""
    from model.attention.tisa_split import SPLIT_KERNEL_OPTIONS as opt

    launch = {"num_warps": opt["num_warps"], "num_stages": opt["num_stages"]}
    configs = []
    for has_mask in (False, True):
        flags = {"HAS_MASK": has_mask, "BLOCK": opt["BLOCK"], "D": 64, "HEAD": 64,
                 "UPCAST": False, "PRECISION": None}  # fmt: skip
        for kernel in ("row_lse", "diagonal_grad"):
            configs.append({"kernel": kernel, "constexprs": flags, "launch": launch})
    return configs


def gauss_jordan_configs() -> list[dict]:
    from model.orthogonal import GAUSS_JORDAN_WARPS

    return [
        {"kernel": "gauss_jordan_inverse", "constexprs": {"NP": NP},
         "launch": {"num_warps": GAUSS_JORDAN_WARPS}}
        for NP in (128, 64)
    ]  # fmt: skip


def kernel_attention_configs() -> list[dict]:
    """Kernel attention's inference kernels (`kernel.inference_backend: triton`), bf16: the
    albert-base recipe's map (aoglu, one unit, head width 64, gate rank 16), the LRA recipes'
    (three aoglu units; head width 32 in the Skyformer setting) and elu+1, shipped options."""
    from model.attention.kernel_triton import KERNEL_OPTIONS as opt

    maps = [  # head width, units, product width c, gate rank, gate kind, elu
        (64, 1, 80, 16, 2, False),
        (32, 3, 40, 8, 2, False),
        (64, 1, 64, 0, 0, True),
    ]
    launch = {"num_warps": opt["num_warps"], "num_stages": opt["num_stages"]}
    configs = []
    for head, units, c, rank, gate, elu in maps:
        flags = {
            "BLOCK_N": opt["BLOCK_N"], "D": head, "DG": max(16, c - head), "U": units,
            "HEAD": head, "C": c, "R": rank, "GATE": gate, "ELU": elu, "ROUND": "bf16",
            "UPCAST": False, "PRECISION": None,
        }  # fmt: skip
        configs.append(
            {"kernel": "key_summary", "constexprs": {**flags, "HAS_MASK": False},
             "launch": launch}
        )  # fmt: skip
        configs.append(
            {"kernel": "query_output", "launch": launch,
             "constexprs": {**flags, "OUT_ROUND": "bf16", "FP32_PRECISION": "tf32x3"}}
        )  # fmt: skip
    return configs


def kernel_training_configs() -> list[dict]:
    """Kernel attention's training backward kernels (`kernel.training_backend: triton`), bf16,
    at head widths 64 (albert-base) and 32 (LRA), shipped options. Its forward kernels are the
    inference kernels with the identity as feature map (`kernel_attention_configs`, fewer
    registers)."""
    from model.attention.kernel_triton import GRAD_KERNEL_OPTIONS as opt

    launch = {"num_warps": opt["num_warps"], "num_stages": opt["num_stages"]}
    configs = []
    for head in (64, 32):
        flags = {
            "BLOCK_N": opt["BLOCK_N"], "D": head, "HEAD": head, "ROUND": "bf16",
            "UPCAST": False, "FP32_PRECISION": "tf32x3",
        }  # fmt: skip
        configs.append({"kernel": "query_grad", "constexprs": flags, "launch": launch})
        summary = {k: v for k, v in flags.items() if k != "ROUND"}
        configs.append({"kernel": "summary_grad", "constexprs": summary, "launch": launch})
        configs.append(
            {"kernel": "key_grad", "constexprs": {**flags, "HAS_MASK": False}, "launch": launch}
        )
    return configs


def all_configs() -> list[dict]:
    """Every kernel of the project with its shipped options."""
    return (
        split_configs() + gauss_jordan_configs() + kernel_attention_configs()
        + kernel_training_configs()
    )  # fmt: skip


def signature(kernel: str, fn) -> dict[str, str]:
    """Triton's signature of a kernel: bf16 tensors for the attention inputs, fp32 for the
    rest, int8 for the key mask, i32 integers, fp32 scalars, constexprs by name."""
    types = {}
    for name in fn.arg_names:
        if fn.params[fn.arg_names.index(name)].is_constexpr:
            types[name] = "constexpr"
        elif kernel == "gauss_jordan_inverse":
            types[name] = "*fp32" if name in ("M", "OUT") else "i32"
        elif name in ("Q", "K", "V", "DO", "WIN", "BW", "OUT", "DQ", "DK", "DV"):
            types[name] = "*bf16"
        elif name == "VALID":
            types[name] = "*i8"
        elif name in ("VALS", "LSE", "DELTA", "PART", "KV", "Z", "DKV", "DZ", "R", "DDEN"):
            types[name] = "*fp32"
        elif name in ("scale", "eps"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


LAUNCH_VALUES = {
    # A launch at the recipe's shape (B 64, H 12, N 512, head width 64, q / k / v views of the
    # fused (B, N, 3, H, h) projection, dO contiguous), for the specialisation a real launch
    # gets: Triton marks pointers and integers that are multiples of 16 as such.
    "sqb": 512 * 3 * 768, "sqh": 64, "sqn": 3 * 768, "skb": 512 * 3 * 768, "skh": 64,
    "skn": 3 * 768, "svb": 512 * 3 * 768, "svh": 64, "svn": 3 * 768, "sdb": 12 * 512 * 64,
    "sdh": 512 * 64, "sdn": 64, "s_vals": 2 * 512 - 1, "s_valid": 512, "N": 512, "H": 12,
    "B": 64, "NB": 8, "SLICES": 8, "n": 96, "stride_b": 96 * 96, "stride_r": 96,
    # kernel attention's: the output in (B, N, H, h) memory; 8 tiles of keys, 2 a program
    "sob": 512 * 768, "soh": 64, "son": 768, "TILES": 8, "TILES_PER": 2,
    # its training backward: dO as the output, the features' gradients heads first
    # (H, B, N, h), dK too, dV in the projection's (B, N, H, h) memory
    "sdob": 512 * 768, "sdoh": 64, "sdon": 768, "sdqb": 512 * 64, "sdqh": 64 * 512 * 64,
    "sdqn": 64, "sdkb": 512 * 64, "sdkh": 64 * 512 * 64, "sdkn": 64, "sdvb": 512 * 768,
    "sdvh": 64, "sdvn": 768,
}  # fmt: skip


def specialisation(fn, types: dict[str, str]) -> dict[tuple[int], list]:
    """The divisibility attributes Triton's launcher would give these arguments."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        kind = types[name]
        if kind.startswith("*") or (kind == "i32" and LAUNCH_VALUES.get(name, 1) % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resources(ptx: str, arch: int) -> dict[str, int]:
    """Registers per thread and spilled bytes per thread of a kernel's PTX, by `ptxas -v` from
    Triton's wheel (the one that reads its PTX version)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    tool = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run(
            [str(tool), f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out))
    return {"registers": registers, "spill_bytes": spills}


def check(config: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model import orthogonal_kernels
    from model.attention import kernel_triton_kernels, tisa_split_kernels

    modules = (orthogonal_kernels, kernel_triton_kernels, tisa_split_kernels)
    fn = getattr(next(m for m in modules if hasattr(m, config["kernel"])), config["kernel"])
    row = {"kernel": config["kernel"], "arch": f"sm_{arch}", **config["constexprs"]}
    row.update(config["launch"])
    try:
        types = signature(config["kernel"], fn)
        source = ASTSource(
            fn=fn,
            signature=types,
            constexprs=config["constexprs"],
            attrs=specialisation(fn, types),
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options=dict(config["launch"])
        )
    except Exception as error:  # a compile error is this check's finding
        row["error"] = str(error).strip().splitlines()[-1][:300]
        return row
    row["shared_bytes"] = compiled.metadata.shared
    # Loads Triton pipelined (async copies into shared memory, `num_stages` deep).
    row["async_copies"] = compiled.asm["ttgir"].count("async_copy_global_to_local")
    row.update(resources(compiled.asm["ptx"], arch))
    row["fits"] = compiled.metadata.shared <= SHARED_LIMIT[arch]
    return row
