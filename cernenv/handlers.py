"""What each of the environment's actions does: `ActionHandlers`, the handler of every verb of
`cernenv.actions.ACTION_TABLE` (`_do_<verb>`: check its rules, charge its cost, then change the
episode and say what it found), with the analysis helpers they share (the episode's cached fits,
the significance as a result reports it).

A mixin of `cernenv.environment.CERNCollisionEnvironment`: the handlers read and change the
episode the environment holds (`self._episode`) and use its charging and rule checks
(`_charge`, `_require_option`, `_satisfied`); the environment's API (reset, step, the state, the
grade and the observation) is in environment.py.

The physics (`cernenv.analysis`, `cernenv.physics`: numba's compiled kernels, scipy) is imported by
the handlers that compute with it, when one first runs: `import cernenv` does not load it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import numpy as np

from cernenv.actions import ACTION_TABLE
from cernenv.detector import (
    BEAM_ENERGIES,
    CALIBRATION_BIAS_FACTOR,
    MAX_CALIBRATION_LEVEL,
    PILEUP_SETTINGS,
    RECONSTRUCTIONS,
    TRIGGERS,
    mass_resolution_gev,
)
from cernenv.models import (
    ActionType,
    DiscoveryClaim,
)
from cernenv.rules import (
    RuleViolation,
    Violation,
    missing_prerequisite,
)
from cernenv.simulation import MAX_SPECTRUM_BINS, MIN_SPECTRUM_BINS, Spectrum

LUMINOSITY_UNCERTAINTY_FRAC = 0.017  # ATLAS Run-2 luminosity, EPJC 83 (2023) 982

_SIGNIFICANT_FIGURES = {digits: f".{digits}g" for digits in range(1, 18)}  # format specs, made once


_FIT_ERRORS = {"mass": "mass_err_gev", "width": "width_err_gev", "signal yield": "signal_yield_err"}
"""The errors a resonance fit shows, by the parameter's name in words."""
_NO_PEAK_INSIDE = (
    "the fit found no peak inside the window; fit again from another mass_hint_gev inside it "
    "(another bump-scan candidate, @scan.candidates[i]), or claim what the data show"
)
"""What a resonance fit whose mass ran to the spectrum's edge means, and what to do: the fit's note
and the refusal of a significance estimate at that mass say it."""


def _r(value: Optional[float], digits: int = 4) -> Optional[float]:
    """Round to `digits` (1-17) significant figures: compact, text-friendly and byte-stable.
    (Called some 300 times an episode, so with `math` and ready-made format specs.)"""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(format(value, _SIGNIFICANT_FIGURES[digits]))


def _r_within(value: Optional[float], error: Optional[float], digits: int = 4) -> Optional[float]:
    """`value` to `digits` significant figures, or where coarser to the place of its `error`'s second
    significant digit (a fit's 3697.5 ± 2450 events is shown as 3700): digits below that say where a
    minimisation stopped, which the C library's last bits can move, not what the data say."""
    if value is None or error is None or not (math.isfinite(float(error)) and float(error) > 0.0):
        return _r(value, digits)
    place = math.floor(math.log10(float(error))) - 1
    return _r(round(float(value), -place), digits)


