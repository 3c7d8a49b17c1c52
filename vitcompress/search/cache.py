"""The search's cache: one JSON line per scored candidate, appended and flushed as it is scored.

A killed search leaves every finished candidate on disk (a torn last line, from a kill in the
middle of a write, is ignored); the next run with the same settings reads them back and scores
only what is missing. The header line records what the scores depend on (model, calibration
images, scoring settings); a cache made with other settings is refused, not mixed in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CACHE_NAME = "search_cache.jsonl"


class CacheMismatch(ValueError):
    """The cache in the output folder was made with other settings."""


class ScoreCache:
    def __init__(self, directory: Path, settings: dict[str, Any]) -> None:
        self.path = Path(directory) / CACHE_NAME
        self.settings = json.loads(json.dumps(settings, default=str))
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._read()
        else:
            folder = self.path.parent
            if folder.is_dir() and any(folder.iterdir()):
                # Not a search's folder (it would hold its cache): the search's plan.yaml and
                # search.json would replace files of the same names there.
                raise CacheMismatch(
                    f"{folder} exists and is not a search output (it has no {CACHE_NAME}); "
                    "not writing into it: choose another --out"
                )
            folder.mkdir(parents=True, exist_ok=True)
            self._append({"settings": self.settings})

    def _read(self) -> None:
        text = self.path.read_text()
        if text and not text.endswith("\n"):
            # Killed mid-write: end the torn line, or the next row would be appended to it.
            with open(self.path, "a") as f:
                f.write("\n")
        lines = text.splitlines()
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write: that candidate is scored again
        if not rows or "settings" not in rows[0]:
            raise CacheMismatch(f"{self.path} is not a search cache; choose another --out")
        if rows[0]["settings"] != self.settings:
            changed = sorted(
                k
                for k in set(rows[0]["settings"]) | set(self.settings)
                if rows[0]["settings"].get(k) != self.settings.get(k)
            )
            raise CacheMismatch(
                f"{self.path} was made with other settings ({', '.join(changed)} differ); use "
                "another --out, or delete the cache to start over"
            )
        for row in rows[1:]:
            if "key" in row:
                self.entries[row["key"]] = row

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, result: dict[str, Any]) -> None:
        row = {"key": key, **result}
        self.entries[key] = row
        self._append(row)

    def __len__(self) -> int:
        return len(self.entries)
