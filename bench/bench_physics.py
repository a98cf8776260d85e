"""Single-core timings of the physics kernels an episode calls most (median of repeats).

    make bench            # runs this after bench_env.py; or: python bench/bench_physics.py

The spectra are the ones the physics tests use (a 125 GeV peak over a falling background,
80 bins); the targets are the budgets that keep a HeuristicAgent episode (~10 fits, two
scans, one spin measurement) within the >= 50 episodes/s of bench_env.py.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # single core: no BLAS threads
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cernenv.physics import (  # noqa: E402
    background_angular_probabilities,
    fit_signal_plus_background,
    profile_likelihood_significance,
    scan_local_significance,
    shapes,
    spin_likelihoods,
)

SQRT_S_TEV, RESOLUTION_GEV = 13.0, 1.6
P1, P2, BACKGROUND_EVENTS = 8.0, 5.0, 20000.0
TARGETS_MS = {
    "s+b fit, 80 bins": 5.0,
    "bump scan, 60 masses x 80 bins": 5.0,
    "profile-likelihood significance": 5.0,
    "spin likelihoods (profiled f)": 2.0,
}


def median_ms(fn, repeat: int = 30) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def spectrum(seed: int, signal_events: float):
    edges = np.linspace(100.0, 180.0, 81)
    expected = BACKGROUND_EVENTS * shapes.background_bin_fractions(
        edges, SQRT_S_TEV, P1, P2
    ) + signal_events * shapes.signal_bin_fractions(edges, 125.0, 0.0, RESOLUTION_GEV)
    return edges, np.random.default_rng(seed).poisson(expected)


def resolution_gev(mass_gev):
    return 0.01 * mass_gev + 0.35  # grows with mass: 1.6 GeV at 125 GeV


def main() -> int:
    edges, counts = spectrum(8, 600)
    grid = np.linspace(105.0, 175.0, 60)
    cos_counts = np.random.default_rng(17).multinomial(2000, background_angular_probabilities("dimuon", 10))
    measured = {
        "s+b fit, 80 bins": median_ms(
            lambda: fit_signal_plus_background(edges, counts, SQRT_S_TEV, RESOLUTION_GEV, 124.0, max_width_gev=0.0)
        ),
        "bump scan, 60 masses x 80 bins": median_ms(
            lambda: scan_local_significance(edges, counts, SQRT_S_TEV, resolution_gev, grid)
        ),
        "profile-likelihood significance": median_ms(
            lambda: profile_likelihood_significance(edges, counts, SQRT_S_TEV, RESOLUTION_GEV, 125.0)
        ),
        "spin likelihoods (profiled f)": median_ms(lambda: spin_likelihoods(cos_counts, "dimuon"), repeat=50),
    }
    print(f"{'physics kernel [ms, median]':<40}{'measured':>10}{'target':>8}")
    for name, value in measured.items():
        print(f"{name:<40}{value:>10.2f}{TARGETS_MS[name]:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
