"""CERNenv: a simulated LHC discovery campaign as an OpenEnv environment.

Installs and imports without any machine-learning library.
"""

from cernenv._deferred_imports import defer_openenv_package_inits

defer_openenv_package_inits()  # before anything imports openenv (see the module)

from cernenv._version import __version__  # noqa: E402
from cernenv.actions import ACTION_TABLE  # noqa: E402
from cernenv.environment import CERNCollisionEnvironment  # noqa: E402
from cernenv.models import (  # noqa: E402
    ActionType,
    CernState,
    CollisionObservation,
    DiscoveryClaim,
    ExperimentAction,
)
from cernenv.scenarios import list_scenarios  # noqa: E402

__all__ = [
    "ACTION_TABLE",
    "ActionType",
    "CERNCollisionEnvironment",
    "CernState",
    "CollisionObservation",
    "DiscoveryClaim",
    "ExperimentAction",
    "list_scenarios",
    "__version__",
]
