"""Spin hypotheses from the decay-angle distribution |cos theta*| in [0, 1].

Signal shapes (production x decay, integrated over the azimuths; cf. ATLAS,
"Evidence for the spin-0 nature of the Higgs boson using ATLAS data", Phys. Lett.
B 726 (2013) 120, and the graviton benchmarks therein):

* spin 0: isotropic, flat in |cos theta*|.
* spin 1 (q qbar -> Z' -> f fbar, vector couplings): 1 + c^2 (the forward-backward
  asymmetry cancels in |c|).
* spin 2 (g g -> G*, minimal couplings): gamma gamma 1 + 6c^2 + c^4; f fbar (and,
  as a modelling simplification here, 4l and jj) 1 - c^4.

Landau (Dokl. Akad. Nauk SSSR 60 (1948) 207) - Yang (Phys. Rev. 77 (1950) 242):
a spin-1 particle cannot decay to two identical massless vector bosons, so spin 1 is
not a hypothesis in the diphoton channel.

Backgrounds: 1 + b2 c^2 per channel. The b2 values are modelling choices of this
simulation (parton-level forward peaking, softened by detector acceptance), not
measurements: q qbar -> gamma gamma (t/u-channel) 2.0; Drell-Yan (spin-1 exchange,
1 + c^2 flattened by lepton acceptance) 0.6; q qbar -> ZZ 1.5; QCD dijets (t-channel,
strongly forward) 4.0.

Caveat: all spin-0/1 shapes and backgrounds belong to the family 1 + a c^2. When the
signal fraction is profiled, a mixture "spin 0 + background" spans a in [0, b2] and
can mimic spin 1 (a = 1) whenever b2 > 1 (dijet, four_lepton): pass the signal
fraction measured in the mass fit to break that degeneracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from numpy.polynomial import polynomial as P

from . import portable

# The decay channels whose angular distributions are modelled here: the detector's channels
# (`cernenv.detector.CHANNELS`, a dict of their detector response; tests/test_physics.py checks they agree).
ANGULAR_CHANNELS = ("diphoton", "four_lepton", "dimuon", "dielectron", "dijet")

BACKGROUND_B2 = {
    "diphoton": 2.0,
    "dimuon": 0.6,
    "dielectron": 0.6,
    "four_lepton": 1.5,
    "dijet": 4.0,
}

# polynomial coefficients in c = |cos theta*| (lowest order first), unnormalised
_SPIN0 = (1.0,)
_SPIN1 = (1.0, 0.0, 1.0)
_SPIN2_GAMMA_GAMMA = (1.0, 0.0, 6.0, 0.0, 1.0)
_SPIN2_FERMIONS = (1.0, 0.0, 0.0, 0.0, -1.0)


def _check_channel(channel: str) -> str:
    if channel not in ANGULAR_CHANNELS:
        raise ValueError(f"unknown channel {channel!r}; expected one of {ANGULAR_CHANNELS}")
    return channel


def allowed_spins(channel: str) -> tuple[int, ...]:
    """Spin hypotheses a resonance decaying to ``channel`` may have (Landau-Yang for gamma gamma)."""
    return (0, 2) if _check_channel(channel) == "diphoton" else (0, 1, 2)


def _bin_probabilities(coeffs, n_bins: int) -> np.ndarray:
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    coeffs = tuple(map(float, coeffs))  # no Python call per coefficient: every spin the same work
    return _cached_bin_probabilities(coeffs, int(n_bins)).copy()


@lru_cache(maxsize=256)
def _cached_bin_probabilities(coeffs: tuple, n_bins: int) -> np.ndarray:
    anti = P.polyint(np.asarray(coeffs, dtype=float))
    cdf = P.polyval(np.linspace(0.0, 1.0, n_bins + 1), anti)
    probs = np.diff(cdf)
    return probs / (cdf[-1] - cdf[0])


def _signal_coeffs(spin: int, channel: str):
    channel = _check_channel(channel)
    if spin not in allowed_spins(channel):
        raise ValueError(f"spin {spin} is not allowed in channel {channel!r}")
    if spin == 0:
        return _SPIN0
    if spin == 1:
        return _SPIN1
    return _SPIN2_GAMMA_GAMMA if channel == "diphoton" else _SPIN2_FERMIONS


def angular_density(spin: int, channel: str, cos_theta) -> np.ndarray:
    """Normalised pdf of |cos theta*| on [0, 1] for a signal of ``spin`` in ``channel``."""
    coeffs = np.asarray(_signal_coeffs(spin, channel), dtype=float)
    norm = P.polyval(1.0, P.polyint(coeffs))
    return P.polyval(np.abs(np.asarray(cos_theta, dtype=float)), coeffs) / norm


def angular_bin_probabilities(spin: int, channel: str, n_bins: int = 10) -> np.ndarray:
    """Exact probabilities of ``n_bins`` equal bins of |cos theta*| in [0, 1] (sum 1)."""
    return _bin_probabilities(_signal_coeffs(spin, channel), n_bins)


def background_angular_probabilities(channel: str, n_bins: int = 10) -> np.ndarray:
    """Bin probabilities of the background, 1 + b2 c^2 with the channel's b2 (modelling choice)."""
    return _bin_probabilities((1.0, 0.0, BACKGROUND_B2[_check_channel(channel)]), n_bins)


