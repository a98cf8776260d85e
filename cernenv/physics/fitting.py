"""Extended binned maximum-likelihood fits of a resonance on a smooth background.

The model and its cost are in `likelihood.py` (``PoissonDeviance``, the Baker-Cousins
Poisson deviance of the extended binned likelihood, with the falling-shape constraint).

Minimisation: Newton's method on the exact gradient and Hessian of the deviance
(``_newton``), with a line search on the deviance itself and bounds held by an active
set. It reaches Migrad's minimum (a test fits the same data with a plain iminuit
``ExtendedBinnedNLL`` fit) in a handful of iterations instead of Migrad's tens of
function calls, and the exact Hessian gives the parameter errors (Minuit's numerical
Hesse is the fallback where it is not positive definite).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from iminuit import Minuit
from scipy.special import chdtrc

from . import portable
from .kernels import newton_direction, newton_minimise, onto_bounds
from .likelihood import (
    A1,
    A2,
    BARRIER,
    NB,
    NS,
    PARAMETER_NAMES,
    SHAPE_PENALTY,
    WALL_TOL,
    M,
    PoissonDeviance,
    W,
    as_counts,
    template,
    whitening,
)

_SQRT2PI = float(np.sqrt(2.0 * np.pi))


@dataclass(frozen=True)
class BackgroundFit:
    """Background-only fit. ``nll`` is -ln L relative to the saturated model (deviance / 2)."""

    background_yield: float
    p1: float
    p2: float
    nll: float
    converged: bool


@dataclass(frozen=True)
class ResonanceFit:
    """Signal-plus-background fit.

    ``chi2`` is the Poisson deviance (Baker-Cousins) over all bins (every bin has a
    positive expectation), ``ndof`` = bins minus floating model parameters (the
    constrained spurious-signal nuisance is not counted: its constraint is a
    pseudo-measurement), ``fit_p_value`` = P(chi2_ndof > chi2).
    ``signal_yield_err`` includes the spurious-signal term in quadrature when it is on. An
    error is ``math.inf`` where the data do not constrain the parameter: a mass and width when
    the signal barely improves on no signal (``shape_unconstrained``), any error wider than its
    parameter's range (``unconstrained``).
    """

    mass_gev: float
    mass_err_gev: float
    width_gev: float
    width_err_gev: float
    signal_yield: float
    signal_yield_err: float
    background_yield: float
    p1: float
    p2: float
    nll: float
    chi2: float
    ndof: int
    fit_p_value: float
    converged: bool


def _start_shape(tmpl, counts):
    """Weighted least-squares start for (p1, p2): ln(n_i / w_i) ~ c + p1 ln(1-x) - p2 ln x."""
    ok = counts > 0
    if ok.sum() < 4:
        return None
    l1 = tmpl.log_1mx[1::2][ok]
    l2 = -tmpl.log_x[1::2][ok]
    y = portable.log(counts[ok] / np.diff(tmpl.edges)[ok])
    a = np.vstack([np.ones_like(l1), l1, l2]).T
    wts = np.sqrt(counts[ok])
    sol = portable.lstsq(a * wts[:, None], y * wts)
    if not np.all(np.isfinite(sol)):
        return None
    return float(sol[1]), float(sol[2])


def _newton(cost, start, free, lower, upper, max_iter=100, tol=1e-6, max_step=None):
    """Minimise ``cost`` over the parameters ``free`` (indices into the 7) from ``start``,
    within [lower, upper] (per free parameter).

    Newton steps on the exact gradient and Hessian (``PoissonDeviance.value_grad_hess``), with
    the Hessian's eigenvalues taken in absolute value (and floored) where it is not
    positive definite; a parameter at a bound that the step would cross is held there
    (active set); the falling-shape constraints (``PoissonDeviance.wall_constraint``) are held as
    well where the shape is on the wall, and a step is cut where it would
    reach the wall; steps are shortened to ``max_step`` (per free parameter) and then by a
    backtracking (Armijo) line search on the cost itself, so every step decreases it.
    Stops when the Newton decrement g^T H^-1 g (twice the predicted decrease, deviance
    units) is below ``tol``, after that last step: with quadratic convergence the cost is
    then within ~tol^2 of the minimum (Migrad's EDM < 2e-5 was the previous criterion).
    The step before its cuts is ``kernels.newton_direction`` (compiled). Where the signal is
    a Gaussian of width 0 (or absent), as in the background-only fits and the significance's,
    these iterations run compiled whole (``kernels.newton_minimise``; tests/test_kernels.py
    holds it to this loop); a Voigt's rows come from scipy, and its fits run this loop.
    Returns (parameters, cost, converged)."""
    x = np.array(start, dtype=float)
    free = np.asarray(free)
    if _gaussian_throughout(cost, x, free):
        return _newton_compiled(cost, x, free, lower, upper, max_iter, tol, max_step)
    return _newton_loop(cost, x, free, lower, upper, max_iter, tol, max_step)


def _gaussian_throughout(cost, x, free) -> bool:
    """Whether every cost this fit evaluates has a Gaussian signal of width 0 (or none): the
    width is fixed at 0 and not free (``PoissonDeviance._compiled`` then passes no scipy rows)."""
    return not cost.width_free and x[W] <= 0.0 and W not in free.tolist()


def _newton_compiled(cost, x, free, lower, upper, max_iter, tol, max_step):
    """``_newton`` run by ``kernels.newton_minimise``."""
    t = cost.t
    caps = np.full(free.size, np.inf) if max_step is None else np.array(max_step, dtype=float)
    x, fval, converged = newton_minimise(
        x, free.astype(np.int64), np.array(lower, dtype=float), np.array(upper, dtype=float), caps,
        int(max_iter), float(tol), WALL_TOL, np.ascontiguousarray(cost.wall), t.log_1mx, t.log_x, t.w6, t.nodes,
        cost.n, cost.mask_float, cost.T, cost.p_ref, t.slope_matrix, cost.spur, cost.sigma,
        bool(cost.signal_free), SHAPE_PENALTY, BARRIER,
    )  # fmt: skip
    return x, float(fval), bool(converged)


def _newton_loop(cost, x, free, lower, upper, max_iter=100, tol=1e-6, max_step=None):
    """``_newton``'s iterations in Python, for any cost (the reference of ``kernels.newton_minimise``)."""
    block = np.ix_(free, free)
    lo, hi = [float(v) for v in lower], [float(v) for v in upper]
    caps = None if max_step is None else [float(v) for v in max_step]
    lower, upper = np.asarray(lo), np.asarray(hi)
    bounded = np.array([lo[k] > -np.inf or hi[k] < np.inf for k in range(free.size)], dtype=bool)
    fval, g_all, h_all = cost.value_grad_hess(*x)
    for _ in range(max_iter):
        g, h = g_all[free], h_all[block]
        if not (np.isfinite(g).all() and np.isfinite(h).all()):
            return x, fval, False
        xf = x[free].tolist()
        slope, normals = cost.wall_constraint(x, free)
        on_wall = slope <= WALL_TOL
        step = newton_direction(g, h, x[free], lower, upper, bounded, normals, on_wall)
        decrement = -float(portable.vecdot(g, step))
        slope_step = portable.matvec(normals, step)
        t_wall = 1.0  # the longest step that keeps the shapes off the wall inside it
        for j in range(slope.size):
            if not on_wall[j] and slope_step[j] < 0.0:
                t_wall = min(t_wall, -float(slope[j]) / float(slope_step[j]))
        if t_wall < 1.0:
            step = t_wall * step
        descent = t_wall * decrement  # -g . step: the Armijo reference
        steps = step.tolist()
        if decrement < tol:  # within ~decrement/2 of the minimum: take the last step if it helps
            trial = x.copy()
            trial[free] = [onto_bounds(xf[k], steps[k], lo[k], hi[k]) for k in range(free.size)]
            ftrial = float(cost(*trial))
            if ftrial <= fval:
                x, fval = trial, ftrial
            return x, fval, True
        t = 1.0  # longest step inside the bounds and the trust region
        for k in range(free.size):
            d = steps[k]
            if d < 0.0:
                t = min(t, (lo[k] - xf[k]) / d)
            elif d > 0.0:
                t = min(t, (hi[k] - xf[k]) / d)
            if caps is not None and d != 0.0:
                t = min(t, caps[k] / abs(d))
        trial = x.copy()
        trial[free] = [onto_bounds(xf[k], t * steps[k], lo[k], hi[k]) for k in range(free.size)]
        ftrial, g_trial, h_trial = cost.value_grad_hess(*trial)  # the full step is usually taken
        if not ftrial <= fval - 1e-4 * t * descent:
            for _ in range(60):
                t *= 0.5
                trial[free] = [onto_bounds(xf[k], t * steps[k], lo[k], hi[k]) for k in range(free.size)]
                ftrial = float(cost(*trial))
                if ftrial <= fval - 1e-4 * t * descent:
                    break
            else:
                return x, fval, decrement < 1e-4  # no descent left: converged to rounding
            ftrial, g_trial, h_trial = cost.value_grad_hess(*trial)
        x, fval, g_all, h_all = trial, ftrial, g_trial, h_trial
    return x, fval, False


def _feasible_shape(tmpl, p1, p2):
    """(p1, p2) moved onto the falling shapes (log-log slope >= 0 at both window edges) if it is
    not on them: the nearest point of that cone (Euclidean in (p1, p2)), a start for a fit."""
    p = np.array([p1, p2], dtype=float)
    c = tmpl.slope_matrix
    if np.all(portable.matvec(c, p) >= 0.0):
        return float(p1), float(p2)
    best = np.zeros(2)  # flat: both slopes 0
    for j in range(2):
        q = p - c[j] * portable.vecdot(c[j], p) / portable.vecdot(c[j], c[j])
        if np.all(portable.matvec(c, q) >= -1e-12) and np.sum((q - p) ** 2) < np.sum((best - p) ** 2):
            best = q
    return float(best[0]), float(best[1])


def fit_background_on_template(tmpl, counts, starts=None, mask=None):
    """Background-only fit from the given (p1, p2) starts, the lowest minimum kept; by default
    the WLS start (``_start_shape``), and (8, 5) only if that fit does not converge. (On the
    spectra of 300 heuristic episodes, 1,059 fits, the WLS start alone reached the two-start
    minimum to 1e-6 wherever it converged; tests/test_physics.py checks this per scenario.)

    With `mask`, only the bins it selects enter the likelihood; N_b is still the yield
    over the whole window (the shape extrapolates into the masked bins)."""
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        counts = np.where(mask, counts, 0.0)
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("the histogram is empty: nothing to fit")
    first_converged_is_enough = starts is None
    if starts is None:
        starts = []
        wls = _start_shape(tmpl, counts)  # masked bins hold 0 and are skipped
        if wls is not None:
            starts.append(wls)
        starts += [(8.0, 5.0), (5.0, 4.0)]
        starts = starts[:2]
    best = None
    for p1, p2 in starts:
        if first_converged_is_enough and best is not None and best[2]:
            break
        p1, p2 = _feasible_shape(tmpl, p1, p2)
        kept = 1.0 if mask is None else max(float(tmpl.background(p1, p2)[0][mask].sum()), 1e-3)
        nb0 = max(total / kept, 1.0)
        T = whitening(tmpl, nb0, p1, p2)
        cost = PoissonDeviance(tmpl, counts, 1.0, 0.0, (p1, p2), T, mask)
        cost.width_free = cost.signal_free = False
        start = (nb0, 0.0, 0.0, 0.0, float(tmpl.nodes[tmpl.n_bins]), 0.0, 0.0)
        if mask is None:
            # f sums to 1 over the window, so d(cost)/dN_b = 2 (1 - total / N_b): N_b-hat is the
            # number of events at every shape; only the shape is minimised
            x, fval, converged = _newton(cost, start, [A1, A2], np.full(2, -np.inf), np.full(2, np.inf))
        else:
            x, fval, converged = _newton(
                cost, start, [NB, A1, A2], np.array([0.0, -np.inf, -np.inf]), np.full(3, np.inf)
            )
        if best is None or fval < best[1]:
            best = (x, fval, converged, cost)
    x, fval, converged, cost = best
    p1, p2 = cost.shape_params(x[A1], x[A2])
    return BackgroundFit(
        background_yield=float(x[NB]), p1=float(p1), p2=float(p2), nll=0.5 * fval, converged=bool(converged)
    )


def background_fit_with_shape(tmpl, counts, p1: float, p2: float) -> BackgroundFit:
    """The background-only fit with the shape held at (p1, p2): N_b is the window's events (the shape
    is normalised over the window, so the yield that maximises the likelihood is the count), and
    ``nll`` is the deviance there over 2."""
    total = float(np.sum(counts))
    if total <= 0:
        raise ValueError("the histogram is empty: nothing to fit")
    cost = PoissonDeviance(tmpl, counts, 1.0, 0.0, (p1, p2), whitening(tmpl, total, p1, p2))
    cost.width_free = cost.signal_free = False
    fval = float(cost(total, 0.0, 0.0, 0.0, float(tmpl.nodes[tmpl.n_bins]), 0.0, 0.0))
    return BackgroundFit(background_yield=total, p1=float(p1), p2=float(p2), nll=0.5 * fval, converged=True)


def fit_background_only(edges, counts, sqrt_s_tev: float, mask=None) -> BackgroundFit:
    """Extended binned ML fit of the dijet function alone (no signal).

    Two starts (a weighted least-squares fit of ln n_i, and p1=8, p2=5); the one with
    the lower NLL is kept. `mask` (bool per bin): fit only those bins, e.g. the
    sidebands around a signal region.
    """
    edges, counts = as_counts(edges, counts)
    return fit_background_on_template(template(edges, sqrt_s_tev), counts, mask=mask)


def _default_max_width(edges):
    return 0.25 * float(edges[-1] - edges[0])


@dataclass
class Minimum:
    """A minimum of a ``PoissonDeviance``: what the fits read from it (Minuit-like names)."""

    values: np.ndarray  # all 7 parameters, in PARAMETER_NAMES order
    fval: float
    valid: bool
    fixed: dict  # name -> bool
    limits: dict  # name -> (lo, hi), +-inf where open
    errors: np.ndarray  # step sizes (Minuit's starting errors), for a fallback Hesse
    cost: "PoissonDeviance"
    start: np.ndarray  # the 7 parameters it was minimised from

    def hesse_errors(self):
        """Minuit's numerical Hesse at this minimum (the fallback of ``_parabolic_errors``)."""
        m = Minuit(self.cost, *self.values, grad=self.cost.grad, name=PARAMETER_NAMES)
        m.print_level = 0
        m.strategy = 0
        m.errors = self.errors
        for name in PARAMETER_NAMES:
            m.fixed[name] = self.fixed[name]
            lo, hi = self.limits[name]
            if np.isfinite(lo) or np.isfinite(hi):
                m.limits[name] = (lo if np.isfinite(lo) else None, hi if np.isfinite(hi) else None)
        m.hesse()
        return dict(zip(PARAMETER_NAMES, (float(e) for e in m.errors))), bool(m.valid)


def _minimize(cost, start, fixed, limits, errors, max_step=None, tol=1e-6, max_iter=100):
    """Minimise ``cost`` over the parameters not in ``fixed`` (names) within ``limits``
    (name -> (lo, hi), None for open) from ``start`` with ``_newton`` (``tol``, ``max_iter``)."""
    lims = {name: (-np.inf, np.inf) for name in PARAMETER_NAMES}
    for name, (lo, hi) in limits.items():
        lims[name] = (-np.inf if lo is None else float(lo), np.inf if hi is None else float(hi))
    free = [i for i, name in enumerate(PARAMETER_NAMES) if name not in fixed]
    lower = np.array([lims[PARAMETER_NAMES[i]][0] for i in free])
    upper = np.array([lims[PARAMETER_NAMES[i]][1] for i in free])
    start = np.clip(
        np.array(start, dtype=float), [lims[n][0] for n in PARAMETER_NAMES], [lims[n][1] for n in PARAMETER_NAMES]
    )
    steps = None if max_step is None else np.array([max_step.get(PARAMETER_NAMES[i], np.inf) for i in free])
    x, fval, converged = _newton(cost, start, free, lower, upper, max_iter=max_iter, tol=tol, max_step=steps)
    return Minimum(
        values=x,
        fval=fval,
        valid=converged,
        fixed={n: n in fixed for n in PARAMETER_NAMES},
        limits=lims,
        errors=np.asarray(errors, dtype=float),
        cost=cost,
        start=start,
    )


SHOWN_FIT_TOLERANCE = 1e-12
"""``_newton``'s tolerance (Newton decrement, deviance units) for polishing a fit whose values an agent
reads (``polished``): fits stop at 1e-6 (q0 to ~1e-6), but a fit along a
falling-shape wall converges only linearly, and one stopped at 1e-6 lies ~1e-4 of its errors from
its minimum, where the C library's last bits chose the fourth digit of a signal yield (59.64 or
59.65 events). The polish stops there, at its iteration cap, or where rounding leaves no descent."""
SHOWN_FIT_ITERATIONS = 400
"""``_newton``'s iterations for the polish: the linear convergence along a wall takes a few hundred."""


def fit_resonance_on_template(
    tmpl,
    counts,
    bkg: BackgroundFit,
    resolution_gev,
    mass_start_gev,
    *,
    mass_bounds_gev,
    fix_mass,
    max_width_gev,
    spurious_events,
    fix_signal_zero=False,
    fit_theta=True,
    signal_yield_min=None,
    width_start_gev=None,
    fit_background_shape=True,
    shape_after_signal=False,
):
    """Core s+b fit; returns the minimum (``Minimum``) and the cost. ``signal_yield_min``: a
    lower limit on N_s above the positivity floor (0 for a fit that seeks an excess only);
    ``width_start_gev``: the width to start from (default: half a resolution);
    ``fit_background_shape`` False holds the background's shape at ``bkg``'s (a1 = a2 = 0);
    ``shape_after_signal``: minimise with the shape held first, then with it free from there (the
    path to a minimum stays off the flat directions a poorly known shape opens, where which of two
    minima a start reached could turn on rounding: Z fits under ~100 background events)."""
    p_ref = (bkg.p1, bkg.p2)
    T = whitening(tmpl, bkg.background_yield, *p_ref)
    cost = PoissonDeviance(tmpl, counts, resolution_gev, spurious_events, p_ref, T)
    cost.width_free = not (max_width_gev <= 0.0)
    if mass_bounds_gev is None:
        lo, hi = float(tmpl.edges[0]), float(tmpl.edges[-1])
    else:
        lo, hi = sorted(map(float, mass_bounds_gev))
    mass0 = float(np.clip(mass_start_gev, lo, hi))
    width_fixed = max_width_gev <= 0.0
    width0 = 0.0 if width_fixed else min(0.5 * resolution_gev, 0.5 * max_width_gev)
    if width_start_gev is not None and not width_fixed:
        width0 = float(np.clip(width_start_gev, 0.0, max_width_gev))
    f_b, _, _ = tmpl.background(*p_ref)
    b_exp = bkg.background_yield * f_b
    s0, _, _ = tmpl.signal(mass0, width0, resolution_gev)
    # one Newton step from N_s = 0 for the signal-yield start
    ns0 = (
        0.0
        if fix_signal_zero
        else float(
            np.sum(s0 * (counts - b_exp) / np.maximum(b_exp, 1e-9))
            / max(np.sum(s0 * s0 / np.maximum(b_exp, 1e-9)), 1e-12)
        )
    )
    ns_err = float(np.sqrt(1.0 / max(np.sum(s0 * s0 / np.maximum(b_exp, 1e-9)), 1e-12)))
    m_range = (mass0, mass0) if fix_mass else (lo, hi)
    lower = _signal_yield_floor(tmpl, b_exp, resolution_gev, *m_range, width_fixed)
    if signal_yield_min is not None:
        lower = max(lower, float(signal_yield_min))
    ns0 = max(ns0, 0.5 * lower if lower < 0.0 else lower)
    nb0 = max(bkg.background_yield - ns0 * float(s0.sum()), 1.0)
    fixed = set()
    if fix_signal_zero:
        fixed.add("signal_yield")
    if fix_mass:
        fixed.add("mass_gev")
    if width_fixed:
        fixed.add("width_gev")
    if spurious_events <= 0.0 or not fit_theta:
        fixed.add("theta")
    if not fit_background_shape:
        fixed.update(("a1", "a2"))
    limits = {"background_yield": (0.0, None), "signal_yield": (lower, None)}
    if "theta" not in fixed and lower / spurious_events > -10.0:
        limits["theta"] = (lower / spurious_events, None)
    if not fix_mass:
        limits["mass_gev"] = (lo, hi)
    if not width_fixed:
        limits["width_gev"] = (0.0, float(max_width_gev))
    start = (nb0, 0.0, 0.0, ns0, mass0, width0, 0.0)
    errors = (max(np.sqrt(nb0), 1.0), 1.0, 1.0, ns_err, 0.5 * resolution_gev, 0.5 * resolution_gev, 1.0)
    # a fit stays with the peak it starts on: mass and width move at most one resolution a step
    steps = _shape_steps(resolution_gev)
    if shape_after_signal and "a1" not in fixed:
        # the signal first, under the background-only fit's shape; then the shape as well, from there
        signal_first = _minimize(cost, start, fixed | {"a1", "a2"}, limits, errors, max_step=steps)
        m = _minimize(cost, signal_first.values, fixed, limits, errors, max_step=steps)
        return dataclasses.replace(m, start=signal_first.start), cost
    return _minimize(cost, start, fixed, limits, errors, max_step=steps), cost


def _shape_steps(resolution_gev):
    """The largest step of mass and width a fit takes: one resolution (it stays with the peak it
    starts on)."""
    return {"mass_gev": resolution_gev, "width_gev": resolution_gev}


def polished(m: Minimum, resolution_gev) -> Minimum:
    """``m`` (a ``fit_resonance_on_template`` minimum) minimised on to ``SHOWN_FIT_TOLERANCE``, for a fit
    whose values are shown; its ``valid`` stays ``m``'s, whose tolerance is far above rounding."""
    fixed = {name for name, held in m.fixed.items() if held}
    closer = _minimize(
        m.cost,
        m.values,
        fixed,
        m.limits,
        m.errors,
        max_step=_shape_steps(resolution_gev),
        tol=SHOWN_FIT_TOLERANCE,
        max_iter=SHOWN_FIT_ITERATIONS,
    )
    return dataclasses.replace(closer, valid=m.valid) if closer.fval <= m.fval else m


SHAPE_FIT_MIN_EVENTS = 25
"""The fewest background events for which a signal fit floats the background's shape with the
signal. Where the window holds fewer events, or the fit leaves fewer to the background (a signal
that takes nearly all of them), a fit given the channel's simulated shape (``background_shape``)
holds the shape there and fits only the background's yield: a search's background from simulation
where the data are too few to set it. A two-parameter falling shape under a handful of events is
not determined by them, and a fit that floats it drifts along the flat directions (a whitened shape
parameter at 800 of its units under one background event) to wherever the C library's last bits
stopped it, or into another minimum. (The background-only fit's own shape is no stand-in: over a
sparse window it bends over the signal's events and takes them from the signal.)"""

MINIMA_TIE_DEVIANCE = 1e-6
"""Minima from several starts whose deviances (twice -ln L) lie within this of the lowest are
equal, and the first start's is kept: the fits stop at a Newton decrement of 1e-6 (``_newton``),
so smaller differences say where a minimisation stopped, not which minimum is lower."""


def _held_where_idle(m: Minimum, default: Minimum, shape_free_of_data) -> Minimum:
    """``m``, or where the data do not constrain the signal's mass and width (``shape_free_of_data``,
    from ``shape_unconstrained``: with no signal to speak of the likelihood is flat in them, and a
    minimisation leaves them where rounding did) the fit with them held at the first start's values
    (which the spectrum and the hint fix), minimised from that start (``default.start``)."""
    if not shape_free_of_data:
        return m
    fixed = {name for name, held in m.fixed.items() if held} | set(shape_free_of_data)
    return _minimize(m.cost, default.start, fixed, m.limits, m.errors, max_step=_shape_steps(m.cost.sigma))


def _signal_yield_floor(tmpl, b_exp, resolution_gev, m_lo, m_hi, width_fixed):
    """Lower limit on N_s that keeps every bin expectation positive, with margin.

    N_s >= -0.5 min_i b_i / s_i^max, with s_i^max an upper bound of the signal fraction
    in bin i over the allowed masses and widths: for a Gaussian (width 0) the density
    at the bin's closest approach to the mass range; for a Voigt, its peak density
    1/(sigma sqrt(2 pi)), which bounds every Voigt of that sigma. The factor 0.5 leaves
    room for the background to move in the fit; the cost's barrier guards the rest.
    Deficits deeper than this are pinned at the limit (then mu-hat < 0 and q0 = 0).
    """
    sigma = max(float(resolution_gev), 1e-6)
    lo_e, hi_e = tmpl.edges[:-1], tmpl.edges[1:]
    if width_fixed:
        dist = np.maximum.reduce([lo_e - m_hi, m_lo - hi_e, np.zeros_like(lo_e)])
        s_max = np.minimum(1.0, (hi_e - lo_e) * portable.exp(-0.5 * (dist / sigma) ** 2) / (sigma * _SQRT2PI))
    else:
        s_max = np.minimum(1.0, (hi_e - lo_e) / (sigma * _SQRT2PI))
    return -0.5 * float(np.min(b_exp / np.maximum(s_max, 1e-300)))


def width_starts(resolution_gev: float, max_width_gev: float) -> list:
    """The widths [GeV] a fit with a floating width starts from, in order: its default (None: half a
    resolution), 0, one and three resolutions, a quarter of its range. The likelihood in (mass,
    width) can have several minima (a narrow peak or a wide one over the same events); from one
    start, which a fit reached could turn on the C library's last bits (a held-out fit ended at
    -ln L 40.906 with width 0 under one libm, 40.142 with 0.72 GeV under another; from these
    starts both keep 40.142)."""
    return [None, 0.0, resolution_gev, 3.0 * resolution_gev, 0.25 * max_width_gev]


def fit_signal_plus_background(
    edges,
    counts,
    sqrt_s_tev: float,
    resolution_gev: float,
    mass_start_gev: float,
    *,
    mass_bounds_gev: tuple[float, float] | None = None,
    fix_mass_gev: float | None = None,
    max_width_gev: float | None = None,
    spurious_signal_events: float = 0.0,
    background: BackgroundFit | None = None,
    background_shape: tuple[float, float] | None = None,
) -> ResonanceFit:
    """Extended binned ML fit of background + Voigt signal (resolution fixed).

    Mass floats in ``mass_bounds_gev`` (default: the fit window) unless ``fix_mass_gev``
    is given. Width floats in [0, max_width_gev]; ``max_width_gev=None`` means a quarter
    of the window, ``0`` fixes a narrow (resolution-dominated) resonance; a floating width is
    fitted from several starts (``width_starts``) and the lowest minimum kept. Under fewer than
    ``SHAPE_FIT_MIN_EVENTS`` background events the background's shape is held at
    ``background_shape`` (p1, p2: the channel's simulated shape) where one is given; a mass and width
    the data do not constrain, at the first start's values (``_held_where_idle``). Errors are
    from the exact Hessian (observed information; ``_parabolic_errors``); the mass's and
    width's are infinite where the signal lowers the deviance by less than 1 below the
    background-only fit (``shape_unconstrained``; with the shape held, the one with that shape).
    ``background``: a background-only fit of the same histogram (`fit_background_only`) to start
    from and compare with, to save refitting it.
    """
    edges, counts = as_counts(edges, counts)
    tmpl = template(edges, sqrt_s_tev)
    bkg = background if background is not None else fit_background_on_template(tmpl, counts)
    max_w = _default_max_width(edges) if max_width_gev is None else float(max_width_gev)
    fix_mass = fix_mass_gev is not None

    def fit(width_start_gev, fit_shape, reference):
        return fit_resonance_on_template(
            tmpl,
            counts,
            reference,
            float(resolution_gev),
            float(fix_mass_gev) if fix_mass else float(mass_start_gev),
            mass_bounds_gev=mass_bounds_gev,
            fix_mass=fix_mass,
            max_width_gev=max_w,
            spurious_events=float(spurious_signal_events),
            width_start_gev=width_start_gev,
            fit_background_shape=fit_shape,
            shape_after_signal=True,
        )[0]

    def lowest(fit_shape, reference):
        """The lowest minimum over the width starts (the first of equals), and the first start's."""
        starts = width_starts(float(resolution_gev), max_w) if max_w > 0.0 else [None]
        minima = [fit(start, fit_shape, reference) for start in starts]
        best = min(minimum.fval for minimum in minima)
        return next(x for x in minima if x.fval <= best + MINIMA_TIE_DEVIANCE), minima[0]

    held = None if background_shape is None else background_fit_with_shape(tmpl, counts, *background_shape)
    fit_shape = held is None or float(np.sum(counts)) >= SHAPE_FIT_MIN_EVENTS
    reference = bkg if fit_shape else held
    m, first = lowest(fit_shape, reference)
    if fit_shape and held is not None:
        # decided on the minimum the shown fit would be: a start can stop where the deviance is
        # flat (a saddle), on either side of the threshold as the last bits fall, and the polish
        # goes on from there to the minimum
        m = polished(m, float(resolution_gev))
        if m.values[NB] < SHAPE_FIT_MIN_EVENTS:
            reference = held  # too little background left to fit its shape
            m, first = lowest(False, reference)
    free_of_data = shape_unconstrained(m, reference)
    m = polished(_held_where_idle(m, first, free_of_data), float(resolution_gev))
    cost = m.cost
    return _resonance_result(m, cost, tmpl.n_bins, _parabolic_errors(m, cost, free_of_data), free_of_data)


def _at_limit(value, lo, hi, rel=1e-5):
    """Within `rel` of the range (of the value's size, for an open range) of a limit."""
    scale = (hi - lo) if np.isfinite(hi - lo) else max(abs(value), 1.0)
    return min(value - lo, hi - value) <= rel * scale


def _along_walls(cost, values, free):
    """Orthonormal columns (over ``free``) spanning the directions that keep the point on every
    falling-shape wall it is on (``PoissonDeviance.wall_constraint``, within ``WALL_TOL``, as
    ``_newton`` holds it): the null space of those walls' gradient rows C, from the eigenvectors of
    the projector I - C^T (C C^T)^+ C; the identity where the point is on no wall."""
    slope, normals = cost.wall_constraint(values, free)
    rows = normals[(slope <= WALL_TOL) & np.any(normals != 0.0, axis=1)]
    if rows.size == 0:
        return np.eye(len(free))
    projector = np.eye(len(free)) - portable.matmul(
        portable.matmul(rows.T, portable.pinv(portable.matmul(rows, rows.T))), rows
    )
    eigenvalues, vectors = portable.eigh(np.ascontiguousarray(0.5 * (projector + projector.T)))
    return np.ascontiguousarray(vectors[:, eigenvalues > 0.5])


def _parabolic_errors(m, cost, hold=frozenset()):
    """Parabolic errors at the minimum from the exact Hessian H of the cost
    (``PoissonDeviance.hess``; H / 2 is the observed information, the deviance being twice
    -ln L with errordef 1): the covariance is 2 H^-1 over the free parameters, which is
    what Minuit's Hesse estimates by finite differences.

    A parameter at one of its limits (there, or the minimum of the quadratic model lies
    beyond it) is held there, as Minuit's Hesse effectively does (its internal coordinate
    is flat at a limit): the others get their errors at that value (e.g. a width at 0 does
    not inflate the signal yield's error); its own error is sqrt(2 / H_jj). So are the
    parameters named in ``hold`` (those the data do not constrain, ``shape_unconstrained``).
    A falling-shape wall the minimum is on is held too: the covariance is that of the quadratic
    model restricted to the wall, 2 Z (Z^T H Z)^-1 Z^T with Z spanning the directions along it
    (``_along_walls``; where H is positive definite this is 2 [H^-1 - H^-1 c (c^T H^-1 c)^-1
    c^T H^-1] for the wall's normal c). It depends neither on the wall penalty's curvature (a
    multiple of c c^T, present or not at the wall as the slope rounds to one side of 0: on a Z
    fit that flipped the signal yield's error between 101 and 116 events) nor on H's curvature
    across the wall, which at a minimum the wall holds can be negative (a four-lepton fit whose
    H had an eigenvalue of -1.4e-4 fell back to numerical derivatives, whose errors changed by
    40% with the C library's last bits). They are taken where the minimisation stopped, converged
    or not (``ResonanceFit.converged`` says which). Where Z^T H Z is not positive definite on the
    rest, Minuit's numerical Hesse is used instead."""
    errors = dict(zip(PARAMETER_NAMES, (float(e) for e in m.errors)))
    values = np.array(m.values, dtype=float)
    _, grad, h_full = cost.value_grad_hess(*values)
    free = [i for i, name in enumerate(PARAMETER_NAMES) if not m.fixed[name]]
    held = [i for i in free if PARAMETER_NAMES[i] in hold or _at_limit(values[i], *m.limits[PARAMETER_NAMES[i]])]
    free = [i for i in free if i not in held]
    cov = None
    while free:
        along = _along_walls(cost, values, free)
        reduced = portable.matmul(portable.matmul(along.T, h_full[np.ix_(free, free)]), along)
        try:
            portable.cholesky(reduced)
        except np.linalg.LinAlgError:
            break
        h_inv = portable.matmul(portable.matmul(along, portable.inv(reduced)), along.T)
        newton = values[free] - portable.matvec(h_inv, grad[free])
        beyond = [
            i
            for i, x in zip(free, newton)
            if not m.limits[PARAMETER_NAMES[i]][0] <= x <= m.limits[PARAMETER_NAMES[i]][1]
        ]
        if not beyond:
            cov = 2.0 * h_inv
            # a shape parameter the walls pin (both edges on the wall: the flat shape) has no
            # variance left: its own error, as a held parameter's
            own = 2.0 / np.maximum(np.diag(h_full)[free], 1e-300)
            pinned = np.diag(cov) <= 1e-9 * own
            held += [i for i, pin in zip(free, pinned) if pin]
            free, cov = [i for i, pin in zip(free, pinned) if not pin], cov[np.ix_(~pinned, ~pinned)]
            break
        held += beyond
        free = [i for i in free if i not in beyond]
    if cov is None or not (np.all(np.isfinite(cov)) and np.all(np.diag(cov) > 0)):
        return m.hesse_errors()[0]
    errors.update({PARAMETER_NAMES[i]: float(np.sqrt(cov[k, k])) for k, i in enumerate(free)})
    for i in held:
        errors[PARAMETER_NAMES[i]] = float(np.sqrt(2.0 / max(h_full[i, i], 1e-300)))
    return errors


SIGNAL_DEVIANCE_FOR_SHAPE = 1.0
"""The least fall in the deviance (twice -ln L) from the background-only fit to the signal fit for
which the signal's mass and width have an error: the change of one unit that bounds a parameter's
68% interval. Below it, every mass in the window (and every width) fits within one unit of the best,
since a signal yield of 0 does not depend on them: no interval exists, and the Hessian's curvature
in them (proportional to the signal yield) is rounding noise."""


def shape_unconstrained(m, background: BackgroundFit) -> set:
    """The signal's free shape parameters (mass, width) the data do not constrain: all of them when
    the signal fit lowers the deviance by less than ``SIGNAL_DEVIANCE_FOR_SHAPE`` below the
    background-only fit ``background`` of the same spectrum."""
    if 2.0 * background.nll - float(m.fval) >= SIGNAL_DEVIANCE_FOR_SHAPE:
        return set()
    return {name for name in ("mass_gev", "width_gev") if not m.fixed[name]}


def unconstrained(m, cost, errs) -> set:
    """The shown parameters (mass, width, signal yield) whose parabolic error ``errs`` is not
    finite or exceeds the span of values the fit allows them (the mass window, the width's range,
    the signal yield from its floor to every event of the spectrum): the inverse of a curvature
    that is rounding noise, whose digits would change with the processor's C library."""
    events = max(float(np.sum(cost.n)), 1.0)
    found = set()
    for name in ("mass_gev", "width_gev", "signal_yield"):
        if m.fixed[name]:
            continue
        lo, hi = m.limits[name]
        if name == "signal_yield":
            hi = events
        error = float(errs[name])
        if not np.isfinite(error) or error > hi - lo:
            found.add(name)
    return found


def _resonance_result(m, cost, n_bins, errs, free_of_data=frozenset()) -> ResonanceFit:
    """The fit as shown: an error is infinite for a parameter in ``free_of_data`` or
    ``unconstrained``, 0 for a fixed one."""
    par = tuple(float(v) for v in m.values)
    dev, _ = cost.deviance_terms(par)
    n_free = sum(1 for name in PARAMETER_NAMES if not m.fixed[name] and name != "theta")
    ndof = max(int(n_bins - n_free), 1)
    free_of_data = set(free_of_data) | unconstrained(m, cost, errs)

    def err(name):
        if name in free_of_data:
            return math.inf
        return 0.0 if m.fixed[name] else float(errs[name])

    return ResonanceFit(
        mass_gev=par[M],
        mass_err_gev=err("mass_gev"),
        width_gev=par[W],
        width_err_gev=err("width_gev"),
        signal_yield=par[NS],
        signal_yield_err=err("signal_yield"),
        background_yield=par[NB],
        p1=float(cost.shape_params(par[A1], par[A2])[0]),
        p2=float(cost.shape_params(par[A1], par[A2])[1]),
        nll=0.5 * float(m.fval),
        chi2=float(dev),
        ndof=ndof,
        fit_p_value=float(chdtrc(ndof, dev)),  # chi2 survival function (scipy.stats.chi2.sf)
        converged=bool(m.valid),
    )
