"""Shared by the Python sides of bench/peers: the timing rule and the probe classifier.

Timing rule (the same as `turnstile-peerbench micro` and bench/peers/vercel.mjs): one warm-up
call (two, taking the faster, to calibrate, unless one call already lasts a run), then each run repeats the operation enough times to
last at least `min_run` seconds; a run's figure is elapsed / repetitions. Interpreter start-up
and imports are outside every timing.
"""

import json
import math
import sys
import time


def measure(op, runs, min_run):
    started = time.perf_counter()
    op()
    once = time.perf_counter() - started
    if once < min_run:
        started = time.perf_counter()
        op()
        once = min(once, time.perf_counter() - started)
    once = max(once, 1e-7)
    iterations = max(1, math.ceil(min_run / once))
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(iterations):
            op()
        samples.append((time.perf_counter() - started) / iterations)
    return samples, iterations


def emit(system, workload, samples, iterations, extra=None, unit="s/op"):
    print(json.dumps({"system": system, "workload": workload, "unit": unit, "samples": samples,
                      "iterations_per_run": iterations, "extra": extra or {}}), flush=True)


def emit_unavailable(system, workload, reason):
    print(json.dumps({"system": system, "workload": workload, "unavailable": reason}), flush=True)
    print(f"{system} {workload}: not measured: {reason}", file=sys.stderr)


def probe_line(system, case, observation):
    print(json.dumps({"probe": case, "system": system, "observation": observation}), flush=True)
