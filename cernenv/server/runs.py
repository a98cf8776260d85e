"""Scored runs: the evaluation server, not the client, decides what is played, and commits to the
worlds before anyone plays them.

An operator opens a run when starting the server (`python -m cernenv.server --scored-run v3`):
the run holds a list of tasks (`cernenv.suite.selected_tasks`), in an order the server draws and
keeps to itself. Each client reset gets the run's next task — a reset names no seed, scenario,
difficulty or secret — and each task is assigned once. Every assigned episode ends in the run's
ledger, abandoned ones too (a reset, a disconnect, an idle timeout, the server's shutdown), and a
run's scorecard (`python -m lib.measure.scorecard`) counts an abandoned or unplayed task as a
failure: nobody can choose their tasks or drop the ones they are unsure of.

Commit before play, mix in the entrant's nonce, reveal after. A run holds an operator's secret
(32 random bytes, never the server's long-lived one) and an Ed25519 signing key, both made when it
opens. Before the first reset the server publishes the SHA-256 of the run's commitment document
(`commitment_of`): the selection, every task, the order they are handed out in, the operator's
secret, the signing key's public half, cernenv's version and commit. The hash is the `RunOpened`
line's `commitment` and is served by `GET /evaluation`; it says nothing of the secret. The
entrant, having seen it, sends a nonce of its own (`POST /evaluation/nonce`, `ScoredRun.seed`):
no task is handed out before it. Every world of the run is drawn with the secret mixed from both
(`worlds_secret`: an HMAC-SHA-256 of the nonce under the operator's secret) and a nonce derived
from that for each task (`world_nonce`): the operator cannot choose worlds (its secret is
committed before the nonce is known), and the entrant cannot (it does not know the secret). When
the run ends the server writes the document itself, the reveal (`reveal_path`, readable by the
operator alone), for the operator to publish with the ledger: anyone can then check it against
the published hash, draw every world again and replay every recorded episode
(`cernenv.server.audit`, `python -m lib.measure.scorecard LEDGER --reveal REVEAL`). A development
run (`dev:N`: the validation split's first N tasks) draws its worlds with a public secret instead
(`DEVELOPMENT_WORLDS_SECRET`), the same in every run, so that two agents can be compared on the same
worlds: it is a measurement for an agent's developer, not a score.

The run's ledger is a file of its own (`ResultsLedger(run_file=True)`), locked while the server
runs, never rotated, whose lines chain (each carries the hash of the line before) and are signed
with the run's key: its first line (`RunOpened`) names its id, its tasks, the operator's secret's
fingerprint, the public key, the code and the commitment; its second (`RunSeeded`) the entrant's
nonce; its last (`RunEnded`) says why it ended (every task played, or the server stopped), with
its counts. `describe()` serves the receipt of the ledger's last line (its hash and signature):
an entrant that keeps one after each of its episodes can later show that a published ledger is
not the one the server signed while it played (`python -m lib.measure.scorecard --receipts`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cernenv._version import __version__
from cernenv.provenance import source_revision
from cernenv.server.evaluation import fingerprint, open_private_file
from cernenv.server.ledger import ResultsLedger, public_key_hex, utc_now
from cernenv.server.wire import RequestError
from cernenv.suite import SuiteTask, is_development, selected_tasks

logger = logging.getLogger("cernenv.server")

COMMITMENT_FORMAT = "cernenv scored-run commitment 2"
"""The `format` of a commitment document: what its fields are and how it is hashed (`commitment_of`)."""


def source_commit() -> Optional[str]:
    """The git commit of the code the server runs, "+modified" when its tracked files changed
    (None when it is not a git checkout)."""
    revision = source_revision()
    if revision["commit"] is None:
        return None
    return revision["commit"] + ("+modified" if revision["dirty"] else "")


def canonical_json(value: Any) -> bytes:
    """`value` as the bytes a commitment hashes: JSON with sorted keys, no spaces, ASCII only."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def commitment_of(document: Mapping[str, Any]) -> str:
    """The commitment to a run's document: the SHA-256 (hex) of its canonical JSON."""
    return hashlib.sha256(canonical_json(document)).hexdigest()


