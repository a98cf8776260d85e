"""Line shapes of invariant-mass spectra, shared by the simulation and the fits.

Background: the smooth, falling "dijet function" used by ATLAS and CMS resonance
searches (e.g. CMS, Phys. Rev. D 87 (2013) 114015, eq. 1; ATLAS, Phys. Rev. D 96
(2017) 052004, eq. 1)::

    dN/dm  ∝  (1 - x)^p1 · x^-(p2),      x = m / √s

With channel-specific (p1, p2) it also describes the diphoton and dilepton
continua well over a limited window, which is how we use it.

Signal: a relativistic-free Breit–Wigner of natural width Γ convolved with a
Gaussian detector resolution σ, i.e. a Voigt profile (scipy.special.voigt_profile).
"""

from __future__ import annotations

import numpy as np
from scipy.special import voigt_profile

from . import portable

# Simpson's rule on each bin: weights for the left edge, centre and right edge.
_SIMPSON_WEIGHTS = np.array([1.0, 4.0, 1.0]) / 6.0


def background_density(mass_gev: np.ndarray, sqrt_s_tev: float, p1: float, p2: float) -> np.ndarray:
    """Unnormalised background density dN/dm at `mass_gev` for a collider at `sqrt_s_tev`."""
    x = np.asarray(mass_gev, dtype=float) / (1000.0 * sqrt_s_tev)
    x = np.clip(x, 1e-9, 1.0 - 1e-9)
    return portable.power(1.0 - x, p1) * portable.power(x, -p2)


def signal_density(mass_gev: np.ndarray, mass0_gev: float, width_gev: float, resolution_gev: float) -> np.ndarray:
    """Normalised Voigt density (1/GeV): Breit–Wigner(mass0, Γ=width) ⊗ Gauss(σ=resolution)."""
    sigma = max(float(resolution_gev), 1e-6)
    gamma_half = max(float(width_gev), 0.0) / 2.0
    return voigt_profile(np.asarray(mass_gev, dtype=float) - mass0_gev, sigma, gamma_half)


def simpson_nodes(edges: np.ndarray) -> np.ndarray:
    """Evaluation points (n_bins, 3): left edge, centre, right edge of each bin."""
    edges = np.asarray(edges, dtype=float)
    lo, hi = edges[:-1], edges[1:]
    return np.stack([lo, 0.5 * (lo + hi), hi], axis=1)


def integrate_bins(density_at_nodes: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Integral of a density over each bin, from its values at `simpson_nodes(edges)`."""
    widths = np.diff(np.asarray(edges, dtype=float))
    return portable.matvec(np.asarray(density_at_nodes, dtype=float), _SIMPSON_WEIGHTS) * widths


def background_bin_fractions(edges: np.ndarray, sqrt_s_tev: float, p1: float, p2: float) -> np.ndarray:
    """Fraction of the in-window background falling in each bin (sums to 1).

    Evaluated in log space relative to its maximum, so fitted parameters far from the
    usual range (a background fit pulled by a huge peak) cannot overflow."""
    x = np.clip(simpson_nodes(edges) / (1000.0 * sqrt_s_tev), 1e-9, 1.0 - 1e-9)
    log_density = p1 * portable.log1p(-x) - p2 * portable.log(x)
    integrals = integrate_bins(portable.exp(log_density - log_density.max()), edges)
    return integrals / integrals.sum()


def signal_bin_fractions(edges: np.ndarray, mass0_gev: float, width_gev: float, resolution_gev: float) -> np.ndarray:
    """Fraction of *all* signal events falling in each bin (sums to <= 1: tails leave the window)."""
    nodes = simpson_nodes(edges)
    return integrate_bins(signal_density(nodes, mass0_gev, width_gev, resolution_gev), edges)
