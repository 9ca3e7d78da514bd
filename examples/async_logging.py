"""The print(loss) stall, and how a logging pipeline on another worker thread removes it.

A training loop that logs its loss every step::

    for i in range(steps):
        loss = train_step()
        print(f"step {i} loss {loss.item():.4f}")   # naive

waits for the logging on every step. On CUDA, ``loss.item()`` blocks the Python thread until the
whole backward pass has run, so the GPU runs dry while Python waits and then while it formats and
writes the line (the "print(loss) stall"). On the CPU there is no device to starve, but the I/O of
logging (formatting, writing a log file, flushing, a slow terminal or a network logger) still
costs the training loop time on every step.

With torch_pipeline the logging is handed to a pipeline bound to worker thread 1::

    logger = tp.Pipeline(tp.get_worker_thread(1))
    for i in range(steps):
        loss = train_step()
        logger.submit(log_step, i, loss.detach())   # returns at once

``log_step`` runs on worker thread 1, in submission order, under ``logger``: it calls
``loss.item()`` (on CUDA the logger's stream first waits for the step that produced the loss;
the training stream does not wait for anything) and does the I/O there, so the training loop never
waits for it.

What this program does: trains the same small MLP on the same random data twice (same seed),
first logging naively, then through the logging pipeline. The logging of each step formats the
line, appends it to a log file, flushes it, and then sleeps ``--log-latency-ms`` (default 2 ms) to
stand for slow log I/O (``time.sleep`` releases the GIL, like real I/O). It prints, per run,

* loop steps/s       -- steps per second of the training loop itself (until the last step was
                        issued; the pipelined run has not finished logging by then), and
* end-to-end steps/s -- until every step has been logged (and, on CUDA, the device is idle),

and the speed-ups pipelined / naive. End to end, the pipelined run takes about
max(train, log) per step instead of train + log. It then checks that the pipelined run logged
every step, in order, with exactly the loss values of the naive run (same seed, same ops, so the
same numbers bit for bit), and exits with status 1 if not.

    python examples/async_logging.py [--steps N] [--log-latency-ms MS] [--device cpu|cuda|sim]
                                     [--width N] [--batch N] [--threads N] [--log-dir DIR] [--echo]

``--device sim`` runs the sim device asynchronously (docs/design.md,
"Asynchronous mode and the latency model"), every kernel taking ``--sim-kernel-us`` on its stream's
thread: ``loss.item()`` then stalls the loop as on a GPU, without one.

On the CPU the training uses CPUs - 1 intra-op threads by default (``--threads``), so that the
logging thread has a core of its own; both runs use the same setting.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, TextIO, Tuple

import torch
import torch.nn.functional as F

import torch_pipeline as tp


@dataclass
class StepLog:
    """Where log lines go: a log file (flushed every line), optionally stdout too. ``records``
    keeps what was logged, for the check."""

    file: TextIO
    latency_s: float
    echo: bool = False
    records: List[Tuple[int, float]] = field(default_factory=list)

    def log_step(self, step: int, loss: torch.Tensor) -> None:
        """Logs one step: reads the loss (on CUDA: a device sync), formats, writes, flushes."""
        value = loss.item()
        line = f"step {step} loss {value:.4f}"
        self.file.write(line + "\n")
        self.file.flush()
        if self.echo:
            print(line, flush=True)
        if self.latency_s > 0:
            time.sleep(self.latency_s)  # stands for slow I/O; releases the GIL, like real I/O
        self.records.append((step, value))


@dataclass
class Result:
    name: str
    steps: int
    loop_s: float
    end_s: float
    records: List[Tuple[int, float]]

    @property
    def loop_rate(self) -> float:
        return self.steps / self.loop_s

    @property
    def end_rate(self) -> float:
        return self.steps / self.end_s


def make_problem(
    device: torch.device, width: int, batch: int, seed: int
) -> Tuple[Callable[[int], torch.Tensor], torch.nn.Module]:
    """An MLP, its optimizer and a fixed set of random batches; returns ``train_step(i) -> loss``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    n_batches = 8
    xs = torch.randn(n_batches, batch, width, device=device)
    ys = torch.randint(0, 10, (n_batches, batch), device=device)

    def train_step(i: int) -> torch.Tensor:
        x, y = xs[i % n_batches], ys[i % n_batches]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return train_step, model


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def run_naive(args: argparse.Namespace, device: torch.device, log_path: str) -> Result:
    train_step, _ = make_problem(device, args.width, args.batch, args.seed)
    with open(log_path, "w") as f:
        log = StepLog(f, args.log_latency_ms / 1000.0, args.echo)
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = train_step(i)
            log.log_step(i, loss)  # the stall: .item() and the I/O, on the training thread
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
    return Result("naive", args.steps, t1 - t0, t2 - t0, log.records)


def run_pipelined(args: argparse.Namespace, device: torch.device, log_path: str) -> Result:
    train_step, _ = make_problem(device, args.width, args.batch, args.seed)
    logger = tp.Pipeline(tp.get_worker_thread(1))
    with open(log_path, "w") as f:
        log = StepLog(f, args.log_latency_ms / 1000.0, args.echo)
        futures: List[torch.futures.Future] = []
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = train_step(i)
            futures.append(logger.submit(log.log_step, i, loss.detach()))  # returns at once
        t1 = time.perf_counter()
        logger.synchronize()  # every logging task has run (and, on CUDA, its stream is idle)
        for fut in futures:
            fut.wait()  # done already; raises if a logging task raised
        sync(device)
        t2 = time.perf_counter()
    return Result("pipelined", args.steps, t1 - t0, t2 - t0, log.records)


