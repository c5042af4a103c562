"""Offline-compile cases of every kernel behind the op registry, for tests/test_targets.py.

``KERNELS``: kernel name -> (module, jitted function, argument types, the ops it serves). ``cases(cap,
full)``: (case id, kernel name, constexprs, warps, stages) to compile for sm_``cap``: every
configuration the routers (``kernels.gemm.route.choices``, ``kernels.sparse_attention.choices``) pick
there, and the configurations the other kernels' launchers pick for V4-Flash / V4-Pro shapes on an
H200-sized GPU. ``full=False`` (CI) keeps one configuration per kernel, the one with the largest tiles
(``_size``); ``full=True`` every one.
Imported by the AOT subprocess (TRITON_INTERPRET=0).
"""
from __future__ import annotations

import importlib

P = lambda t: "*" + t      # noqa: E731
F = P("fp32")

FP8_GEMM = dict(A=P("u8"), SA=F, B=P("u8"), SB=F, C=P("bf16"), CS=F, OUT=P("bf16"), CNT=P("i32"), limit="fp32")
FP4 = dict(A16=P("fp16"), SA=F, W=P("u8"), WS=P("u8"), WS2=F, C=P("bf16"), CS=F, PERM=P("i64"), OFFS=P("i64"),
           TCUM=P("i64"), PW=F, limit="fp32")
SCALED = dict(A=P("u8"), SA=F, W=P("u8"), WS=P("u8"), C=P("bf16"), CS=F, PERM=P("i64"), OFFS=P("i64"),
              TCUM=P("i64"), PW=F, limit="fp32")
