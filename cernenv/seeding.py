"""The environment's random streams: what each draws and how its seed comes from an episode's seed.

An episode's world is a function of its seed, and in evaluation of a secret salt (the evaluator's
key and a per-reset nonce, `cernenv.environment`). Each stream has its own seed sequence, so
drawing more from one never shifts another, and the streams that hold the answer mix in the
secret, without which the public code cannot reproduce them:

| stream   | seed sequence                           | draws                                           | secret |
|----------|-----------------------------------------|-------------------------------------------------|--------|
| task     | `[seed, level, TASK_STREAM]`            | a procedural task's configuration (window,      | no     |
|          |                                         | channels, budget)                               |        |
| particle | `[seed, PARTICLE_STREAM + level, salt]` | whether a particle exists; its mass, width,     | yes    |
|          |                                         | spin, decays and cross-section                  |        |
| data     | `[seed, DATA_STREAM, salt]`             | the recorded collisions (signal, background,    | yes    |
|          |                                         | the selections' thinning seed)                  |        |

`level` is the difficulty's index in `cernenv.scenarios.DIFFICULTIES` (a curated campaign has no
task or particle stream: its task and particle are fixed). `salt` is two 64-bit words of the
secret's SHA-256 (nothing without a secret). The stream numbers are arbitrary distinct primes;
changing one changes every world (and every committed evidence file's replay).
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Tuple

import numpy as np

TASK_STREAM = 104_729
"""Third word of the task stream's seed sequence."""
PARTICLE_STREAM = 7_919
"""Second word of the particle stream's seed sequence, plus the difficulty level."""
DATA_STREAM = 31_337
"""Second word of the data stream's seed sequence."""


def salt_words(secret_salt: Optional[str]) -> Tuple[int, ...]:
    """The secret as two 64-bit words for a hidden stream's seed (none without a secret)."""
    if not secret_salt:
        return ()
    digest = hashlib.sha256(secret_salt.encode("utf-8")).digest()
    return (int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little"))


def hidden_stream_seed(seed: int, stream: int, secret_salt: Optional[str] = None) -> List[int]:
    """The seed sequence of a hidden stream (`stream`: `PARTICLE_STREAM + level` or `DATA_STREAM`),
    the secret mixed in when one is given."""
    return [int(seed), int(stream), *salt_words(secret_salt)]


def task_rng(seed: int, level: int) -> np.random.Generator:
    """The task stream of a procedural campaign of difficulty index `level` (public: the visible task)."""
    return np.random.default_rng([int(seed), int(level), TASK_STREAM])


def particle_rng(seed: int, level: int, secret_salt: Optional[str] = None) -> np.random.Generator:
    """The particle stream of a procedural campaign of difficulty index `level`."""
    return np.random.default_rng(hidden_stream_seed(seed, PARTICLE_STREAM + int(level), secret_salt))


def data_rng(seed: int, secret_salt: Optional[str] = None) -> np.random.Generator:
    """The data stream of an episode: the collisions it records."""
    return np.random.default_rng(hidden_stream_seed(seed, DATA_STREAM, secret_salt))
