"""Extended binned maximum-likelihood fits of a resonance on a smooth background.

Model (expected events in bin i)::

    mu_i = N_b * f_i(p1, p2) + (N_s + theta * S_spur) * s_i(m, Gamma, sigma)

f_i: dijet shape (shapes.background_density) normalised to 1 over the fit window, so
N_b is the background yield *in the window*; s_i: Voigt bin fractions
(shapes.signal_bin_fractions, Simpson on each bin), so N_s is the *total* signal
yield (tails leaving the window included). The detector resolution sigma is fixed.

Likelihood: extended binned Poisson likelihood (Barlow, NIM A297 (1990) 496). The
cost minimised is the Poisson deviance of Baker & Cousins, NIM 221 (1984) 437,
``D = 2 sum_i [mu_i - n_i + n_i ln(n_i / mu_i)]`` -- identical to
``iminuit.cost.ExtendedBinnedNLL`` with a scaled cdf (a test checks this) -- so
``nll = D / 2`` is -ln L relative to the saturated model and differences of ``nll``
between fits of the same data are exact log-likelihood ratios.

We evaluate the deviance ourselves (with analytic gradients, for speed) instead of
handing the model to ExtendedBinnedNLL because that class clips negative bin
predictions to zero and treats ln(0) as 0, which would let a negative signal yield
dig holes below zero at no cost. Here the signal yield may go negative (CCGV 2011
treat mu-hat as Gaussian, unbounded, in eq. 12; an unbiased, Gaussian mu-hat around 0
is what makes q0 half-chi2 distributed), but only down to a floor at half the
physical boundary (where some bin expectation would reach zero; see
``_signal_yield_floor``), with a steep barrier in the cost as a safety net. Only the
sign of mu-hat enters q0, so pinning a deep deficit at the floor is harmless.

Binning caveat: bin integrals use Simpson's rule per bin (shapes.integrate_bins),
good to ~2e-4 at resolution = 1.6 bin widths, 1e-3 at 1 bin width, 1 % at 1/2.
Generator and fit share it, so fits are unbiased either way, but keep bins <~ sigma.

Spurious-signal systematic (ATLAS H->gamma gamma, Phys. Lett. B 716 (2012) 1): nuisance
theta ~ N(0, 1) adds theta * S_spur signal-shaped events; the constraint adds
theta^2 / 2 to the NLL (theta^2 to the deviance).

Minimisation: Newton's method on the exact gradient and Hessian of the deviance
(``_newton``), with a line search on the deviance itself and bounds held by an active
set. It reaches Migrad's minimum (a test fits the same data with a plain iminuit
``ExtendedBinnedNLL`` fit) in a handful of iterations instead of Migrad's tens of
function calls, and the exact Hessian gives the parameter errors (Minuit's numerical
Hesse is the fallback where it is not positive definite).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from iminuit import Minuit
from scipy.special import chdtrc, wofz

_SQRT2 = float(np.sqrt(2.0))
_SQRT2PI = float(np.sqrt(2.0 * np.pi))
_TWO_I_OVER_SQRTPI = 2j / float(np.sqrt(np.pi))
_BARRIER = 1e9  # deviance returned (plus violation) when a bin expectation is <= 0
# The backgrounds modelled here (Drell-Yan, γγ and ZZ* continua, QCD dijets) fall with
# mass. Without that constraint a fit to a few events (or to a huge peak) bends the
# "background" into the signal. The log-log slope -dln f/dln m = p2 + p1·x/(1-x) is
# monotone in x, so requiring it >= 0 at both window edges keeps the dijet function
# falling over the whole window (without constraining p1 and p2 separately, which are
# nearly degenerate over a narrow window). A hard constraint: ``_newton`` cuts a step where
# it would reach the wall and holds the constraint there (starts are moved inside,
# ``_feasible_shape``). The quadratic penalty below only acts outside the wall, to lead a
# start given from outside back in.
_SHAPE_PENALTY = 1e2
_WALL_TOL = 1e-9  # a log-log slope this close to 0 is on the wall

# parameter order used by the internal cost
_NAMES = ("background_yield", "a1", "a2", "signal_yield", "mass_gev", "width_gev", "theta")
_NB, _A1, _A2, _NS, _M, _W, _TH = range(7)


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
    ``signal_yield_err`` includes the spurious-signal term in quadrature when it is on.
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


class BinnedTemplate:
    """Per-binning precomputation of the model ingredients.

    Simpson nodes are shared by neighbouring bins (2n+1 points instead of 3n) and the
    rule is applied as one matrix product; the numbers agree with
    shapes.background_bin_fractions / shapes.signal_bin_fractions to rounding (tested).
    """

    def __init__(self, edges: np.ndarray, sqrt_s_tev: float):
        edges = np.asarray(edges, dtype=float)
        if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
            raise ValueError("edges must be a strictly increasing 1-d array")
        n = edges.size - 1
        nodes = np.empty(2 * n + 1)
        nodes[0::2] = edges
        nodes[1::2] = 0.5 * (edges[:-1] + edges[1:])
        w6 = np.diff(edges) / 6.0
        self.edges = edges
        self.n_bins = n
        self.nodes = nodes
        self.w6 = w6
        x = np.clip(nodes / (1000.0 * sqrt_s_tev), 1e-9, 1.0 - 1e-9)  # same clip as shapes
        self.log_1mx = np.log1p(-x)
        self.log_x = np.log(x)
        self._logs = np.vstack([np.ones_like(x), self.log_1mx, -self.log_x])
        l1, l2 = self.log_1mx, -self.log_x  # exp(phi) times these: d/dp1, d/dp2 and second derivatives
        self._logs2 = np.vstack([np.ones_like(x), l1, l2, l1 * l1, l1 * l2, l2 * l2])
        edge_x = x[[0, -1]]
        # rows: window edges; columns: d(slope)/d(p1, p2) with slope = p2 + p1·x/(1-x)
        self.slope_matrix = np.stack([edge_x / (1.0 - edge_x), np.ones(2)], axis=1)

    def simpson(self, values: np.ndarray) -> np.ndarray:
        """Bin integrals from values at the nodes (last axis): strided sums, O(n)."""
        return self.w6 * (values[..., 0:-1:2] + 4.0 * values[..., 1::2] + values[..., 2::2])

    def background(self, p1: float, p2: float, grad: bool = False):
        """Normalised background fractions f_i and (if grad) df/dp1, df/dp2."""
        phi = p1 * self.log_1mx - p2 * self.log_x
        e = np.exp(phi - phi.max())
        if not grad:
            b = self.simpson(e)
            return b / b.sum(), None, None
        b, b1, b2 = self.simpson(self._logs * e)
        total = b.sum()
        f = b / total
        return f, (b1 - f * b1.sum()) / total, (b2 - f * b2.sum()) / total

    def signal(self, mass_gev: float, width_gev: float, resolution_gev: float, grad: bool = False,
               width_grad: bool = True):
        """Voigt bin fractions s_i and (if grad) ds/dmass, ds/dwidth.

        Voigt = Re w(z) / (sigma sqrt(2 pi)), z = (m - m0 + i Gamma/2) / (sigma sqrt 2),
        with w the Faddeeva function; w'(z) = -2 z w(z) + 2i/sqrt(pi) gives the
        derivatives analytically. Gamma = 0 (and no width derivative wanted) takes the
        pure Gaussian path, which is the same function, faster.
        """
        sigma = max(float(resolution_gev), 1e-6)
        u = self.nodes - mass_gev
        if width_gev <= 0.0 and not (grad and width_grad):
            g = np.exp(-0.5 * (u / sigma) ** 2) * (1.0 / (sigma * _SQRT2PI))
            if not grad:
                return self.simpson(g), None, None
            s, ds_dm = self.simpson(np.vstack([g, g * u * (1.0 / sigma**2)]))
            return s, ds_dm, None
        z = (u + 0.5j * max(float(width_gev), 0.0)) * (1.0 / (sigma * _SQRT2))
        w = wofz(z)
        if not grad:
            return self.simpson(w.real) * (1.0 / (sigma * _SQRT2PI)), None, None
        wp = -2.0 * z * w + _TWO_I_OVER_SQRTPI
        scale = 1.0 / (sigma * _SQRT2 * sigma * _SQRT2PI)
        s, ds_dm, ds_dw = self.simpson(np.vstack([w.real * (1.0 / (sigma * _SQRT2PI)), -wp.real * scale,
                                                  -0.5 * scale * wp.imag]))
        return s, ds_dm, ds_dw

    def background_hessian(self, p1: float, p2: float) -> np.ndarray:
        """Rows f_i, df/dp1, df/dp2, d2f/dp1^2, d2f/dp1dp2, d2f/dp2^2: a (6, n_bins) array.

        f = b / B with b_i the bin integrals of exp(phi), phi = p1 ln(1-x) - p2 ln x, and
        B = sum_i b_i; derivatives of exp(phi) bring down L1 = ln(1-x) and L2 = -ln x."""
        phi = p1 * self.log_1mx - p2 * self.log_x
        e = np.exp(phi - phi.max())
        bins = self.simpson(self._logs2 * e)
        total, s1, s2, s11, s12, s22 = bins.sum(axis=1)
        out = bins / total
        f, f1, f2 = out[0], out[1], out[2]
        f1 -= f * (s1 / total)
        f2 -= f * (s2 / total)
        out[3] -= (2.0 * s1 / total) * f1 + (s11 / total) * f
        out[4] -= (s1 / total) * f2 + (s2 / total) * f1 + (s12 / total) * f
        out[5] -= (2.0 * s2 / total) * f2 + (s22 / total) * f
        return out

    def signal_hessian(self, mass_gev: float, width_gev: float, resolution_gev: float,
                       width_free: bool = True) -> np.ndarray:
        """Rows s_i, ds/dmass, ds/dwidth, d2s/dmass^2, d2s/dmass dwidth, d2s/dwidth^2: (6, n_bins).

        With w'' = -2 w - 2 z w' (from w' = -2 z w + 2i/sqrt(pi)) and dz/dmass = -1/(sigma sqrt 2),
        dz/dGamma = i/(2 sigma sqrt 2). A fixed zero width takes the Gaussian path (width
        derivatives 0)."""
        sigma = max(float(resolution_gev), 1e-6)
        u = self.nodes - mass_gev
        norm = 1.0 / (sigma * _SQRT2PI)
        if width_gev <= 0.0 and not width_free:
            g = np.exp(-0.5 * (u / sigma) ** 2) * norm
            v = u * (1.0 / sigma**2)
            gv = g * v
            rows = np.zeros((6, u.size))
            rows[0], rows[1], rows[3] = g, gv, gv * v - g * (1.0 / sigma**2)
            return self.simpson(rows)
        z = (u + 0.5j * max(float(width_gev), 0.0)) * (1.0 / (sigma * _SQRT2))
        w = wofz(z)
        wp = -2.0 * z * w + _TWO_I_OVER_SQRTPI
        wpp = -2.0 * w - 2.0 * z * wp
        c1 = norm / (sigma * _SQRT2)
        c2 = norm / (sigma * sigma)
        return self.simpson(np.vstack([w.real * norm, -wp.real * c1, -0.5 * wp.imag * c1,
                                       0.5 * wpp.real * c2, 0.25 * wpp.imag * c2, -0.125 * wpp.real * c2]))


def _template(edges: np.ndarray, sqrt_s_tev: float) -> BinnedTemplate:
    """``BinnedTemplate(edges, sqrt_s_tev)``, shared: the scan, the fits and the significance of
    one spectrum use the same binning (a few recent ones are kept; their arrays are read-only)."""
    return _cached_template(np.asarray(edges, dtype=float).tobytes(), float(sqrt_s_tev))


@lru_cache(maxsize=16)
def _cached_template(edges_bytes: bytes, sqrt_s_tev: float) -> BinnedTemplate:
    tmpl = BinnedTemplate(np.frombuffer(edges_bytes, dtype=float).copy(), sqrt_s_tev)
    for value in vars(tmpl).values():
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
    return tmpl


class _Deviance:
    """Poisson deviance + theta^2 with analytic gradient and Hessian (errordef 1 for Minuit).

    The background shape parameters are fitted in whitened coordinates (a1, a2):
    p = p_ref + T a, with T from the Fisher information of the shape at p_ref. (p1, p2)
    are ~99.9 % correlated over a narrow window; whitening keeps the problem well
    conditioned.
    """

    errordef = Minuit.LEAST_SQUARES

    def __init__(self, tmpl, counts, resolution_gev, spurious_events, p_ref, transform, mask=None):
        self.t = tmpl
        # bins outside `mask` (a sideband fit's signal region) do not enter the likelihood
        self.mask = np.ones(counts.size, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        counts = np.where(self.mask, counts, 0.0)
        self.n = counts
        nlogn = np.where(counts > 0, counts * np.log(np.where(counts > 0, counts, 1.0)), 0.0)
        self.const = float(np.sum(nlogn - counts))  # deviance = 2 (sum mu - n.ln mu + const)
        self.pos = counts > 0
        self.n_pos = counts[self.pos]
        self.sigma = float(resolution_gev)
        self.spur = float(spurious_events)
        self.p_ref = np.asarray(p_ref, dtype=float)
        self.T = np.asarray(transform, dtype=float)
        self.width_free = True
        self.signal_free = True  # False: background-only fit (hess skips the signal terms)
        self.mask_float = self.mask.astype(float)
        self._all_bins = bool(self.mask.all())
        self._slope_rows = tuple(tuple(float(c) for c in row) for row in tmpl.slope_matrix)
        self.wall = tmpl.slope_matrix @ self.T  # d(slope at the window edges)/d(a1, a2)
        self._key_b = self._key_s = None

    def shape_params(self, a1, a2):
        t = self.T
        return (self.p_ref[0] + t[0, 0] * a1 + t[0, 1] * a2,
                self.p_ref[1] + t[1, 0] * a1 + t[1, 1] * a2)

    def _components(self, par, grad):
        # cache: Migrad often moves only some parameters, and in the background-only
        # fit the signal shape never changes
        _, a1, a2, _, m, w, _ = par
        key_b, key_s = (a1, a2, grad), (m, w, grad)
        if key_b != self._key_b:
            self._bkg = self.t.background(*self.shape_params(a1, a2), grad)
            self._key_b = key_b
        if key_s != self._key_s:
            self._sig = self.t.signal(m, w, self.sigma, grad, self.width_free)
            self._key_s = key_s
        return self._bkg, self._sig

    def expected(self, par, grad=False):
        nb, _, _, ns, _, _, th = par
        (f, df1, df2), (s, ds_m, ds_w) = self._components(par, grad)
        amp = ns + th * self.spur
        mu = nb * f + amp * s
        if not grad:
            return mu, None
        t = self.T
        jac = np.empty((7, mu.size))
        jac[_NB] = f
        jac[_A1] = nb * (t[0, 0] * df1 + t[1, 0] * df2)
        jac[_A2] = nb * (t[0, 1] * df1 + t[1, 1] * df2)
        jac[_NS] = s
        jac[_M] = amp * ds_m
        jac[_W] = 0.0 if ds_w is None else amp * ds_w
        jac[_TH] = self.spur * s
        return mu, jac

    def _deviance(self, mu, th):
        # mu < 0 anywhere, or mu = 0 in a bin with events, is outside the model: barrier
        total = float(mu.sum()) if self._all_bins else float(mu[self.mask].sum())
        if mu.min() > 0.0:  # the usual case: every bin (with or without events) has mu > 0
            return 2.0 * (total - float(self.n @ np.log(mu)) + self.const) + th * th
        mu_pos = mu[self.pos]
        if mu.min() < 0.0 or (mu_pos.size and mu_pos.min() <= 0.0):
            return _BARRIER * (1.0 + float(np.sum(np.clip(-mu, 0.0, None))))
        return 2.0 * (total - float(self.n_pos @ np.log(mu_pos)) + self.const) + th * th

    def _negative_slope(self, par):
        """Negative parts of the log-log slope at the two window edges."""
        return np.minimum(self.t.slope_matrix @ np.array(self.shape_params(par[_A1], par[_A2])), 0.0)

    def wall_constraint(self, par, free):
        """For ``_newton``: the log-log slopes at the two window edges (>= 0 inside the wall) and
        their gradients with respect to the parameters ``free``: ((2,), (2, len(free)))."""
        slope = self.t.slope_matrix @ np.array(self.shape_params(par[_A1], par[_A2]))
        rows = np.zeros((2, 7))
        rows[:, _A1:_A2 + 1] = self.wall
        return slope, rows[:, free]

    def __call__(self, *par):
        mu, _ = self.expected(par)
        p1, p2 = self.shape_params(par[_A1], par[_A2])
        (c10, c11), (c20, c21) = self._slope_rows
        wall = min(c10 * p1 + c11 * p2, 0.0) ** 2 + min(c20 * p1 + c21 * p2, 0.0) ** 2
        return self._deviance(mu, par[_TH]) + _SHAPE_PENALTY * wall

    def grad(self, *par):
        mu, jac = self.expected(par, grad=True)
        r = self.mask.astype(float)
        r[self.pos] -= self.n_pos / np.maximum(mu[self.pos], 1e-300)
        g = 2.0 * (jac @ r)
        g[_TH] += 2.0 * par[_TH]
        g[[_A1, _A2]] += 2.0 * _SHAPE_PENALTY * (self.T.T @ (self.t.slope_matrix.T @ self._negative_slope(par)))
        return g

    def value_grad_hess(self, *par):
        """(cost, gradient, exact Hessian) at ``par``, from one evaluation of the model and its
        first and second derivatives (for the Newton minimiser, ``_newton``).

        Hessian: 2 [J diag(n/mu^2) J^T + sum_i r_i d2mu_i], r_i = 1 - n_i/mu_i, plus the
        theta constraint and the shape wall; H / 2 is the observed information. The cost and
        gradient are those of ``__call__`` and ``grad``. Outside the model (some mu <= 0)
        the cost is the barrier and the derivatives are NaN."""
        nb, a1, a2, ns, m, w, th = par
        t = self.T
        bkg = self.t.background_hessian(*self.shape_params(a1, a2))
        f = bkg[0]
        amp = ns + th * self.spur
        if self.signal_free:
            sig = self.t.signal_hessian(m, w, self.sigma, self.width_free)
            mu = nb * f + amp * sig[0]
        else:  # background-only: no signal (N_s = theta = 0, fixed)
            sig = None
            mu = nb * f
        negative = self._negative_slope(par)
        value = self._deviance(mu, th) + _SHAPE_PENALTY * float(negative @ negative)
        if value >= _BARRIER:
            return value, np.full(7, np.nan), np.full((7, 7), np.nan)
        f_a = t.T @ bkg[1:3]  # df/da1, df/da2
        jac = np.zeros((7, f.size))
        jac[_NB] = f
        jac[_A1:_A2 + 1] = nb * f_a
        if sig is not None:
            jac[_NS] = sig[0]
            jac[_M:_W + 1] = amp * sig[1:3]
            jac[_TH] = self.spur * sig[0]
        mu = np.maximum(mu, 1e-100)  # where mu ~ 0 (no events there) the terms below vanish; no overflow
        n_over_mu = self.n / mu
        r = self.mask_float - n_over_mu
        grad = 2.0 * (jac @ r)
        grad[_TH] += 2.0 * th
        grad[_A1:_A2 + 1] += 2.0 * _SHAPE_PENALTY * (self.wall.T @ negative)
        hess = (jac * (n_over_mu / mu)) @ jac.T
        curv = np.zeros((7, 7))  # sum_i r_i d2mu_i / dpar dpar, upper triangle
        r_b = bkg[1:] @ r  # r.f1, r.f2, r.f11, r.f12, r.f22
        curv[_NB, _A1:_A2 + 1] = t.T @ r_b[:2]
        curv[_A1:_A2 + 1, _A1:_A2 + 1] = (0.5 * nb) * (t.T @ np.array([[r_b[2], r_b[3]], [r_b[3], r_b[4]]]) @ t)
        if sig is not None:
            r_s = sig[1:] @ r  # r.s_m, r.s_w, r.s_mm, r.s_mw, r.s_ww
            curv[_NS, _M:_W + 1] = r_s[:2]
            curv[_TH, _M:_W + 1] = self.spur * r_s[:2]
            curv[_M, _M], curv[_M, _W], curv[_W, _W] = 0.5 * amp * r_s[2], amp * r_s[3], 0.5 * amp * r_s[4]
        hess += curv + curv.T
        hess *= 2.0
        hess[_TH, _TH] += 2.0
        if negative.any():
            active = (negative < 0.0).astype(float)
            hess[_A1:_A2 + 1, _A1:_A2 + 1] += 2.0 * _SHAPE_PENALTY * (self.wall.T * active) @ self.wall
        return value, grad, hess

    def hess(self, *par):
        """Exact Hessian of the cost (deviance units; see ``value_grad_hess``). Not named
        ``hessian``, which iminuit would pick up (for the fallback Hesse)."""
        return self.value_grad_hess(*par)[2]

    def deviance_terms(self, par):
        """(Poisson deviance without the constraint, constraint term)."""
        mu, _ = self.expected(par)
        return self._deviance(mu, 0.0), par[_TH] ** 2


def _whitening(tmpl, nb, p1, p2):
    """T with T^T I T = 1, I = Fisher information of (p1, p2) for nb events (read-only;
    the fits of one spectrum share its background fit's)."""
    return _cached_whitening(tmpl, float(nb), float(p1), float(p2))


@lru_cache(maxsize=16)
def _cached_whitening(tmpl, nb, p1, p2):
    transform = _whitening_matrix(tmpl, nb, p1, p2)
    transform.setflags(write=False)
    return transform


def _whitening_matrix(tmpl, nb, p1, p2):
    f, df1, df2 = tmpl.background(p1, p2, grad=True)
    d = np.vstack([df1, df2])
    info = max(nb, 1.0) * (d / np.maximum(f, 1e-300)) @ d.T
    info += 1e-12 * np.trace(info) * np.eye(2)
    chol = np.linalg.cholesky(info)
    return np.linalg.inv(chol.T)


def _as_counts(edges, counts):
    edges = np.asarray(edges, dtype=float)
    counts = np.asarray(counts, dtype=float)
    if counts.shape != (edges.size - 1,):
        raise ValueError("counts must have len(edges) - 1 entries")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("counts must be finite and non-negative")
    return edges, counts


def _start_shape(tmpl, counts):
    """Weighted least-squares start for (p1, p2): ln(n_i / w_i) ~ c + p1 ln(1-x) - p2 ln x."""
    ok = counts > 0
    if ok.sum() < 4:
        return None
    l1 = tmpl.log_1mx[1::2][ok]
    l2 = -tmpl.log_x[1::2][ok]
    y = np.log(counts[ok] / np.diff(tmpl.edges)[ok])
    a = np.vstack([np.ones_like(l1), l1, l2]).T
    wts = np.sqrt(counts[ok])
    try:
        sol, *_ = np.linalg.lstsq(a * wts[:, None], y * wts, rcond=None)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(sol)):
        return None
    return float(sol[1]), float(sol[2])