def check(naive: Result, piped: Result, steps: int) -> List[str]:
    """What is wrong with the pipelined run's log (empty when it matches the naive run's)."""
    problems = []
    order = [s for s, _ in piped.records]
    if order != list(range(steps)):
        missing = sorted(set(range(steps)) - set(order))
        problems.append(
            f"pipelined run logged {len(order)} of {steps} steps"
            + (f", missing {missing[:10]}" if missing else "")
            + ("" if order == sorted(order) else ", out of order")
        )
    mismatched = [
        (a, b) for a, b in zip(naive.records, piped.records) if a != b
    ]
    if mismatched:
        (s, va), (_, vb) = mismatched[0]
        problems.append(
            f"{len(mismatched)} logged losses differ from the naive run's; first: step {s}: "
            f"naive {va!r}, pipelined {vb!r}"
        )
    if len(naive.records) != steps:
        problems.append(f"naive run logged {len(naive.records)} of {steps} steps")
    return problems


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# The defaults per device: what parse_args uses and what --help says, from one table.
DEFAULTS = {
    "cpu": {"steps": 500, "width": 384, "batch": 64},
    "cuda": {"steps": 1000, "width": 4096, "batch": 1024},
    "sim": {"steps": 200, "width": 256, "batch": 64},
}


def _default_help(name: str) -> str:
    return (f"(default: {DEFAULTS['cpu'][name]} on CPU, {DEFAULTS['cuda'][name]} on CUDA, "
            f"{DEFAULTS['sim'][name]} on sim)")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run " + _default_help("steps"))
    parser.add_argument(
        "--log-latency-ms", type=float, default=2.0, help="simulated I/O latency per log line (default 2)"
    )
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or sim (default: cuda when available); sim: the sim "
                             "device run asynchronously, each kernel taking --sim-kernel-us")
    parser.add_argument("--sim-kernel-us", type=float, default=50.0,
                        help="modelled device time per kernel on --device sim (default 50)")
    parser.add_argument("--width", type=int, default=None, help="MLP width " + _default_help("width"))
    parser.add_argument("--batch", type=int, default=None, help="batch size " + _default_help("batch"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="where the two log files go (default: a temporary folder)")
    parser.add_argument("--echo", action="store_true", help="also print every log line to stdout")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads on the CPU (default: CPUs - 1, leaving a core to the logging "
        "thread; 0: torch's default)",
    )
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sim = args.device.split(":")[0] == "sim"
    cuda = not sim and torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    defaults = DEFAULTS["cuda" if cuda else "sim" if sim else "cpu"]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None:
        args.threads = 0 if cuda else max(1, _cpu_count() - 1)
    if args.steps < 1 or args.log_latency_ms < 0 or args.threads < 0:
        parser.error("--steps must be >= 1, --log-latency-ms >= 0 and --threads >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.device.split(":")[0] == "sim":
        import torch_pipeline.sim as sim

        # Asynchronous, with a modelled time per kernel: loss.item() stalls as on a GPU.
        sim.enable(num_devices=1, asynchronous=True)
        sim.set_latency(launch_us=args.sim_kernel_us)
    device = torch.device(args.device)
    if args.threads > 0:
        # On the CPU, intra-op threads that fill every core fight the logging thread for the CPUs
        # (and stall at their barriers whenever one of them is descheduled); both runs use this.
        torch.set_num_threads(args.threads)
    print(
        f"async_logging: device {device}, {args.steps} steps, MLP width {args.width}, batch "
        f"{args.batch}, log latency {args.log_latency_ms:g} ms, {torch.get_num_threads()} intra-op "
        f"threads, torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or tmp
        os.makedirs(log_dir, exist_ok=True)
        # Warm up (allocator, kernels, the worker thread), untimed and unlogged.
        warm = argparse.Namespace(**{**vars(args), "steps": min(20, args.steps), "log_latency_ms": 0.0, "echo": False})
        run_naive(warm, device, os.devnull)
        run_pipelined(warm, device, os.devnull)

        naive = run_naive(args, device, os.path.join(log_dir, "naive.log"))
        piped = run_pipelined(args, device, os.path.join(log_dir, "pipelined.log"))
        if args.log_dir:
            print(f"log files: {os.path.join(log_dir, 'naive.log')}, {os.path.join(log_dir, 'pipelined.log')}")

    print()
    print(f"{'run':<10} {'loop steps/s':>13} {'end-to-end steps/s':>19} {'end-to-end s':>13}")
    for r in (naive, piped):
        print(f"{r.name:<10} {r.loop_rate:>13.1f} {r.end_rate:>19.1f} {r.end_s:>13.3f}")
    print()
    print(f"speed-up pipelined / naive, training loop: {piped.loop_rate / naive.loop_rate:.2f}x")
    print(f"speed-up pipelined / naive, end to end:    {piped.end_rate / naive.end_rate:.2f}x")
    per_step_naive = naive.end_s / args.steps * 1e3
    per_step_loop = piped.loop_s / args.steps * 1e3
    print(
        f"per step: naive {per_step_naive:.2f} ms (train + log), pipelined training loop "
        f"{per_step_loop:.2f} ms, logging {args.log_latency_ms:g} ms + I/O on worker thread 1"
    )

    problems = check(naive, piped, args.steps)
    print()
    if problems:
        for p in problems:
            print(f"CHECK FAILED: {p}")
        return 1
    print(
        f"check passed: the pipelined run logged all {args.steps} steps in order, with the same "
        f"loss values as the naive run (last: {piped.records[-1][1]:.4f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