GEMV = dict(A=P("u8"), SA=F, W=P("u8"), WS=P("u8"), WS2=F, C=F, PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"))
MMA4 = dict(A=P("u8"), SA=F, W=P("u8"), WS=P("u8"), WS2=F, C=F, PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"))
MMA8 = dict(A=P("bf16"), SA=F, W=P("u8"), WS=F, C=P("bf16"), PART=F, CNT=P("i32"))
HC = dict(X=P("bf16"), FN=F, PART=F, CNT=P("i32"), BASE=F, SCALE=F, Y=P("bf16"), POST=F, COMB=F, inv_k="fp32",
          rms_eps="fp32", hc_eps="fp32", YP=P("bf16"), RES=P("bf16"), PPOST=F, PCOMB=F, NW=F, norm_eps="fp32")
HC_FIN = dict(X=P("bf16"), PART=F, SQ=F, BASE=F, SCALE=F, Y=P("bf16"), POST=F, COMB=F, inv_k="fp32",
              rms_eps="fp32", hc_eps="fp32")
HC_TOK = dict(PART=F, BASE=F, SCALE=F, PRE=F, POST=F, COMB=F, inv_k="fp32", rms_eps="fp32", hc_eps="fp32")
COMP = dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F, POOLED=F, NORMW=F, COS=F, COSIN_=F,
            OUT=P("bf16"), COMPLETE=P("i8"), PAGES=P("u8"), PSLOTS=P("i64"), eps="fp32")
POST_ = dict(POOLED=F, NORMW=F, COS=F, SIN_=F, POS=P("i64"), OUT=P("bf16"), COMPLETE=P("i8"), PAGES=P("u8"),
             PSLOTS=P("i64"), eps="fp32")
PREF = dict(RK=F, RS=F, POOLED=F, NORMW=F, COS=F, SIN_=F, OUT=P("bf16"), PAGES=P("u8"), PSLOTS=P("i64"),
            CNT=P("i32"), eps="fp32")
DIV = ("K", "N_out", "n_half", "stride_am", "stride_sam", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
       "stride_w2e", "stride_cm", "stride_csm", "stride_bn", "stride_sbn", "stride_x", "stride_q", "stride_s",
       "stride_a", "d", "stride_o", "stride_y", "N", "k_per_split", "N2")

# kernel -> (module under dsv4.kernels, function, argument types, ops served)
KERNELS = {
    "fp8_gemm": ("gemm.fp8", "_fp8_gemm_kernel", FP8_GEMM, ("linear", "moe")),
    "act_quant": ("gemm.fp8", "_act_quant_kernel", dict(X=P("bf16"), Q=P("u8"), S=F), ("linear", "moe")),
    "splitk_sum": ("gemm.common", "splitk_sum_kernel", dict(WS=F, C=P("bf16")), ("moe",)),
    "fp4_gemm": ("gemm.fp4", "_fp4_gemm_kernel", FP4, ("moe",)),
    "fp4_scaled": ("gemm.fp4", "_fp4_scaled_kernel", SCALED, ("moe",)),
    "gemv": ("gemm.gemv", "_gemv_kernel", GEMV, ("moe",)),
    "swiglu_quant": ("gemm.gemv", "_swiglu_quant_kernel", dict(WSP=F, H=P("u8"), HS=F, PW=F, PERM=P("i64"),
                                                               limit="fp32"), ("moe",)),
    # the pre-decoded path's unfused GEMM 1: bf16 w1|w3 outputs in sorted order
    "swiglu_quant_bf16": ("gemm.gemv", "_swiglu_quant_kernel", dict(WSP=P("bf16"), H=P("u8"), HS=F, PW=F,
                                                                    PERM=P("i64"), limit="fp32"), ("moe",)),
    "fp4_mma": ("gemm.fp4_mma", "_mma_gemv_kernel", MMA4, ("moe",)),
    "fp8_mma": ("gemm.fp8_mma", "_fp8_mma_kernel", MMA8, ("linear", "wo_a", "moe")),
    "dequant_bf16": ("gemm.fp8", "_dequant_bf16_kernel", dict(W=P("u8"), SB=F, Y=P("bf16")), ("wo_a",)),
    "fp8_prefill": ("gemm.fp8_prefill", None, None, ("linear", "moe")),
    "fp4_prefill": ("gemm.fp4_prefill", "_fp4_prefill_kernel", FP4, ("moe",)),
    "fp4_fp8": ("gemm.fp4_fp8", "_fp4_fp8_kernel", dict(FP4, A=P("u8")), ("moe",)),
    "fp4_fp8_predec": ("gemm.fp4_fp8", "_fp4_fp8_kernel", dict(FP4, A=P("u8"), WS=F), ("moe",)),
    "predecode": ("gemm.fp4_fp8", "_predecode_kernel", dict(W=P("u8"), WS=P("u8"), W8=P("u8"), SB=F, SMX=P("u8")),
                  ("moe",)),
    "moe_route": ("moe", "_route_kernel", dict(LOGIT=F, BIAS=F, TID2EID=P("i32"), IDS=P("i64"), IDX=P("i64"), W=F,
                                              EFLAT=P("i32"), X=P("bf16"), Q=P("u8"), SQ=F, route_scale="fp32",
                                              CNT=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), INV=P("i32")),
                  ("moe",)),
    "moe_sort_prep": ("moe", "_moe_sort_prep", dict(EFLAT=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"),
                                                   INV=P("i32")), ("moe",)),
    "moe_prep": ("moe", "_moe_prep", dict(SORTED_E=P("i32"), PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"),
                                         INV=P("i32")), ("moe",)),
    "moe_combine": ("moe", "_moe_combine", dict(OUT=F, INV=P("i32"), OFFS=P("i64"), SH=P("bf16"), Y=P("bf16")),
                    ("moe",)),
    "dense_gemv": ("gemm.dense_gemv", "_dense_gemv_kernel", dict(X=P("bf16"), W=P("bf16"), PART=F, Y=F, CNT=P("i32")),
                   ("linear",)),
    "dense_gemv_f32": ("gemm.dense_gemv", "_dense_gemv_kernel", dict(X=P("bf16"), W=F, PART=F, Y=F, CNT=P("i32")),
                       ("moe",)),
    "dense_mm": ("gemm.dense_mm", "_dense_mm_kernel", dict(X=P("bf16"), W=P("bf16"), Y=F, one="fp32"), ("moe",)),
    "kv_insert": ("kv_insert", "_kv_insert_kernel", dict(Q=P("bf16"), KV=P("bf16"), COS=F, SIN=F, PAGES=P("u8"),
                                                         SLOTS=P("i64"), QO=P("bf16"), KVO=P("bf16"), eps="fp32"),
                  ("kv_insert",)),
    "sparse_fwd": ("sparse_attention", "_sparse_fwd", dict(Q=P("bf16"), WIDX=P("i32"), EIDX=P("i32"),
                                                           WPAGES=P("u8"), EPAGES=P("u8"), SINK=F, O=P("bf16"),
                                                           OP=F, MLP=F, qk_scale="fp32"),
                   ("sparse_decode", "sparse_prefill")),
    "sparse_combine": ("sparse_attention", "_combine", dict(OP=F, MLP=F, SINK=F, O=P("bf16"), COS=F, SIN=F),
                       ("sparse_decode",)),
    "inverse_rope": ("inverse_rope", "_inverse_rope_kernel", dict(O=P("bf16"), COS=F, SIN=F, Y=P("bf16"),
                                                                  YQ=P("u8"), YS=F), ("inverse_rope",)),
    "rms_norm": ("norm", "_rms_norm_kernel", dict(X=P("bf16"), W=F, Y=P("bf16"), eps="fp32"), ("rms_norm",)),
    "rms_norm_pair": ("norm", "_rms_norm_pair_kernel", dict(X=P("bf16"), WA=F, WB=F, YA=P("bf16"), YB=P("bf16"),
                                                            eps="fp32"), ("rms_norm_pair",)),
    "entry_ids": ("paging", "_entry_ids_kernel", dict(BT=P("i64"), E=P("i64"), OUT=P("i32")), ("entry_ids",)),
    "decode_meta": ("decode_meta", "_decode_meta_kernel", dict(POS=P("i64"), SLOTS=P("i64"), BT=P("i64"), TABS=F,
                                                              ROPE_REQ=P("i64"), ROPE_OUT=F, WIN_SLOT=P("i64"),
                                                              WIDX=P("i32"), WRITE_REQ=P("i64"), WRITE_OUT=P("i64"),
                                                              VIS_REQ=P("i64"), VIS0=P("i32"), VIS1=P("i32"),
                                                              NVALID=P("i32")), ("decode_meta",)),
    "hc_fused": ("mhc", "_hc_fused", HC, ("hc_pre", "hc_post_pre")),
    "hc_mix_tile": ("mhc", "_hc_mix_tile", dict(X=P("bf16"), W=P("bf16"), PART=F), ("hc_pre",)),
    "hc_tokens": ("mhc", "_hc_tokens", HC_TOK, ("hc_pre",)),
    "hc_apply": ("mhc", "_hc_apply", dict(X=P("bf16"), PRE=F, Y=P("bf16")), ("hc_pre",)),
    "hc_mix_partial": ("mhc", "_hc_mix_partial", dict(X=P("bf16"), FN=P("bf16"), PART=F, SQ=F), ("hc_head",)),
    "hc_finish": ("mhc", "_hc_finish", HC_FIN, ("hc_head",)),
    "hc_post": ("mhc", "_hc_post_kernel", dict(Yin=P("bf16"), RES=P("bf16"), POST=F, COMB=F, OUT=P("bf16")),
                ("hc_post",)),
    "comp_fused": ("compressor", "_comp_fused", COMP, ("compress_decode",)),
    "comp_pool": ("compressor", "_comp_pool", dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F,
                                                   POOLED=F), ("compress_decode",)),
    "comp_post": ("compressor", "_comp_post", POST_, ("compress_decode",)),
    "pref_pool": ("compressor", "_pref_pool", PREF, ("compress_prefill",)),
    "index_q": ("indexer", "_index_q_kernel", dict(Q=P("bf16"), COS=F, SIN=F, OUT=P("bf16"), HMAT=P("bf16")),
                ("index_q_prologue",)),
    "index_scores": ("indexer", "_index_scores_kernel", dict(Q=P("bf16"), W=F, PAGES=P("u8"), BT=P("i64"),
                                                             POS=P("i64"), OUT=P("bf16"), w_scale="fp32"),
                     ("index_scores",)),
    "index_scores_rows": ("indexer", "_index_scores_rows_kernel", dict(Q=P("bf16"), W=F, PAGES=P("u8"), BT=P("i64"),
                                                                       POS=P("i64"), OUT=P("bf16"), w_scale="fp32"),
                          ("index_scores",)),
    "topk_single": ("indexer", "_topk_single", dict(SC=P("i16"), NV=P("i32"), BUF=P("i64"), OUT=P("i32")),
                    ("index_topk",)),
    "topk_pass1": ("indexer", "_topk_pass1", dict(SC=P("i16"), NV=P("i32"), WS=P("i32")), ("index_topk",)),
    "topk_pass2": ("indexer", "_topk_pass2", dict(SC=P("i16"), NV=P("i32"), WS=P("i32"), H2=P("i32"),
                                                  BASE=P("i32")), ("index_topk",)),
    "topk_pass3": ("indexer", "_topk_pass3", dict(SC=P("i16"), NV=P("i32"), WS=P("i32"), BASE=P("i32"),
                                                  BUF=P("i64"), OUT=P("i32")), ("index_topk",)),
    "topk_rank": ("indexer", "_topk_rank", dict(BUF=P("i64"), NV=P("i32"), OUT=P("i32")), ("index_topk",)),
}

