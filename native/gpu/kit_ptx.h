/*
 * The kit's kernels as PTX text, JIT-compiled by the driver (cuModuleLoadDataEx):
 * no nvcc is needed where the kit runs. Shared by kit.c and ptxdump.c (which
 * prints it for ptxas at build time).
 */
#ifndef KIT_PTX_H
#define KIT_PTX_H

/* gs_fma_loop: every thread runs `iters` iterations of 16 dependent FMAs and
 * stores the result (so nothing is optimised away). Fixed work per launch.
 * gs_empty: does nothing (launch overhead). Target sm_75 with PTX ISA 7.0, so
 * any driver from CUDA 11 on JIT-compiles it for the GPU at hand. */
#define FMA16                                                                                 \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"                   \
    "\tfma.rn.f32 %f1, %f1, %f2, %f3;\n\tfma.rn.f32 %f1, %f1, %f2, %f3;\n"
#define FMA_PER_ITER 16

static const char KIT_PTX[] __attribute__((unused)) =
    ".version 7.0\n"
    ".target sm_75\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gs_fma_loop(\n"
    "\t.param .u64 gs_fma_loop_out,\n"
    "\t.param .u32 gs_fma_loop_iters,\n"
    "\t.param .f32 gs_fma_loop_mul,\n"
    "\t.param .f32 gs_fma_loop_add\n"
    ")\n"
    "{\n"
    "\t.reg .pred %p<2>;\n"
    "\t.reg .b32 %r<8>;\n"
    "\t.reg .f32 %f<4>;\n"
    "\t.reg .b64 %rd<4>;\n"
    "\n"
    "\tld.param.u64 %rd1, [gs_fma_loop_out];\n"
    "\tld.param.u32 %r1, [gs_fma_loop_iters];\n"
    "\tld.param.f32 %f2, [gs_fma_loop_mul];\n"
    "\tld.param.f32 %f3, [gs_fma_loop_add];\n"
    "\tmov.u32 %r2, %ctaid.x;\n"
    "\tmov.u32 %r3, %ntid.x;\n"
    "\tmov.u32 %r4, %tid.x;\n"
    "\tmad.lo.u32 %r5, %r2, %r3, %r4;\n"
    "\tcvt.rn.f32.u32 %f1, %r5;\n"
    "\tmov.u32 %r6, 0;\n"
    "\tsetp.eq.u32 %p1, %r1, 0;\n"
    "\t@%p1 bra $L_done;\n"
    "$L_loop:\n" FMA16
    "\tadd.u32 %r6, %r6, 1;\n"
    "\tsetp.lt.u32 %p1, %r6, %r1;\n"
    "\t@%p1 bra $L_loop;\n"
    "$L_done:\n"
    "\tcvta.to.global.u64 %rd2, %rd1;\n"
    "\tmul.wide.u32 %rd3, %r5, 4;\n"
    "\tadd.s64 %rd2, %rd2, %rd3;\n"
    "\tst.global.f32 [%rd2], %f1;\n"
    "\tret;\n"
    "}\n"
    "\n"
    ".visible .entry gs_empty()\n"
    "{\n"
    "\tret;\n"
    "}\n";

#endif