def _newton(cost, start, free, lower, upper, max_iter=100, tol=1e-6, max_step=None):
    """Minimise ``cost`` over the parameters ``free`` (indices into the 7) from ``start``,
    within [lower, upper] (per free parameter).

    Newton steps on the exact gradient and Hessian (``_Deviance.value_grad_hess``), with
    the Hessian's eigenvalues taken in absolute value (and floored) where it is not
    positive definite; a parameter at a bound that the step would cross is held there
    (active set); the falling-shape constraints (``_Deviance.wall_constraint``) are held as
    well where the shape is on the wall (``_wall_step``), and a step is cut where it would
    reach the wall; steps are shortened to ``max_step`` (per free parameter) and then by a
    backtracking (Armijo) line search on the cost itself, so every step decreases it.
    Stops when the Newton decrement g^T H^-1 g (twice the predicted decrease, deviance
    units) is below ``tol``, after that last step: with quadratic convergence the cost is
    then within ~tol^2 of the minimum (Migrad's EDM < 2e-5 was the previous criterion).
    Returns (parameters, cost, converged)."""
    x = np.array(start, dtype=float)
    free = np.asarray(free)
    block = np.ix_(free, free)
    lo, hi = [float(v) for v in lower], [float(v) for v in upper]
    caps = None if max_step is None else [float(v) for v in max_step]
    bounded = [k for k in range(free.size) if lo[k] > -np.inf or hi[k] < np.inf]
    fval, g_all, h_all = cost.value_grad_hess(*x)
    for _ in range(max_iter):
        g, h = g_all[free], h_all[block]
        if not (np.isfinite(g).all() and np.isfinite(h).all()):
            return x, fval, False
        xf = x[free].tolist()
        at_lower = [k for k in bounded if xf[k] <= lo[k]]
        at_upper = [k for k in bounded if xf[k] >= hi[k]]
        held = [k for k in at_lower if g[k] > 0] + [k for k in at_upper if g[k] < 0]
        slope, normals = cost.wall_constraint(x, free)
        on_wall = slope <= _WALL_TOL
        for _ in range(2 * free.size + 2):  # Newton step on the parameters not held; hold those it would
            move = [k for k in range(free.size) if k not in held]  # push out
            step = np.zeros(free.size)
            if not move:
                break
            sub = h if not held else h[np.ix_(move, move)]
            eigval, eigvec = np.linalg.eigh(sub)
            eigval = np.abs(eigval)
            eigval = np.maximum(eigval, 1e-12 * max(float(eigval.max()), 1e-300))
            step[move] = _wall_step(eigval, eigvec, g[move], normals[:, move], on_wall)
            blocked = [k for k in at_lower if step[k] < 0 and k not in held]
            blocked += [k for k in at_upper if step[k] > 0 and k not in held]
            if blocked:
                held += blocked
                continue
            break
        decrement = -float(g @ step)
        slope_step = normals @ step
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
            trial[free] = [min(max(xf[k] + steps[k], lo[k]), hi[k]) for k in range(free.size)]
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
        trial[free] = [min(max(xf[k] + t * steps[k], lo[k]), hi[k]) for k in range(free.size)]
        ftrial, g_trial, h_trial = cost.value_grad_hess(*trial)  # the full step is usually taken
        if not ftrial <= fval - 1e-4 * t * descent:
            for _ in range(60):
                t *= 0.5
                trial[free] = [min(max(xf[k] + t * steps[k], lo[k]), hi[k]) for k in range(free.size)]
                ftrial = float(cost(*trial))
                if ftrial <= fval - 1e-4 * t * descent:
                    break
            else:
                return x, fval, decrement < 1e-4  # no descent left: converged to rounding
            ftrial, g_trial, h_trial = cost.value_grad_hess(*trial)
        x, fval, g_all, h_all = trial, ftrial, g_trial, h_trial
    return x, fval, False


