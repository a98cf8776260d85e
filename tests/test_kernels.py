"""The compiled kernels of the bump scan (cernenv/physics/kernels.py) against independent code:
the background model of likelihood.py, numpy's LAPACK solve and pseudo-inverse, and scipy's
constrained minimiser for the steps that hold the falling-shape walls. (Each scan point is
also checked against an independent iminuit fit in tests/test_scan_crosscheck.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import LinearConstraint, minimize

from cernenv.physics import kernels
from cernenv.physics.likelihood import template


@pytest.mark.parametrize("p1,p2", [(0.0, 0.0), (5.0, 2.0), (-3.0, 4.5), (300.0, -40.0), (12.0, 0.01)])
def test_background_grid_is_the_template_background_model(p1, p2):
    tmpl = template(np.linspace(100.0, 400.0, 61), 13.0)
    f, df1, df2 = (np.empty(tmpl.n_bins) for _ in range(3))
    kernels.background_grid(tmpl.log_1mx, tmpl.log_x, tmpl.w6, p1, p2, f, df1, df2)
    ref_f, ref_df1, ref_df2 = tmpl.background(p1, p2, grad=True)
    np.testing.assert_allclose(f, ref_f, rtol=1e-12, atol=1e-300)
    scale = np.abs(ref_df1).max() + np.abs(ref_df2).max()
    np.testing.assert_allclose(df1, ref_df1, rtol=1e-10, atol=1e-13 * scale)
    np.testing.assert_allclose(df2, ref_df2, rtol=1e-10, atol=1e-13 * scale)
    assert f.sum() == pytest.approx(1.0, abs=1e-12)


def _spd(rng, p):
    a = rng.normal(size=(p, p))
    return a @ a.T + 0.1 * np.eye(p)


@pytest.mark.parametrize("p", [3, 4])
def test_solve_matches_lapack_and_reports_an_exactly_singular_system(p):
    rng = np.random.default_rng(p)
    for _ in range(50):
        a, b = rng.normal(size=(p, p)), rng.normal(size=p)
        x, ok = kernels._solve(a, b)
        assert ok
        np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-9, atol=1e-9)
    a = _spd(rng, p)
    a[1, :] = a[:, 1] = 0.0
    assert not kernels._solve(a, rng.normal(size=p))[1]


def test_a_parameter_without_information_gets_the_pseudo_inverse_step():
    """A background of no events says nothing about its shape: those rows and columns of the
    information are 0, and the step leaves the shape alone (as the pseudo-inverse does)."""
    rng = np.random.default_rng(7)
    info = _spd(rng, 4)
    info[1:3, :] = 0.0
    info[:, 1:3] = 0.0
    vectors = rng.normal(size=(4, 3))
    np.testing.assert_allclose(kernels._inverse_times(info, vectors), np.linalg.pinv(info) @ vectors, atol=1e-10)
    assert not np.any(kernels._inverse_times(np.zeros((3, 3)), vectors[:3]))


def _constrained_minimum(info, score, normals, on_wall):
    """min of score.x + x.info.x / 2 subject to normals[j].x >= 0 for the walls on (scipy's
    trust-region constrained minimiser), and its value."""
    model = lambda x: score @ x + 0.5 * x @ info @ x  # noqa: E731
    result = minimize(
        model,
        np.zeros(score.size),
        jac=lambda x: score + info @ x,
        hess=lambda x: info,
        constraints=[LinearConstraint(normals[on_wall], 0.0, np.inf)],
        method="trust-constr",
        options={"gtol": 1e-12, "xtol": 1e-14, "maxiter": 5000},
    )
    assert np.all(normals[on_wall] @ result.x >= -1e-8)
    return model(result.x)


def _scan_step(info, score, normals, on_wall):
    """The bump scan's step (Fisher scoring), checked to return its decrement -score.step."""
    step, decrement = kernels.wall_step(info, score, normals, on_wall)
    assert decrement == pytest.approx(-score @ step, abs=1e-12)
    return step


