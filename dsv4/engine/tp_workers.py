"""Tensor-parallel workers: one process per rank, started by the engine itself (no torchrun).

Rank 0 is the engine's own process: it holds the scheduler, the sampler and its slice of the model.
``TPWorkers.start`` spawns ranks 1..N-1 (``spawn`` context), each loading its slice of the same
model; all join one ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs; rank r on cuda:r) and a
gloo control group. Every model step, rank 0 broadcasts the step's chunks (token ids, position,
slot, block table of each, and the prefix-cache snapshots to restore and take) on the control
group before running them; every worker runs the same
``ModelRunner.forward`` on its slice and its own copy of the KV cache (same geometry, same slot
and block ids: the allocator lives on rank 0 only), so the collectives inside the forward pair up.

Workers are started as ``python -m dsv4.engine.tp_workers`` (never by re-importing the caller's
``__main__``), so ``LLM(tensor_parallel_size=N)`` works from any caller: a script without an
``if __name__ == "__main__"`` guard, a script read from stdin, a notebook cell.

Failure handling: during start-up (the group forming, then every rank loading its slice until
``setup``) rank 0 waits for each step while polling the workers: a worker that exits makes
``TPWorkers`` / ``setup`` raise at once, naming the rank, its exit code and the error it reported
(each worker writes its exception to a file rank 0 reads), after stopping the other workers.
Once serving, a watchdog thread in rank 0 polls the workers; when one exits unexpectedly, the
engine process prints which rank exited with which code and terminates itself (the other
collectives would block on the missing rank). Each worker exits when its parent process is gone.
``TPWorkers.stop`` (also at interpreter exit) tells the workers to finish and joins them.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..parallel import Group, free_port

POLL_S = 0.5
WORKER_MODULE = "dsv4.engine.tp_workers"     # what each worker process runs (``python -m``)


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
    """Rank ``rank`` >= 1: load the slice, build the cache (and drafter) rank 0 announces, run every step
    and draft message."""
    import torch.distributed as dist

    from .build import build_model
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from .llm_engine import engine_threads
    torch.set_num_threads(engine_threads(kind, world))
    group, ctrl = init_group(rank, world, port, kind)
    dev = _device(kind, rank)
    log = (lambda line: print(f"dsv4: rank {rank}: {line}", file=sys.stderr, flush=True)) if spec.get("log") else None
    model = build_model(spec, dev, group, log=log)
    setup = [None]
    dist.broadcast_object_list(setup, src=0, group=ctrl)
    worker = _Worker(model, dev, setup[0])
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=ctrl)
        if msg[0] is None:
            break
        kind, body = msg[0]
        {"step": worker.step, "draft": worker.draft}[kind](*body)
    dist.destroy_process_group()


@dataclass(eq=False)
class DraftSeq:
    """A worker's view of a speculating sequence in a draft call: what the drafters read (slot,
    block table, the sampling parameters ``DSparkDrafter`` groups by) and write (``draft_ids``).
    No generator: a worker's probabilistic drafts come from its global RNG; they are never used."""
    slot: int
    block_table: list
    params: SimpleNamespace
    generator: None = None
    draft_ids: list = field(default_factory=list)


