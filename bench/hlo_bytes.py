"""Where an optimised XLA program's memory traffic goes: each top-level instruction of its entry computation
(a fusion, a dot or convolution XLA left alone, a copy, a custom call), the bytes it reads and writes, and the
op and source line XLA's metadata names for it.

    python bench/hlo_bytes.py program.hlo.txt [--top 30]

A top-level instruction reads each operand from memory and writes its result, so its traffic is roughly the
sum of their sizes; the total is close to the ``bytes accessed`` of XLA's cost analysis (which refines it per
instruction kind). Bitcasts, tuples, parameters and constants move nothing and are left out. ``bench/tpu.py``
uses it for the per-program breakdown of the TPU benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

_ELEMENT_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_INSTRUCTION_START = re.compile(r"^\s+(?:ROOT\s+)?%[\w.\-]+\s*=")
_OPCODE = re.compile(r"\s(?P<opcode>[a-z][a-z0-9\-]*)\(")
_FREE = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
         "send-done", "recv-done"}
_METADATA = {key: re.compile(rf'{key}="(?P<value>[^"]*)"') for key in ("op_name", "source_file")}
_SOURCE_LINE = re.compile(r"source_line=(\d+)")
_KIND = re.compile(r"kind=(k\w+)")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_LOOP_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'op_name="rolled loop x(\d+)"|"known_trip_count":\{"n":"(\d+)"')
_COMPUTATION = re.compile(r"^%?(?P<name>[\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass
class Traffic:
    name: str
    opcode: str
    read: int
    written: int
    op_name: str
    source: str
    cycles: int = 0
    """The TPU compiler's estimate of the instruction's cycles (its backend config), 0 where it gives none."""

    @property
    def total(self) -> int:
        return self.read + self.written


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (a tuple's members added up)."""
    total = 0.0
    for element, dims in _SHAPE.findall(text):
        size = _ELEMENT_BYTES.get(element, 1)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def entry_traffic(hlo_text: str) -> list[Traffic]:
    """The traffic of each top-level instruction of the entry computation of ``hlo_text``, largest first. A
    ``while`` loop (rolled layers) counts as its body's instructions, each once per iteration (its bytes and
    cycles times the trip count XLA knows; named ``<instruction> x<n>``): XLA's own cost analysis counts a
    loop's body once."""
    rows = _traffic(hlo_text, _entry_lines(hlo_text), 1)
    rows.sort(key=lambda r: r.total, reverse=True)
    return rows


def _traffic(hlo_text: str, lines: list[str], repeat: int) -> list[Traffic]:
    rows = []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        rest = match["rest"]
        opcode_match = _OPCODE.search(rest)
        if opcode_match is None:
            continue
        opcode = opcode_match["opcode"]
        if opcode in _FREE:
            continue
        if opcode == "while":
            body, trips = _LOOP_BODY.search(rest), _TRIP_COUNT.search(rest)
            if body is None or trips is None:
                raise ValueError(f"a while loop without a known trip count: {match['name']}")
            trip_count = int(trips.group(1) or trips.group(2))
            rows += _traffic(hlo_text, _computation_lines(hlo_text, body.group(1)), repeat * trip_count)
            continue
        result_type = rest[: opcode_match.start()]
        operands = _balanced(rest, opcode_match.end() - 1)
        if opcode == "fusion":
            kind = _KIND.search(rest)
            opcode = f"fusion:{kind.group(1)[1:].lower()}" if kind else opcode
        elif opcode == "custom-call":
            target = _CUSTOM_TARGET.search(rest)
            opcode = f"custom-call:{target.group(1)}" if target else opcode
        op_name = _METADATA["op_name"].search(rest)
        source_file = _METADATA["source_file"].search(rest)
        source_line = _SOURCE_LINE.search(rest)
        source = f"{source_file['value']}:{source_line.group(1)}" if source_file and source_line else ""
        cycles = _CYCLES.search(rest)
        name = match["name"] if repeat == 1 else f"{match['name']} x{repeat}"
        rows.append(Traffic(name, opcode, repeat * shape_bytes(operands), repeat * shape_bytes(result_type),
                            op_name["value"] if op_name else "", source,
                            repeat * int(cycles.group(1)) if cycles else 0))
    return rows


def _entry_lines(hlo_text: str) -> list[str]:
    """The entry computation's instructions, one string each (``_computation_lines``)."""
    return _computation_lines(hlo_text, None)


def _computation_lines(hlo_text: str, name: str | None) -> list[str]:
    """The instructions of the computation ``name`` (a loop's body; None: the entry), one string each: an
    instruction's attributes may hold newlines (a Pallas kernel's custom call carries JSON metadata over
    several lines, some starting with "}"), so a line that does not start an instruction continues the one
    before, and only a bare "}" ends the computation."""
    lines: list[str] = []
    inside = False
    for line in hlo_text.splitlines():
        if not inside:
            header = _COMPUTATION.match(line) if name is not None else None
            inside = header is not None and header["name"] == name if name is not None else \
                line.startswith("ENTRY ")
            continue
        if line.rstrip() == "}":
            break
        if _INSTRUCTION_START.match(line) or not lines:
            lines.append(line)
        else:
            lines[-1] += " " + line.strip()
    return lines


def _balanced(text: str, start: int) -> str:
    """The text inside the parenthesis that opens at ``start``."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index]
    return text[start + 1 :]


def table(rows: list[Traffic], top: int = 25) -> str:
    """A markdown table of the ``top`` rows and the total of all."""
    total = sum(r.total for r in rows) or 1
    lines = ["| instruction | kind | read MB | written MB | share | est. cycles | op | source |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows[:top]:
        lines.append(f"| {row.name} | {row.opcode} | {row.read / 1e6:.1f} | {row.written / 1e6:.1f} | "
                     f"{row.total / total:.1%} | {row.cycles} | {row.op_name[-60:]} | {row.source} |")
    lines.append(f"| all {len(rows)} | | {sum(r.read for r in rows) / 1e6:.1f} | "
                 f"{sum(r.written for r in rows) / 1e6:.1f} | 100% | {sum(r.cycles for r in rows)} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", help="a file of optimised HLO text (dump-hlo's, or an executable's)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.hlo) as stream:
        print(table(entry_traffic(stream.read()), args.top))


if __name__ == "__main__":
    main()