def _fit_step(info, score, normals, on_wall):
    """The fits' Newton step (``fitting._newton``) on the eigen-decomposed Hessian."""
    eigval, eigvec = np.linalg.eigh(info)
    return kernels._held_wall_step(eigval, eigvec, score, normals, on_wall)


@pytest.mark.parametrize("step_of", [_scan_step, _fit_step])
@pytest.mark.parametrize("p", [3, 4])
def test_wall_steps_are_the_minimum_of_the_quadratic_model_on_the_feasible_cone(p, step_of):
    """For every combination of walls on, the step is feasible (it does not push a wall that is
    on outwards) and as good as scipy's constrained minimum of the same quadratic model.
    Without walls it is the Newton step -info^-1 score."""
    rng = np.random.default_rng(100 + p)
    pushed = 0
    for _ in range(60):
        info, score = _spd(rng, p), rng.normal(size=p)
        normals = np.zeros((2, p))
        normals[:, 1:3] = rng.normal(size=(2, 2))  # the walls constrain the shape parameters only
        for on_wall in ([False, False], [True, False], [False, True], [True, True]):
            on_wall = np.array(on_wall)
            step = step_of(info, score, normals, on_wall)
            if not on_wall.any():
                np.testing.assert_allclose(step, -np.linalg.solve(info, score), rtol=1e-10, atol=1e-12)
                continue
            assert np.all(normals[on_wall] @ step >= -1e-9)
            reference = _constrained_minimum(info, score, normals, on_wall)
            value = score @ step + 0.5 * step @ info @ step
            assert value <= reference + 1e-7 * (1.0 + abs(reference))
            pushed += bool(np.any(normals[on_wall] @ -np.linalg.solve(info, score) < 0))
    assert pushed > 50, "the free step left the cone often enough to test the held walls"


def test_profile_rows_ends_at_the_maximum_likelihood():
    """Converged rows have a zero score in the parameters off the walls, and no direction that
    keeps the walls raises the likelihood further (a Newton decrement ~0)."""
    rng = np.random.default_rng(3)
    tmpl = template(np.linspace(100.0, 200.0, 51), 13.0)
    truth = np.array([2000.0, 6.0, 3.0])
    f = np.empty(tmpl.n_bins)
    kernels.background_grid(tmpl.log_1mx, tmpl.log_x, tmpl.w6, truth[1], truth[2], f, f.copy(), f.copy())
    counts = rng.poisson(truth[0] * f).astype(float)
    centres = 0.5 * (tmpl.edges[1:] + tmpl.edges[:-1])
    signal = np.exp(-0.5 * ((centres[None, :] - np.array([[130.0], [160.0]])) / 2.0) ** 2)
    signal /= signal.sum(axis=1, keepdims=True)
    starts = np.tile([counts.sum(), 0.0, 0.0, 0.0], (2, 1))
    theta, mu, *_, converged = kernels.profile_rows(
        tmpl.log_1mx, tmpl.log_x, tmpl.w6, tmpl.slope_matrix, counts, starts, signal, True, 50, False
    )
    assert converged.all()
    np.testing.assert_allclose(mu.sum(axis=1), counts.sum(), rtol=1e-6)  # the yield's score: sum(mu) = sum(n)

    def nll(th, s):
        shape = np.empty(tmpl.n_bins)
        kernels.background_grid(tmpl.log_1mx, tmpl.log_x, tmpl.w6, th[1], th[2], shape, shape.copy(), shape.copy())
        expected = th[0] * shape + th[3] * s
        return np.sum(expected - counts * np.log(expected))

    for row in range(2):
        best = nll(theta[row], signal[row])
        for direction in np.eye(4):
            for h in (1e-3, -1e-3):
                moved = theta[row] + h * direction * max(1.0, abs(theta[row]) @ direction)
                assert nll(moved, signal[row]) >= best - 1e-9


