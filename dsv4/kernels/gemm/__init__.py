"""Block-scaled GEMMs of the hot path: one file per implementation, one router.

* ``route.py``: which kernel and tile runs for M rows on a target (FP8 linears, FP4 / FP8 experts);
* ``linear.py``: the FP8 linear entry points dispatched by ``route``;
* ``fp8.py``: act quant + the Triton FP8 tile kernel (decode split-K, fused act quant, SwiGLU epilogue);
* ``fp4.py``: the Triton FP8 x FP4 kernels (in-register dequant; ``dot_scaled`` on sm_100);
* ``gemv.py``: the CUDA-core decode GEMV (FP8 and FP4 weights) and the SwiGLU + quant pass;
* ``fp8_mma.py`` / ``fp4_mma.py``: Gluon tensor-core decode kernels (sm_89+);
* ``fp8_prefill.py`` / ``fp4_prefill.py``: prefill-sized tiles (TMA FP8 on sm_90; K=128 FP4 chains);
* ``common.py``: checks, split-K plan and sum, the grouped tile and epilogue they share.

Implementations import only ``common``, ``route`` and ``kernels.lib``; nothing here imports upward.
"""
