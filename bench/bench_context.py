"""Cost of entering and leaving a pipeline context, next to the context managers users know.

What is measured: the wall time of one ``with <context>: pass`` statement (construct the context
object where the form needs one, ``__enter__``, ``__exit__``), in a tight Python loop:

* ``tp.pipeline(p)``         -- ``with tp.pipeline(p): pass`` (the documented form)
* ``with p``                 -- ``with p: pass`` (the Pipeline object is its own context)
* ``nullcontext()``          -- ``with contextlib.nullcontext(): pass``: the floor, what any
                                Python-level context manager costs at least
* ``torch.no_grad()``        -- ``with torch.no_grad(): pass``: the context every training loop uses
* ``torch.cuda.stream(s)``   -- ``with torch.cuda.stream(s): pass`` with ``s = torch.cuda.Stream()``
                                (only when CUDA is available; then ``p`` has a CUDA stream, so
                                entering it switches the current CUDA stream just like this does)
* ``empty loop``             -- the ``for`` loop alone (for reference; included in every row)

The variants run interleaved in rounds in one process (default 7 rounds x 200k iterations) and the
median per variant is reported, in nanoseconds per enter+exit (loop overhead included).

How to read the output: the table gives median/min/max ns per enter+exit; the ratio lines compare
``tp.pipeline(p)`` and ``with p`` with the others. The targets (docs/design.md: entering a pipeline must
be cheap enough to use around every small region) are

* enter+exit <= 4x ``nullcontext()``   and
* enter+exit <= ``torch.no_grad()``,

checked for both forms, one PASS/FAIL line each. The exit status is 0 unless ``--check`` is given
and a target is missed. ``--quick`` runs fewer rounds and iterations (a smoke test; the numbers
are noisier).

    python bench/bench_context.py [--quick] [--check] [--rounds N] [--iterations N]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import torch_pipeline as tp  # noqa: E402
from _harness import (  # noqa: E402
    Target,
    Variant,
    add_common_args,
    check_targets,
    environment_line,
    finish,
    median,
    print_ratio,
    print_table,
    time_rounds,
)

TP = "tp.pipeline(p)"
WITH_P = "with p"
NULL = "nullcontext()"
NO_GRAD = "torch.no_grad()"
CUDA_STREAM = "torch.cuda.stream(s)"
EMPTY = "empty loop"


def make_variants(p: tp.Pipeline, iterations: int, cuda: bool) -> List[Variant]:
    """The loops to time. Globals are bound as default arguments so that every loop pays the
    same (local) lookup cost."""

    def tp_pipeline(n: int, pipeline: Callable = tp.pipeline, p: tp.Pipeline = p) -> None:
        for _ in range(n):
            with pipeline(p):
                pass

    def with_p(n: int, p: tp.Pipeline = p) -> None:
        for _ in range(n):
            with p:
                pass

    def null(n: int, nullcontext: Callable = contextlib.nullcontext) -> None:
        for _ in range(n):
            with nullcontext():
                pass

    def no_grad(n: int, no_grad: Callable = torch.no_grad) -> None:
        for _ in range(n):
            with no_grad():
                pass

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    variants = [
        Variant(TP, tp_pipeline, iterations),
        Variant(WITH_P, with_p, iterations),
        Variant(NULL, null, iterations),
        Variant(NO_GRAD, no_grad, iterations),
    ]
    if cuda:
        s = torch.cuda.Stream()

        def cuda_stream(n: int, stream: Callable = torch.cuda.stream, s: torch.cuda.Stream = s) -> None:
            for _ in range(n):
                with stream(s):
                    pass

        variants.append(Variant(CUDA_STREAM, cuda_stream, iterations))
    variants.append(Variant(EMPTY, empty, iterations))
    return variants


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--iterations", type=int, default=None, help="iterations per round (default 200000, quick 20000)"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    iterations = args.iterations or (20_000 if args.quick else 200_000)
    cuda = torch.cuda.is_available()

    print(f"bench_context: {environment_line()}")
    p = tp.Pipeline()
    with p:  # acquires p's streams (on CUDA: its stream on the current device) before timing
        pass
    print(f"pipeline: {p!r}")
    if cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
        own = p.stream(dev)
        print(f"p's CUDA stream: {own} (default stream: {torch.cuda.default_stream(dev)})")
        if own is None or own.cuda_stream == torch.cuda.default_stream(dev).cuda_stream:
            print("WARNING: p has no CUDA stream of its own; `with p` switches nothing")
        print(f"torch.cuda.stream(s): s = torch.cuda.Stream() on {dev}")
    print(f"{rounds} rounds x {iterations} iterations, interleaved; ns per enter+exit (loop included)")
    samples = time_rounds(make_variants(p, iterations, cuda), rounds)
    print()
    print_table(samples)
    print()
    for form in (TP, WITH_P):
        print_ratio(samples, form, NULL)
        print_ratio(samples, form, NO_GRAD)
        if cuda:
            print_ratio(samples, form, CUDA_STREAM)
    loop = median(samples[EMPTY])
    print(
        f"without the loop: {TP} {median(samples[TP]) - loop:.1f} ns, {NULL} "
        f"{median(samples[NULL]) - loop:.1f} ns, {NO_GRAD} {median(samples[NO_GRAD]) - loop:.1f} ns"
    )
    print()
    targets = []
    for form in (TP, WITH_P):
        targets.append(Target(form, NULL, 4.0, "enter+exit <= 4x nullcontext"))
        targets.append(Target(form, NO_GRAD, 1.0, "enter+exit <= torch.no_grad()"))
    ok = check_targets(samples, targets)
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