class ActionHandlers:
    """The action handlers of `CERNCollisionEnvironment` (see the module docstring)."""

    def _execute(self, action_type: ActionType, params: Any) -> Dict[str, Any]:
        channel = getattr(params, "channel", None)
        if channel is not None:
            self._require_option("channel", channel, self._episode.scenario.channels)
        prerequisite = missing_prerequisite(action_type, self._satisfied(channel))
        if prerequisite is not None:
            raise prerequisite
        handler: Callable[[Any], Dict[str, Any]] = getattr(self, f"_do_{action_type.value}")
        return handler(params)  # each handler checks its rules and charges before it changes state

    def _charge_table(self, action_type: ActionType, extra_musd: float = 0.0, extra_days: float = 0.0) -> None:
        spec = ACTION_TABLE[action_type]
        self._charge(spec.cost_musd + extra_musd, spec.time_days + extra_days)

    def _do_configure_beam(self, params) -> Dict[str, Any]:
        episode = self._episode
        energy = float(params.beam_energy_tev)
        self._require_option("beam_energy_tev", energy, episode.scenario.beam_energies_tev)
        if episode.luminosity_fb > 0:
            raise RuleViolation(
                Violation.BEAM_LOCKED,
                "collisions are already recorded at "
                f"{episode.beam_energy_tev:g} TeV; one campaign runs at one beam setting",
            )
        self._charge_table(ActionType.CONFIGURE_BEAM)
        episode.beam_energy_tev, episode.pileup = energy, params.pileup
        beam, pileup = BEAM_ENERGIES[energy], PILEUP_SETTINGS[params.pileup]
        return {
            "beam_energy_tev": energy,
            "pileup": params.pileup,
            "cost_musd_per_fb": beam.cost_musd_per_fb,
            "days_per_fb": _r(beam.days_per_fb / pileup.luminosity_rate_factor),
        }

    def _do_allocate_luminosity(self, params) -> Dict[str, Any]:
        episode = self._episode
        requested = float(params.luminosity_fb)
        left = episode.scenario.luminosity_fb - episode.luminosity_fb - episode.booked_fb
        if requested > left + 1e-9:
            raise RuleViolation(
                Violation.LUMINOSITY_LIMIT,
                f"only {left:.4g} fb^-1 of the campaign's {episode.scenario.luminosity_fb:g} are left",
            )
        cost = requested * BEAM_ENERGIES[episode.beam_energy_tev].cost_musd_per_fb
        self._charge_table(ActionType.ALLOCATE_LUMINOSITY, extra_musd=cost)
        episode.booked_fb += requested
        episode.bookings += 1
        return {"booked_fb": _r(episode.booked_fb), "cost_musd": _r(cost)}

    def _do_set_trigger(self, params) -> Dict[str, Any]:
        episode = self._episode
        self._require_option("trigger", params.trigger, episode.scenario.triggers)
        self._charge_table(ActionType.SET_TRIGGER)
        episode.trigger = params.trigger
        factor = PILEUP_SETTINGS[episode.pileup].trigger_efficiency_factor
        return {
            "trigger": params.trigger,
            "efficiency": {ch: _r(TRIGGERS[params.trigger].get(ch, 0.0) * factor) for ch in episode.scenario.channels},
        }

    def _do_collect_collisions(self, params) -> Dict[str, Any]:
        episode = self._episode
        requested = float(params.luminosity_fb)
        if requested > episode.booked_fb + 1e-9:
            raise RuleViolation(
                Violation.NOT_ENOUGH_BOOKED, f"{episode.booked_fb:.4g} fb^-1 booked; allocate_luminosity for more"
            )
        days = requested * BEAM_ENERGIES[episode.beam_energy_tev].days_per_fb
        days /= PILEUP_SETTINGS[episode.pileup].luminosity_rate_factor
        self._charge_table(ActionType.COLLECT_COLLISIONS, extra_days=days)
        recorded = episode.recorder.collect(
            requested, episode.beam_energy_tev, episode.pileup, TRIGGERS[episode.trigger]
        )
        episode.booked_fb -= requested
        episode.luminosity_fb += requested
        episode.data_version += 1
        if any(recorded.values()):
            episode.milestones.add("collisions_collected")
        return {"luminosity_fb": _r(requested), "days": _r(days), "events_recorded": recorded}

    def _do_calibrate_detector(self, params) -> Dict[str, Any]:
        episode = self._episode
        record = episode.recorder.records[params.channel]
        if record.calibration_level >= MAX_CALIBRATION_LEVEL:
            raise RuleViolation(
                Violation.FULLY_CALIBRATED, f"{params.channel} is already at the highest calibration level"
            )
        self._charge_table(ActionType.CALIBRATE_DETECTOR)
        record.calibration_level += 1
        episode.data_version += 1
        return {
            "channel": params.channel,
            "calibration_level": record.calibration_level,
            "energy_scale_uncertainty_frac": _r(self._scale_uncertainty(params.channel)),
            "resolution_at_window_centre_gev": _r(self._resolution(params.channel)),
        }

    def _do_reconstruct_tracks(self, params) -> Dict[str, Any]:
        episode = self._episode
        quality = RECONSTRUCTIONS[params.quality]
        self._charge(quality.cost_musd, quality.days)
        record = episode.recorder.records[params.channel]
        if record.reconstruction != params.quality:
            episode.data_version += 1  # re-running the same reconstruction changes no data
        record.reconstruction = params.quality
        return {
            "channel": params.channel,
            "quality": params.quality,
            "resolution_at_window_centre_gev": _r(self._resolution(params.channel)),
        }

    def _do_select_channel(self, params) -> Dict[str, Any]:
        episode = self._episode
        self._charge_table(ActionType.SELECT_CHANNEL)
        if episode.channel != params.channel:
            episode.channel = params.channel
            episode.spectrum = episode.background_fit = None
            episode.resonance_fit = episode.scan = episode.angular = None
        record = episode.recorder.records[params.channel]
        return {
            "channel": params.channel,
            "luminosity_fb": _r(record.luminosity_fb),
            "recorded_events": record.recorded_events,
            "reconstructed": record.reconstruction is not None,
        }

    def _do_build_invariant_mass(self, params) -> Dict[str, Any]:
        episode = self._episode
        lo_window, hi_window = episode.scenario.search_window_gev
        lo = max(lo_window, params.mass_min_gev or lo_window)
        hi = min(hi_window, params.mass_max_gev or hi_window)
        if hi <= lo:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"the range must overlap the search window [{lo_window:g}, {hi_window:g}] GeV",
            )
        finest = float(self._record_resolution(episode.channel, lo))
        width = params.bin_width_gev or self._default_bin_width(episode.channel, lo, hi)
        if width > finest * 1.0001:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"bin_width_gev {width:.4g} is wider than the mass resolution {finest:.4g} GeV at "
                f"{lo:g} GeV: a narrow peak would be lost in one bin; choose bins ≤ {finest:.4g} GeV",
            )
        n_bins = (hi - lo) / width
        if not MIN_SPECTRUM_BINS <= n_bins <= MAX_SPECTRUM_BINS:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"{n_bins:.0f} bins; choose bin_width_gev between {(hi - lo) / MAX_SPECTRUM_BINS:.3g} "
                f"and {(hi - lo) / MIN_SPECTRUM_BINS:.3g} GeV",
            )
        self._charge_table(ActionType.BUILD_INVARIANT_MASS)
        spectrum = episode.recorder.build_spectrum(
            episode.channel, (lo, hi), width, episode.beam_energy_tev, episode.pileup
        )
        if episode.spectrum is None or episode.spectrum.fit_key != spectrum.fit_key:
            episode.data_version += 1  # the same histogram again is the same data
        episode.spectrum, episode.background_fit = spectrum, None
        episode.resonance_fit = episode.scan = episode.angular = None
        episode.milestones.add("spectrum_built")
        counts, edges = spectrum.counts, spectrum.edges_gev
        peak = int(np.argmax(counts / np.diff(edges)))
        return {
            "channel": episode.channel,
            "events": int(counts.sum()),
            "bins": int(counts.size),
            "range_gev": [_r(edges[0]), _r(edges[-1])],
            "bin_width_gev": _r(edges[1] - edges[0]),
            "resolution_at_window_centre_gev": _r(self._resolution(episode.channel)),
            "densest_bin_gev": _r(0.5 * (edges[peak] + edges[peak + 1])),
        }

    def _do_subtract_background(self, params) -> Dict[str, Any]:
        from cernenv import analysis
        from cernenv.physics.fitting import fit_background_only

        episode = self._episode
        spectrum = episode.spectrum
        edges, counts = spectrum.edges_gev, spectrum.counts
        centres = 0.5 * (edges[:-1] + edges[1:])
        mask = np.ones_like(counts, dtype=bool)
        region = params.signal_region_gev
        if params.method == "sideband":
            mask = (centres < region[0]) | (centres > region[1])
            if mask.sum() < 6:
                raise RuleViolation(Violation.INVALID_PARAMETERS, "the signal region leaves too few sideband bins")
        self._charge_table(ActionType.SUBTRACT_BACKGROUND)
        fit = (
            fit_background_only(edges, counts, spectrum.sqrt_s_tev, mask=mask)
            if params.method == "sideband"
            else self._background_only(spectrum)
        )
        expected = analysis.background_expectation(fit, edges, spectrum.sqrt_s_tev)
        episode.background_fit = fit
        residual = (counts - expected) / np.sqrt(np.maximum(expected, 1.0))
        worst = int(np.argmax(residual))
        result: Dict[str, Any] = {
            "method": params.method,
            "background_fit_converged": bool(fit.converged),
            "largest_excess_gev": _r(centres[worst]),
            "largest_excess_bin_pull": _r(residual[worst], 3),
        }
        if region is not None:
            inside = (centres >= region[0]) & (centres <= region[1])
            observed, background = float(counts[inside].sum()), float(expected[inside].sum())
            result.update(
                {
                    "signal_region_gev": [_r(region[0]), _r(region[1])],
                    "observed": int(observed),
                    "expected_background": _r(background),
                    "excess": _r(observed - background),
                    "excess_error": _r(np.sqrt(max(observed, 1.0))),
                }
            )
        return result

    def _do_fit_resonance(self, params) -> Dict[str, Any]:
        from cernenv import analysis
        from cernenv.physics.fitting import fit_signal_plus_background

        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        start = params.mass_hint_gev or self._strongest_scan_mass(spectrum)
        if start is None:
            counts = spectrum.counts
            background = (
                analysis.background_expectation(episode.background_fit, edges, spectrum.sqrt_s_tev)
                if episode.background_fit
                else np.median(counts)
            )
            centres = 0.5 * (edges[:-1] + edges[1:])
            start = float(centres[int(np.argmax(counts - background))])
        if not edges[0] < start < edges[-1]:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"mass_hint_gev must lie in the spectrum [{edges[0]:g}, {edges[-1]:g}] GeV",
            )
        self._charge_table(ActionType.FIT_RESONANCE)
        resolution = float(spectrum.resolution_gev(start))
        window_width = edges[-1] - edges[0]
        fit = fit_signal_plus_background(
            edges,
            spectrum.counts,
            spectrum.sqrt_s_tev,
            resolution,
            start,
            max_width_gev=(0.25 * window_width if params.float_width else 0.0),
            background=self._background_only(spectrum),
            background_shape=analysis.simulated_background_shape(spectrum),
        )
        episode.resonance_fit = fit
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.milestones.add("resonance_fitted")
        mass_gev = _r(fit.mass_gev, 6)
        found = [] if edges[0] < mass_gev < edges[-1] else [f"the mass ran to the spectrum's edge ({mass_gev:g} GeV)"]
        free = [name for name, error in _FIT_ERRORS.items() if not math.isfinite(getattr(fit, error))]
        if free:
            named = " and ".join([", ".join(free[:-1]), free[-1]] if len(free) > 1 else free)
            found.append(f"the data do not constrain its {named} (no error can be given)")
        no_peak = not edges[0] < mass_gev < edges[-1] or "mass" in free  # where to look again
        edge = {"note": "; ".join(found) + (f": {_NO_PEAK_INSIDE}" if no_peak else "")} if found else {}
        return {
            "channel": spectrum.channel,
            "mass_gev": _r_within(mass_gev, fit.mass_err_gev, 6),
            "mass_err_gev": _r(fit.mass_err_gev, 3),
            "width_gev": _r_within(fit.width_gev, fit.width_err_gev, 3),
            "width_err_gev": _r(fit.width_err_gev, 3),
            "signal_yield": _r_within(fit.signal_yield, fit.signal_yield_err),
            "signal_yield_err": _r(fit.signal_yield_err, 3),
            # its Poisson error for its precision: the fit gives the background yield no error
            "background_yield": _r_within(fit.background_yield, math.sqrt(max(fit.background_yield, 1.0))),
            "resolution_gev": _r(resolution, 3),
            "chi2_per_ndof": _r(fit.chi2 / max(fit.ndof, 1), 3),
            "fit_p_value": _r(fit.fit_p_value, 3),
            "converged": bool(fit.converged),
            **edge,
        }

    def _do_scan_bump(self, params) -> Dict[str, Any]:
        from cernenv import analysis
        from cernenv.physics.significance import count_upcrossings

        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        step = params.step_gev or analysis.default_scan_step(spectrum)  # grid ≤ σ_m/2: no peak missed
        n_points = int((edges[-1] - edges[0]) / step)
        if not 5 <= n_points <= 400:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"{n_points} scan points; choose step_gev between {(edges[-1] - edges[0]) / 400:.3g} "
                f"and {(edges[-1] - edges[0]) / 5:.3g} GeV",
            )
        self._charge_table(ActionType.SCAN_BUMP)
        grid = analysis.scan_grid(edges, step)
        scan = analysis.bump_scan(spectrum, grid, self._background_only(spectrum))
        episode.scan = scan
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.candidates_gev = [_r(m, 5) for m in scan.candidates_gev]
        return {
            "channel": spectrum.channel,
            "best_mass_gev": _r(scan.best_mass_gev, 5),
            "best_z_local": _r(scan.best_z_local, 3),
            "candidates_gev": episode.candidates_gev,
            "points": int(len(grid)),
            "upcrossings_z1": int(count_upcrossings(np.asarray(scan.z_local), 1.0)),
        }

    def _do_measure_angular(self, params) -> Dict[str, Any]:
        from cernenv.physics.angular import AngularMeasurement, allowed_spins, spin_likelihoods

        episode = self._episode
        spectrum = episode.spectrum
        sigma = float(spectrum.resolution_gev(params.mass_gev))
        half = params.window_sigma * sigma
        cos_counts = spectrum.cos_counts(params.mass_gev - half, params.mass_gev + half)
        if cos_counts.sum() < 5:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"only {int(cos_counts.sum())} events within ±{params.window_sigma:g}σ of "
                f"{params.mass_gev:g} GeV; pick the candidate mass or widen window_sigma",
            )
        self._charge_table(ActionType.MEASURE_ANGULAR)
        result = spin_likelihoods(
            cos_counts,
            spectrum.channel,
            signal_fraction=self._fitted_signal_fraction(params.mass_gev, half, cos_counts.sum()),
        )
        episode.angular = AngularMeasurement(result, cos_counts, spectrum.channel, float(params.mass_gev), float(half))
        return {
            "mass_gev": _r(params.mass_gev),
            "events": int(cos_counts.sum()),
            "allowed_spins": list(allowed_spins(spectrum.channel)),
            # a probability to 1e-4: 7.9e-183 is 0, whose digits an angular fit's rounding moved
            "relative_likelihood": {f"spin_{j}": _r(round(p, 4), 3) for j, p in result.relative_likelihood.items()},
            "best_spin": int(result.best_spin),
            "separation_2dlnl": _r(result.separation, 3),
            "signal_fraction": _r(result.signal_fraction, 3),
        }

    def _do_estimate_significance(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        if not edges[0] < params.mass_gev < edges[-1]:
            fit = episode.logbook.get("fit_resonance") or {}
            quoted_fit = fit.get("channel") == spectrum.channel and fit.get("mass_gev") == params.mass_gev
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"mass_gev must lie inside the spectrum ({edges[0]:g}, {edges[-1]:g}) GeV, not at {params.mass_gev:g}"
                + (
                    f": that is the latest fit's mass, which ran to the spectrum's edge: {_NO_PEAK_INSIDE}"
                    if quoted_fit
                    else ""
                ),
            )
        self._charge_table(ActionType.ESTIMATE_SIGNIFICANCE)
        with_systematics = spectrum.channel in episode.systematics
        result = self._significance(spectrum, params.mass_gev, with_systematics, scan=episode.scan)
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.best_significance = max(episode.best_significance, result["z_global"] or 0.0)
        episode.milestones.add("significance_estimated")
        return result

    def _do_request_systematics(self, params) -> Dict[str, Any]:
        from cernenv import analysis

        episode = self._episode
        self._charge_table(ActionType.REQUEST_SYSTEMATICS)
        channel = episode.spectrum.channel
        spectrum = episode.spectrum
        centre = 0.5 * (spectrum.edges_gev[0] + spectrum.edges_gev[-1])
        systematics = {
            "energy_scale_frac": _r(self._scale_uncertainty(channel)),
            "resolution_frac": 0.1,
            "luminosity_frac": LUMINOSITY_UNCERTAINTY_FRAC,
            "spurious_signal_frac_of_stat_error": analysis.SPURIOUS_SIGNAL_STAT_FRACTION,
            "mass_scale_error_at_centre_gev": _r(self._scale_uncertainty(channel) * centre, 3),
        }
        episode.systematics[channel] = systematics
        return {"channel": channel, **systematics, "note": "estimate_significance now includes systematics"}

    def _do_request_theory_review(self, params) -> Dict[str, Any]:
        from cernenv.physics.angular import allowed_spins
        from cernenv.physics.significance import asimov_significance

        episode = self._episode
        spectrum, fit = episode.spectrum, episode.resonance_fit
        self._charge_table(ActionType.REQUEST_THEORY_REVIEW)
        sigma = float(spectrum.resolution_gev(params.mass_gev))
        background = self._background_under_peak(spectrum, params.mass_gev, sigma)
        signal = max(fit.signal_yield, 0.0) * 0.95
        z_now = float(asimov_significance(signal, max(background, 1e-3))) if signal > 0 else 0.0
        lumi = spectrum.luminosity_fb
        needed = lumi * (5.0 / z_now) ** 2 if z_now > 0 else None
        narrow = fit.width_gev < 2.0 * max(fit.width_err_gev, 1e-9) or fit.width_gev < 0.5 * sigma
        return {
            "channel": spectrum.channel,
            "allowed_spins": list(allowed_spins(spectrum.channel)),
            "landau_yang": spectrum.channel == "diphoton",
            "expected_z_at_current_yield": _r(z_now, 3),
            "luminosity_for_expected_5sigma_fb": _r(needed, 3),
            "background_per_fb_under_peak": _r(background / max(lumi, 1e-12), 3),
            "width_consistent_with_resolution": bool(narrow),
        }

    def _do_submit_discovery_claim(self, claim: DiscoveryClaim) -> Dict[str, Any]:
        return self._grade(claim)

    def _strongest_scan_mass(self, spectrum: Spectrum) -> Optional[float]:
        """The best mass of the latest bump scan of `spectrum`'s channel inside its range (the scan
        of this very spectrum, or the logbook's of an earlier one: a rebuilt histogram clears the
        scan, not what it found); None without one."""
        episode = self._episode
        edges = spectrum.edges_gev
        if episode.scan is not None:
            return float(episode.scan.best_mass_gev)
        logged = episode.logbook.get(f"{ActionType.SCAN_BUMP.value}/{spectrum.channel}") or {}
        mass = logged.get("best_mass_gev")
        return float(mass) if isinstance(mass, (int, float)) and edges[0] < mass < edges[-1] else None

    # Physics helpers -------------------------------------------------------------------

    def _record_resolution(self, channel: str, mass_gev: float) -> float:
        """Mass resolution [GeV] of `channel` at `mass_gev` in its current detector state."""
        episode = self._episode
        record = episode.recorder.records[channel]
        return float(
            mass_resolution_gev(
                record.channel,
                mass_gev,
                record.calibration_level,
                record.reconstruction or "standard",
                episode.pileup or "nominal",
            )
        )

    def _default_bin_width(self, channel: str, lo_gev: float, hi_gev: float) -> float:
        """Half the resolution at the window centre, with 20 to 100 bins, never wider than the
        resolution at the low edge (so a narrow peak spans several bins)."""
        finest = self._record_resolution(channel, lo_gev)
        span = hi_gev - lo_gev
        return min(finest, span / 20, max(0.5 * self._resolution(channel), span / 100))

    def _resolution(self, channel: str) -> float:
        lo, hi = self._episode.scenario.search_window_gev
        return self._record_resolution(channel, 0.5 * (lo + hi))

    def _fitted_signal_fraction(self, mass_gev: float, half_width_gev: float, events: float) -> Optional[float]:
        """Signal fraction in [m − half, m + half] from the resonance fit, when one was made near
        `mass_gev`; None lets the spin fit profile it (less powerful: spin 0 + background can
        mimic spin 1)."""
        from cernenv.physics.shapes import signal_bin_fractions

        fit = self._episode.resonance_fit
        if fit is None or abs(fit.mass_gev - mass_gev) > half_width_gev or events <= 0:
            return None
        sigma = float(self._episode.spectrum.resolution_gev(fit.mass_gev))
        edges = np.linspace(mass_gev - half_width_gev, mass_gev + half_width_gev, 41)
        inside = float(signal_bin_fractions(edges, fit.mass_gev, fit.width_gev, sigma).sum())
        return float(np.clip(max(fit.signal_yield, 0.0) * inside / events, 0.0, 1.0))

    def _scale_uncertainty(self, channel: str) -> float:
        """Residual energy-scale uncertainty (1σ of the uniform bias range) after calibration."""
        record = self._episode.recorder.records[channel]
        bias_factor = CALIBRATION_BIAS_FACTOR[record.calibration_level]
        return record.channel.energy_scale_bias_max_frac * bias_factor / np.sqrt(3)

    def _cached_fit(self, key: tuple, fit: Callable[[], Any]) -> Any:
        """`fit()`, made once per episode for each `key` (fits are deterministic functions of their
        inputs, which the key holds, so a repeat, e.g. the grader's reference spectrum when it is
        the agent's own, reuses the result)."""
        fits = self._episode.fits
        if key not in fits:
            fits[key] = fit()
        return fits[key]

    def _background_only(self, spectrum: Spectrum):
        """The background-only fit of `spectrum`, fitted once and reused by every action."""
        from cernenv import analysis

        return self._cached_fit(("background_only", spectrum.fit_key), lambda: analysis.background_fit(spectrum))

    def _background_under_peak(self, spectrum: Spectrum, mass_gev: float, sigma_gev: float, background=None) -> float:
        from cernenv import analysis

        return analysis.background_under_peak(
            spectrum, mass_gev, sigma_gev, background or self._background_only(spectrum)
        )

    def _significance(
        self, spectrum: Spectrum, mass_gev: float, with_systematics: bool, scan: Optional[Any]
    ) -> Dict[str, Any]:
        """`cernenv.analysis.significance` at `mass_gev`, with the episode's cached fits; `scan`: a
        bump scan of this spectrum (its upcrossings), or None (the analytic count)."""
        from cernenv import analysis

        background = self._background_only(spectrum)
        spurious = analysis.spurious_signal_events(spectrum, mass_gev, background) if with_systematics else 0.0
        local = self._cached_fit(
            ("local_significance", spectrum.fit_key, float(mass_gev), float(spurious)),
            lambda: analysis.local_significance(spectrum, mass_gev, spurious, background),
        )
        result = analysis.significance(spectrum, mass_gev, with_systematics, scan, background, local)
        return {
            "mass_gev": _r(mass_gev),
            "q0": _r(result["q0"], 4),
            "z_local": _r(result["z_local"], 3),
            "p_local": _r(result["p_local"], 3),
            "local_p_method": result["local_p_method"],
            "z_global": _r(result["z_global"], 3),
            "p_global": _r(result["p_global"], 3),
            "trials_factor": _r(result["trials_factor"], 3),
            "upcrossings_source": result["upcrossings_source"],
            "systematics_included": bool(with_systematics),
        }