def _cost(signal_free=True, width_free=True, mask=None, spurious=25.0):
    from cernenv.physics.likelihood import PoissonDeviance, whitening

    rng = np.random.default_rng(11)
    tmpl = template(np.arange(100.0, 161.0, 1.0), 13.0)
    f = tmpl.background(8.0, 5.0)[0]
    counts = rng.poisson(5000.0 * f + 300.0 * tmpl.signal(125.0, 0.0, 1.6)[0]).astype(float)
    cost = PoissonDeviance(tmpl, counts, 1.6, spurious, (8.0, 5.0), whitening(tmpl, 5000.0, 8.0, 5.0), mask)
    cost.signal_free, cost.width_free = signal_free, width_free
    return cost


@pytest.mark.parametrize(
    "case,par",
    [
        ("gaussian", [5050.0, 0.3, -0.2, 280.0, 125.2, 0.0, 0.4]),
        ("voigt", [5050.0, 0.3, -0.2, 280.0, 125.2, 0.6, 0.4]),
        ("free width at 0", [5050.0, 0.3, -0.2, 280.0, 125.2, 0.0, -0.3]),
        ("background only", [5300.0, -0.4, 0.5, 0.0, 125.0, 0.0, 0.0]),
        ("sideband", [5050.0, 0.3, -0.2, 280.0, 125.2, 0.0, 0.0]),
        ("on the wall", [5050.0, -40.0, 25.0, 280.0, 125.2, 0.0, 0.0]),
    ],
)
def test_the_compiled_cost_has_numpys_value_gradient_and_a_hessian_that_is_its_derivative(case, par):
    """`PoissonDeviance.value_grad_hess` (the kernel) against the numpy model of likelihood.py:
    the value against `deviance_terms` plus the wall penalty, the gradient against `grad`, and
    the Hessian against central differences of `grad`."""
    from cernenv.physics.likelihood import SHAPE_PENALTY

    mask = None
    if case == "sideband":
        mask = np.ones(60, dtype=bool)
        mask[20:30] = False
    cost = _cost(
        signal_free=case != "background only",
        width_free=case in ("voigt", "free width at 0"),
        mask=mask,
    )
    par = np.array(par)
    value, grad, hess = cost.value_grad_hess(*par)
    deviance, constraint = cost.deviance_terms(par)
    slopes = cost.t.slope_matrix @ np.array(cost.shape_params(par[1], par[2]))
    assert (slopes.min() < 0) == (case == "on the wall")
    penalty = SHAPE_PENALTY * float(np.sum(np.minimum(slopes, 0.0) ** 2))
    assert value == pytest.approx(deviance + constraint + penalty, rel=1e-11)
    assert cost(*par) == pytest.approx(value, rel=1e-12)
    free = [i for i in range(7) if cost.signal_free or i in (0, 1, 2)]
    if not cost.width_free:
        free = [i for i in free if i != 5]
    np.testing.assert_allclose(grad[free], cost.grad(*par)[free], rtol=1e-9, atol=1e-7)
    numeric = np.empty((len(free), len(free)))
    for a, i in enumerate(free):
        step = np.zeros(7)
        step[i] = 1e-6 * max(1.0, abs(par[i]))
        if i == 5 and par[5] == 0.0:  # the width's derivative at 0, one-sided from inside
            numeric[a] = (cost.grad(*(par + step)) - cost.grad(*par))[free] / step[i]
            continue
        numeric[a] = (cost.grad(*(par + step)) - cost.grad(*(par - step)))[free] / (2 * step[i])
    scale = np.abs(hess[np.ix_(free, free)]).max()
    np.testing.assert_allclose(hess[np.ix_(free, free)], numeric, atol=2e-5 * scale)
    np.testing.assert_allclose(hess, hess.T, atol=1e-9 * scale)


