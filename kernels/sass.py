"""What ptxas made of a kernel: its SASS, split into loops and counted, without a GPU.

The decode kernels are issue bound (docs/fp2-kernel.md, "Issue costs"): the warp instructions of
their main loop are what a change has to lower, and Nsight Compute needs a GPU to count them.
`census(cubin, kernel)` disassembles a cubin (nvdisasm, from the cuda-toolkit wheel), splits the
kernel into basic blocks, finds its natural loops (back edges of the control-flow graph) and, per
loop, walks from its head round to a back edge: the steady walk (`Loop`) is a pipelined kernel's
steady-state iteration. The counts are static, as a warp issues them: a predicated-off instruction
counts (Nsight's "instructions executed" counts it too); a branch that diverges within a warp runs
both sides, which no walk shows; calls (the compiler's slow paths for division) count as one
instruction. For the committed decode kernel the steady walk of the H200's build (NVRTC 13.0) is 474
instructions per stage where Nsight Compute measured 474.5 (NVRTC 13.5 builds 472: the census counts
what the NVRTC it is given builds; docs/fp2-kernel.md, "Static counts").

The count is not the whole schedule: ptxas also writes into each instruction's control bits how
many cycles its warp stalls before issuing the next (fixed-latency dependences; variable-latency
ones wait on scoreboards instead). `Loop.stall_cycles` sums them along the steady walk. The field
(bits 105-108 of the 128-bit sm_90 encoding) is not documented by NVIDIA; it is read as the
published reverse-engineering of Volta-to-Hopper SASS gives it. On the H200 two builds of the decode
loop with the same 474 instructions but 896 and 829 stall cycles ran 2-3% apart, and a build with
533 instructions and 1010 cycles 18% slower (docs/benchmarks.md, 2026-12-05): a second static
number, still not a time.

Limits: indirect branches (BRX, JMX) end a block with no successor, so a kernel with switch tables
gets loops that may be too small; `KernelSass.indirect` names them.
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

# "        /*01a0*/               @!P0 BRA P1, `(.L_x_0) ;"
_INSTR_RE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL_RE = re.compile(r"^(\.L_x_\d+|\.text\.\S+):")
_TARGET_RE = re.compile(r"`\((\.L_x_\d+)\)")
_EIATTR_REGCOUNT = 0x2F
_SECTION_RE = re.compile(r"^\s*\.section\s+\.text\.(\S+?),")
# nvdisasm -hex: the encoding's high 64 bits alone on the line after the instruction
_HIGH_WORD_RE = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_STALL_SHIFT = 105 - 64  # the stall count: bits 105-108 of the instruction, 41-44 of its high word


class SassError(RuntimeError):
    """nvdisasm is missing or failed, or the cubin has no such kernel."""


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str  # with its modifiers: "LDGSTS.E.BYPASS.128"
    predicated: bool
    target: str | None  # a branch's label
    stall: int = 0  # cycles the warp stalls after it (control bits; 0 where the listing has no encoding)
    text: str = ""  # as nvdisasm wrote it, predicate and operands included

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]


MMA_OPS = ("HMMA", "IMMA", "HGMMA", "IGMMA", "QGMMA")  # tensor-core instructions


@dataclass(frozen=True)
class Block:
    first: int  # index into KernelSass.instrs
    end: int  # one past the last
    succs: tuple[int, ...]  # block indices


@dataclass(frozen=True)
class Loop:
    """One natural loop (its head and the blocks that reach its back edges), counted by three walks
    from the head round to a back edge (inner loops taken once).

    `walk` is the steady walk: the one that issues the most copy instructions (`COPY_OPS`) and,
    among those, the fewest instructions: a pipelined kernel's steady-state iteration, which copies
    a stage ahead and takes none of its rare branches (a rescale, a partial stage). `shortest` and
    `longest` bound every other walk.
    """

    head_addr: int
    walk: tuple[Instr, ...]  # the steady walk's instructions, in order
    shortest: int
    longest: int
    depth: int  # 0 for an outermost loop

    @property
    def steady(self) -> Counter[str]:
        """Opcode -> count along the steady walk."""
        return Counter(i.opcode for i in self.walk)

    @property
    def stall_cycles(self) -> int:
        """The steady walk's fixed stall cycles (Instr.stall summed)."""
        return sum(i.stall for i in self.walk)

    @property
    def per_iteration(self) -> int:
        return len(self.walk)

    def count(self, bases: tuple[str, ...]) -> int:
        """Instructions of the steady walk whose opcode (before its first dot) is one of `bases`."""
        return sum(n for op, n in self.steady.items() if op.split(".", 1)[0] in bases)