# the configurations the non-routed kernels' launchers pick (V4-Flash / V4-Pro shapes, 132 SMs):
# kernel -> [(constexprs, warps, stages)]
FIXED = {
    "act_quant": [(dict(BLOCKS=8, INTERP=False), 4, None)],
    "dequant_bf16": [(dict(SB_SHIFT=7, SB_E8M0=False, BN=64, INTERP=False), 4, None)],
    # the MXFP4 experts decoded once to e4m3 tiles (``fp4_fp8.predecode``), then the FP8 grouped GEMM on them
    "predecode": [(dict(BN=32, KU=4, USE_ASM=True, TILE_MAX=False), 8, None),
                  (dict(BN=32, KU=4, USE_ASM=True, TILE_MAX=True), 8, None)],
    # PREDEC 1: pointer loads; 2: TMA weight tiles (sm_90+ only, ``cases``)
    "fp4_fp8_predec": [(dict(GROUPED=True, GATHER=True, SWIGLU=True, HAS_PW=True, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=1, INTERP=False, ATMA=False, SB_TILE=False, HOST_TMA=False, PREFETCH=False), 8, 3),
                       (dict(GROUPED=True, GATHER=True, SWIGLU=True, HAS_PW=True, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=False, SB_TILE=False, HOST_TMA=False, PREFETCH=False), 8, 3),
                       (dict(GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, SWAP=False, BM=128,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=False, SB_TILE=False, HOST_TMA=False, PREFETCH=False), 8, 3),
                       # ATMA: the activation tiles by TMA too (sorted rows)
                       (dict(GROUPED=True, GATHER=False, SWIGLU=True, HAS_PW=True, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=True, SB_TILE=False, HOST_TMA=False, PREFETCH=False), 8, 3),
                       (dict(GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, SWAP=False, BM=128,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=True, SB_TILE=False, HOST_TMA=False, PREFETCH=False), 8, 3),
                       # one weight factor per 128 x 128 tile (``predecode(tile=True)``): the plain tile
                       (dict(GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=True, SB_TILE=True, HOST_TMA=False, PREFETCH=False), 4, 3),
                       # the sm_90 default: host-built descriptors, per-tile factors, GEMM 1 unfused (plain tiles)
                       (dict(GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=True, SB_TILE=True, HOST_TMA=True,
                             PREFETCH=False), 4, 3),
                       # the scale operands a K block ahead (off by default, untimed)
                       (dict(GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, SWAP=False, BM=64,
                             BN=128, LOG2G=9, PREDEC=2, INTERP=False, ATMA=True, SB_TILE=True, HOST_TMA=True,
                             PREFETCH=True), 4, 3)],
    "splitk_sum": [(dict(BLOCK=1024, INTERP=False), 4, None)],
    "swiglu_quant": [(dict(GATHER=True, HAS_PW=True, BR=1, INTERP=False, SPLIT=False), 4, None),
                     (dict(GATHER=True, HAS_PW=True, BR=16, INTERP=False, SPLIT=False), 4, None)],
    "swiglu_quant_bf16": [(dict(GATHER=False, HAS_PW=True, BR=16, INTERP=False, SPLIT=False), 4, None),
                          (dict(GATHER=False, HAS_PW=True, BR=16, INTERP=False, SPLIT=True), 4, None)],
    "moe_route": [(dict(KTOP=6, KP=8, EP=256, HASH=False, QUANT=True, QB=8, INTERP=False), 4, None),
                  (dict(KTOP=6, KP=8, EP=512, HASH=True, QUANT=False, QB=8, INTERP=False), 4, None),
                  # the decode path's router with the pair sort in its last program (V4-Pro: 384 experts + sentinel)
                  (dict(KTOP=6, KP=8, EP=512, HASH=False, QUANT=True, QB=8, INTERP=False, SORT=True, BM=8, ES=512,
                        PP=128), 4, None)],
    "moe_sort_prep": [(dict(BM=8, EP=512, PP=1024, CH=64), 4, None)],
    # the multi-row form (4 rows a program, one accumulator each) on the router's tile: the largest-tile pick of the
    # CI matrix (it ties the router's one-row case and comes first)
    "dense_gemv": [(dict(BN=8, BK=256, SPLIT=True, RB=4, PF=False), 4, 3)],
    "dense_gemv_f32": [(dict(BN=8, BK=256, SPLIT=True, RB=4, PF=True, PFL=8), 4, 3)],
    "moe_prep": [(dict(BM=64, EP=512, LOG2P=15, CH=1024), 4, None)],
    "moe_combine": [(dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=True, SPLIT=True, F32=False, INTERP=False), 4, None),
                    # the decode step's one-round-trip form (COMBINE_ONE_TRIP: up to four split partials)
                    (dict(KTOP=6, KP=8, BD=256, HAS_SHARED=True, SPLIT=True, F32=False, INTERP=False, S4=True), 4,
                     None),
                    (dict(KTOP=6, KP=8, BD=1024, HAS_SHARED=False, SPLIT=False, F32=True, INTERP=False), 4, None)],
    "kv_insert": [(dict(HPB=8), 4, None)],
    # the decode step's combine with the output's inverse RoPE (layers.attention FUSE_DECODE_ROPE)
    "sparse_combine": [(dict(HB=8, ROPE=True), 4, None)],
    "inverse_rope": [(dict(HPB=4, FP8=False), 4, None)],
    "rms_norm": [(dict(BD=bd, INTERP=False), 4 if bd <= 2048 else 8, None) for bd in (8192, 4096, 2048, 1024, 512)],
    "rms_norm_pair": [(dict(BDA=2048, BDB=512, INTERP=False), 4, None), (dict(BDA=1024, BDB=512, INTERP=False), 4, None)],
    "entry_ids": [(dict(BLOCK=1024), 4, None)],
    "decode_meta": [(dict(N_ROPE=3, N_WRITE=3, N_VIS=1, WIN=128, HALF=32, NEG=128, VB=1024, BLOCK_TOK=256), 4, None)],
    "hc_fused": [(dict(NMIX=24, NP=32, SP=128, BT=1, BK=128, BD=4096, HEAD=False), 4, None),
                 (dict(NMIX=24, NP=32, SP=128, BT=2, BK=64, BD=4096, HEAD=False), 4, None),
                 # hc_post_pre: V4-Flash (d 4096) and V4-Pro (d 7168: the row in one 8192 tile, 8 warps)
                 (dict(NMIX=24, NP=32, SP=128, BT=1, BK=128, BD=4096, HEAD=False, PRE_POST=True, NORM=True,
                       LOADS_FIRST=True, FAST_RCP=True), 4, None),
                 (dict(NMIX=24, NP=32, SP=128, BT=1, BK=128, BD=8192, HEAD=False, PRE_POST=True, NORM=True,
                       LOADS_FIRST=True, FAST_RCP=True), 8, None)],
    "hc_mix_tile": [(dict(NMIX=24, NP=32, BT=128, BK=64, MODE=1, SEP=True), 8, 3),
                    (dict(NMIX=24, NP=32, BT=64, BK=64, MODE=1, SEP=True), 4, 3)],
    "hc_tokens": [(dict(NMIX=24, NP=32, SP=8, BT=16, HEAD=False, FAST_RCP=True), 4, None)],
    "hc_apply": [(dict(BD=1024, REVERSE=True), 4, None), (dict(BD=2048, REVERSE=True), 4, None)],
    "hc_mix_partial": [(dict(NMIX=4, NP=16, BT=16, BK=64, MODE=1), 4, 3), (dict(NMIX=4, NP=16, BT=64, BK=64, MODE=1),
                                                                          8, 3)],
    "hc_finish": [(dict(NP=16, SP=64, BD=512, HEAD=True), 4, None)],
    "hc_post": [(dict(BD=1024), 4, None)],
    # decode: the score rows come without their APE row, the kernel adds it (layers.attention._decode)
    "comp_fused": [(dict(M=4, C=512, OVERLAP=True, HAS_APE=True, INDEXER=False, WRITE=True, STORE_POOLED=False,
                         FAST=True), 8, None)],
    "comp_pool": [(dict(M=4, C=128, OVERLAP=True, HAS_APE=True, CB=32, FAST=True), 4, None),
                  (dict(M=128, C=512, OVERLAP=False, HAS_APE=True, CB=32, FAST=True), 4, None)],
    "comp_post": [(dict(M=4, C=128, INDEXER=True, WRITE=True, FAST=True), 4, None),
                  (dict(M=128, C=512, INDEXER=False, WRITE=True, FAST=True), 4, None)],
    "pref_pool": [(dict(M=4, C=512, OVERLAP=True, CB=512, POST=True, INDEXER=False, WRITE=True, STORE_POOLED=False,
                        FAST=True), 2, None),
                  (dict(M=4, C=128, OVERLAP=True, CB=128, POST=True, INDEXER=True, WRITE=True, STORE_POOLED=False,
                        FAST=True), 1, None),
                  (dict(M=128, C=512, OVERLAP=False, CB=32, POST=True, INDEXER=False, WRITE=True, STORE_POOLED=True,
                        FAST=True), 4, None)],
    "index_q": [(dict(HB=16, INTERP=False, LOAD_H=True), 4, None), (dict(HB=64, INTERP=False, LOAD_H=True), 8, None)],
    "index_scores": [(dict(TPP=8, HP=64, INTERP=False, W_SCALE=True, DIRECT=False), 4, None)],
    "index_scores_rows": [(dict(QB=4, TPP=8, HP=64, INTERP=False, W_SCALE=True), 8, None)],
    "topk_single": [(dict(KP=1024, TILE=4096, HAS_NV=True), 8, None),
                    (dict(KP=512, TILE=4096, HAS_NV=True, FULL=True), 8, None)],
    "topk_pass1": [(dict(WSTRIDE=264, TILE=2048, HAS_NV=True), 8, None)],
    "topk_pass2": [(dict(WSTRIDE=264, G=32, TILE=2048, HAS_NV=True), 8, None)],
    "topk_pass3": [(dict(WSTRIDE=264, KP=1024, TILE=2048, SORT=True, HAS_NV=True), 8, None)],
    "topk_rank": [(dict(KP=2048, RB=16, HAS_NV=True), 8, None)],
}

