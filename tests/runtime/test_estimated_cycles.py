"""The TPU compiler's cycle estimates summed over a program: a Pallas kernel's multi-line metadata does not end
the entry computation early, and a rolled loop's body counts once per iteration."""

from __future__ import annotations

from tpucompile.contracts.loop_ops import TRIPS_PREFIX
from tpucompile.runtime.targets.cross_compile import estimated_cycles

_HLO = f"""HloModule main

%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %p = (s32[], f32[8]) parameter(0)
  %f = f32[8] fusion(%p), kind=kLoop, calls=%x, backend_config={{"estimated_cycles":"7"}}
  ROOT %t = (s32[], f32[8]) tuple(%p, %f)
}}

ENTRY %main.2 (a: f32[8]) -> f32[8] {{
  %a = f32[8] parameter(0)
  %k = f32[8] custom-call(%a), custom_call_target="tpu_custom_call", backend_config={{"estimated_cycles":"100",
"kernel_metadata":{{"a": 1
}}, "b": 2}}
  %w = (s32[], f32[8]) while(%t0), condition=%c, body=%body.1, metadata={{op_name="{TRIPS_PREFIX}16"}}
  ROOT %g = f32[8] fusion(%k), kind=kLoop, calls=%y, backend_config={{"estimated_cycles":"50"}}
}}
"""


class _Module:
    def to_string(self) -> str:
        return _HLO


class _Executable:
    def hlo_modules(self) -> list[_Module]:
        return [_Module()]


def test_kernel_metadata_and_loops_are_counted_whole():
    assert estimated_cycles(_Executable()) == 100 + 50 + 16 * 7