@dataclass(frozen=True)
class KernelSass:
    name: str
    registers: int
    instrs: tuple[Instr, ...]
    blocks: tuple[Block, ...]
    loops: tuple[Loop, ...]  # outermost first, then by address
    indirect: tuple[int, ...]  # addresses of indirect branches

    def main_loop(self) -> Loop:
        """The loop whose steady walk holds the most tensor-core instructions (`MMA_OPS`), the
        innermost on a tie: an outer loop's walk takes its inner loops once, so a kernel whose stage
        loop runs inside a loop over chunks of stages (attn_fp2_decode) ties it, and the stage loop is
        the one to count. Without MMAs, the outermost loop with the most instructions per iteration."""
        if not self.loops:
            raise SassError(f"{self.name} has no loop")

        def rank(lp: Loop) -> tuple[int, int, int]:
            mma = lp.count(MMA_OPS)
            return mma, lp.depth if mma else -lp.depth, lp.per_iteration

        return max(self.loops, key=rank)

    def local_memory_ops(self) -> int:
        """LDL / STL in the whole kernel: register spills (the kernels use no local arrays)."""
        return sum(1 for i in self.instrs if i.base in ("LDL", "STL"))


def nvdisasm_path() -> str:
    from cuda.pathfinder import find_nvidia_binary_utility

    path = find_nvidia_binary_utility("nvdisasm")
    if path is None:
        raise SassError("nvdisasm not found: pip install 'cuda-toolkit[nvdisasm]' (a dependency of zerodram)")
    return path


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        run = subprocess.run([nvdisasm_path(), "-c", "-hex", str(f)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SassError(f"nvdisasm failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout


def registers(cubin: bytes, kernel: str) -> int:
    """Registers per thread: the EIATTR_REGCOUNT record of the cubin's `.nv.info` section for the
    kernel's symbol (the symbol index is the `sh_info` of its `.text.<kernel>` section)."""
    if cubin[:5] != b"\x7fELF\x02":
        raise SassError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = {}  # name -> (file offset, size, sh_info)
    strtab = struct.unpack_from("<IIQQQQII", cubin, shoff + shstrndx * shentsize)[4]
    for i in range(shnum):
        name, _, _, _, offset, size, _, info = struct.unpack_from("<IIQQQQII", cubin, shoff + i * shentsize)
        sections[cubin[strtab + name : cubin.index(b"\0", strtab + name)].decode()] = (offset, size, info)
    if f".text.{kernel}" not in sections or ".nv.info" not in sections:
        raise SassError(f"the cubin has no kernel {kernel!r}")
    symbol = sections[f".text.{kernel}"][2]
    p, size, _ = sections[".nv.info"]
    end = p + size
    while p + 4 <= end and cubin[p] == 0x04:  # EIFMT_SVAL records: format, attribute, u16 size, value
        attr, n = cubin[p + 1], struct.unpack_from("<H", cubin, p + 2)[0]
        if attr == _EIATTR_REGCOUNT and struct.unpack_from("<I", cubin, p + 4)[0] == symbol:
            return struct.unpack_from("<I", cubin, p + 8)[0]
        p += 4 + n
    raise SassError(f"no register count for {kernel!r} in the cubin's .nv.info")


def parse(sass: str, kernel: str) -> tuple[list[Instr], dict[str, int]]:
    """The kernel's instructions and its labels (label -> instruction index), from nvdisasm -c
    (with -hex, each instruction's stall count too)."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    inside = False
    for line in sass.splitlines():
        if instrs and inside and (m := _HIGH_WORD_RE.match(line)):
            instrs[-1] = replace(instrs[-1], stall=(int(m.group(1), 16) >> _STALL_SHIFT) & 0xF)
            continue
        if m := _SECTION_RE.match(line):
            inside = m.group(1) == kernel
            continue
        if not inside:
            continue
        if m := _LABEL_RE.match(line):
            labels[m.group(1)] = len(instrs)
        elif m := _INSTR_RE.match(line):
            addr, pred, opcode, operands = m.groups()
            target = _TARGET_RE.search(operands)
            predicated = pred is not None and pred.strip() not in ("@PT", "@UPT")
            if opcode.startswith("BRA") and not operands.lstrip().startswith("`"):
                predicated = True  # "BRA P1, target", "BRA.DIV UR6, target": a condition of its own
            text = " ".join(x for x in ((pred or "").strip(), opcode, operands.strip()) if x)
            instrs.append(Instr(int(addr, 16), opcode, predicated, target.group(1) if target else None, text=text))
    if not instrs:
        raise SassError(f"no SASS for kernel {kernel!r} in the disassembly")
    return instrs, labels


COPY_OPS = ("LDGSTS", "UBLKCP", "UTMALDG")  # cp.async, cp.async.bulk, cp.async.bulk.tensor

# Opcodes that move control: the block ends after them. BSSY/BSYNC/WARPSYNC only mark reconvergence.
_BRANCHES = ("BRA", "JMP")
_INDIRECT = ("BRX", "JMX")
_ENDS = ("EXIT", "RET", "KILL")


def _blocks(instrs: list[Instr], labels: dict[str, int]) -> tuple[list[Block], list[int]]:
    leaders = {0, *labels.values()}
    indirect = []
    for i, ins in enumerate(instrs):
        if ins.base in _BRANCHES + _INDIRECT + _ENDS and i + 1 < len(instrs):
            leaders.add(i + 1)
        if ins.base in _INDIRECT:
            indirect.append(ins.addr)
    starts = sorted(s for s in leaders if s < len(instrs))
    block_of = {s: b for b, s in enumerate(starts)}
    blocks = []
    for b, first in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else len(instrs)
        last = instrs[end - 1]
        succs: list[int] = []
        falls = end < len(instrs)
        if last.base in _BRANCHES and last.target is not None:
            succs.append(block_of[labels[last.target]])
            falls = falls and last.predicated
        elif last.base in _INDIRECT or (last.base in _ENDS and not last.predicated):
            falls = False
        if falls:
            succs.append(b + 1)
        blocks.append(Block(first, end, tuple(dict.fromkeys(succs))))
    return blocks, indirect


def _dominators(preds: list[list[int]]) -> list[set[int]]:
    """dom[b]: the blocks every path from the entry (block 0) to b passes, b included."""
    n = len(preds)
    dom = [set(range(n)) for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            ps = [dom[p] for p in preds[b]]
            new = {b} | (set.intersection(*ps) if ps else set())
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def census(cubin: bytes, kernel: str) -> KernelSass:
    """Disassemble `kernel` from `cubin` and count its loops (module docstring).

    Raises:
        SassError: nvdisasm missing or failing, or no such kernel in the cubin.
    """
    return census_text(disassemble(cubin), kernel, registers(cubin, kernel))


def census_text(sass: str, kernel: str, num_registers: int = 0) -> KernelSass:
    """`census` from nvdisasm's text (tests feed it a hand-written listing)."""
    instrs, labels = parse(sass, kernel)
    blocks, indirect = _blocks(instrs, labels)
    preds: list[list[int]] = [[] for _ in blocks]
    for b, blk in enumerate(blocks):
        for s in blk.succs:
            preds[s].append(b)
    dom = _dominators(preds)
    latches: dict[int, list[int]] = {}  # loop head -> blocks with a back edge to it
    for b, blk in enumerate(blocks):
        for s in blk.succs:
            if s in dom[b]:
                latches.setdefault(s, []).append(b)
    bodies: dict[int, set[int]] = {}
    for head, tails in latches.items():
        body, stack = {head}, list(tails)
        while stack:  # everything that reaches a back edge without passing the head
            b = stack.pop()
            if b not in body:
                body.add(b)
                stack.extend(preds[b])
        bodies[head] = body
    loops = []
    for head, body in bodies.items():
        walk, shortest, longest = _walks(instrs, blocks, body, head, set(latches[head]), dom)
        walked = tuple(instrs[i] for b in walk for i in range(blocks[b].first, blocks[b].end))
        depth = sum(1 for h, other in bodies.items() if h != head and body < other)
        loops.append(Loop(instrs[blocks[head].first].addr, walked, shortest, longest, depth))
    loops.sort(key=lambda lp: (lp.depth, lp.head_addr))
    return KernelSass(kernel, num_registers, tuple(instrs), tuple(blocks), tuple(loops), tuple(indirect))


def _walks(
    instrs: list[Instr], blocks: list[Block], body: set[int], head: int, latches: set[int], dom: list[set[int]]
) -> tuple[tuple[int, ...], int, int]:
    """The steady walk's blocks, and the shortest and longest walk's instruction counts, from `head`
    to any of `latches` over the loop body without its back edges (a DAG for ptxas's reducible
    control flow)."""
    succs = {b: [s for s in blocks[b].succs if s in body and s not in dom[b]] for b in body}
    indeg = Counter(s for b in body for s in succs[b])
    order, ready = [], [b for b in body if indeg[b] == 0]
    while ready:  # Kahn's topological order
        b = ready.pop()
        order.append(b)
        for s in succs[b]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)

    def size(b: int) -> int:
        return blocks[b].end - blocks[b].first

    def copies(b: int) -> int:
        return sum(1 for i in range(blocks[b].first, blocks[b].end) if instrs[i].base in COPY_OPS)

    # best[b]: (copies, -instructions) of the steady walk from head to b, its predecessor; lo / hi
    best: dict[int, tuple[tuple[int, int], int | None]] = {head: ((copies(head), -size(head)), None)}
    lo, hi = {head: size(head)}, {head: size(head)}
    for b in order:
        if b not in best:
            continue
        for s in succs[b]:
            cand = (best[b][0][0] + copies(s), best[b][0][1] - size(s))
            if s not in best or cand > best[s][0]:
                best[s] = (cand, b)
            lo[s] = min(lo.get(s, 1 << 30), lo[b] + size(s))
            hi[s] = max(hi.get(s, 0), hi[b] + size(s))
    end = max((t for t in latches if t in best), key=lambda t: best[t][0])
    path, b = [], end
    while b is not None:
        path.append(b)
        b = best[b][1]
    return tuple(reversed(path)), min(lo[t] for t in latches if t in lo), max(hi[t] for t in latches if t in hi)
