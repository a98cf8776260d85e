"""The binned model of a resonance on a smooth background, and its Poisson deviance.

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
``fitting._signal_yield_floor``), with a steep barrier in the cost as a safety net. Only the
sign of mu-hat enters q0, so pinning a deep deficit at the floor is harmless.

Binning caveat: bin integrals use Simpson's rule per bin (shapes.integrate_bins),
good to ~2e-4 at resolution = 1.6 bin widths, 1e-3 at 1 bin width, 1 % at 1/2.
Generator and fit share it, so fits are unbiased either way, but keep bins <~ sigma.

Spurious-signal systematic (ATLAS H->gamma gamma, Phys. Lett. B 716 (2012) 1): nuisance
theta ~ N(0, 1) adds theta * S_spur signal-shaped events; the constraint adds
theta^2 / 2 to the NLL (theta^2 to the deviance).

`BinnedTemplate` precomputes a binning's model ingredients (`template` shares one per
binning); `PoissonDeviance` is the cost the fits (`fitting.py`), the bump scan (`scan.py`)
and the significance (`significance.py`) minimise, with its exact gradient and Hessian.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from iminuit import Minuit
from scipy.special import wofz

from . import portable
from .kernels import deviance

_SQRT2 = float(np.sqrt(2.0))
_SQRT2PI = float(np.sqrt(2.0 * np.pi))
_TWO_I_OVER_SQRTPI = 2j / float(np.sqrt(np.pi))
_NO_ROWS = np.zeros((6, 0))  # no signal rows passed: the kernel computes a Gaussian's itself
BARRIER = 1e9  # deviance returned (plus violation) when a bin expectation is <= 0
# The backgrounds modelled here (Drell-Yan, γγ and ZZ* continua, QCD dijets) fall with
# mass. Without that constraint a fit to a few events (or to a huge peak) bends the
# "background" into the signal. The log-log slope -dln f/dln m = p2 + p1·x/(1-x) is
# monotone in x, so requiring it >= 0 at both window edges keeps the dijet function
# falling over the whole window (without constraining p1 and p2 separately, which are
# nearly degenerate over a narrow window). A hard constraint: ``fitting._newton`` cuts a step where
# it would reach the wall and holds the constraint there (starts are moved inside,
# ``fitting._feasible_shape``). The quadratic penalty below only acts outside the wall, to lead a
# start given from outside back in.
SHAPE_PENALTY = 1e2
WALL_TOL = 1e-9  # a log-log slope this close to 0 is on the wall

# The parameters of `PoissonDeviance`, in order, and their indices: background yield N_b,
# whitened shape parameters a1, a2, signal yield N_s, mass, width, spurious-signal nuisance theta.
PARAMETER_NAMES = ("background_yield", "a1", "a2", "signal_yield", "mass_gev", "width_gev", "theta")
NB, A1, A2, NS, M, W, TH = range(7)


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
        self.log_1mx = portable.log1p(-x)
        self.log_x = portable.log(x)
        self._logs = np.vstack([np.ones_like(x), self.log_1mx, -self.log_x])  # exp(phi) times these: d/dp1, d/dp2
        edge_x = x[[0, -1]]
        # rows: window edges; columns: d(slope)/d(p1, p2) with slope = p2 + p1·x/(1-x)
        self.slope_matrix = np.stack([edge_x / (1.0 - edge_x), np.ones(2)], axis=1)

    def simpson(self, values: np.ndarray) -> np.ndarray:
        """Bin integrals from values at the nodes (last axis): strided sums, O(n)."""
        return self.w6 * (values[..., 0:-1:2] + 4.0 * values[..., 1::2] + values[..., 2::2])

    def background(self, p1: float, p2: float, grad: bool = False):
        """Normalised background fractions f_i and (if grad) df/dp1, df/dp2."""
        phi = p1 * self.log_1mx - p2 * self.log_x
        e = portable.exp(phi - phi.max())
        if not grad:
            b = self.simpson(e)
            return b / b.sum(), None, None
        b, b1, b2 = self.simpson(self._logs * e)
        total = b.sum()
        f = b / total
        return f, (b1 - f * b1.sum()) / total, (b2 - f * b2.sum()) / total

    def signal(
        self, mass_gev: float, width_gev: float, resolution_gev: float, grad: bool = False, width_grad: bool = True
    ):
        """Voigt bin fractions s_i and (if grad) ds/dmass, ds/dwidth.

        Voigt = Re w(z) / (sigma sqrt(2 pi)), z = (m - m0 + i Gamma/2) / (sigma sqrt 2),
        with w the Faddeeva function; w'(z) = -2 z w(z) + 2i/sqrt(pi) gives the
        derivatives analytically. Gamma = 0 (and no width derivative wanted) takes the
        pure Gaussian path, which is the same function, faster.
        """
        sigma = max(float(resolution_gev), 1e-6)
        u = self.nodes - mass_gev
        if width_gev <= 0.0 and not (grad and width_grad):
            g = portable.exp(-0.5 * (u / sigma) ** 2) * (1.0 / (sigma * _SQRT2PI))
            if not grad:
                return self.simpson(g), None, None
            s, ds_dm = self.simpson(np.vstack([g, g * u * (1.0 / sigma**2)]))
            return s, ds_dm, None
        z = (u + 0.5j * max(float(width_gev), 0.0)) * (1.0 / (sigma * _SQRT2))
        w = wofz(z)
        if not grad:
            return self.simpson(w.real) * (1.0 / (sigma * _SQRT2PI)), None, None
        wp = -2.0 * portable.cmul(z, w) + _TWO_I_OVER_SQRTPI
        scale = 1.0 / (sigma * _SQRT2 * sigma * _SQRT2PI)
        s, ds_dm, ds_dw = self.simpson(
            np.vstack([w.real * (1.0 / (sigma * _SQRT2PI)), -wp.real * scale, -0.5 * scale * wp.imag])
        )
        return s, ds_dm, ds_dw

    def signal_hessian(
        self, mass_gev: float, width_gev: float, resolution_gev: float, width_free: bool = True
    ) -> np.ndarray:
        """Rows s_i, ds/dmass, ds/dwidth, d2s/dmass^2, d2s/dmass dwidth, d2s/dwidth^2: (6, n_bins).

        With w'' = -2 w - 2 z w' (from w' = -2 z w + 2i/sqrt(pi)) and dz/dmass = -1/(sigma sqrt 2),
        dz/dGamma = i/(2 sigma sqrt 2). A fixed zero width takes the Gaussian path (width
        derivatives 0)."""
        sigma = max(float(resolution_gev), 1e-6)
        u = self.nodes - mass_gev
        norm = 1.0 / (sigma * _SQRT2PI)
        if width_gev <= 0.0 and not width_free:
            g = portable.exp(-0.5 * (u / sigma) ** 2) * norm
            v = u * (1.0 / sigma**2)
            gv = g * v
            rows = np.zeros((6, u.size))
            rows[0], rows[1], rows[3] = g, gv, gv * v - g * (1.0 / sigma**2)
            return self.simpson(rows)
        z = (u + 0.5j * max(float(width_gev), 0.0)) * (1.0 / (sigma * _SQRT2))
        w = wofz(z)
        wp = -2.0 * portable.cmul(z, w) + _TWO_I_OVER_SQRTPI
        wpp = -2.0 * w - 2.0 * portable.cmul(z, wp)
        c1 = norm / (sigma * _SQRT2)
        c2 = norm / (sigma * sigma)
        return self.simpson(
            np.vstack(
                [
                    w.real * norm,
                    -wp.real * c1,
                    -0.5 * wp.imag * c1,
                    0.5 * wpp.real * c2,
                    0.25 * wpp.imag * c2,
                    -0.125 * wpp.real * c2,
                ]
            )
        )


def template(edges: np.ndarray, sqrt_s_tev: float) -> BinnedTemplate:
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


class PoissonDeviance:
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
        nlogn = np.where(counts > 0, counts * portable.log(np.where(counts > 0, counts, 1.0)), 0.0)
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
        self.wall = portable.matmul(tmpl.slope_matrix, self.T)  # d(slope at the window edges)/d(a1, a2)
        self._key_b = self._key_s = None

    def shape_params(self, a1, a2):
        t = self.T
        return (self.p_ref[0] + t[0, 0] * a1 + t[0, 1] * a2, self.p_ref[1] + t[1, 0] * a1 + t[1, 1] * a2)

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
        jac[NB] = f
        jac[A1] = nb * (t[0, 0] * df1 + t[1, 0] * df2)
        jac[A2] = nb * (t[0, 1] * df1 + t[1, 1] * df2)
        jac[NS] = s
        jac[M] = amp * ds_m
        jac[W] = 0.0 if ds_w is None else amp * ds_w
        jac[TH] = self.spur * s
        return mu, jac

    def _deviance(self, mu, th):
        # mu < 0 anywhere, or mu = 0 in a bin with events, is outside the model: barrier
        total = float(mu.sum()) if self._all_bins else float(mu[self.mask].sum())
        if mu.min() > 0.0:  # the usual case: every bin (with or without events) has mu > 0
            return 2.0 * (total - portable.vecdot(self.n, portable.log(mu)) + self.const) + th * th
        mu_pos = mu[self.pos]
        if mu.min() < 0.0 or (mu_pos.size and mu_pos.min() <= 0.0):
            return BARRIER * (1.0 + float(np.sum(np.clip(-mu, 0.0, None))))
        return 2.0 * (total - portable.vecdot(self.n_pos, portable.log(mu_pos)) + self.const) + th * th

    def _negative_slope(self, par):
        """Negative parts of the log-log slope at the two window edges."""
        return np.minimum(portable.matvec(self.t.slope_matrix, np.array(self.shape_params(par[A1], par[A2]))), 0.0)

    def wall_constraint(self, par, free):
        """For ``fitting._newton``: the log-log slopes at the two window edges (>= 0 inside the wall) and
        their gradients with respect to the parameters ``free``: ((2,), (2, len(free)))."""
        slope = portable.matvec(self.t.slope_matrix, np.array(self.shape_params(par[A1], par[A2])))
        rows = np.zeros((2, 7))
        rows[:, A1 : A2 + 1] = self.wall
        return slope, rows[:, free]

    def __call__(self, *par):
        return self._compiled(par, derivatives=False)[0]

    def _compiled(self, par, derivatives):
        """``kernels.deviance`` at ``par``: the cost (and its gradient and Hessian); a Voigt's
        signal rows (width > 0, or a free width's derivatives) are computed here by scipy."""
        width = par[W]
        gaussian = width <= 0.0 and not (derivatives and self.width_free)
        signal_rows = _NO_ROWS
        if self.signal_free and not gaussian:
            if derivatives:
                signal_rows = self.t.signal_hessian(par[M], width, self.sigma, self.width_free)
            else:
                signal_rows = np.zeros((6, self.n.size))
                signal_rows[0] = self.t.signal(par[M], width, self.sigma)[0]
        return deviance(
            np.asarray(par, dtype=float),
            self.t.log_1mx,
            self.t.log_x,
            self.t.w6,
            self.t.nodes,
            self.n,
            self.mask_float,
            self.T,
            self.p_ref,
            self.t.slope_matrix,
            self.spur,
            self.sigma,
            self.signal_free,
            signal_rows,
            gaussian,
            derivatives,
            SHAPE_PENALTY,
            BARRIER,
        )

    def grad(self, *par):
        mu, jac = self.expected(par, grad=True)
        r = self.mask.astype(float)
        r[self.pos] -= self.n_pos / np.maximum(mu[self.pos], 1e-300)
        g = 2.0 * portable.matvec(jac, r)
        g[TH] += 2.0 * par[TH]
        g[[A1, A2]] += (
            2.0
            * SHAPE_PENALTY
            * portable.matvec(self.T.T, portable.matvec(self.t.slope_matrix.T, self._negative_slope(par)))
        )
        return g

    def value_grad_hess(self, *par):
        """(cost, gradient, exact Hessian) at ``par``, from one evaluation of the model and its
        first and second derivatives (for the Newton minimiser, ``fitting._newton``; compiled:
        ``kernels.deviance``).

        Hessian: 2 [J diag(n/mu^2) J^T + sum_i r_i d2mu_i], r_i = 1 - n_i/mu_i, plus the
        theta constraint and the shape wall; H / 2 is the observed information. The cost and
        gradient are those of ``__call__`` and ``grad``. Outside the model (some mu <= 0)
        the cost is the barrier and the derivatives are NaN."""
        return self._compiled(par, derivatives=True)

    def hess(self, *par):
        """Exact Hessian of the cost (deviance units; see ``value_grad_hess``). Not named
        ``hessian``, which iminuit would pick up (for the fallback Hesse)."""
        return self.value_grad_hess(*par)[2]

    def deviance_terms(self, par):
        """(Poisson deviance without the constraint, constraint term)."""
        mu, _ = self.expected(par)
        return self._deviance(mu, 0.0), par[TH] ** 2


def whitening(tmpl, nb, p1, p2):
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
    info = portable.matmul(max(nb, 1.0) * (d / np.maximum(f, 1e-300)), d.T)
    info += 1e-12 * np.trace(info) * np.eye(2)
    chol = portable.cholesky(info)
    return portable.inv(chol.T)


def as_counts(edges, counts):
    edges = np.asarray(edges, dtype=float)
    counts = np.asarray(counts, dtype=float)
    if counts.shape != (edges.size - 1,):
        raise ValueError("counts must have len(edges) - 1 entries")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("counts must be finite and non-negative")
    return edges, counts
