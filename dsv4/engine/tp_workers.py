"""Tensor-parallel workers: one process per rank, started by the engine itself (no torchrun).

Rank 0 is the engine's own process: it holds the scheduler, the sampler and its slice of the model.
``TPWorkers.start`` spawns ranks 1..N-1 (``spawn`` context), each loading its slice of the same
model; all join one ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs; rank r on cuda:r) and a
gloo control group. Every model step, rank 0 broadcasts the step's chunks (token ids, position,
slot, block table of each) on the control group before running them; every worker runs the same
``ModelRunner.forward`` on its slice and its own copy of the KV cache (same geometry, same slot
and block ids: the allocator lives on rank 0 only), so the collectives inside the forward pair up.

Failure handling: a watchdog thread in rank 0 polls the workers; when one exits unexpectedly, the
engine process prints which rank exited with which code and terminates itself (the other
collectives would block on the missing rank). Each worker exits when its parent process is gone.
``TPWorkers.stop`` (also at interpreter exit) tells the workers to finish and joins them.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..parallel import Group, free_port

POLL_S = 0.5


@dataclass
class StepState:
    """A worker's view of a sequence in a step: what the model reads (``PagedSequenceState``'s
    position, slot and block table)."""
    pos: int
    slot: int
    block_table: list

    def advance_to(self, pos: int) -> None:
        self.pos = pos


def _device(kind: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if kind == "cuda" else torch.device("cpu")


def init_group(rank: int, world: int, port: int, kind: str):
    """(model Group, control process group) of this rank."""
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world)
    ctrl = dist.new_group(backend="gloo")
    # one collective now: NCCL builds its communicator at the first call, which must not be a
    # call inside a CUDA-graph capture
    dist.all_reduce(torch.zeros(1, device=_device(kind, rank)))
    return Group(dist.group.WORLD), ctrl


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def worker_main(rank: int, world: int, port: int, kind: str, spec: dict, parent: int) -> None:
    """Rank ``rank`` >= 1: load the slice, build the cache rank 0 announces, run every step."""
    import torch.distributed as dist

    from .build import build_model
    from .kv_cache import CacheConfig, KVCache
    from .runner import ModelRunner
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from .llm_engine import engine_threads
    torch.set_num_threads(engine_threads(kind, world))
    group, ctrl = init_group(rank, world, port, kind)
    dev = _device(kind, rank)
    log = (lambda line: print(f"dsv4: rank {rank}: {line}", file=sys.stderr, flush=True)) if spec.get("log") else None
    model = build_model(spec, dev, group, log=log)
    setup = [None]
    dist.broadcast_object_list(setup, src=0, group=ctrl)
    num_blocks, max_num_seqs, max_model_len, graphs = setup[0]
    cache = KVCache(model.cfg, CacheConfig(max_num_seqs=max_num_seqs + 1, num_blocks=num_blocks, device=str(dev)))
    model.attach_cache(cache, max_model_len)
    runner = ModelRunner(model, max_num_seqs, graphs)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=ctrl)
        if msg[0] is None:
            break
        chunks, scores = msg[0]
        runner.forward([(torch.tensor(ids, dtype=torch.long), StepState(pos, slot, bt)) for ids, pos, slot, bt in chunks],
                       scores)
    dist.destroy_process_group()


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1 (module doc)."""

    def __init__(self, world: int, kind: str, spec: dict):
        if world < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for workers, got {world}")
        if kind == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
        import torch.multiprocessing as mp
        self.world, self.kind = world, kind
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, world, port, kind, spec, os.getpid()), daemon=True,
                                  name=f"dsv4-tp-rank{r}") for r in range(1, world)]
        for p in self.procs:
            p.start()
        self.group, self.ctrl = init_group(0, world, port, kind)
        self._stopping = False
        threading.Thread(target=self._watch, daemon=True).start()
        atexit.register(self.stop)

    def _watch(self) -> None:
        while not self._stopping:
            for r, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self._stopping:
                    print(f"dsv4: error: tensor-parallel worker rank {r} (pid {p.pid}) exited with code "
                          f"{p.exitcode}; stopping", file=sys.stderr, flush=True)
                    for q in self.procs:
                        if q.is_alive():
                            q.kill()
                    os._exit(1)
            time.sleep(POLL_S)

    def setup(self, num_blocks: int, max_num_seqs: int, max_model_len: int, graphs: bool) -> None:
        import torch.distributed as dist
        dist.broadcast_object_list([(num_blocks, max_num_seqs, max_model_len, graphs)], src=0, group=self.ctrl)

    def broadcast_step(self, chunks, scores=None) -> None:
        """Send the step's chunks (and the rows to score) to every worker (before rank 0 runs them)."""
        import torch.distributed as dist
        msg = [([(ids.tolist(), st.pos, st.slot, list(st.block_table)) for ids, st in chunks], scores or {})]
        dist.broadcast_object_list(msg, src=0, group=self.ctrl)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        import torch.distributed as dist
        try:
            dist.broadcast_object_list([None], src=0, group=self.ctrl)
            for p in self.procs:
                p.join(timeout=10)
            dist.destroy_process_group()
        except Exception:         # a worker already gone: nothing left to tell
            pass
        for p in self.procs:
            if p.is_alive():
                p.kill()