def _wall_step(eigval, eigvec, g, normals, on_wall):
    """Newton step -H^-1 g (H = eigvec diag(eigval) eigvec^T) that keeps the linear constraints
    ``normals`` . step >= 0 of those ``on_wall``.

    For each subset of the constraints on the wall, the minimiser of the quadratic model
    with those held (the step projected onto their face in the metric of H, through their
    Lagrange multipliers); of those that push no other constraint on the wall outwards,
    the one with the largest decrement -g . step (the lowest model value, -decrement / 2)
    is the minimiser of the model on the feasible cone."""

    def hinv(v):
        return eigvec @ ((eigvec.T @ v) / (eigval if v.ndim == 1 else eigval[:, None]))

    free_step = -hinv(g)
    walls = np.flatnonzero(on_wall)
    if walls.size == 0 or np.all(normals[walls] @ free_step >= 0.0):
        return free_step
    best, best_dec = None, -np.inf
    subsets = [[int(j)] for j in walls] + ([walls.tolist()] if walls.size > 1 else [])
    for subset in subsets:
        c = normals[subset]
        if not np.any(c):
            continue
        hc = hinv(c.T)
        lam = np.linalg.lstsq(c @ hc, c @ free_step, rcond=None)[0]
        step = free_step - hc @ lam
        others = [j for j in walls if j not in subset]
        if others and np.any(normals[others] @ step < 0.0):
            continue
        dec = -float(g @ step)
        if dec > best_dec:
            best, best_dec = step, dec
    return np.zeros_like(free_step) if best is None else best


