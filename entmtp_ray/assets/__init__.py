"""What the package ships beside its code: built-in trees, the HumanEval calibration split, and the
trained heads and topology banks of the embedded model. Read-only at run time; jobs write elsewhere."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def asset(*parts: str) -> Path:
    """The path of a shipped file or folder (it may not exist: callers check and name the fix)."""
    return Path(str(resources.files(__name__).joinpath(*parts)))


def shipped_heads(model_name: str) -> Path:
    """Where heads trained by this project for `model_name` ship: assets/heads/<model>/."""
    return asset("heads", Path(model_name).name)


def shipped_bank(model_name: str, task: str) -> Path:
    """Where the topology bank for (model, task) ships: assets/banks/<model>/<task>.json."""
    return asset("banks", Path(model_name).name, f"{task}.json")


def shipped_bank_variants(model_name: str, task: str) -> list[Path]:
    """Every bank shipped for (model, task): <task>.json first, then the same task timed on other kinds of hardware,
    assets/banks/<model>/<variant>/<task>.json, in the variants' order by name."""
    primary = shipped_bank(model_name, task)
    variants = sorted(p / f"{task}.json" for p in primary.parent.iterdir() if p.is_dir()) if primary.parent.is_dir() \
        else []
    return [p for p in [primary, *variants] if p.is_file()]
