"""A template agent to copy: a scripted physicist that uses only `cernenv`.

    make evaluate AGENT=examples.template_agent:TemplateAgent SUITE=draw:20

`reset()` starts an episode; `act(observation)` gets a `CollisionObservation` and returns the next
action, here an `ExperimentAction` (a plain dict of the same shape works as well: docs/agents.md).
Numbers the environment showed are quoted by reference (`"@fit.mass_gev"`), never retyped. The plan:
the highest beam energy, the trigger that records the task's first channel best, half of what is
affordable booked and collected, that channel calibrated, reconstructed, histogrammed, scanned and
fitted, the significance estimated, and a discovery claimed at 3 sigma global or more (with the fit's
mass and its uncertainty, when the fit could give one), else "nothing there". A refused action is not
retried: the plan moves on, and the claim ends the episode anyway (a fit whose mass ran to the
spectrum's edge has its significance estimate refused, and the claim is then "nothing there").
"""

from __future__ import annotations

from cernenv import ExperimentAction
from cernenv.detector import TRIGGERS
from cernenv.models import CollisionObservation

DISCOVERY_Z_GLOBAL = 3.0
"""The global significance [sigma] from which the agent claims a discovery."""


class TemplateAgent:
    def reset(self) -> None:
        self.step = 0

    def act(self, observation: CollisionObservation) -> ExperimentAction:
        task = observation.task
        channel = task.available_channels[0]
        trigger = max(task.available_triggers, key=lambda name: TRIGGERS.get(name, {}).get(channel, 0.0))
        plan = [
            ("configure_beam", {"beam_energy_tev": max(task.available_beam_energies_tev)}),
            ("set_trigger", {"trigger": trigger}),
            ("allocate_luminosity", {"luminosity_fb": "@luminosity.affordable_fb*0.5"}),
            ("collect_collisions", {"luminosity_fb": "@luminosity.booked_fb"}),
            ("calibrate_detector", {"channel": channel}),
            ("reconstruct_tracks", {"channel": channel}),
            ("select_channel", {"channel": channel}),
            ("build_invariant_mass", {}),
            ("scan_bump", {}),
            ("fit_resonance", {}),
            ("estimate_significance", {"mass_gev": "@fit.mass_gev"}),
        ]
        self.step += 1
        if self.step <= len(plan):
            action_type, parameters = plan[self.step - 1]
            return ExperimentAction(action_type=action_type, parameters=parameters)
        return self.claim(observation, channel)

    @staticmethod
    def claim(observation: CollisionObservation, channel: str) -> ExperimentAction:
        references = observation.references
        z_global = references.get("significance.significance_sigma")
        measured = "fit.mass_uncertainty_gev" in references  # absent when the data do not constrain the mass
        if isinstance(z_global, (int, float)) and z_global >= DISCOVERY_Z_GLOBAL and measured:
            parameters = {
                "discovered": True,
                "mass_gev": "@fit.mass_gev",
                "mass_uncertainty_gev": "@fit.mass_uncertainty_gev",
                "channel": channel,
                "significance_sigma": "@significance.significance_sigma",
                "confidence": 0.8,
            }
        else:
            parameters = {"discovered": False, "confidence": 0.7}
        return ExperimentAction(action_type="submit_discovery_claim", parameters=parameters)
