"""kernels_pallas/gpu_lowering.py: reading the SASS (the compile itself needs the `triton`
package and runs by hand: its numbers are in docs/BENCHMARKS.md)."""

from kernels_pallas.gpu_lowering import loop_opcodes

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
.L_x_1:
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/              @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
.L_x_2:
        /*0040*/                   FADD R5, R5, 1 ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   STG.E desc[UR4][R2.64], R4 ;
        /*0090*/                   EXIT ;
"""


def test_loop_is_the_longest_backward_branch_span():
    ops = loop_opcodes(SASS)
    assert ops == {"HMMA": 1, "LDGSTS": 1, "FADD": 1, "BRA": 2, "BAR": 1}, ops