def _feasible_shape(tmpl, p1, p2):
    """(p1, p2) moved onto the falling shapes (log-log slope >= 0 at both window edges) if it is
    not on them: the nearest point of that cone (Euclidean in (p1, p2)), a start for a fit."""
    p = np.array([p1, p2], dtype=float)
    c = tmpl.slope_matrix
    if np.all(c @ p >= 0.0):
        return float(p1), float(p2)
    best = np.zeros(2)  # flat: both slopes 0
    for j in range(2):
        q = p - c[j] * (c[j] @ p) / (c[j] @ c[j])
        if np.all(c @ q >= -1e-12) and np.sum((q - p) ** 2) < np.sum((best - p) ** 2):
            best = q
    return float(best[0]), float(best[1])


def _fit_background(tmpl, counts, starts=None, mask=None):
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
        T = _whitening(tmpl, nb0, p1, p2)
        cost = _Deviance(tmpl, counts, 1.0, 0.0, (p1, p2), T, mask)
        cost.width_free = cost.signal_free = False
        start = (nb0, 0.0, 0.0, 0.0, float(tmpl.nodes[tmpl.n_bins]), 0.0, 0.0)
        if mask is None:
            # f sums to 1 over the window, so d(cost)/dN_b = 2 (1 - total / N_b): N_b-hat is the
            # number of events at every shape; only the shape is minimised
            x, fval, converged = _newton(cost, start, [_A1, _A2], np.full(2, -np.inf), np.full(2, np.inf))
        else:
            x, fval, converged = _newton(cost, start, [_NB, _A1, _A2], np.array([0.0, -np.inf, -np.inf]),
                                         np.full(3, np.inf))
        if best is None or fval < best[1]:
            best = (x, fval, converged, cost)
    x, fval, converged, cost = best
    p1, p2 = cost.shape_params(x[_A1], x[_A2])
    return BackgroundFit(background_yield=float(x[_NB]), p1=float(p1), p2=float(p2), nll=0.5 * fval,
                         converged=bool(converged))


