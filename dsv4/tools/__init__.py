"""Tools beside the serving path: ``dsv4 validate`` and the former fused fast path it still
compares (``fast_decode.FastDecoder`` / ``fast_prefill.FastPrefiller``, built on the reference's
weights; ``benchmarks/decode_step.py`` times it). They may import the reference; nothing on the
serving path imports them."""
