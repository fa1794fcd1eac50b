"""Timing helpers shared by ``python -m flashbridge check`` and benchmarks/ (GPU only).

torch: ``triton.testing.do_bench`` (CUDA events, median). JAX: a jitted function dispatched back to back
and synchronised once with ``block_until_ready``, so dispatch overlaps device work as it does in a real
training step. Each sample times a batch of ``inner`` calls and one of ``2 * inner`` calls and keeps the
difference divided by ``inner`` (the marginal cost of a call); the median over ``reps`` samples. The
difference cancels the fixed cost of starting and synchronising a batch: the first dispatch and the final
wake-up cost ~0.4 ms on the H200 (a CUPTI trace of a batch of six 8-call executions at ~180 us per kernel
ran every kernel back to back, <= 5 us apart, yet the batch's wall clock was 4% longer), which dividing
one ~10 ms batch by its length charged to every call.

Comparing the two frameworks' paths, which launch the same kernels, needs one method for both:
``time_torch_steady`` and ``time_jax_steady`` run the op over several distinct input sets back to back (a
CUDA graph of all of them in torch; one jitted function calling the op once per set in JAX, so that no
per-call dispatch or Python is timed), with no L2 flush in between in either. ``do_bench`` flushes the L2
before every call, which also leaves the write-back of the call's last dirty lines to the flush: for an op
that writes hundreds of MB that is up to the L2's 60 MB free, a few percent in its favour.
"""
from __future__ import annotations

import statistics
import time


def time_torch(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds per call of ``fn`` (which launches CUDA work)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_torch_steady(fn, arg_sets, *, reps: int = 20) -> float:
    """Median milliseconds per call of ``fn(*args)`` for ``args`` in ``arg_sets``, all sets replayed back to
    back from one CUDA graph (no host work, no L2 flush between calls)."""
    import torch

    _absorb_first_backward_capture()
    graph = steady_graph(fn, arg_sets)
    torch.cuda.synchronize()
    return statistics.median(replay_ms(graph, len(arg_sets), reps))


def steady_graph(fn, arg_sets):
    """One CUDA graph of ``fn(*args)`` for every set of ``arg_sets``, after a warm-up run of each on a side
    stream (compiles and allocations happen there, as capture requires)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    return _capture(fn, arg_sets)


def replay_ms(graph, calls: int, reps: int) -> list[float]:
    """``reps`` samples of milliseconds per call: each the CUDA-event time of one replay of ``graph`` (which
    makes ``calls`` calls) divided by ``calls``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return samples


_first_capture_done = False


def _absorb_first_backward_capture() -> None:
    """On the H200 the first CUDA-graph captures of a backward in a process fail
    (cudaErrorStreamCaptureInvalidated) and later ones succeed: spend the first one on a throwaway graph,
    once per process. That was enough for the cross-entropy benchmark; in the norm benchmark the first
    backward row still failed every capture (three retries included), so it spends a throwaway row too.

    A failed capture leaves torch's default CUDA generator registered with the dead graph: every later
    ``torch.randn(device="cuda")`` without a ``generator=`` fails ("Offset increment outside graph
    capture"). Callers of the steady timings draw their inputs from generators of their own."""
    global _first_capture_done
    if _first_capture_done:
        return
    _first_capture_done = True
    import torch

    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    y = (x * x).sum()
    try:
        _capture(lambda: torch.autograd.grad(y, [x], retain_graph=True), [()])
    except RuntimeError as exc:
        print(f"throwaway backward capture: {type(exc).__name__}")
    torch.cuda.synchronize()


def _capture(fn, arg_sets):
    import torch

    graph = torch.cuda.CUDAGraph()
    # thread_local: the capture must not fail on what other threads do meanwhile (JAX's runtime threads
    # poll events and allocate; under the default "global" mode that invalidates the capture)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for args in arg_sets:
            fn(*args)
    graph.replay()
    return graph


def time_jax_steady(fn, arg_sets, **kwargs) -> float:
    """Median milliseconds per call of ``fn(*args)`` for ``args`` in ``arg_sets``, all calls inside one
    jitted function. The sets must differ (XLA would merge identical calls into one)."""
    def every_set(sets):
        return [fn(*args) for args in sets]

    return time_jax(every_set, list(arg_sets), **kwargs) / len(arg_sets)


def time_jax(fn, *args, inner: int | None = None, reps: int = 15) -> float:
    """Median milliseconds per call of ``jax.jit(fn)(*args)``: the marginal cost of a call in a batch of
    back-to-back calls (see the module docstring). ``inner`` (default: automatic) makes the shorter batch
    last about 10 ms."""
    import jax

    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compile

    def batch(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            out = jitted(*args)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    if inner is None:
        per_call = batch(3) / 3
        inner = max(10, min(500, int(0.010 / max(per_call, 1e-6))))
    samples = []
    for _ in range(reps):
        short = batch(inner)
        long = batch(2 * inner)
        samples.append((long - short) / inner * 1e3)
    return statistics.median(samples)


def jax_dispatch_ms(fn, *args, calls: int = 4) -> float:
    """Host milliseconds to enqueue one call of ``jax.jit(fn)(*args)``: ``calls`` calls dispatched without
    waiting, divided by ``calls``. When this reaches the device time of a call, :func:`time_jax` measures
    the host, not the kernels. Keep ``calls`` x kernels per call well under the launch queue's ~1000
    entries, or a full queue makes the host wait for the device."""
    import jax

    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compile, and an idle device to start from
    start = time.perf_counter()
    outs = [jitted(*args) for _ in range(calls)]
    elapsed = time.perf_counter() - start
    jax.block_until_ready(outs)
    return elapsed / calls * 1e3
