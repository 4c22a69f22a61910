#!/usr/bin/env bash
# CPU, no GPU (this machine, Triton 3.9 with its bundled ptxas; commit after 077608f): each training-side kernel
# compiled for sm_90 with its token counts marked 16-divisible against unmarked (what do_not_specialize compiles to).
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 python -m benchmarks.kernels.count_specialization > out.txt
