"""Rekey FEMNIST records made while `femnist-leaf-<hash>` named the writers only, not their samples.

    python scripts/rekey_femnist_records.py PATH --leaf DIR [--dry-run]

Until 2026-11-28 a FEMNIST run's data source hashed its writers' ids and train/test counts: the same writers
split again by LEAF with another seed (the same counts, other samples) shared a key. It now also hashes the
bytes of the LEAF files that hold them (`prodigy_core.data.femnist_source`), so every record made before
has a source that no new run makes. This gives such records the source DIR makes today: a record whose
data_source is the old hash of DIR's writers (its n_clients first eligible writers, at its
femnist_min_writer_samples) gets DIR's current source and the key that makes, and keeps the old source in
`data_source_rekeyed_from`. Other records are left as they are, and each is named, among them those whose
key the current code no longer makes (an older revision of their variant: they stay out of date).

PATH: a results folder (its `<experiment>/<key>.json` records) or a `gpu_run.py` tarball, rewritten in place
(atomically). Name only the folder the records were made from: the old hash cannot tell two LEAF splits of
the same writers apart (why it was replaced), so that is the records' provenance to vouch for.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from prodigy_core import data
from prodigy_core import results as store
from prodigy_core.config import ConfigError
from prodigy_core.safe_io import atomic_write, write_json_atomic

RECORD_NAME = re.compile(r"^(?P<folder>(?:.*/)?[^/]+)/(?P<key>[0-9a-f]{16})(?P<suffix>(?:\.failed)?\.json)$")
RECORD_FILE = re.compile(r"^[0-9a-f]{16}(?:\.failed)?\.json$")  # a record's own name, in its folder


def legacy_source(counts: dict[str, tuple[int, int]], writers: Iterable[str]) -> str:
    """The data source as it was made before 2026-11-28: a hash of the writers and their counts alone."""
    blob = json.dumps([[w, *counts[w]] for w in writers], separators=(",", ":"))
    return data.FEMNIST_SOURCE_PREFIX + hashlib.sha256(blob.encode()).hexdigest()[:12]


class Rekeyer:
    """The old and the new source of DIR's first N eligible writers, per (N, k) a record names."""

    def __init__(self, leaf: Path) -> None:
        self.leaf, self.counts = leaf, data.leaf_writer_counts(leaf)
        self.sources: dict[tuple[int, int], tuple[str, str] | None] = {}

    def new_source(self, config: dict) -> str | None:
        """DIR's current source for this config when its data_source is DIR's old one, else None."""
        n, k = config.get("n_clients"), config.get("femnist_min_writer_samples") or 0
        if config.get("dataset") != "femnist" or not isinstance(n, int) or not isinstance(k, int):
            return None
        if (n, k) not in self.sources:
            writers = data.eligible_writers(self.counts, k)[:n]
            self.sources[n, k] = (
                (legacy_source(self.counts, writers), data.femnist_source(self.leaf, self.counts, writers))
                if len(writers) == n
                else None
            )
        pair = self.sources[n, k]
        return pair[1] if pair is not None and config.get("data_source") == pair[0] else None

    def rekey(self, record: dict) -> dict | None:
        """The record with DIR's current source and its key, or None when it is not one of DIR's old ones or
        its key is not current (an older revision of its variant: a new key would call it current)."""
        config = record.get("config")
        source = self.new_source(config) if isinstance(config, dict) else None
        try:
            if source is None or store.record_config_key(record) != record.get("key"):
                return None
        except (ConfigError, KeyError, TypeError):  # not a valid record: left for the store to judge
            return None
        new = {**record, "config": {**config, "data_source": source}}
        new["data_source_rekeyed_from"] = config["data_source"]
        new["key"] = store.record_config_key(new)
        return new


def rekey_members(members: dict[str, bytes], rekeyer: Rekeyer, say=print) -> dict[str, tuple[str, bytes]]:
    """{name: (its new name, its new bytes)} of the old FEMNIST records of DIR among {name: bytes}."""
    out = {}
    for name, content in members.items():
        match = RECORD_NAME.match(name)
        try:
            record = json.loads(content) if match else None
        except ValueError:
            record = None
        if not isinstance(record, dict):
            continue
        new = rekeyer.rekey(record)
        if new is None:
            config = record.get("config")  # not a mapping (null, a list): not a FEMNIST record, skipped
            source = config.get("data_source") if isinstance(config, dict) else None
            if str(source).startswith(data.FEMNIST_SOURCE_PREFIX):
                why = f"not an old source of {rekeyer.leaf}, or a key of an older revision"
                say(f"left as it is: {name} ({why})")
            continue
        new_name = f"{match['folder']}/{new['key']}{match['suffix']}"  # type: ignore[index]
        if new_name in members:
            say(f"left as it is: {name} (its rekeyed copy {new_name} is there already)")
            continue
        say(f"{name} -> {new_name} ({record['config']['data_source']} -> {new['config']['data_source']})")
        out[name] = (new_name, (json.dumps(new, indent=1) + "\n").encode())
    return out


def rekey_tarball(tarball: Path, rekeyer: Rekeyer, dry_run: bool, say=print) -> int:
    try:  # read whole before anything is written; the errors `gpu_run.read_tarball` refuses
        with tarfile.open(tarball, "r:gz") as tar:
            infos = [m for m in tar.getmembers() if m.isfile()]
            members = {m.name: tar.extractfile(m).read() for m in infos}  # type: ignore[union-attr]
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:  # truncated: EOFError; corrupted: zlib's
        why = " ".join(str(e).split())
        raise data.DataError(
            f"{tarball}: not a .tar.gz, or a truncated or corrupted one ({type(e).__name__}: {why}); nothing "
            "changed"
        ) from None
    changes = rekey_members(members, rekeyer, say)
    if changes and not dry_run:
        with atomic_write(tarball, "wb") as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
            for info in infos:  # the same order and times; a rekeyed record under its new name
                name, content = changes.get(info.name, (info.name, members[info.name]))
                new = tarfile.TarInfo(name)
                new.size, new.mtime, new.mode = len(content), info.mtime, info.mode
                tar.addfile(new, io.BytesIO(content))
    return len(changes)


def rekey_folder(results: Path, rekeyer: Rekeyer, dry_run: bool, say=print) -> int:
    if any(RECORD_FILE.match(p.name) for p in results.glob("*.json")):
        raise data.DataError(f"{results} holds records itself: pass its parent, the results folder")
    paths = {p.relative_to(results).as_posix(): p for p in sorted(results.glob("*/*.json"))}
    changes = rekey_members({name: p.read_bytes() for name, p in paths.items()}, rekeyer, say)
    if not dry_run:
        for name, (new_name, content) in changes.items():
            write_json_atomic(results / new_name, json.loads(content))  # written before the old one goes
            paths[name].unlink()
    return len(changes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a results folder or a gpu_run.py tarball (.tar.gz)")
    parser.add_argument("--leaf", type=Path, required=True, help="the LEAF folder the records were made from")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    args = parser.parse_args(argv)
    try:
        rekeyer = Rekeyer(args.leaf)
        if args.path.is_file():
            changed = rekey_tarball(args.path, rekeyer, args.dry_run)
        elif args.path.is_dir():
            changed = rekey_folder(args.path, rekeyer, args.dry_run)
        else:
            raise data.DataError(f"{args.path} is neither a results folder nor a tarball")
    except (data.DataError, tarfile.TarError, OSError, ValueError) as e:
        print(f"rekey_femnist_records: {e}", file=sys.stderr)
        return 2
    print(f"{changed} record(s) {'would be ' if args.dry_run else ''}rekeyed in {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
