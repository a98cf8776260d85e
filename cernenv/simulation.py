"""Recorded collisions and their reconstruction into invariant-mass spectra.

Background is recorded as Poisson counts on a fine (mass × |cos θ*|) grid over the
search window; the smooth continuum is insensitive to the detector smearing, so it
is drawn directly at reconstructed level (an approximation we accept). Signal is
recorded event by event (true mass, a standard-normal smearing draw, a selection
draw and a decay-angle bin), so a later calibration or reconstruction re-processes
*the same events*, as re-reconstruction does in a real experiment.

The signal's events are drawn as a block of candidates whose size depends only on what the
agent can see (the task's `signal_capacity_per_fb`, the luminosity and the trigger), the first
n of them real, n ~ Poisson(expected signal): every array the simulation draws, stores and
histograms has the same size in every hidden world of a visible task, so the time taking data
and building spectra takes does not tell how many signal events there are.

Every random draw comes from the episode's generator, so an episode is reproducible
from its seed and its actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Dict, Optional, Tuple

import hist
import numpy as np

from cernenv.detector import (
    CALIBRATION_BIAS_FACTOR,
    CHANNELS,
    PILEUP_SETTINGS,
    RECONSTRUCTIONS,
    Channel,
    cross_section_scale,
    expected_background_events,
    mass_resolution_gev,
)
from cernenv.scenarios import ParticleTruth

N_FINE_BINS = 1200
N_COS_BINS = 10
MIN_SPECTRUM_BINS = 10
MAX_SPECTRUM_BINS = 400
# The loosest selection ("fast") keeps this much background relative to "standard";
# background is recorded at that level and thinned for tighter selections.
_LOOSEST_BACKGROUND = max(r.background_efficiency_factor for r in RECONSTRUCTIONS.values())


@dataclass
class ChannelRecord:
    """Everything recorded in one decay channel during the episode."""

    channel: Channel
    background_counts: np.ndarray  # (N_FINE_BINS, N_COS_BINS), loosest selection
    energy_scale_bias_frac: float  # hidden; calibration shrinks it
    luminosity_fb: float = 0.0
    signal_true_mass_gev: np.ndarray = field(default_factory=lambda: np.zeros(0))
    signal_smear: np.ndarray = field(default_factory=lambda: np.zeros(0))
    signal_selection_draw: np.ndarray = field(default_factory=lambda: np.zeros(0))
    signal_cos_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    signal_real: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """Which signal candidates are events (the rest pad each block to its visible size)."""
    signal_events: int = 0
    calibration_level: int = 0
    reconstruction: Optional[str] = None
    selection_seed: int = 0

    _selected: Optional[Tuple[tuple, np.ndarray]] = field(default=None, repr=False)
    _recorded: Optional[Tuple[float, int]] = field(default=None, repr=False)

    @property
    def recorded_events(self) -> int:
        if self._recorded is None or self._recorded[0] != self.luminosity_fb:  # the data change with it
            self._recorded = (
                self.luminosity_fb,
                int(self.background_counts.sum() / _LOOSEST_BACKGROUND) + self.signal_events,
            )
        return self._recorded[1]

    def selected_background(self, reconstruction: str) -> np.ndarray:
        """The recorded background that passes `reconstruction`'s selection (the loosest selection
        thinned, reproducibly: the same events pass whatever mass range is histogrammed).
        Computed once per reconstruction and data set."""
        key = (reconstruction, int(round(self.luminosity_fb * 1e6)))
        if self._selected is None or self._selected[0] != key:
            kept_fraction = RECONSTRUCTIONS[reconstruction].background_efficiency_factor / _LOOSEST_BACKGROUND
            background = self.background_counts
            if kept_fraction < 1.0:
                thin_rng = np.random.default_rng(
                    [self.selection_seed, list(RECONSTRUCTIONS).index(reconstruction), key[1]]
                )
                background = thin_rng.binomial(background, kept_fraction)
            self._selected = (key, background)
        return self._selected[1]


@dataclass(frozen=True)
class Spectrum:
    """A reconstructed invariant-mass histogram (mass × |cos θ*| bin) of one channel."""

    channel: str
    histogram: hist.Hist
    sqrt_s_tev: float
    calibration_level: int
    reconstruction: str
    pileup: str
    luminosity_fb: float

    @property
    def edges_gev(self) -> np.ndarray:
        return self.histogram.axes[0].edges

    @cached_property
    def counts(self) -> np.ndarray:
        """Events per mass bin (summed over |cos θ*|); computed once, a spectrum never changes."""
        return self.histogram.values().sum(axis=1)

    @cached_property
    def fit_key(self) -> tuple:
        """Everything a fit of the mass spectrum depends on (binning, counts, √s and the detector
        state that sets the resolution): two spectra with equal keys give identical fits."""
        return (
            self.channel,
            self.sqrt_s_tev,
            self.calibration_level,
            self.reconstruction,
            self.pileup,
            self.edges_gev.tobytes(),
            self.counts.tobytes(),
        )

    def resolution_gev(self, mass_gev):
        return mass_resolution_gev(
            CHANNELS[self.channel], mass_gev, self.calibration_level, self.reconstruction, self.pileup
        )

    def cos_counts(self, mass_lo_gev: float, mass_hi_gev: float) -> np.ndarray:
        """|cos θ*| counts of events with reconstructed mass in [lo, hi) (whole bins)."""
        centres = self.histogram.axes[0].centers
        inside = (centres >= mass_lo_gev) & (centres < mass_hi_gev)
        return self.histogram.values()[inside].sum(axis=0)


class CollisionRecorder:
    """The episode's recorded data, channel by channel."""

    def __init__(
        self,
        window_gev: Tuple[float, float],
        channels: Tuple[str, ...],
        truth: Optional[ParticleTruth],
        rng: np.random.Generator,
        signal_capacity_per_fb: Optional[Callable[[str, float], float]] = None,
    ) -> None:
        """`signal_capacity_per_fb(channel, sqrt_s_tev)`: the most signal events per fb^-1, before
        the trigger, any hidden world of the task can record (`Scenario.signal_capacity_per_fb`);
        None: the truth's own rate (a recorder made for a known world, as the tests make)."""
        self.window_gev = window_gev
        self.fine_edges_gev = np.linspace(window_gev[0], window_gev[1], N_FINE_BINS + 1)
        self.truth = truth
        # what `_record_signal` draws from in a channel without a signal (no particle, or one
        # that does not decay there): no events (no σ·B), by the same operations as a particle's
        self._no_signal = ParticleTruth(0.5 * (window_gev[0] + window_gev[1]), 0.0, 0, "gg", {})
        self.rng = rng
        self.signal_capacity_per_fb = signal_capacity_per_fb or self._own_rate_per_fb
        self.records: Dict[str, ChannelRecord] = {}
        for name in channels:
            spec = CHANNELS[name]
            self.records[name] = ChannelRecord(
                channel=spec,
                background_counts=np.zeros((N_FINE_BINS, N_COS_BINS), dtype=np.int64),
                energy_scale_bias_frac=float(rng.uniform(-1, 1) * spec.energy_scale_bias_max_frac),
                selection_seed=int(rng.integers(2**31)),
            )

    def collect(
        self, luminosity_fb: float, sqrt_s_tev: float, pileup: str, trigger_efficiency: Dict[str, float]
    ) -> Dict[str, int]:
        """Record `luminosity_fb` of collisions; returns the events recorded per channel."""
        from cernenv.physics.angular import background_angular_probabilities

        recorded: Dict[str, int] = {}
        pileup_factor = PILEUP_SETTINGS[pileup].trigger_efficiency_factor
        for name, record in self.records.items():
            efficiency = trigger_efficiency.get(name, 0.0) * pileup_factor
            if efficiency <= 0.0:
                continue
            spec = record.channel
            background = expected_background_events(spec, self.fine_edges_gev, sqrt_s_tev, luminosity_fb)
            expected = np.outer(
                background * efficiency * _LOOSEST_BACKGROUND, background_angular_probabilities(name, N_COS_BINS)
            )
            before = record.recorded_events
            record.background_counts += self.rng.poisson(expected)
            self._record_signal(record, luminosity_fb, sqrt_s_tev, efficiency)
            record.luminosity_fb += luminosity_fb
            recorded[name] = record.recorded_events - before  # so the collections add up to the total
        return recorded

    def _own_rate_per_fb(self, channel: str, sqrt_s_tev: float) -> float:
        truth = self.truth
        if truth is None:
            return 0.0
        scale = cross_section_scale(truth.mass_gev, sqrt_s_tev, truth.production)
        return truth.sigma_br_fb.get(channel, 0.0) * scale * CHANNELS[channel].signal_efficiency

    def _record_signal(self, record: ChannelRecord, luminosity_fb: float, sqrt_s_tev: float, efficiency: float) -> int:
        """Draw the signal events of `record`'s channel for `luminosity_fb`; returns how many.

        A block of candidates is drawn whose size depends on the visible task alone (its capacity
        with a 6σ Poisson margin; a count beyond it, below 1e-9 of blocks, enlarges the block),
        with the same operations whether or not the channel holds a signal (no particle, or one
        that does not decay here: a mean of 0 events); its first n are the events."""
        from cernenv.physics.angular import angular_bin_probabilities

        name = record.channel.name
        particle = self.truth if self.truth is not None else self._no_signal
        source = particle if particle.sigma_br_fb.get(name, 0.0) > 0.0 else self._no_signal
        mean = (
            source.sigma_br_fb.get(name, 0.0)
            * cross_section_scale(source.mass_gev, sqrt_s_tev, source.production)
            * luminosity_fb
            * record.channel.signal_efficiency
            * efficiency
        )
        n = int(self.rng.poisson(mean))
        capacity = self.signal_capacity_per_fb(name, sqrt_s_tev) * luminosity_fb * efficiency
        size = max(n, int(np.ceil(capacity + 6.0 * np.sqrt(capacity))) + 16)
        offsets = self.rng.standard_cauchy(size)  # Breit-Wigner offsets of the true masses
        true_mass = source.mass_gev + 0.5 * source.width_gev * offsets
        probabilities = angular_bin_probabilities(source.spin, name, N_COS_BINS)
        record.signal_true_mass_gev = np.concatenate([record.signal_true_mass_gev, true_mass])
        record.signal_smear = np.concatenate([record.signal_smear, self.rng.standard_normal(size)])
        record.signal_selection_draw = np.concatenate([record.signal_selection_draw, self.rng.random(size)])
        record.signal_cos_bin = np.concatenate(
            [record.signal_cos_bin, self.rng.choice(N_COS_BINS, size=size, p=probabilities)]
        )
        record.signal_real = np.concatenate([record.signal_real, np.arange(size) < n])
        record.signal_events += n
        return n

    def build_spectrum(
        self, channel: str, mass_range_gev: Tuple[float, float], bin_width_gev: float, sqrt_s_tev: float, pileup: str
    ) -> Spectrum:
        """Histogram the reconstructed events of `channel`. The range and bin width snap to the
        fine recording grid (the returned histogram's edges are the ones used)."""
        record = self.records[channel]
        reconstruction = RECONSTRUCTIONS[record.reconstruction or "standard"]
        fine_width = self.fine_edges_gev[1] - self.fine_edges_gev[0]
        group = max(1, int(round(bin_width_gev / fine_width)))
        first = int(np.clip(np.floor((mass_range_gev[0] - self.window_gev[0]) / fine_width + 1e-9), 0, N_FINE_BINS - 1))
        last = int(
            np.clip(np.ceil((mass_range_gev[1] - self.window_gev[0]) / fine_width - 1e-9), first + 1, N_FINE_BINS)
        )
        n_bins = max(1, (last - first) // group)
        last = first + n_bins * group
        edges = self.fine_edges_gev[first : last + 1 : group]

        background = record.selected_background(reconstruction.name)[first:last]
        background = background.reshape(n_bins, group, N_COS_BINS).sum(axis=1)

        histogram = hist.Hist(
            hist.axis.Variable(edges, name="mass_gev", label=f"m({record.channel.final_state_mathtext}) [GeV]"),
            hist.axis.Integer(
                0, N_COS_BINS, name="cos_theta_bin", label="|cos θ*| bin", underflow=False, overflow=False
            ),
            storage=hist.storage.Int64(),
        )
        counts = np.zeros((edges.size + 1, N_COS_BINS), dtype=np.int64)  # with the mass under/overflow
        counts[1:-1] = background
        # the signal events: every candidate is processed, the events are counted (the same
        # operations on arrays of the same size in every hidden world of the task)
        keep = record.signal_real & (record.signal_selection_draw < reconstruction.signal_efficiency_factor)
        true_mass = record.signal_true_mass_gev
        scale = 1.0 + record.energy_scale_bias_frac * CALIBRATION_BIAS_FACTOR[record.calibration_level]
        sigma = mass_resolution_gev(record.channel, true_mass, record.calibration_level, reconstruction.name, pileup)
        reco_mass = true_mass * scale + sigma * record.signal_smear
        # what histogram.fill does: bin i holds [edge_i, edge_i+1); 0 and the last are the flow bins
        index = np.searchsorted(edges, reco_mass, side="right") * N_COS_BINS + record.signal_cos_bin
        counts += np.bincount(index, weights=keep, minlength=counts.size).astype(np.int64).reshape(counts.shape)
        histogram.view(flow=True)[...] = counts
        return Spectrum(
            channel, histogram, sqrt_s_tev, record.calibration_level, reconstruction.name, pileup, record.luminosity_fb
        )
