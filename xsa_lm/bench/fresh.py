"""Each phase in a fresh process (no heap, allocator cache, threads or compiled code inherited), forked from a
forkserver that has imported torch and Lightning once and never touches CUDA."""

import multiprocessing
import sys
import traceback
from multiprocessing.connection import Connection

from xsa_lm.bench.loops import Phase, PhaseResult, measure
from xsa_lm.errors import UserError


def process_context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["xsa_lm.bench.fresh"])  # this module, hence loops, torch and Lightning
        return context
    return multiprocessing.get_context("spawn")  # Windows: a new interpreter per phase (slower, as fresh)


def child(phase: Phase, connection: Connection) -> None:
    try:
        connection.send(("ok", measure(phase)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which reports it
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def run_fresh(phase: Phase, label: str, context: multiprocessing.context.BaseContext) -> PhaseResult:
    """measure(phase) in a new process; a failure or a killed process ends the bench with one line naming it."""
    receive, send = context.Pipe(duplex=False)
    start = context.Process  # type: ignore[attr-defined]  # not on BaseContext; on both of process_context()'s
    process = start(target=child, args=(phase, send), name=f"xsa-lm-bench-{label}")
    process.start()
    send.close()  # the child holds the only sending end: its death ends recv() with EOFError
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "died", None
    process.join()
    if status == "ok":
        return payload
    if status == "died":
        raise UserError(
            f"bench phase {label} died (exit code {process.exitcode}; -9 is often the out-of-memory "
            "killer): lower micro_batch or context"
        )
    print(payload, end="", file=sys.stderr, flush=True)  # the child's traceback, above the one-line summary
    last = payload.strip().splitlines()[-1]
    raise UserError(f"bench phase {label} failed: {last}")
