"""A small emulator of the 32-bit integer PTX that the kernels' inline-asm decoders use (``add.u32``,
``sub.u32``, ``and / or / not / shl / shr .b32`` and ``prmt.b32`` in its default mode), so that an asm
string's results can be checked on a CPU against the reference decode. Operands: ``$n`` (outputs first, then
inputs, as Triton's ``inline_asm_elementwise`` numbers them), registers declared with ``.reg .b32``, and
decimal or hex immediates."""
from __future__ import annotations

import re

M32 = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32 d, a, b, c`` (default mode): byte i of d is byte (c >> 4i) & 7 of {b, a} (a the low
    bytes 0-3), or that byte's bit 7 replicated when bit 3 of the selector nibble is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    d = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        v = src[sel & 7]
        if sel & 8:
            v = 0xFF if v & 0x80 else 0
        d |= v << (8 * i)
    return d


def run(asm: str, *inputs: int, n_out: int) -> list[int]:
    """The ``n_out`` outputs of ``asm`` for 32-bit ``inputs`` ($n_out, $n_out + 1, ...)."""
    env: dict[str, int] = {f"${n_out + i}": v & M32 for i, v in enumerate(inputs)}
    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    for stmt in (s.strip() for s in body.replace("\n", ";").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        args = [x.strip() for x in args.split(",")]

        def val(x: str) -> int:
            if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", x):
                return int(x, 0) & M32
            return env[x]
        d = args[0]
        if op == "add.u32":
            env[d] = (val(args[1]) + val(args[2])) & M32
        elif op == "sub.u32":
            env[d] = (val(args[1]) - val(args[2])) & M32
        elif op == "and.b32":
            env[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            env[d] = val(args[1]) | val(args[2])
        elif op == "not.b32":
            env[d] = ~val(args[1]) & M32
        elif op == "shl.b32":
            env[d] = (val(args[1]) << min(32, val(args[2]))) & M32
        elif op == "shr.b32":
            env[d] = val(args[1]) >> min(32, val(args[2]))
        elif op == "prmt.b32":
            env[d] = prmt(val(args[1]), val(args[2]), val(args[3]))
        else:
            raise ValueError(f"ptx_emu: unsupported instruction {op!r} in {stmt!r}")
    return [env[f"${i}"] for i in range(n_out)]
