"""Torch twins of the kernels: one file per file of ``dsv4.kernels``, the same entry names and
signatures, DeepSeek's official numerics (``reference.numerics.OFFICIAL``) computed from the same
native weights and cache bytes with the reference's math functions (never its modules, and no
reference object built per call).

They are what the op table (``dsv4.ops``) runs where a kernel cannot (a CPU, a GPU below an op's
minimum capability, a kernel that failed its self-check) and what every kernel is tested against.
``lib.py``: the row padding that makes a twin's result independent of how many rows share a call.
"""