def fit_background_only(edges, counts, sqrt_s_tev: float, mask=None) -> BackgroundFit:
    """Extended binned ML fit of the dijet function alone (no signal).

    Two starts (a weighted least-squares fit of ln n_i, and p1=8, p2=5); the one with
    the lower NLL is kept. `mask` (bool per bin): fit only those bins, e.g. the
    sidebands around a signal region.
    """
    edges, counts = _as_counts(edges, counts)
    return _fit_background(_template(edges, sqrt_s_tev), counts, mask=mask)


def _default_max_width(edges):
    return 0.25 * float(edges[-1] - edges[0])


@dataclass
class _Minimum:
    """A minimum of a ``_Deviance``: what the fits read from it (Minuit-like names)."""

    values: np.ndarray  # all 7 parameters, in _NAMES order
    fval: float
    valid: bool
    fixed: dict  # name -> bool
    limits: dict  # name -> (lo, hi), +-inf where open
    errors: np.ndarray  # step sizes (Minuit's starting errors), for a fallback Hesse
    cost: "_Deviance"

    def hesse_errors(self):
        """Minuit's numerical Hesse at this minimum (the fallback of ``_parabolic_errors``)."""
        m = Minuit(self.cost, *self.values, grad=self.cost.grad, name=_NAMES)
        m.print_level = 0
        m.strategy = 0
        m.errors = self.errors
        for name in _NAMES:
            m.fixed[name] = self.fixed[name]
            lo, hi = self.limits[name]
            if np.isfinite(lo) or np.isfinite(hi):
                m.limits[name] = (lo if np.isfinite(lo) else None, hi if np.isfinite(hi) else None)
        m.hesse()
        return dict(zip(_NAMES, (float(e) for e in m.errors))), bool(m.valid)