# constexprs every configuration of a kernel takes (the routers give the tile ones)
BASE_CONST = {
    "fp8_gemm": dict(SB_SHIFT=7, SB_E8M0=False, INTERP=False),
    "fp4_gemm": dict(GROUPED=True, GATHER=True, HAS_PW=True, USE_ASM=True, LOG2G=9, INTERP=False),
    "fp4_scaled": dict(GROUPED=True, GATHER=True, HAS_PW=True, LOG2G=9, INTERP=False),
    "gemv": dict(SB_SHIFT=7, SB_E8M0=False, A_BF16=False, GROUPED=True, GATHER=True, USE_ASM=True, LOG2G=9,
                 SPLIT=True, INTERP=False),
    "fp4_mma": dict(GROUPED=True, GATHER=True, BM=8, LOG2G=9, SPLIT=True, NUM_WARPS=4, BAND=False, A16=False,
                    VEC_TILES=True),
    "fp8_mma": dict(SB_E8M0=False, SB_ROW=False, BM=8, BN=64, SPLIT=True, REDUCE=True, NUM_WARPS=4),
    "fp4_prefill": dict(GROUPED=True, USE_ASM=True, DEC=0, LOG2G=9, INTERP=False),
    "fp4_fp8": dict(GROUPED=True, USE_ASM=True, LOG2G=9, PREDEC=0, ATMA=False, SB_TILE=False, HOST_TMA=False,
                    PREFETCH=False, INTERP=False),
    "fp4_fp8_predec": dict(GROUPED=True, USE_ASM=True, LOG2G=9, INTERP=False),
    "predecode": dict(USE_ASM=True),
    "dense_mm": dict(INTERP=False),
    "sparse_fwd": dict(INTERP=False),
}


