"""Models and heads named by hub id (`lmsys/vicuna-7b-v1.3`, `ankner/hydra-vicuna-7b-v1.3`): a snapshot in this
node's hub cache (HF_HOME / HF_HUB_CACHE), downloaded by huggingface_hub once per node; it locks each file, so
the actors starting together on a node wait for one download. Checks before loading (the driver's) fetch only
the small JSON files; loading fetches everything.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HFValidationError, IncompleteSnapshotError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

# configs, tokenizer configs, the heads' draft vocabulary: kilobytes, never weights
CONFIG_FILES = ["*.json"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """`owner/name` that is not a local path (hub ids have one slash and start with neither `.`, `/` nor `~`)."""
    return bool(REPO_ID.match(name)) and not Path(name).exists()


def _fix(repo_id: str) -> str:
    return (f"pre-download it with `hf download {repo_id}` (`huggingface-cli download {repo_id}` with an older "
            "huggingface_hub) on every node, or pass a local directory")


def snapshot(repo_id: str, flag: str, config_only: bool = False) -> Path:
    """The local snapshot folder of hub repo `repo_id` (`flag` names the option in errors): its JSON files only
    with `config_only`, else every file. FileNotFoundError/ValueError name the fix."""
    where = f"{flag} {repo_id}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=CONFIG_FILES if config_only else None))
    except IncompleteSnapshotError as exc:  # the cache holds part of it (e.g. only the configs) and no download
        raise FileNotFoundError(f"{where}: this node's hub cache holds only part of it and it cannot be downloaded "
                                f"now ({exc}); set HF_HUB_OFFLINE=0, or {_fix(repo_id)}") from exc
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"{where}: not in this node's hub cache ({constants.HF_HUB_CACHE}) and "
                                    f"HF_HUB_OFFLINE=1 forbids downloading it; set HF_HUB_OFFLINE=0, or "
                                    f"{_fix(repo_id)}") from exc
        raise FileNotFoundError(f"{where}: the hub could not be reached and it is not in this node's hub cache "
                                f"({constants.HF_HUB_CACHE}); check the network, or {_fix(repo_id)}") from exc
    except GatedRepoError as exc:
        raise FileNotFoundError(f"{where}: the repository is gated; accept its terms on huggingface.co and set "
                                "HF_TOKEN (or `hf auth login`) on every node, or pass a local directory") from exc
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(f"{where}: no such repository on the hub, and no local directory of that name "
                                "(a private one needs HF_TOKEN); check the id, or pass a local directory") from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"{where}: the hub has no main revision of it ({exc})") from exc
    except HFValidationError as exc:
        raise ValueError(f"{where}: not a valid hub id ({exc}); pass owner/name or a local directory") from exc


def snapshot_label(path: Path) -> str | None:
    """`owner/name@commit` for a folder inside the hub cache's snapshots (what identifies its content exactly),
    else None."""
    parts = Path(path).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1].removeprefix("models--").replace("--", "/", 1) + "@" + parts[i + 1]
    return None
