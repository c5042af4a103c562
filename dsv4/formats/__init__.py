"""Numeric formats: FP8 e4m3 + ue8m0 scales, FP4 e2m1 (MXFP4 / NVFP4), FlashMLA KV entries, MXFP4
indexer keys, and the paged cache geometry they are stored in."""
from .fp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequant_mxfp4,
    dequant_nvfp4,
    e2m1_decode,
    e2m1_encode,
    fp4_qdq,
    mxfp4_to_nvfp4,
    pack_fp4,
    quant_mxfp4,
    quant_nvfp4,
    unpack_fp4,
)
from .fp8 import (
    FP8_MAX,
    act_quant_fp8,
    dequant_fp8_weight,
    e8m0_to_fp32,
    fp8_qdq,
    fp32_to_e8m0,
    pow2_ceil,
    quant_fp8_weight,
    ue8m0_scale,
)
from .index_key import (
    decode_index_keys,
    encode_index_keys,
    index_entry_bytes,
    index_page_bytes,
    index_page_views,
    read_index_entries,
    read_index_keys,
    write_index_entries,
    write_index_keys,
)
from .kv_entry import (
    ENTRY_BYTES,
    KV_DIM,
    KV_QUANT_BLOCK,
    N_SCALES,
    NOPE_DIM,
    PAGE_ALIGN,
    ROPE_DIM,
    SCALE_BYTES,
    TOKEN_DATA_BYTES,
    decode_kv_entries,
    encode_kv_entries,
    page_bytes,
    page_views,
    read_entries,
    read_kv_entries,
    write_entries,
    write_kv_entries,
)
from .paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW, WINDOW_PAGE, block_table_tensor, blocks_needed

__all__ = [
    # fp8
    "FP8_MAX", "pow2_ceil", "ue8m0_scale", "act_quant_fp8", "fp8_qdq", "quant_fp8_weight",
    "dequant_fp8_weight", "e8m0_to_fp32", "fp32_to_e8m0",
    # fp4
    "E2M1_MAX", "E2M1_VALUES", "MXFP4_BLOCK", "NVFP4_BLOCK", "e2m1_encode", "e2m1_decode",
    "pack_fp4", "unpack_fp4", "fp4_qdq", "quant_mxfp4", "dequant_mxfp4", "quant_nvfp4",
    "dequant_nvfp4", "mxfp4_to_nvfp4",
    # kv entries
    "NOPE_DIM", "ROPE_DIM", "KV_DIM", "KV_QUANT_BLOCK", "N_SCALES", "TOKEN_DATA_BYTES",
    "SCALE_BYTES", "ENTRY_BYTES", "PAGE_ALIGN", "page_bytes", "encode_kv_entries",
    "decode_kv_entries", "write_kv_entries", "read_kv_entries", "page_views", "write_entries",
    "read_entries",
    # indexer keys
    "index_entry_bytes", "index_page_bytes", "encode_index_keys", "decode_index_keys",
    "index_page_views", "write_index_entries", "read_index_entries", "write_index_keys",
    "read_index_keys",
    # paging
    "BLOCK_TOKENS", "WINDOW", "WINDOW_PAGE", "INDEX_PAGE", "blocks_needed", "block_table_tensor",
]
