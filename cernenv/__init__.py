"""CERNenv: a simulated LHC discovery campaign as an OpenEnv environment.

Installs and imports without any machine-learning library.
"""

from cernenv.actions import ACTION_TABLE
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import (
    ActionType,
    CernState,
    CollisionObservation,
    DiscoveryClaim,
    ExperimentAction,
)
from cernenv.scenarios import list_scenarios

__version__ = "0.1.0"

__all__ = [
    "ACTION_TABLE",
    "ActionType",
    "CERNCollisionEnvironment",
    "CernState",
    "CollisionObservation",
    "DiscoveryClaim",
    "ExperimentAction",
    "list_scenarios",
]
