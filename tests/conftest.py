import os

# MKL's BLAS and vector math (torch's CPU matmul, exp, log, ...) pick a code path per CPU (SSE4.2, AVX,
# AVX2, AVX-512 / AMX) whose last bits differ, and on the AVX2 and AVX-512 paths a row of a matmul can
# change with the number of rows (the twins pad rows to a multiple of 8, ``twins.lib``, which holds only
# on some paths): tests that hold a chunked, batched or decode-path run to another bit for bit fail
# there. MKL_CBWR pins one path (MKL's conditional numerical reproducibility): the AVX path gives the
# same bits on every CPU that has AVX, keeps those tests exact, and writes the golden checkpoint's
# bytes; its fp32 GEMM runs at about 45 GFLOP/s on two cores. It must be set before MKL's first call,
# so before torch is imported.
os.environ.setdefault("MKL_CBWR", "AVX")


def _keep_freed_memory_in_the_heap() -> None:
    """glibc's malloc serves every block above its mmap threshold (at most 32 MiB when it adapts) with a fresh
    mmap and unmaps it on free, so each such tensor the twins allocate (the tiny model's prefill gathers run to
    hundreds of MiB) faults its pages in again, zeroed by the kernel: about a third of an engine test's time on
    the CI machines went to those faults. Here the heap serves and keeps them (mmap and trim thresholds at
    2 GiB): the same allocations, reused pages. ``GLIBC_TUNABLES`` carries it to the processes the tests start
    (servers, CLI runs, tensor-parallel workers); one already set is kept. Not glibc: nothing to do."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    big = 2**31 - 1
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, big)
    mallopt(M_TRIM_THRESHOLD, big)
    os.environ.setdefault("GLIBC_TUNABLES", f"glibc.malloc.mmap_threshold={big}:glibc.malloc.trim_threshold={big}")


_keep_freed_memory_in_the_heap()

import pytest  # noqa: E402
import torch  # noqa: E402

# Deterministic CPU numerics and a bounded thread count on the 2-core CI machines, shared among
# pytest-xdist's workers where one runs the suite with ``-n``; engines built by the tests keep it
# (DSV4_NUM_THREADS overrides the serving rule, ``llm_engine.engine_threads``).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
# xdist's workers inherit the controller's environment, so a value this file set there (the controller's own
# share, all the cores) is replaced by the worker's share: two engines of two OpenMP threads each on two cores
# spin on each other (the engine tests ran 2.6x slower). A value the user set is kept.
if "DSV4_NUM_THREADS" not in os.environ or os.environ.get("_DSV4_NUM_THREADS_BY_CONFTEST") == "1":
    os.environ["DSV4_NUM_THREADS"] = str(torch.get_num_threads())
    os.environ["_DSV4_NUM_THREADS_BY_CONFTEST"] = "1"
# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported
# (``triton.jit`` picks the interpreter when a kernel is defined). This is the one place that sets it:
# on a GPU machine a plain ``pytest`` runs the kernels compiled. Offline (AOT) compiles run in a
# subprocess with TRITON_INTERPRET=0 (kernel_helpers.run_aot_script), never by flipping it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")

# The tiny checkpoints' tensors (``checkpoint.tiny.build_tiny_tensors``, ~1.3 s a build) are built once per
# arguments: the suite asks for the same few about twenty times (each call gets its own copy).
# tests/test_checkpoint.py's determinism test turns it off to build twice.
import dsv4.checkpoint.tiny  # noqa: E402

dsv4.checkpoint.tiny.BUILD_CACHE = 4


def _one_rank_process_group() -> None:
    """``DSV4_TEST_PROCESS_GROUP=nccl`` (or ``gloo``): the whole session runs inside a one-rank
    process group whose collectives run (``parallel.Group(always=True)``), the default group of
    every model built without one: the tensor-parallel code path (NCCL calls inside the decode
    CUDA graphs, the MoE's fp32 partial sums, the head's all-gather) under the unchanged suite."""
    backend = os.environ.get("DSV4_TEST_PROCESS_GROUP")
    if not backend:
        return
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"DSV4_TEST_PROCESS_GROUP must be 'nccl' or 'gloo', got {backend!r}")
    from dsv4.parallel import one_rank_group, set_default_group
    if backend == "nccl":
        torch.cuda.set_device(0)
    set_default_group(one_rank_group("cuda" if backend == "nccl" else "cpu"))


_one_rank_process_group()


@pytest.fixture(autouse=True)
def _gpu_memory_back(request):
    """After a GPU test, the device memory of its dead objects still in reference cycles goes back before the
    next test allocates (an engine sizes its KV cache from the free memory)."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _triton_interpret_unchanged():
    """A test that changes TRITON_INTERPRET in this process would switch the kernels of every module
    imported after it: restore it and fail that test."""
    yield
    now = os.environ.get("TRITON_INTERPRET")
    if now != _TRITON_INTERPRET:
        if _TRITON_INTERPRET is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _TRITON_INTERPRET
        pytest.fail(f"the test left TRITON_INTERPRET={now!r} (was {_TRITON_INTERPRET!r}); "
                    "compile offline in a subprocess (kernel_helpers.run_aot_script)")


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden", "official-tiny-seed1.json")
SHARED_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "shared", "tools", "make_tiny_official.py")


@pytest.fixture(scope="session", autouse=True)
def _default_model_cache(tmp_path_factory):
    """One cache directory for the session's embedded default model (``models.default_model_dir``, written
    on its first use, in this process or in a server or CLI process started with this environment); a
    ``DSV4_CACHE_DIR`` already set is kept."""
    os.environ.setdefault("DSV4_CACHE_DIR", str(tmp_path_factory.mktemp("dsv4-cache")))


@pytest.fixture(scope="session")
def default_model_dir(_default_model_cache) -> str:
    """The session's embedded default model (``models.default_model_dir``: ``make_tiny``'s official layout, seed
    0), written once: a test module that only reads that checkpoint takes it instead of writing a copy."""
    from dsv4.models import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def golden() -> dict:
    """The outputs of DeepSeek's official inference code on the tiny checkpoint of seed 1 (the
    file's ``about`` says how they were made)."""
    import json
    with open(GOLDEN) as fh:
        return json.load(fh)


@pytest.fixture(scope="session")
def official_seed1_dir(tmp_path_factory) -> str:
    """The checkpoint the golden outputs were computed on, written by dsv4
    (``checkpoint.official_tiny``; tests/test_checkpoint.py checks it byte for byte)."""
    # written in a subprocess on MKL's COMPATIBLE path: the golden checkpoint's bytes are that path's
    # (``torch.exp`` of the lm-head row norms differs in last bits on the AVX2 / AVX-512 paths)
    import subprocess
    import sys
    out = str(tmp_path_factory.mktemp("official-seed1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sys; from dsv4.checkpoint.official_tiny import write_official_tiny; write_official_tiny(sys.argv[1], seed=1)"
    env = dict(os.environ, MKL_CBWR="COMPATIBLE", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code, out], check=True, env=env, timeout=300)
    return out


def skip_or_fail_without_shared(what: str) -> None:
    """``../shared`` (spec, official-layout tool) sits beside every checkout in CI: there a missing
    file is a failure, elsewhere a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing; CI expects ../shared beside the checkout")
    pytest.skip(f"{what} is missing")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