class _Worker:
    """A worker's model, cache, runner and drafter, and the messages of rank 0 it runs (module doc)."""

    def __init__(self, model, dev, setup: dict):
        from .kv_cache import CacheConfig, KVCache
        from .runner import ModelRunner
        from .spec_decode import SpeculativeConfig, make_drafter
        self.model = model
        self.cache = KVCache(model.cfg, CacheConfig(max_num_seqs=setup["max_num_seqs"] + 1,
                                                    num_blocks=setup["num_blocks"], device=str(dev),
                                                    num_snapshots=setup["num_snapshots"],
                                                    draft_layers=setup["draft_layers"],
                                                    draft_row=tuple(setup["draft_row"])))
        model.attach_cache(self.cache, setup["max_model_len"])
        spec = None if setup["spec"] is None else SpeculativeConfig(*setup["spec"])
        verify_rows = 1 if spec is None else spec.num_speculative_tokens + 1
        self.runner = ModelRunner(model, setup["max_num_seqs"], setup["graphs"], verify_rows=verify_rows)
        self.drafter = None if spec is None else make_drafter(model, spec, self.runner, setup["max_num_seqs"])
        self.saved: dict = {}              # verify chunk index -> (slot, start, end, saved rows)

    def step(self, chunks, scores, restores, captures, all_rows, keep) -> None:
        states = [StepState(pos, slot, bt) for _, pos, slot, bt in chunks]
        self.saved = {i: (states[i].slot, states[i].pos, states[i].pos + len(chunks[i][0]),
                          self.cache.save_positions(states[i].slot, states[i].pos, states[i].pos + len(chunks[i][0])))
                      for i in all_rows}
        self.runner.forward([(torch.tensor(ids, dtype=torch.long), st) for (ids, *_), st in zip(chunks, states)],
                            scores, all_rows, keep, restores=restores, captures=captures)

    def draft(self, cuts, fills) -> None:
        """``cuts`` [(verify chunk index, accepted end position)] of the sequences still running;
        ``fills`` [(chunk index, p0, rows, next tokens, slot, block table, drafts wanted, greedy,
        temperature, snapshot captures, pre)]: ``LLMEngine._draft``'s items, the streams taken from
        this rank's step (``pre``: after the row the restored snapshot keeps)."""
        from .spec_decode import draft_step
        for i, end in cuts:
            slot, start, stop, rows = self.saved[i]
            self.cache.restore_positions(slot, start, stop, rows, end)
        self.saved = {}
        items, k_of = [], {}
        for i, p0, n, nxt, slot, bt, k, greedy, temp, caps, pre in fills:
            seq = DraftSeq(slot, bt, SimpleNamespace(is_greedy=greedy, temperature=temp))
            h = self.runner.hidden[i][:n - pre]
            if pre:
                h = torch.cat([self.cache.restored_rows[slot][None], h])
            items.append((seq, p0, h, nxt, caps))
            if k:
                k_of[seq] = k
        draft_step(self.drafter, self.cache, items, k_of)
        self.cache.restored_rows.clear()
        getattr(self.drafter, "probs", {}).clear()      # rank 0 keeps the q rows it verifies with


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1 (module doc)."""

    def __init__(self, world: int, kind: str, spec: dict):
        if world < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for workers, got {world}")
        if kind == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
        self.world, self.kind = world, kind
        self._stopping = False
        self._errors = tempfile.mkdtemp(prefix="dsv4-tp-")
        port = free_port()
        # the dsv4 this process runs, whatever put it on sys.path (an install, PYTHONPATH, sys.path.insert)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.procs: list[subprocess.Popen] = []
        try:
            for r in range(1, world):
                args = dict(rank=r, world=world, port=port, kind=kind, spec=spec, parent=os.getpid(),
                            error_file=self._error_file(r))
                self.procs.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE, json.dumps(args)], env=env))
            self.group, self.ctrl = self._while_workers_live("forming the process group",
                                                             lambda: init_group(0, world, port, kind))
        except BaseException:
            self._kill()
            raise
        atexit.register(self.stop)

    def _error_file(self, rank: int) -> str:
        return os.path.join(self._errors, f"rank{rank}.err")

    def _exited(self) -> tuple[int, subprocess.Popen] | None:
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return r, p
        return None

    def _death_note(self, r: int, p: subprocess.Popen) -> str:
        try:
            with open(self._error_file(r)) as fh:
                err = fh.read().strip()
        except OSError:
            err = ""
        return (f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.returncode}: " +
                (err or "it reported no error (see its output above)"))

    def _while_workers_live(self, what: str, fn):
        """Run the blocking start-up step ``fn`` (a collective every rank must join) on a thread and
        return its result; if a worker exits first, stop the others and raise naming it (the step
        itself would wait for the missing rank until torch's timeout)."""
        box: dict = {}

        def run():
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
        t = threading.Thread(target=run, daemon=True, name=f"dsv4-tp-{what.replace(' ', '-')}")
        t.start()
        while True:
            t.join(POLL_S)
            if not t.is_alive():
                if "error" in box:
                    raise box["error"]
                return box["result"]
            dead = self._exited()
            if dead is not None:
                note = self._death_note(*dead)
                self._kill()
                raise RuntimeError(f"{note} (while {what})")

    def _kill(self) -> None:
        self._stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self._errors, ignore_errors=True)

    def _watch(self) -> None:
        while not self._stopping:
            dead = self._exited()
            if dead is not None and not self._stopping:
                print(f"dsv4: error: {self._death_note(*dead)}; stopping", file=sys.stderr, flush=True)
                for q in self.procs:
                    if q.poll() is None:
                        q.kill()
                os._exit(1)
            time.sleep(POLL_S)

    def setup(self, num_blocks: int, max_num_seqs: int, max_model_len: int, graphs: bool, num_snapshots: int,
              spec=None, draft_layers: int = 0, draft_row: tuple = ()) -> None:
        """Announce the cache geometry, the decode graphs to capture (``ModelRunner``) and the
        speculative decoding (a resolved ``SpeculativeConfig`` or None; ``draft_layers`` and
        ``draft_row`` of the cache, ``CacheConfig``);
        returns once every worker has loaded its slice and taken it (or raises naming a worker that
        exited meanwhile). Then the serving watchdog starts."""
        import torch.distributed as dist
        setup = dict(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len, graphs=graphs,
                     num_snapshots=num_snapshots, draft_layers=draft_layers, draft_row=tuple(draft_row),
                     spec=None if spec is None else (spec.method, spec.num_speculative_tokens,
                                                     spec.draft_sample_method))
        self._while_workers_live("loading the model", lambda: dist.broadcast_object_list(
            [setup], src=0, group=self.ctrl))
        threading.Thread(target=self._watch, daemon=True).start()

    def broadcast_step(self, chunks, scores=None, restores=None, captures=None, all_rows=(), keep=()) -> None:
        """Send the step's chunks, the rows to score, the prefix-cache snapshots to restore and take,
        and the verify / kept chunks to every worker (before rank 0 runs them): every rank must run
        each chunk on the same path (their collectives pair up)."""
        self._send("step", ([(ids.tolist(), st.pos, st.slot, list(st.block_table)) for ids, st in chunks],
                            scores or {}, restores or [], captures or {}, set(all_rows), set(keep)))

    def broadcast_draft(self, cuts, fills) -> None:
        """After rank 0 sampled a step of speculating sequences, before it drafts: the accepted end
        of each verify chunk still running and the drafter's fills (``_Worker.draft``)."""
        self._send("draft", (cuts, fills))

    def _send(self, kind: str, body: tuple) -> None:
        import torch.distributed as dist
        dist.broadcast_object_list([(kind, body)], src=0, group=self.ctrl)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        import torch.distributed as dist
        try:
            dist.broadcast_object_list([None], src=0, group=self.ctrl)
            for p in self.procs:
                p.wait(timeout=10)
            dist.destroy_process_group()
        except Exception:         # a worker already gone: nothing left to tell
            pass
        self._kill()


def _worker_entry(argv: list[str]) -> int:
    """``python -m dsv4.engine.tp_workers ARGS_JSON``: run ``worker_main``; on failure write the
    exception to the error file rank 0 reads (and the traceback to stderr) and exit 1."""
    args = json.loads(argv[1])
    error_file = args.pop("error_file")
    try:
        worker_main(**args)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process ends
        traceback.print_exc()
        with open(error_file, "w") as fh:
            fh.write(f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_worker_entry(sys.argv))
