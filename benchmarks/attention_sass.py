"""The paged attention kernel's machine code for an H100/H200 (sm_90) at W1's decode launch (the 8B shape: 4 query
heads a KV head, heads of 128, 16-token blocks), a bf16 cache against an fp8 one read by bf16 queries, compiled
here with the Triton wheel's own ``ptxas`` and ``nvdisasm``: no GPU needed. Prints registers, spills and the
counts of the loads, shared-memory traffic, conversions and MMAs each compiles to: how the fp8 kernel was found to
read its tiles from shared memory a byte at a time (``LDS.U8``) where the bf16 one uses ``ldmatrix`` (``LDSM``).
The fp8 cache twice: its value cache as the engine stores it (transposed within each block) and token-major.

    python benchmarks/attention_sass.py --json attention_sass.json
    PYTHONPATH=/path/to/triton-3.6 python benchmarks/attention_sass.py   # as the GPU machine's Triton compiles it

Also the settings ``kernel_sweep.py`` tries (``--stages``, ``--block-n``, ``--warps``).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.kernels.paged_attention import _paged_attention_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import write_json  # noqa: E402

logger = logging.getLogger("benchmarks.attention_sass")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
STRIDES = ("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt", "stride_os", "stride_ot")
STRIDES += ("stride_oh", "stride_ls", "stride_lt", "stride_ft", "stride_fh")
SHOWN = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "F2FP", "HMMA")  # opcode prefixes printed


def compile_kernel(fp8: bool, block_n: int, num_stages: int, num_warps: int, transposed: bool = True) -> bytes:
    """The kernel's cubin for sm_90, specialized as a launch specializes it (pointers and strides divisible by 16).
    An fp8 cache goes in as the launcher passes it: as it is, or as 16-bit words where the kernel takes ``CVT``;
    its value cache ``transposed`` as the engine stores it (kernels/cache_write.py) where the kernel takes ``VT``."""
    words = fp8 and "CVT" in inspect.signature(_paged_attention_kernel.fn).parameters
    cache = "*i16" if words else "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "final_ptr": "*bf16", "counters_ptr": "*i32", "q_ptr": "*bf16"}
    pointers |= {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    pointers |= {"block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32"}
    scalars = {"num_seqs": "i32", "num_splits": "i32", "scale": "fp32", "softcap": "fp32", "sliding_window": "i32"}
    scalars |= dict.fromkeys(STRIDES, "i32")
    constants: dict[str, Any] = dict(
        QUERIES_PER_KV=4, G_PAD=4, BLOCK_Q=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_N=block_n, BLOCK_SIZE=16, SPLIT=False,
        SPLITS_PAD=1, MIN_SPLIT=64, USE_WINDOW=False, USE_SOFTCAP=False, IEEE=False, SCALED=fp8, FP16_DOTS=fp8,
        MASK_ALL=False,
    )  # fmt: skip
    if "CVT" in inspect.signature(_paged_attention_kernel.fn).parameters:
        constants["CVT"] = fp8
    if "VT" in inspect.signature(_paged_attention_kernel.fn).parameters:
        constants["VT"] = fp8 and transposed
    signature = pointers | scalars | dict.fromkeys(constants, "constexpr")
    names = list(signature)
    divisible = [*pointers, *(s for s in STRIDES if s not in ("stride_os", "stride_ls", "stride_lt"))]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = triton.compiler.ASTSource(
        fn=_paged_attention_kernel, signature=signature, constexprs=constants, attrs=attrs
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def census(cubin: bytes) -> dict[str, Any]:
    """Registers, stack and the shown opcodes' counts of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", path], capture_output=True, text=True).stdout
    opcodes: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        found = re.search(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if found:
            opcodes[found.group(1)] += 1
    registers = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert registers is not None, usage
    return {
        "registers": int(registers.group(1)),
        "stack_bytes": int(registers.group(2)),
        "instructions": sum(opcodes.values()),
        "opcodes": {op: n for op, n in sorted(opcodes.items()) if op.startswith(SHOWN)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-n", type=int, default=128, help="keys a tile (the library's decode launch: 128)")
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages (the library's decode launch: 3)")
    parser.add_argument("--warps", type=int, default=4, help="warps a program (the library's decode launch: 4)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results: dict[str, Any] = {"triton": triton.__version__, "command": " ".join(["python", *sys.argv]), "caches": {}}
    for name, fp8, transposed in (("bf16", False, False), ("fp8", True, True), ("fp8_values_token_major", True, False)):
        found = census(compile_kernel(fp8, args.block_n, args.stages, args.warps, transposed))
        results["caches"][name] = found
        logger.info("Triton %s, %s cache: %s", triton.__version__, name, found)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