def _router_const(c) -> dict:
    """A router choice's constexprs completed to a compilable set."""
    const = dict(BASE_CONST.get(c.kernel, {}), **c.constexprs)
    if c.kernel in ("fp4_gemm", "fp4_scaled", "fp4_prefill", "fp4_fp8"):
        sw = const["SWIGLU"]
        const.update(GATHER=sw, HAS_PW=sw)
    if c.kernel == "fp4_fp8_predec":        # ATMA: GEMM 1's rows (and weights) gathered beforehand
        sw = const["SWIGLU"]
        const.update(GATHER=sw and not const["ATMA"], HAS_PW=sw)
    if c.kernel == "fp4_prefill":
        const.update(RB=14 if const["FMT"] == 2 else 0, SB_SCALE=2.0 ** -14)
    if c.kernel == "gemv":
        const.update(NG=4 if const["WFMT"] == 0 else 8, GB=16 if const["WFMT"] in (0, 3) else 8)
        if const["WFMT"] == 3:
            const.update(GROUPED=False, GATHER=False, A_BF16=True, SPLIT=False)
    if c.kernel == "sparse_fwd":
        const.update(DHALF=const["DP"] - 1)
    return const


def types_of(kernel: str, const: dict) -> dict:
    """Argument types of a configuration (outputs whose dtype depends on a mode)."""
    types = dict(KERNELS[kernel][2])
    if kernel == "fp8_gemm":
        types.update(A=P("bf16") if const.get("A_BF16") else P("u8"),
                     C=P("u8") if const.get("SWIGLU") else (F if const.get("SPLIT") else P("bf16")))
    elif kernel in ("fp4_gemm", "fp4_prefill", "fp4_scaled", "fp4_fp8", "fp4_fp8_predec") and const.get("SWIGLU"):
        types.update(C=P("u8"))
    host = const.get("HOST_TMA")
    if kernel == "fp4_fp8_predec" and const.get("PREDEC") == 2:
        types.update(W=f"tensordesc<fp8e4nv[{const['BN']}, 128]>" if host else P("fp8e4nv"))
    if kernel == "fp4_fp8_predec" and const.get("ATMA"):
        types.update(A=f"tensordesc<fp8e4nv[{const['BM']}, 128]>" if host else P("fp8e4nv"))
    elif kernel == "gemv" and const.get("WFMT") == 3:
        types.update(A=P("bf16"), WS=F, C=P("bf16"))
    elif kernel == "fp8_mma":
        types.update(A=P("bf16") if const.get("ACT") else P("u8"))
    return types


