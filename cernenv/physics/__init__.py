"""Physics and statistics layer of CERNenv: line shapes, fits, significance, bump scan, spin.

Pure functions on numpy arrays; no environment or agent state. One job per module:
`shapes` (line shapes, bin integrals), `likelihood` (the binned model and its Poisson
deviance), `fitting` (the minimiser and the fits), `scan` (the bump scan), `significance`
(profile-likelihood significance, look-elsewhere effect), `angular` (spin likelihoods); `portable`
(arithmetic whose bits do not depend on the processor) and `kernels` (the compiled inner loops).
The names of `__all__` are imported from their modules on first use.
"""

import importlib
from typing import Any

_HOMES = {
    "angular": (
        "ANGULAR_CHANNELS",
        "SpinResult",
        "allowed_spins",
        "angular_bin_probabilities",
        "angular_density",
        "background_angular_probabilities",
        "spin_likelihoods",
    ),
    "fitting": ("BackgroundFit", "ResonanceFit", "fit_background_only", "fit_signal_plus_background"),
    "scan": ("BumpScan", "scan_local_significance"),
    "significance": (
        "LocalSignificance",
        "asimov_significance",
        "count_upcrossings",
        "expected_upcrossings",
        "global_significance_from_upcrossings",
        "look_elsewhere",
        "p_from_z",
        "profile_likelihood_significance",
        "z_from_p",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """The names below from their modules, imported on first use: importing the package (or one
    module of it) loads neither numba's compiled kernels nor scipy's optimiser."""
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted({*globals(), *_HOME_OF})


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
    "look_elsewhere",
    "p_from_z",
    "profile_likelihood_significance",
    "scan_local_significance",
    "spin_likelihoods",
    "z_from_p",
]