def _minimize(cost, start, fixed, limits, errors, max_step=None):
    """Minimise ``cost`` over the parameters not in ``fixed`` (names) within ``limits``
    (name -> (lo, hi), None for open) from ``start`` with ``_newton``."""
    lims = {name: (-np.inf, np.inf) for name in _NAMES}
    for name, (lo, hi) in limits.items():
        lims[name] = (-np.inf if lo is None else float(lo), np.inf if hi is None else float(hi))
    free = [i for i, name in enumerate(_NAMES) if name not in fixed]
    lower = np.array([lims[_NAMES[i]][0] for i in free])
    upper = np.array([lims[_NAMES[i]][1] for i in free])
    start = np.clip(np.array(start, dtype=float), [lims[n][0] for n in _NAMES], [lims[n][1] for n in _NAMES])
    steps = None if max_step is None else np.array([max_step.get(_NAMES[i], np.inf) for i in free])
    x, fval, converged = _newton(cost, start, free, lower, upper, max_step=steps)
    return _Minimum(values=x, fval=fval, valid=converged, fixed={n: n in fixed for n in _NAMES}, limits=lims,
                    errors=np.asarray(errors, dtype=float), cost=cost)


def _fit_sb(tmpl, counts, bkg: BackgroundFit, resolution_gev, mass_start_gev, *, mass_bounds_gev,
            fix_mass, max_width_gev, spurious_events, fix_signal_zero=False, fit_theta=True):
    """Core s+b fit; returns the minimum (``_Minimum``) and the cost."""
    p_ref = (bkg.p1, bkg.p2)
    T = _whitening(tmpl, bkg.background_yield, *p_ref)
    cost = _Deviance(tmpl, counts, resolution_gev, spurious_events, p_ref, T)
    cost.width_free = not (max_width_gev <= 0.0)
    if mass_bounds_gev is None:
        lo, hi = float(tmpl.edges[0]), float(tmpl.edges[-1])
    else:
        lo, hi = sorted(map(float, mass_bounds_gev))
    mass0 = float(np.clip(mass_start_gev, lo, hi))
    width_fixed = max_width_gev <= 0.0
    width0 = 0.0 if width_fixed else min(0.5 * resolution_gev, 0.5 * max_width_gev)
    f_b, _, _ = tmpl.background(*p_ref)
    b_exp = bkg.background_yield * f_b
    s0, _, _ = tmpl.signal(mass0, width0, resolution_gev)
    # one Newton step from N_s = 0 for the signal-yield start
    ns0 = 0.0 if fix_signal_zero else float(np.sum(s0 * (counts - b_exp) / np.maximum(b_exp, 1e-9))
                                             / max(np.sum(s0 * s0 / np.maximum(b_exp, 1e-9)), 1e-12))
    ns_err = float(np.sqrt(1.0 / max(np.sum(s0 * s0 / np.maximum(b_exp, 1e-9)), 1e-12)))
    m_range = (mass0, mass0) if fix_mass else (lo, hi)
    lower = _signal_yield_floor(tmpl, b_exp, resolution_gev, *m_range, width_fixed)
    ns0 = max(ns0, 0.5 * lower)
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
    limits = {"background_yield": (0.0, None), "signal_yield": (lower, None)}
    if "theta" not in fixed and lower / spurious_events > -10.0:
        limits["theta"] = (lower / spurious_events, None)
    if not fix_mass:
        limits["mass_gev"] = (lo, hi)
    if not width_fixed:
        limits["width_gev"] = (0.0, float(max_width_gev))
    start = (nb0, 0.0, 0.0, ns0, mass0, width0, 0.0)
    errors = (max(np.sqrt(nb0), 1.0), 1.0, 1.0, ns_err, 0.5 * resolution_gev,
              0.5 * resolution_gev, 1.0)
    # a fit stays with the peak it starts on: mass and width move at most one resolution a step
    m = _minimize(cost, start, fixed, limits, errors,
                  max_step={"mass_gev": resolution_gev, "width_gev": resolution_gev})
    return m, cost


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
        s_max = np.minimum(1.0, (hi_e - lo_e) * np.exp(-0.5 * (dist / sigma) ** 2) / (sigma * _SQRT2PI))
    else:
        s_max = np.minimum(1.0, (hi_e - lo_e) / (sigma * _SQRT2PI))
    return -0.5 * float(np.min(b_exp / np.maximum(s_max, 1e-300)))


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
) -> ResonanceFit:
    """Extended binned ML fit of background + Voigt signal (resolution fixed).

    Mass floats in ``mass_bounds_gev`` (default: the fit window) unless ``fix_mass_gev``
    is given. Width floats in [0, max_width_gev]; ``max_width_gev=None`` means a quarter
    of the window, ``0`` fixes a narrow (resolution-dominated) resonance. Errors are
    from the exact Hessian (observed information; ``_parabolic_errors``). ``background``:
    a background-only fit of the same histogram (`fit_background_only`) to start from,
    to save refitting it.
    """
    edges, counts = _as_counts(edges, counts)
    tmpl = _template(edges, sqrt_s_tev)
    bkg = background if background is not None else _fit_background(tmpl, counts)
    max_w = _default_max_width(edges) if max_width_gev is None else float(max_width_gev)
    fix_mass = fix_mass_gev is not None
    m, cost = _fit_sb(tmpl, counts, bkg, float(resolution_gev),
                      float(fix_mass_gev) if fix_mass else float(mass_start_gev),
                      mass_bounds_gev=mass_bounds_gev, fix_mass=fix_mass, max_width_gev=max_w,
                      spurious_events=float(spurious_signal_events))
    return _resonance_result(m, cost, tmpl.n_bins, _parabolic_errors(m, cost))