def test_newton_direction_holds_a_parameter_at_a_bound_it_would_cross():
    """A parameter at its lower bound whose Newton step would go below it is held (step 0) and
    the others take the Newton step of the rest; an indefinite Hessian's eigenvalues are taken
    in absolute value (a descent direction)."""
    h = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 3.0]])
    g = np.array([0.4, -1.0, 0.3])  # the free step moves parameter 0 down (it is at its bound)
    no_walls = np.zeros((2, 3)), np.zeros(2, dtype=bool)
    lo, hi, bounded = np.array([0.0, -np.inf, -np.inf]), np.full(3, np.inf), np.array([True, False, False])
    free = kernels.newton_direction(g, h, np.array([1.0, 0.0, 0.0]), lo, hi, bounded, *no_walls)
    np.testing.assert_allclose(free, -np.linalg.solve(h, g), rtol=1e-12)
    assert free[0] < 0
    step = kernels.newton_direction(g, h, np.array([0.0, 0.0, 0.0]), lo, hi, bounded, *no_walls)
    assert step[0] == 0.0
    np.testing.assert_allclose(step[1:], -np.linalg.solve(h[1:, 1:], g[1:]), rtol=1e-12)
    indefinite = np.diag([2.0, -1.0, 3.0])
    step = kernels.newton_direction(g, indefinite, np.ones(3), lo, hi, bounded, *no_walls)
    np.testing.assert_allclose(step, -g / np.array([2.0, 1.0, 3.0]), rtol=1e-12)
    assert g @ step < 0


def _record_newton_fits(monkeypatch):
    """The Gaussian (or background-only) fits that `fitting._newton` is asked for while the
    fits and significances of a few spectra run: (cost, start, free, lower, upper, max_iter,
    tol, max_step) each."""
    from cernenv.physics import fitting
    from cernenv.physics.significance import profile_likelihood_significance

    calls = []
    newton = fitting._newton

    def recording(cost, start, free, lower, upper, max_iter=100, tol=1e-6, max_step=None):
        if fitting._gaussian_throughout(cost, np.asarray(start, dtype=float), np.asarray(free)):
            calls.append((cost, np.array(start, dtype=float), np.asarray(free), lower, upper, max_iter, tol, max_step))
        return newton(cost, start, free, lower, upper, max_iter, tol, max_step)

    monkeypatch.setattr(fitting, "_newton", recording)
    rng = np.random.default_rng(5)
    edges = np.arange(100.0, 161.0, 1.0)
    tmpl = template(edges, 13.0)
    for background, signal, shape in ((5000.0, 300.0, (8.0, 5.0)), (80.0, 12.0, (3.0, 2.0)), (400.0, 0.0, (0.5, 0.5))):
        expected = background * tmpl.background(*shape)[0] + signal * tmpl.signal(125.0, 0.0, 1.6)[0]
        counts = rng.poisson(expected).astype(float)
        mask = np.ones(counts.size, dtype=bool)
        mask[20:30] = False
        fitting.fit_background_only(edges, counts, 13.0, mask=mask)  # N_b free, bins masked
        for spurious in (0.0, 3.0):  # mass floated within bounds (steps capped), and theta's H0 fit
            profile_likelihood_significance(
                edges, counts, 13.0, 1.6, 124.0, spurious_signal_events=spurious, mass_bounds_gev=(121.0, 128.0)
            )
        profile_likelihood_significance(edges, counts, 13.0, 1.6, 140.0)  # mass fixed
        fitting.fit_signal_plus_background(edges, counts, 13.0, 1.6, 117.0, max_width_gev=0.0)  # far: steps capped
    return calls


