"""The run manifest: what made an output's rows (model, heads and bank with content hashes, every decoding
and input setting, the project version), written beside the Parquet files when a run starts, so that
`--resume` continues only the same configuration. No Ray here.

The file is `_manifest.json` in the output directory: readers of the dataset (pyarrow, pandas, Ray
Data) skip names starting with `_`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

from entmtp_ray.config import DecodingConfig, InputConfig, ModelConfig
from entmtp_ray.model.hub import snapshot_label
from entmtp_ray.model.loading import UNTRAINED_HEADS, package_version, resolve_heads_path
from entmtp_ray.pipeline.assemble import AUTO_BANK
from entmtp_ray.pipeline.sources import Location

MANIFEST = "_manifest.json"
FORMAT = 1
# input settings that may change between a run and its resume: --limit only adds or drops rows,
# and a row's output does not depend on it
RESUMABLE_INPUT = {"limit"}


def content_hash(path: Path) -> str:
    """sha256 over a file, or over a folder's files (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode() + b"\0")
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def heads_identity(model_cfg: ModelConfig) -> tuple[str, str]:
    """(where the heads are read from, what identifies their content): a hub snapshot's `owner/name@commit` for
    both, else the folder and its content hash; `untrained` for random heads."""
    if model_cfg.heads == UNTRAINED_HEADS:
        return UNTRAINED_HEADS, UNTRAINED_HEADS
    folder = resolve_heads_path(model_cfg.model, model_cfg.heads, config_only=True)
    label = snapshot_label(folder)
    return (label, label) if label else (str(folder), content_hash(folder))


def run_settings(model_cfg: ModelConfig, decoding: DecodingConfig, source: InputConfig | None,
                 needs_heads: bool, bank_path: Path | None, concurrent_requests: int = 1) -> tuple[dict, dict]:
    """(settings, sources): everything an output row depends on, as JSON values compared field by field on
    --resume (heads and bank by content, so a moved checkout still resumes; heads from the hub by their
    `owner/name@commit`, since the driver holds only their configs), and where heads and bank were read
    from, for people."""
    heads_path, heads_id = heads_identity(model_cfg) if needs_heads else (None, None)
    auto = decoding.bank == AUTO_BANK  # calibrated by the run: the key of its cache names what it depends on
    settings = {"model": model_cfg.model_dump(exclude={"heads"}),
                "heads_sha256": heads_id,
                "bank_sha256": AUTO_BANK if auto else content_hash(bank_path) if bank_path else None,
                "decoding": decoding.model_dump(exclude={"bank"}),
                # requests verified together change a row's numerics within the float-tie rule (docs/design.md §7)
                "concurrent_requests": concurrent_requests}
    if source is not None:
        settings["input"] = source.model_dump(exclude=RESUMABLE_INPUT)
    return settings, {"heads": heads_path, "bank": AUTO_BANK if auto else str(bank_path) if bank_path else None}


def manifest(settings: dict, sources: dict) -> dict:
    """The file's content: `settings` (compared on --resume) and, for people, where things came from."""
    return {"format": FORMAT, "project": "entmtp-ray", "version": package_version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": settings, "sources": sources}


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out.update(_flat(inner, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _defaults() -> dict:
    """Every model and decoding setting at its default, flattened as in a manifest."""
    return _flat({"model": ModelConfig().model_dump(), "decoding": DecodingConfig().model_dump(),
                  "concurrent_requests": 1})


def differences(before: dict, now: dict) -> list[str]:
    """'field: old -> new' for every setting that differs (nested fields dotted). A setting the old manifest
    lacks (added by a later release) that is now at its default decodes as before, so it is no difference."""
    old, new, defaults = _flat(before), _flat(now), _defaults()
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)
            and not (key not in old and key in defaults and new[key] == defaults[key])]


def check_or_write(output: str | Location, settings: dict, resume: bool, sources: dict | None = None) -> None:
    """On a fresh output, write the manifest; on --resume, refuse (ValueError naming the fields) an output
    whose manifest holds other settings. An output of a release without manifests gets one. `output` is a
    path or URI (or its Location): the manifest goes through the output's own filesystem."""
    location = Location.of(output)
    if resume and location.exists(MANIFEST):
        written = json.loads(location.read_text(MANIFEST))
        changed = differences(written.get("settings", {}), settings)
        if changed:
            raise ValueError(f"--resume: {location.uri} was written with other settings ({'; '.join(changed)}); "
                             "resume with the settings of that run, or write to a new --output")
        return
    location.make()
    location.write_text(MANIFEST, json.dumps(manifest(settings, sources or {}), indent=1) + "\n")