@dataclass(frozen=True)
class SpinResult:
    """Spin test. ``log_likelihood``: sum_i n_i ln p_i (multinomial constant dropped).

    ``relative_likelihood``: L_J / sum L (flat prior over allowed spins).
    ``separation``: 2 (lnL_best - lnL_runner_up). ``signal_fraction``: f used for the
    best spin; ``signal_fraction_by_spin``: f per hypothesis (profiled or given).
    """

    log_likelihood: dict
    relative_likelihood: dict
    best_spin: int
    separation: float
    signal_fraction: float
    signal_fraction_by_spin: dict = field(default_factory=dict)


def _loglik(counts, probs):
    ok = counts > 0
    return float(np.sum(counts[ok] * portable.log(np.maximum(probs[ok], 1e-300))))


def _profile_fraction(counts, sig, bkg) -> float:
    """argmax_f in [0,1] of sum n ln(f A + (1-f) B): concave, so the score is monotone."""
    diff = sig - bkg

    def score(f):
        p = np.maximum(f * sig + (1.0 - f) * bkg, 1e-300)
        return float(np.sum(counts * diff / p))

    if score(0.0) <= 0.0:
        return 0.0
    if score(1.0) >= 0.0:
        return 1.0
    from scipy.optimize import brentq  # here, not at import: scipy's optimiser is slow to load

    return float(brentq(score, 0.0, 1.0, xtol=1e-12))


@dataclass(frozen=True)
class AngularMeasurement:
    """What one `measure_angular` step measured: the |cos θ*| counts of the events within
    `window_gev` of `mass_gev` in `channel`, and the spin test on them (for plots and replays)."""

    result: SpinResult
    cos_counts: np.ndarray
    channel: str
    mass_gev: float
    window_gev: float


def spin_likelihoods(cos_counts, channel: str, signal_fraction: float | None = None) -> SpinResult:
    """Binned multinomial likelihood of each allowed spin, p = f A_J + (1 - f) A_B.

    ``cos_counts``: counts in equal |cos theta*| bins on [0, 1]. ``signal_fraction``
    None: f profiled in [0, 1] separately for each hypothesis; else used as given
    (e.g. N_s / (N_s + N_b) in the mass window from the resonance fit).
    """
    counts = np.asarray(cos_counts, dtype=float)
    if counts.ndim != 1 or counts.size < 1 or np.any(counts < 0):
        raise ValueError("cos_counts must be a 1-d array of non-negative counts")
    if signal_fraction is not None and not 0.0 <= float(signal_fraction) <= 1.0:
        raise ValueError("signal_fraction must be in [0, 1]")
    spins = allowed_spins(channel)
    bkg = background_angular_probabilities(channel, counts.size)
    loglik, fractions = {}, {}
    for spin in spins:
        sig = angular_bin_probabilities(spin, channel, counts.size)
        f = _profile_fraction(counts, sig, bkg) if signal_fraction is None else float(signal_fraction)
        fractions[spin] = f
        loglik[spin] = _loglik(counts, f * sig + (1.0 - f) * bkg)
    ll = np.array([loglik[s] for s in spins])
    w = portable.exp(ll - ll.max())
    rel = {s: float(v) for s, v in zip(spins, w / w.sum())}
    order = np.argsort(-ll, kind="stable")
    best = spins[int(order[0])]
    separation = float(2.0 * (ll[order[0]] - ll[order[1]])) if len(spins) > 1 else float("inf")
    return SpinResult(
        log_likelihood=loglik,
        relative_likelihood=rel,
        best_spin=int(best),
        separation=separation,
        signal_fraction=fractions[best],
        signal_fraction_by_spin=fractions,
    )