def world_nonce(world_secret: str, task_index: int) -> str:
    """The nonce mixed into task `task_index`'s hidden streams, with the world secret: an HMAC-SHA-256
    of the task's index under the secret (32 hex digits), so the secret alone rebuilds every world."""
    message = f"world nonce of task {task_index}".encode()
    return hmac.new(world_secret.encode("utf-8"), message, hashlib.sha256).hexdigest()[:32]


RUN_END_REASONS = ("every task played", "server shut down", "ended by its entrant")
"""Why a run ends, as its `RunEnded` line says: every task's episode ended, the server stopped, or
the entrant ended it (`POST /evaluation/end`, signed with its key: the tasks it did not play count
as failures, and the end line is served to it, so its receipts cover the run to its end)."""

ENTRANT_CONTEXT = b"cernenv scored-run entrant\x00"
END_CONTEXT = b"cernenv scored-run end\x00"
RECEIPTS_CONTEXT = b"cernenv scored-run receipts\x00"
"""What an entrant's Ed25519 key signs, before the statement: its nonce and agent
(`entrant_statement`), the end of its run (`end_statement`), its receipts (`receipts_statement`);
a signature of one is never one of another."""


def entrant_statement(run_id: str, commitment: str, nonce: str, agent: str, agent_sha256: str) -> bytes:
    """What the entrant signs when it sends its nonce: the run, the commitment it read, its nonce and
    what plays (the agent's module:Class and the SHA-256 of its module's file)."""
    fields = {"run_id": run_id, "commitment": commitment, "nonce": nonce, "agent": agent, "agent_sha256": agent_sha256}
    return ENTRANT_CONTEXT + canonical_json(fields)


def end_statement(run_id: str) -> bytes:
    """What the entrant signs to end its run (`POST /evaluation/end`)."""
    return END_CONTEXT + run_id.encode("utf-8")


def receipts_statement(receipts: Mapping[str, Any]) -> bytes:
    """What the entrant signs of its receipts file: everything in it but its signature."""
    return RECEIPTS_CONTEXT + canonical_json({k: v for k, v in receipts.items() if k != "entrant_signature"})


def entrant_signature_holds(public_key: Any, statement: bytes, signature: Any) -> bool:
    """Whether `signature` (hex) is the Ed25519 signature of `statement` under `public_key` (hex, raw 32 bytes)."""
    if not isinstance(public_key, str) or not isinstance(signature, str):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key)).verify(bytes.fromhex(signature), statement)
        return True
    except (ValueError, InvalidSignature):
        return False


AGENT_SHA256_CHARACTERS = 64

ENTRANT_NONCE_CHARACTERS = (16, 256)
"""The shortest and longest entrant's nonce [characters, printable ASCII]: 16 is 64 bits as hex."""


