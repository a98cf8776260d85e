"""Physics and statistics layer of CERNenv: line shapes, fits, significance, bump scan, spin.

Pure functions on numpy arrays; no environment or agent state. One job per module:
`shapes` (line shapes, bin integrals), `likelihood` (the binned model and its Poisson
deviance), `fitting` (the minimiser and the fits), `scan` (the bump scan), `significance`
(profile-likelihood significance, look-elsewhere effect), `angular` (spin likelihoods).
"""

from .angular import (
    ANGULAR_CHANNELS,
    SpinResult,
    allowed_spins,
    angular_bin_probabilities,
    angular_density,
    background_angular_probabilities,
    spin_likelihoods,
)
from .fitting import BackgroundFit, ResonanceFit, fit_background_only, fit_signal_plus_background
from .scan import BumpScan, scan_local_significance
from .significance import (
    LocalSignificance,
    asimov_significance,
    count_upcrossings,
    expected_upcrossings,
    global_significance_from_upcrossings,
    p_from_z,
    profile_likelihood_significance,
    z_from_p,
)

__all__ = [
    "ANGULAR_CHANNELS",
    "BackgroundFit",
    "BumpScan",
    "LocalSignificance",
    "ResonanceFit",
    "SpinResult",
    "allowed_spins",
    "angular_bin_probabilities",
    "angular_density",
    "asimov_significance",
    "background_angular_probabilities",
    "count_upcrossings",
    "expected_upcrossings",
    "fit_background_only",
    "fit_signal_plus_background",
    "global_significance_from_upcrossings",
    "p_from_z",
    "profile_likelihood_significance",
    "scan_local_significance",
    "spin_likelihoods",
    "z_from_p",
]