def test_the_compiled_newton_fit_is_the_python_loop(monkeypatch):
    """`kernels.newton_minimise` runs `fitting._newton_loop`'s iterations: on every Gaussian and
    background-only fit of three spectra (a strong peak, a few events, none; bins masked, mass
    fixed or floated with capped steps, the spurious signal's nuisance), both reach the same
    minimum: the same convergence, costs within 1e-9 (deviance units) and parameters within
    1e-6 of their scale. (They differ at all only in the order of a few floating-point sums.)"""
    from cernenv.physics import fitting

    calls = _record_newton_fits(monkeypatch)
    assert len(calls) >= 15
    assert {tuple(free) for _, _, free, *_ in calls} >= {(0, 1, 2), (1, 2), (0, 1, 2, 3, 4)}
    assert any(max_step is not None for *_, max_step in calls)
    cost, start, free, lower, upper, _, tol, max_step = next(c for c in calls if c[-1] is not None)
    calls.append((cost, start, free, lower, upper, 4, tol, np.minimum(max_step, 0.1)))  # 4 steps, tightly capped
    for cost, start, free, lower, upper, max_iter, tol, max_step in calls:
        x, fval, converged = fitting._newton_compiled(cost, start.copy(), free, lower, upper, max_iter, tol, max_step)
        ref_x, ref_fval, ref_converged = fitting._newton_loop(
            cost, start.copy(), free, lower, upper, max_iter, tol, max_step
        )
        assert converged == ref_converged
        assert fval == pytest.approx(ref_fval, abs=1e-9)
        np.testing.assert_allclose(x, ref_x, rtol=1e-6, atol=1e-6)


def test_gaussian_bin_fractions_are_the_shapes_signal_fractions_of_width_zero():
    from cernenv.physics import shapes
    from cernenv.physics.scan import gaussian_bin_fractions

    edges = np.linspace(100.0, 160.0, 61)
    masses, sigmas = np.array([101.0, 125.3, 159.5]), np.array([0.8, 1.6, 4.0])
    fractions = gaussian_bin_fractions(template(edges, 13.0), masses, sigmas)
    for row, mass, sigma in zip(fractions, masses, sigmas):
        np.testing.assert_allclose(row, shapes.signal_bin_fractions(edges, mass, 0.0, sigma), atol=1e-14)


def test_the_kernels_import_and_run_where_no_cache_folder_is_writable(tmp_path):
    """A read-only install with an unwritable home: numba finds no folder for its cache; the
    kernels are then compiled in the process instead of failing at import. (Simulated with
    files where numba would make its folders: root can write into read-only folders.)"""
    import shutil
    import subprocess
    import sys

    from cernenv.physics import portable

    package = tmp_path / "site" / "physics"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for module in (kernels, portable):  # the kernels and the arithmetic they are compiled with
        shutil.copy(Path(module.__file__), package / Path(module.__file__).name)
    (package / "__pycache__").write_text("a file, not a folder")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(HOME=str(blocked / "home"), XDG_CACHE_HOME=str(blocked / "cache"), PYTHONDONTWRITEBYTECODE="1")
    code = (
        "import numpy as np; from physics import kernels, portable;"
        "x, ok = kernels._solve(np.array([[2.0, 1.0], [1.0, 3.0]]), np.array([1.0, 2.0]));"
        "print(ok, np.round(x, 6).tolist(), float(portable.log(np.e)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=package.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "[0.2,", "0.6]", "1.0"]
    assert not list(package.glob("*.nbi"))


def test_a_step_cut_to_reach_a_bound_lands_on_it():
    """`kernels.onto_bounds`: a step scaled to reach a bound, t = (bound - x) / d, lands a few
    rounding errors from it in floating point (a yield of 5.7e-319 where its bound is 0); it is put
    on the bound, which the next Newton step then holds. A step that stops short keeps its value."""
    from cernenv.physics.kernels import onto_bounds

    rng = np.random.default_rng(0)
    for x, d in zip(rng.uniform(1e-3, 1e4, 200), -rng.uniform(1e-3, 1e4, 200)):
        assert onto_bounds(x, ((0.0 - x) / d) * d, 0.0, np.inf) == 0.0
        assert onto_bounds(x, ((7.5 - x) / -d) * -d, -np.inf, 7.5) == 7.5 or x > 7.5
    landed = [float(x + ((0.0 - x) / d) * d) for x, d in zip(rng.uniform(0.1, 1, 200), -rng.uniform(0.1, 1, 200))]
    assert any(value != 0.0 for value in landed), "rounding leaves some steps off the bound"
    assert onto_bounds(2.0, -1.5, 0.0, np.inf) == 0.5
    assert onto_bounds(2.0, -3.0, 0.0, np.inf) == 0.0