def worlds_secret(operator_secret: str, run_id: str, entrant_nonce: str) -> str:
    """The secret every world of run `run_id` is drawn with: an HMAC-SHA-256 (hex) of the entrant's
    nonce under the operator's committed secret."""
    message = f"cernenv worlds of run {run_id}\x00{entrant_nonce}".encode("utf-8")
    return hmac.new(operator_secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


DEVELOPMENT_WORLDS_SECRET = "cernenv development worlds: public, the same in every run"
"""The secret every world of a development run (`dev:N`, `cernenv.suite.development_tasks`) is drawn
with, in place of `worlds_secret`: public, so that every development run draws the same world for
the same task and two agents are compared on the same worlds. Anyone can draw those worlds: such a
run measures an agent for its developer, it scores nothing."""


def run_worlds_secret(selection: str, operator_secret: str, run_id: str, entrant_nonce: str) -> str:
    """The secret the worlds of a run of `selection` are drawn with: `DEVELOPMENT_WORLDS_SECRET` for
    development tasks (`dev:N`), else `worlds_secret`, which neither the operator nor the entrant
    chooses alone."""
    if is_development(selection):
        return DEVELOPMENT_WORLDS_SECRET
    return worlds_secret(operator_secret, run_id, entrant_nonce)


def nonce_problem(nonce: Any) -> Optional[str]:
    """Why `nonce` cannot be an entrant's nonce, or None."""
    low, high = ENTRANT_NONCE_CHARACTERS
    if not isinstance(nonce, str) or not low <= len(nonce) <= high or not all(" " < c <= "~" for c in nonce):
        return (
            f"an entrant's nonce is {low} to {high} printable ASCII characters without spaces, chosen by the entrant "
            "after reading the commitment (e.g. 32 random hex digits)"
        )
    return None


def reveal_path(ledger: Path) -> Path:
    """Where the server writes a run's reveal: beside its ledger, `RUN_ID.reveal.json`."""
    return Path(ledger).with_suffix(".reveal.json")


class ScoredRun:
    """One scored run over `tasks` (see the module docstring). Its ledger is `ledger_path`, a new
    file, or `RUN_ID.jsonl` inside it when it is a folder."""

    def __init__(self, selection: str, ledger_path: Path) -> None:
        self.selection = selection
        self.tasks: Tuple[SuiteTask, ...] = selected_tasks(selection)
        self.run_id = secrets.token_hex(8)
        self.operator_secret = secrets.token_urlsafe(32)
        self.secret_fingerprint = fingerprint(self.operator_secret)
        self._signing_key = Ed25519PrivateKey.generate()
        self.public_key = public_key_hex(self._signing_key)
        self.entrant_nonce: Optional[str] = None
        self.entrant_public_key: Optional[str] = None
        self.agent: Optional[str] = None
        self.world_secret: Optional[str] = None
        """The worlds' secret (`worlds_secret`), once the entrant's nonce came (`seed`)."""
        self.worlds_fingerprint: Optional[str] = None
        self._order = list(range(len(self.tasks)))
        secrets.SystemRandom().shuffle(self._order)
        path = Path(ledger_path)
        self.ledger_path = path / f"{self.run_id}.jsonl" if path.is_dir() else path
        self.ledger = ResultsLedger(self.ledger_path, run_file=True, signing_key=self._signing_key)
        self.commit = source_commit()
        self.document: Dict[str, Any] = {
            "format": COMMITMENT_FORMAT,
            "run_id": self.run_id,
            "selection": selection,
            "tasks": [task.to_dict() for task in self.tasks],
            "order": list(self._order),
            "operator_secret": self.operator_secret,
            "public_key": self.public_key,
            "cernenv_version": __version__,
            "commit": self.commit,
        }
        self.commitment = commitment_of(self.document)
        self._lock = threading.Lock()
        self._assigned = 0
        self._ended: set = set()
        self._recorded = {"graded": 0, "abandoned": 0}
        self.end_reason: Optional[str] = None
        self.reveal_file: Optional[Path] = None
        self.ledger.append(
            {
                "record": "run_opened",
                "opened_at": utc_now(),
                "run_id": self.run_id,
                "selection": selection,
                "n_tasks": len(self.tasks),
                "tasks": self.document["tasks"],
                "secret_fingerprint": self.secret_fingerprint,
                "cernenv_version": __version__,
                "commit": self.commit,
                "commitment": self.commitment,
                "public_key": self.public_key,
            }
        )

    def seed(self, entrant_nonce: Any, entrant: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """Take the entrant's nonce (once, before any task is handed out) with what plays: `entrant`
        holds `agent` (module:Class), `agent_sha256`, `public_key` (the entrant's Ed25519 key, hex) and
        `signature`, that key's signature of `entrant_statement`. The worlds' secret is mixed from the
        nonce and the operator's (`worlds_secret`), and the ledger's `RunSeeded` line records them all;
        what `describe` says then. A RequestError when it is not a nonce, the signature does not hold,
        or the run has its nonce."""
        if self.entrant_nonce is not None:
            error = RequestError(
                f"scored run {self.run_id} already has its entrant's nonce ({self.entrant_nonce}): a run takes one"
            )
            error.status_code = 409
            raise error
        problem = nonce_problem(entrant_nonce)
        entrant = dict(entrant or {})
        agent, agent_sha256 = entrant.get("agent"), entrant.get("agent_sha256")
        if problem is None and not (isinstance(agent, str) and 0 < len(agent) <= 255):
            problem = "the nonce comes with what plays: agent, its module:Class (at most 255 characters)"
        if problem is None and not (
            isinstance(agent_sha256, str)
            and len(agent_sha256) == AGENT_SHA256_CHARACTERS
            and all(c in "0123456789abcdef" for c in agent_sha256)
        ):
            problem = "the nonce comes with agent_sha256, the SHA-256 (64 hex digits) of the agent's module file"
        if problem is None and not entrant_signature_holds(
            entrant.get("public_key"),
            entrant_statement(self.run_id, self.commitment, entrant_nonce, agent, agent_sha256),
            entrant.get("signature"),
        ):
            problem = (
                "the nonce comes with the entrant's Ed25519 public_key and its signature of the run, the commitment, "
                "the nonce and the agent (cernenv.server.runs.entrant_statement): it does not verify"
            )
        if problem:
            raise RequestError(problem)
        with self._lock:
            if self.entrant_nonce is not None:
                error = RequestError(
                    f"scored run {self.run_id} already has its entrant's nonce ({self.entrant_nonce}): a run takes one"
                )
                error.status_code = 409
                raise error
            secret = run_worlds_secret(self.selection, self.operator_secret, self.run_id, entrant_nonce)
            self.ledger.append(
                {
                    "record": "run_seeded",
                    "seeded_at": utc_now(),
                    "run_id": self.run_id,
                    "entrant_nonce": entrant_nonce,
                    "secret_fingerprint": fingerprint(secret),
                    "agent": agent,
                    "agent_sha256": agent_sha256,
                    "entrant_public_key": entrant["public_key"],
                    "entrant_signature": entrant["signature"],
                }
            )
            self.entrant_nonce, self.world_secret, self.worlds_fingerprint = entrant_nonce, secret, fingerprint(secret)
            self.entrant_public_key, self.agent = entrant["public_key"], agent
        return self.describe()

    def end_by_entrant(self, signature: Any) -> Dict[str, Any]:
        """End the run at its entrant's word (`signature`: its key's signature of `end_statement`),
        so that the entrant is served the end line and its receipts cover the whole run; what
        `describe` says then (the run may have ended already: every task played). A RequestError
        (403) when the signature is not the entrant's."""
        if self.entrant_public_key is None or not entrant_signature_holds(
            self.entrant_public_key, end_statement(self.run_id), signature
        ):
            error = RequestError(
                f"scored run {self.run_id} is ended early only by its entrant: sign end_statement(run_id) with the "
                "key that sent the nonce"
            )
            error.status_code = 403
            raise error
        self.end(RUN_END_REASONS[2])
        return self.describe()

    def next_task(self) -> Tuple[int, int, SuiteTask]:
        """(index in `tasks`, place in the order handed out, task) of the next task to play; a
        RequestError once none is left."""
        with self._lock:
            if self.world_secret is None and self.end_reason is None:
                raise RequestError(
                    f"scored run {self.run_id} waits for the entrant's nonce: read its commitment (GET /evaluation), "
                    'then send POST /evaluation/nonce {"nonce": "..."} (16 to 256 characters of your choosing); '
                    "its worlds are drawn with it"
                )
            if self.end_reason is not None or self._assigned >= len(self.tasks):
                raise RequestError(
                    f"scored run {self.run_id} has assigned all {len(self.tasks)} of its tasks"
                    + (f" and ended ({self.end_reason})" if self.end_reason else "")
                    + ": there is nothing more to play on this server"
                )
            assignment = self._assigned
            index = self._order[assignment]
            self._assigned += 1
            return index, assignment, self.tasks[index]

    def world_nonce(self, task_index: int) -> str:
        """Task `task_index`'s world nonce (`world_nonce`)."""
        if self.world_secret is None:
            raise RuntimeError("a run's worlds are drawn once the entrant's nonce came (seed)")
        return world_nonce(self.world_secret, task_index)

    def record_episode(self, record: Dict[str, Any]) -> None:
        """Append the ended episode `record` (of task `record["task_index"]`) to the run's ledger;
        the run ends once every task's episode has ended. After the run's end nothing is written
        (its last line is `RunEnded`): the episode is logged instead."""
        with self._lock:
            if self.end_reason is not None:
                logger.warning(
                    "scored run %s has ended (%s): episode of task %s not recorded",
                    self.run_id,
                    self.end_reason,
                    record.get("task_index"),
                )
                return
            if self.ledger.append_or_report(record):
                self._recorded["abandoned" if record.get("grade") is None else "graded"] += 1
            self._ended.add(record["task_index"])
            finished = len(self._ended) == len(self.tasks)
        if finished:
            self.end(RUN_END_REASONS[0])

    def end(self, reason: str) -> None:
        """End the run (once): its last ledger line, then the reveal beside the ledger."""
        with self._lock:
            if self.end_reason is not None:
                return
            self.end_reason = reason
            self.ledger.append_or_report(
                {
                    "record": "run_ended",
                    "ended_at": utc_now(),
                    "run_id": self.run_id,
                    "reason": reason,
                    "assigned": self._assigned,
                    "ended": len(self._ended),
                    "recorded": sum(self._recorded.values()),
                    **self._recorded,
                }
            )
        self.reveal_file = reveal_path(self.ledger_path)
        try:
            fd = open_private_file(self.reveal_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(self.reveal(), indent=1, sort_keys=True) + "\n")
        except OSError as error:
            logger.error("scored run %s: could not write its reveal %s: %s", self.run_id, self.reveal_file, error)
            self.reveal_file = None
            return
        logger.warning(
            "scored run %s ended (%s); its reveal (the secret of its worlds: publish it with the ledger, and "
            "anyone can verify the run) is %s; verify: python -m lib.measure.scorecard %s --reveal %s",
            self.run_id,
            reason,
            self.reveal_file,
            self.ledger_path,
            self.reveal_file,
        )

    def reveal(self) -> Dict[str, Any]:
        """What the operator publishes once the run has ended: the commitment document, its hash,
        the entrant's nonce, and the hash of the ledger's last line (so the ledger published with it
        is the whole one)."""
        if self.end_reason is None:
            raise RuntimeError("a run's reveal is made once the run has ended")
        return {
            "commitment": self.commitment,
            "document": self.document,
            "entrant_nonce": self.entrant_nonce,
            "last_line_sha256": self.ledger.last_sha256,
        }

    def describe(self) -> Dict[str, Any]:
        """What `/evaluation` says of the run: its id, selection, size, progress, commitment, public
        key and entrant's nonce (not the order, not a secret), and `head`, the receipt of its
        ledger's last line (`ResultsLedger.head`); once ended, the hash of that line."""
        with self._lock:
            described = {
                "run_id": self.run_id,
                "selection": self.selection,
                "n_tasks": len(self.tasks),
                "assigned": self._assigned,
                "ended": len(self._ended),
                "open": self.end_reason is None,
                "commitment": self.commitment,
                "public_key": self.public_key,
                "secret_fingerprint": self.secret_fingerprint,
                "awaits_nonce": self.entrant_nonce is None and self.end_reason is None,
                "entrant_nonce": self.entrant_nonce,
                "entrant_public_key": self.entrant_public_key,
                "agent": self.agent,
                "head": self.ledger.head(),
            }
            if self.end_reason is not None:
                described["last_line_sha256"] = self.ledger.last_sha256
            return described


RUN_CHOSEN_RESET_PARAMETERS: List[str] = ["seed", "scenario", "difficulty", "secret_salt"]
"""Reset parameters that would choose or change a scored run's world: refused in a scored run."""


def unscored_reset_problem(arguments: Dict[str, Any], run: ScoredRun) -> Optional[str]:
    """Why a reset that chooses its task (or mixes in a secret of its own) is refused in scored run
    `run` (None: it chooses nothing)."""
    chosen = [name for name in RUN_CHOSEN_RESET_PARAMETERS if arguments.get(name) is not None]
    if not chosen:
        return None
    return (
        f"this server is playing scored run {run.run_id}: the server assigns every task and its world, so a "
        f"reset takes no {', '.join(chosen)}; send reset with no parameters to get the next task"
    )
