"""The teacher cache: what the frozen base model gives each training sequence, computed once.

While the base is frozen its final hidden states and its next-token distributions never change, so
every pass over the data after the first would recompute them for nothing. The cache keeps, per
sequence, the hidden states of every position (in the base's dtype: bf16 halves them, and a bf16 base
produces them in bf16 anyway) and, at each target position, the teacher's top K over the student
vocabulary (renormalised, see trainer.run_teacher) with the base's full-vocabulary argmax. A training
step then runs only the prefix layer and the heads.

Layout: `<directory>/<fingerprint>/` holds `cache.json` and `shard-NNNNN.safetensors`, one per
SHARD_SEQUENCES sequences, each written atomically, so a killed build resumes at its first missing
shard. The fingerprint covers the model, its dtype (and autocast), the student vocabulary, K and every
sequence's tokens and targets: other data gets another cache beside this one, never a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from entmtp_ray.train.trainer import (Sequence, Teacher, batches, pad, run_teacher, teacher_positions,
                                      teacher_rows)

log = logging.getLogger(__name__)
SHARD_SEQUENCES = 256
MANIFEST = "cache.json"


def fingerprint(model_name: str, dtype: torch.dtype, bf16: bool, vocab: torch.Tensor | None, top_k: int,
                sequences: list[Sequence]) -> str:
    digest = hashlib.sha256(json.dumps({"model": model_name, "dtype": str(dtype), "top_k": top_k,
                                        "vocab": None if vocab is None else vocab.tolist()}).encode())
    if bf16 and dtype != torch.bfloat16:  # autocast changes an fp32 or fp16 base's outputs, not a bf16 one's
        digest.update(b"autocast-bf16")
    for seq in sequences:
        digest.update(torch.tensor(seq.token_ids, dtype=torch.int32).numpy().tobytes())
        digest.update(bytes(seq.target_mask))
    return digest.hexdigest()[:16]


class TeacherCache:
    """Cached base outputs of a list of sequences, indexed like that list."""

    def __init__(self, hidden: torch.Tensor, probs: torch.Tensor, index: torch.Tensor | None, top: torch.Tensor,
                 lengths: list[int], targets: list[int], stats: dict):
        self.hidden, self.probs, self.index, self.top = hidden, probs, index, top
        self.token_start = [0]
        self.target_start = [0]
        for n, t in zip(lengths, targets):
            self.token_start.append(self.token_start[-1] + n)
            self.target_start.append(self.target_start[-1] + t)
        self.stats = stats

    def __len__(self) -> int:
        return len(self.token_start) - 1

    def teacher(self, batch: list[int], mask: torch.Tensor) -> Teacher:
        """The Teacher of the padded batch of these sequences (`mask` from trainer.pad)."""
        hidden = torch.zeros((*mask.shape, self.hidden.shape[1]), dtype=torch.float32)
        spans = []
        for row, k in enumerate(batch):
            n = self.token_start[k + 1] - self.token_start[k]
            hidden[row, :n] = self.hidden[self.token_start[k]: self.token_start[k + 1]]
            spans.append(slice(self.target_start[k], self.target_start[k + 1]))
        device = mask.device
        index = None if self.index is None else torch.cat([self.index[s] for s in spans]).long().to(device)
        return Teacher(hidden.to(device), teacher_rows(teacher_positions(mask)),
                       torch.cat([self.probs[s] for s in spans]).float().to(device), index,
                       torch.cat([self.top[s] for s in spans]).long().to(device))

    @classmethod
    def build(cls, directory: str | Path, model_name: str, model, sequences: list[Sequence], pad_id: int,
              vocab: torch.Tensor | None, top_k: int, bf16: bool, batch_tokens: int = 4096,
              progress: bool = True) -> TeacherCache:
        """Load the cache of `sequences` under `directory`, computing the shards it lacks first."""
        dtype = next(model.parameters()).dtype
        where = Path(directory) / fingerprint(model_name, dtype, bf16, vocab, top_k, sequences)
        where.mkdir(parents=True, exist_ok=True)
        shards = range(0, len(sequences), SHARD_SEQUENCES)
        missing = [s for s in shards if not (where / _shard_name(s)).is_file()]
        if missing:
            from tqdm.auto import tqdm

            log.warning("teacher cache %s: computing %d of %d shards", where, len(missing), len(shards))
            device = next(model.parameters()).device
            started = time.time()
            total = sum(len(sequences[s: s + SHARD_SEQUENCES]) for s in missing)
            with tqdm(total=total, disable=not progress, desc="teacher cache",
                      unit="seq") as bar:
                for start in missing:
                    chunk = sequences[start: start + SHARD_SEQUENCES]
                    _write_shard(where / _shard_name(start), model, chunk, pad_id, vocab, top_k, bf16,
                                 batch_tokens, device, dtype, bar)
            (where / MANIFEST).write_text(json.dumps({
                "model": model_name, "dtype": str(dtype), "top_k": top_k,
                "vocab": 0 if vocab is None else len(vocab), "sequences": len(sequences),
                "last_build_seconds": round(time.time() - started, 3)}, indent=2) + "\n")
        parts = [load_file(str(where / _shard_name(s))) for s in shards]
        joined = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        mass = joined.pop("kept_mass")
        built = json.loads((where / MANIFEST).read_text()) if (where / MANIFEST).is_file() else {}
        stats = {"directory": str(where), "tokens": int(joined["lengths"].sum()), "targets": len(joined["top"]),
                 "build_seconds": built.get("last_build_seconds"),
                 "teacher_mass_kept": float(mass.float().mean()), "bytes": sum(
                     (where / _shard_name(s)).stat().st_size for s in shards)}
        return cls(joined["hidden"], joined["probs"], joined.get("index"), joined["top"],
                   joined["lengths"].tolist(), joined["targets"].tolist(), stats)


def _shard_name(start: int) -> str:
    return f"shard-{start // SHARD_SEQUENCES:05d}.safetensors"


@torch.no_grad()
def _write_shard(path: Path, model, chunk: list[Sequence], pad_id: int, vocab, top_k: int, bf16: bool,
                 batch_tokens: int, device, dtype, bar) -> None:
    """One shard: the chunk's sequences run in length-sorted padded batches, stored in chunk order."""
    kept = ("probs", "index", "top", "kept_mass")  # Teacher fields, one row per target
    per_seq: dict[str, list] = {key: [None] * len(chunk) for key in ("hidden", *kept)}
    for batch in batches([len(s.token_ids) for s in chunk], batch_tokens, seed=0, epoch=0):
        tokens, mask = pad([chunk[k] for k in batch], pad_id, device)
        full = run_teacher(model, tokens, mask, vocab, top_k, bf16)
        at = teacher_positions(mask)
        row_of = teacher_rows(at)
        for row, k in enumerate(batch):
            rows = row_of[row][at[row]]
            per_seq["hidden"][k] = full.hidden[row, : len(chunk[k].token_ids)].to(dtype)
            for key in kept:
                value = getattr(full, key)
                per_seq[key][k] = None if value is None else value[rows]
        bar.update(len(batch))
    tensors = {key: torch.cat(parts).cpu().contiguous() for key, parts in per_seq.items() if parts[0] is not None}
    for key in ("index", "top"):
        if key in tensors:
            tensors[key] = tensors[key].to(torch.int32)
    tensors["lengths"] = torch.tensor([len(s.token_ids) for s in chunk], dtype=torch.int64)
    tensors["targets"] = torch.tensor([len(t) for t in per_seq["top"]], dtype=torch.int64)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
