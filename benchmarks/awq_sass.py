"""The AWQ GEMV's machine code for an H100/H200 (sm_90), compiled here with the Triton wheel's own ``ptxas`` and
``nvdisasm``: no GPU needed. Prints its registers per thread, spills and opcode counts, and where its weight loads
sit (``LDG.E``: each line's position in the SASS), which is how the launch options of ``kernels/awq_gemm.py`` were
judged before timing them on a GPU.

    python benchmarks/awq_sass.py           # the heuristic's one-row gate/up launch (registers: 56 with Triton
                                            # 3.9, 128 with the H200 machine's 3.6, which loads a whole group first)
    python benchmarks/awq_sass.py --loads   # also where each weight load sits
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.kernels.awq_gemv import awq_gemv_kernel  # noqa: E402

logger = logging.getLogger("benchmarks.awq_sass")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_gemv(constants: dict[str, int | bool], num_warps: int = 4) -> bytes:
    """The GEMV's cubin for sm_90 with bf16 activations and these constexprs, specialized as a launch of one row
    specializes it: ``M == 1`` a constant, the pointers and the sizes divisible by 16 (without those hints the
    code differs: scalar loads where the launch has vectors)."""
    pointers = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*bf16"}
    pointers |= {"out_ptr": "*bf16", "partial_ptr": "*fp32", "counters_ptr": "*i32"}
    scalars = dict.fromkeys(("n_packs", "K", "k_per_split", "magic"), "i32")
    constants = {"M": 1} | constants
    signature = pointers | {"M": "constexpr"} | scalars | dict.fromkeys(constants, "constexpr")
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *scalars)}
    source = triton.compiler.ASTSource(fn=awq_gemv_kernel, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return kernel.asm["cubin"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row-packs", type=int, default=3584, help="row stride in packs (gate/up fused: 3584)")
    parser.add_argument("--block-m", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=256)
    parser.add_argument("--block-k", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--loads", action="store_true", help="also print each weight load's SASS line")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    constants = dict(
        ROW_PACKS=args.row_packs,
        BLOCK_M=args.block_m,
        BLOCK_N=args.block_n,
        BLOCK_K=args.block_k,
        GROUP_SIZE=args.group_size,
        SPLIT=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "gemv.cubin"
        cubin.write_bytes(compile_gemv(constants))
        usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    registers = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage).group(0)
    logger.info("Triton %s: %s %s", triton.__version__, registers, constants)
    opcodes: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        found = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if found:
            opcodes[found.group(1)] += 1
        if args.loads and "LDG.E " in line:
            logger.info("   %s", line.strip())
    logger.info(", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))


if __name__ == "__main__":
    main()