def _at_limit(value, lo, hi, rel=1e-5):
    """Within `rel` of the range (of the value's size, for an open range) of a limit."""
    scale = (hi - lo) if np.isfinite(hi - lo) else max(abs(value), 1.0)
    return min(value - lo, hi - value) <= rel * scale


def _parabolic_errors(m, cost):
    """Parabolic errors at the minimum from the exact Hessian H of the cost
    (``_Deviance.hess``; H / 2 is the observed information, the deviance being twice
    -ln L with errordef 1): the covariance is 2 H^-1 over the free parameters, which is
    what Minuit's Hesse estimates by finite differences.

    A parameter at one of its limits (there, or the minimum of the quadratic model lies
    beyond it) is held there, as Minuit's Hesse effectively does (its internal coordinate
    is flat at a limit): the others get their errors at that value (e.g. a width at 0 does
    not inflate the signal yield's error); its own error is sqrt(2 / H_jj). Where H is not
    positive definite on the rest, or the minimisation did not converge, Minuit's
    numerical Hesse is used instead."""
    errors = dict(zip(_NAMES, (float(e) for e in m.errors)))
    if not m.valid:
        return m.hesse_errors()[0]
    values = np.array(m.values, dtype=float)
    _, grad, h_full = cost.value_grad_hess(*values)
    free = [i for i, name in enumerate(_NAMES) if not m.fixed[name]]
    held = [i for i in free if _at_limit(values[i], *m.limits[_NAMES[i]])]
    free = [i for i in free if i not in held]
    cov = None
    while free:
        h = h_full[np.ix_(free, free)]
        try:
            np.linalg.cholesky(h)
        except np.linalg.LinAlgError:
            break
        newton = values[free] - np.linalg.solve(h, grad[free])
        beyond = [i for i, x in zip(free, newton)
                  if not m.limits[_NAMES[i]][0] <= x <= m.limits[_NAMES[i]][1]]
        if not beyond:
            cov = 2.0 * np.linalg.inv(h)
            break
        held += beyond
        free = [i for i in free if i not in beyond]
    if cov is None or not (np.all(np.isfinite(cov)) and np.all(np.diag(cov) > 0)):
        return m.hesse_errors()[0]
    errors.update({_NAMES[i]: float(np.sqrt(cov[k, k])) for k, i in enumerate(free)})
    for i in held:
        errors[_NAMES[i]] = float(np.sqrt(2.0 / max(h_full[i, i], 1e-300)))
    return errors


def _resonance_result(m, cost, n_bins, errs) -> ResonanceFit:
    par = tuple(float(v) for v in m.values)
    dev, _ = cost.deviance_terms(par)
    n_free = sum(1 for name in _NAMES if not m.fixed[name] and name != "theta")
    ndof = max(int(n_bins - n_free), 1)

    def err(name):
        return 0.0 if m.fixed[name] else float(errs[name])

    return ResonanceFit(
        mass_gev=par[_M],
        mass_err_gev=err("mass_gev"),
        width_gev=par[_W],
        width_err_gev=err("width_gev"),
        signal_yield=par[_NS],
        signal_yield_err=err("signal_yield"),
        background_yield=par[_NB],
        p1=float(cost.shape_params(par[_A1], par[_A2])[0]),
        p2=float(cost.shape_params(par[_A1], par[_A2])[1]),
        nll=0.5 * float(m.fval),
        chi2=float(dev),
        ndof=ndof,
        fit_p_value=float(chdtrc(ndof, dev)),  # chi2 survival function (scipy.stats.chi2.sf)
        converged=bool(m.valid),
    )