def _size(const: dict, warps, stages) -> int:
    """How much shared memory a configuration is likely to take: its tile area, warps and stages."""
    n = (stages or 1) * warps
    for k in ("BM", "BN", "HB", "BT", "BK", "BD", "TILE", "KP", "C"):
        n *= const.get(k, 1) if isinstance(const.get(k, 1), int) else 1
    return n


def cases(cap: int, full: bool):
    """[(case id, kernel, constexprs, warps, stages)] for sm_``cap`` (module doc): every configuration, or
    (``full=False``) per kernel the one with the largest tiles."""
    from dsv4.kernels import sparse_attention
    from dsv4.kernels.gemm import route
    from dsv4.kernels.lib import aot_target
    t = aot_target(cap)
    out = []
    for kernel, variants in FIXED.items():
        for i, (const, warps, stages) in enumerate(variants):
            if const.get("PREDEC") == 2 and cap < 90:       # TMA: the router takes it on sm_90+ only
                continue
            out.append((f"{kernel}#{i}", kernel, const, warps, stages))
    for c in route.choices(t) + sparse_attention.choices(t):
        out.append((f"{c.kernel}:{c.why}:{sorted(c.constexprs.items())}", c.kernel, _router_const(c), c.num_warps,
                    c.num_stages))
    if full:
        return out
    best = {}
    for case in out:
        k = case[1]
        if k not in best or _size(*case[2:]) > _size(*best[k][2:]):
            best[k] = case
    return list(best.values())


def function(kernel: str):
    mod, fn, _types, _ops = KERNELS[kernel]
    return getattr(importlib.import_module("dsv4.kernels." + mod), fn)


__all__ = ["DIV", "FIXED", "KERNELS", "cases", "function", "types_of"]
