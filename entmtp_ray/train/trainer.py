"""Hydra++ head training: chat sequences -> frozen base hidden states -> per-head soft cross-entropy.

The recipe of docs/design.md §3: the base model is frozen; head i at position t reads the
prefix layer's context h_t and the embeddings of tokens t+1..t+1+i and is trained towards the
base model's own next-token distribution for token t+i+2 (teacher weight 1, ground truth 0),
on target (assistant) tokens only. No Ray, no decoding here.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from entmtp_ray.model.heads import HydraHeads, save_heads
from entmtp_ray.model.llama import rotary
from entmtp_ray.model.loading import LoadedModel

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "checkpoint.pt"


class TrainConfig(BaseModel):
    """The heads' training run: schedule, batches, checkpoints (the recipe: docs/design.md §3)."""

    lr: float = Field(5e-4, gt=0, description="AdamW peak learning rate (Hydra++ recipe)")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up before the cosine decay")
    steps: int = Field(1000, ge=1, description="optimizer steps in the schedule")
    batch_tokens: int = Field(1024, ge=16, description="tokens per step (sequences padded into a batch)")
    max_len: int = Field(512, ge=8, description="sequences are cut to this many tokens")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout inside the heads while training")
    seed: int = Field(0, description="data order and initialisation seed")
    bf16: bool = Field(True, description="bf16 autocast for the head and vocab matmuls (CPU and GPU)")
    draft_vocab: int = Field(8192, ge=0, description="train the heads' vocabulary projection over the K tokens "
                             "most frequent in the training targets, the shortlist drafting projects onto "
                             "(draft_vocab.json is saved beside the heads); 0: the full vocabulary")
    teacher_top_k: int = Field(32, ge=0, description="keep the teacher's K most probable tokens of the student "
                               "vocabulary per target, renormalised (the rest of its mass is dropped); 0: its "
                               "whole distribution over the student vocabulary")
    checkpoint_every: int = Field(100, ge=1, description="steps between resumable checkpoints")
    snapshot_every: int | None = Field(None, ge=1, description="also save the heads every this many steps "
                                       "(out/step-NNNNN), to measure quality against training steps")
    max_minutes: float | None = Field(None, gt=0, description="stop (and save) after this much wall time")


@dataclass(frozen=True)
class Sequence:
    token_ids: list[int]
    target_mask: list[bool]  # True where the token is a training target (assistant text)


# ---- data ------------------------------------------------------------------------------------

def chat_sequence(loaded: LoadedModel, turns: list[dict], max_len: int) -> Sequence | None:
    """Token ids of a conversation with its assistant tokens marked; None if nothing to learn."""
    ids: list[int] = []
    mask: list[bool] = []
    for k, turn in enumerate(turns):
        if turn["role"] == "assistant":
            header = loaded.encode_chat(turns[:k], add_generation_prompt=True)
            full = loaded.encode_chat(turns[: k + 1], add_generation_prompt=False)
            if full[: len(ids)] != ids or full[: len(header)] != header:
                return None  # tokenisation is not prefix-stable here; skip the conversation
            mask += [False] * (len(header) - len(ids)) + [True] * (len(full) - len(header))
            ids = full
        else:
            full = loaded.encode_chat(turns[: k + 1], add_generation_prompt=False)
            if full[: len(ids)] != ids:
                return None
            mask += [False] * (len(full) - len(ids))
            ids = full
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return Sequence(ids, mask) if any(mask[1:]) else None


def sharegpt_conversations(limit: int, subset: str = "tune") -> Iterator[list[dict]]:
    """The first `limit` ShareGPT conversations of `subset` ('tune' or 'eval', see tasks.select_subset)
    as [{role, content}] turns, starting with a user turn."""
    yield from (turns for _, turns in sharegpt_records(limit, subset))


def sharegpt_records(limit: int, subset: str = "tune") -> Iterator[tuple[str, list[dict]]]:
    """sharegpt_conversations with each conversation's id (the ShareGPT task's prompt id)."""
    from entmtp_ray.pipeline.tasks import is_eval_row, iter_sharegpt

    roles = {"human": "user", "gpt": "assistant"}
    seen = 0
    for record in iter_sharegpt():
        if is_eval_row("sharegpt", str(record.get("id"))) != (subset == "eval"):
            continue
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in record.get("conversations", [])
                 if t.get("from") in roles and isinstance(t.get("value"), str) and t["value"].strip()]
        while turns and turns[0]["role"] != "user":
            turns.pop(0)
        if len(turns) < 2:
            continue
        seen += 1
        if seen > limit:
            return
        yield str(record.get("id")), turns


def generated_conversations(directories: Iterable[str]) -> Iterator[list[dict]]:
    """Self-distillation pairs from jobs/generate.py outputs: the prompt and the model's own reply."""
    import pyarrow.dataset as pads

    for directory in directories:
        table = pads.dataset(directory, format="parquet").to_table(columns=["prompt", "output_text", "error"])
        for row in table.to_pylist():
            if row["error"] is None and row["output_text"]:
                yield [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["output_text"]}]


# beside a self-distillation folder's parts: {"task"} its prompts' ids belong to ("_": Parquet readers skip it)
DISTILL_FILE = "_distill.json"


def distilled_ids(directories: Iterable[str]) -> dict[str, set[str]]:
    """The prompt ids of self-distillation folders, by the task distill() recorded for each (a folder without
    one, e.g. another job's output, names no task and adds none)."""
    import pyarrow.dataset as pads

    ids: dict[str, set[str]] = {}
    for directory in directories:
        meta = Path(directory) / DISTILL_FILE
        task = json.loads(meta.read_text()).get("task") if meta.is_file() else None
        if task:
            found = pads.dataset(directory, format="parquet").to_table(columns=["id"]).column("id").to_pylist()
            ids.setdefault(task, set()).update(map(str, found))
    return ids


def distill(loaded: LoadedModel, prompts: pa.Table, out_dir: str | Path, batch_size: int = 32,
            max_new_tokens: int = 256, max_prompt_tokens: int = 384, progress: bool = True,
            task: str | None = None) -> int:
    """Self-distillation data: the base model's own greedy replies to `prompts` (columns id, prompt).

    Replies are generated in padded batches with transformers `generate` (much faster than batch size
    1 on any hardware; the training data need not match the engine token for token) and written as one
    Parquet part per batch with the columns generated_conversations() reads, so a killed run resumes
    where it stopped. Prompts over `max_prompt_tokens` are skipped: training cuts sequences short, so
    their replies would not be seen. `task`: the task the prompts' ids belong to, recorded in DISTILL_FILE so that
    heads trained on these replies list them (distilled_ids). Returns the number of rows written by this call.
    """
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if task:
        (out / DISTILL_FILE).write_text(json.dumps({"task": task}) + "\n")
    done = set()
    for part in sorted(out.glob("part-*.parquet")):
        done.update(pq.read_table(part, columns=["id"]).column("id").to_pylist())
    rows = [r for r in prompts.select(["id", "prompt"]).to_pylist() if r["id"] not in done and r["prompt"]]
    encoded = sorted(((r, loaded.encode_prompt(r["prompt"])) for r in rows), key=lambda x: len(x[1]))
    encoded = [(r, ids) for r, ids in encoded if len(ids) <= max_prompt_tokens]
    pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    eos = sorted(loaded.eos_token_ids)
    from tqdm.auto import tqdm

    written = 0
    index = len(list(out.glob("part-*.parquet")))
    with tqdm(total=len(encoded), disable=not progress, desc="distill", unit="row") as bar:
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start: start + batch_size]
            width = max(len(ids) for _, ids in chunk)
            tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for k, (_, ids) in enumerate(chunk):  # left padding: every reply starts at column `width`
                tokens[k, width - len(ids):] = torch.tensor(ids)
                attention[k, width - len(ids):] = 1
            with torch.no_grad():
                generated = loaded.model.generate(
                    input_ids=tokens.to(loaded.device), attention_mask=attention.to(loaded.device),
                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos)
            texts = []
            for reply in generated[:, width:].tolist():
                cut = next((k for k, t in enumerate(reply) if t in loaded.eos_token_ids), len(reply))
                texts.append(loaded.tokenizer.decode(reply[:cut], skip_special_tokens=True))
            table = pa.table({"id": [r["id"] for r, _ in chunk], "prompt": [r["prompt"] for r, _ in chunk],
                              "output_text": texts, "error": pa.array([None] * len(chunk), pa.string())})
            pq.write_table(table, out / f"part-{index:05d}.parquet")
            index += 1
            written += len(chunk)
            bar.update(len(chunk))
    return written


def batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches (indices into `lengths`) of about `batch_tokens` padded tokens, in a
    seeded order per epoch."""
    rng = random.Random(seed * 100_003 + epoch)
    order = sorted(range(len(lengths)), key=lambda k: (lengths[k], rng.random()))
    out, current = [], []
    for k in order:
        if current and (len(current) + 1) * lengths[k] > batch_tokens:
            out.append(current)
            current = []
        current.append(k)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def pad(batch: list[Sequence], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] right-padded (causal attention makes right padding harmless), mask [B, T]."""
    width = max(len(s.token_ids) for s in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, seq in enumerate(batch):
        tokens[row, : len(seq.token_ids)] = torch.tensor(seq.token_ids)
        mask[row, : len(seq.target_mask)] = torch.tensor(seq.target_mask)
    return tokens.to(device), mask.to(device)


def rank_targets(sequences: Iterable[Sequence]) -> list[tuple[int, int]]:
    """(token id, count) of the sequences' target tokens, most frequent first (ties by token id)."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(t for t, target in zip(seq.token_ids, seq.target_mask) if target)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def coverage(ranked: list[tuple[int, int]], sizes=(2048, 4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Share of all target tokens that the first K ranked tokens cover, for each K there are that many."""
    total = sum(c for _, c in ranked)
    return {k: sum(c for _, c in ranked[:k]) / total for k in sizes if k <= len(ranked)}


# ---- teacher ---------------------------------------------------------------------------------

@dataclass
class Teacher:
    """What the frozen base model gives a padded batch [B, T]: all the heads learn from.

    Targets are the positions p whose next token is a target (mask[:, p + 1]); `rows[b, p]` is p's row
    in probs/index/top (row-major order over the batch), meaningful only at those positions.
    """

    hidden: torch.Tensor  # [B, T, H] final (post-norm) hidden states, float32
    rows: torch.Tensor  # [B, T] long
    probs: torch.Tensor  # [N, K] the kept teacher probabilities of each target, summing to 1
    index: torch.Tensor | None  # [N, K] their columns in the student vocabulary; None: probs is dense over it
    top: torch.Tensor  # [N] the base model's argmax token id over its full vocabulary
    kept_mass: torch.Tensor | None = None  # [N] how much of the base distribution `probs` kept before renormalising


def teacher_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] True where the next token is a target: there the base distribution is a head's target."""
    at = torch.zeros_like(mask)
    at[:, :-1] = mask[:, 1:]
    return at


def teacher_rows(at: torch.Tensor) -> torch.Tensor:
    return at.long().flatten().cumsum(0).view_as(at) - 1


@torch.no_grad()
def run_teacher(model, tokens: torch.Tensor, mask: torch.Tensor, vocab: torch.Tensor | None, top_k: int,
                bf16: bool) -> Teacher:
    """The frozen base model over a batch: hidden states and its next-token distributions at the target
    positions, restricted to the student vocabulary `vocab` (token ids; None: all), and to the top_k most
    probable of those (0: all). What is dropped is dropped from the distribution: the kept probabilities
    are renormalised to sum to 1, so the heads learn the base's distribution over what they can draft."""
    autocast = torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=bf16)
    at = teacher_positions(mask)
    with autocast:
        hidden = model.model(input_ids=tokens).last_hidden_state.float()  # [B, T, H] post-norm
        probs = F.softmax(model.lm_head(hidden[at]).float(), dim=-1)  # [N, V]
    top = probs.argmax(-1)
    if vocab is not None:
        probs = probs[:, vocab]
    index = None
    if top_k and top_k < probs.shape[-1]:
        probs, index = probs.topk(top_k, dim=-1)
    kept = probs.sum(-1)
    return Teacher(hidden, teacher_rows(at), probs / kept[:, None], index, top, kept)


# ---- loss ------------------------------------------------------------------------------------

def head_losses(heads: HydraHeads, model, tokens: torch.Tensor, mask: torch.Tensor, dropout: float = 0.0,
                bf16: bool = False, teacher: Teacher | None = None,
                vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float], list[int]]:
    """Mean soft cross-entropy per head ([num_heads]), top-1 agreement with the base model's argmax
    per head, and the number of target positions per head.

    tokens, mask: [B, T]. Head i at position t targets token t+i+2, valid where mask[:, t+i+2], and
    learns the base distribution for it (teacher position t+i+1) over the student vocabulary `vocab`
    (token ids, the draft vocabulary; None: the full one). `teacher`: from a TeacherCache, or None to
    run the base model now (its whole distribution over `vocab`).
    """
    base = model.model
    if teacher is None:
        teacher = run_teacher(model, tokens, mask, vocab, 0, bf16)
    autocast = torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=bf16)
    hidden = teacher.hidden
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    context = hidden
    if heads.prefix_layer is not None:
        cos_sin = rotary(base.rotary_emb, hidden, positions)
        with autocast:
            context = heads.prefix_norm(heads.prefix_layer(hidden, position_embeddings=cos_sin)).float()  # [B, T, H]
    embeds = base.embed_tokens(tokens).detach()  # [B, T, H]
    losses, accuracy, counts = [], [], []
    for i in range(heads.config.num_heads):
        span = tokens.shape[1] - i - 2  # positions t with a target t+i+2 inside the sequence
        if span <= 0:
            break
        valid = mask[:, i + 2:]  # [B, span]
        parts = [context[:, :span]] + [embeds[:, 1 + j: 1 + j + span] for j in range(i + 1)]
        rows = torch.cat(parts, dim=-1)[valid]  # [N, (i+2)H]
        picked = teacher.rows[:, i + 1: i + 1 + span][valid]  # [N]: the base's view of token t+i+2
        with autocast:
            student = heads.project(i, heads.head_hidden(i, rows, dropout), model.lm_head, vocab)  # [N, V']
        log_q = F.log_softmax(student.float(), dim=-1)
        if teacher.index is not None:
            log_q = log_q.gather(1, teacher.index[picked])
        losses.append(-(teacher.probs[picked] * log_q).sum(-1).mean())  # soft targets: the base's distribution
        drafted = student.argmax(-1)
        drafted = drafted if vocab is None else vocab[drafted]
        accuracy.append((drafted == teacher.top[picked]).float().mean().item())
        counts.append(int(valid.sum()))
    return torch.stack(losses), accuracy, counts


@torch.no_grad()
def evaluate(heads: HydraHeads, model, sequences: list[Sequence], batch_tokens: int, pad_id: int,
             vocab: torch.Tensor | None = None) -> dict:
    """Per-head top-1 agreement with the base model's argmax on held-out target tokens, the heads'
    argmax taken over `vocab` (the draft vocabulary drafting uses; None: all tokens), and the soft
    cross-entropy against the base's whole distribution over `vocab`."""
    heads.eval()
    bf16_base = next(model.parameters()).dtype == torch.bfloat16  # fp32 heads need autocast over a bf16 base
    hits = [0.0] * heads.config.num_heads
    totals = [0] * heads.config.num_heads
    loss_sum = [0.0] * heads.config.num_heads
    device = next(model.parameters()).device
    vocab = None if vocab is None else vocab.to(device)
    for batch in batches([len(s.token_ids) for s in sequences], batch_tokens, seed=0, epoch=0):
        tokens, mask = pad([sequences[k] for k in batch], pad_id, device)
        losses, accuracy, counts = head_losses(heads, model, tokens, mask, bf16=bf16_base, vocab=vocab)
        for i, (loss, acc, n) in enumerate(zip(losses.tolist(), accuracy, counts)):
            hits[i] += acc * n
            loss_sum[i] += loss * n
            totals[i] += n
    return {"top1": [h / t if t else None for h, t in zip(hits, totals)],
            "loss": [s / t if t else None for s, t in zip(loss_sum, totals)], "positions": totals}


# ---- loop ------------------------------------------------------------------------------------

def _schedule(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(heads: HydraHeads, model, sequences: list[Sequence], cfg: TrainConfig, out_dir: str | Path,
          pad_id: int, resume: bool = False, progress: bool = True, save_dtype: torch.dtype | None = None,
          vocab: torch.Tensor | None = None, cache=None, on_save=None) -> dict:
    """Train `heads` in place; checkpoints to out_dir/checkpoint.pt, final heads saved in out_dir.

    `vocab`: the student vocabulary (token ids; None: all). `cache`: a TeacherCache of `sequences`, so a
    step runs only the prefix layer and the heads; None runs the base model every step (the teacher's
    top cfg.teacher_top_k either way). `on_save(directory)` is called after heads are saved there (the
    job writes draft_vocab.json beside them). Returns {"step", "tokens", "seconds", "history"}.
    Resuming continues bit for bit: same data order, optimizer, schedule and dropout stream.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    optimizer, scheduler = new_optimizer(heads, cfg)
    state = {"step": 0, "tokens": 0, "seconds": 0.0, "history": []}
    torch.manual_seed(cfg.seed)
    checkpoint = out / CHECKPOINT_FILE
    if resume and checkpoint.is_file():
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if saved.get("config", _resumable(cfg)) != _resumable(cfg):
            raise ValueError(f"--resume: {checkpoint} was written by another configuration "
                             f"({saved['config']}); rerun with the same options, or use another --out")
        heads.load_state_dict(saved["heads"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["state"]
        torch.set_rng_state(saved["rng"])  # dropout continues as if never stopped
        log.warning("resumed from %s at step %d", checkpoint, state["step"])
    device = next(model.parameters()).device
    vocab = None if vocab is None else vocab.to(device)
    bar = _progress(cfg.steps, state["step"], progress)
    started = time.time() - state["seconds"]
    heads.train()
    for batch in _batch_stream([len(s.token_ids) for s in sequences], cfg, state["step"]):
        tokens, mask = pad([sequences[k] for k in batch], pad_id, device)
        teacher = (cache.teacher(batch, mask) if cache is not None
                   else run_teacher(model, tokens, mask, vocab, cfg.teacher_top_k, cfg.bf16))
        losses, accuracy = train_step(heads, model, tokens, mask, teacher, vocab, cfg, optimizer, scheduler)
        state["step"] += 1
        state["tokens"] += int(mask.sum())
        state["seconds"] = time.time() - started
        state["history"].append({"step": state["step"], "loss": losses.tolist(), "top1": accuracy,
                                 "tokens": state["tokens"], "seconds": state["seconds"]})
        bar.update(1)
        bar.set_postfix(loss=f"{losses.sum().item():.3f}", top1="/".join(f"{a:.2f}" for a in accuracy))
        done = state["step"] >= cfg.steps or (cfg.max_minutes is not None and state["seconds"] > 60 * cfg.max_minutes)
        if done or state["step"] % cfg.checkpoint_every == 0:
            _save_checkpoint(checkpoint, heads, optimizer, scheduler, state, cfg)
        if cfg.snapshot_every and state["step"] % cfg.snapshot_every == 0:
            snapshot = out / f"step-{state['step']:05d}"
            save_heads(heads, snapshot, save_dtype)
            if on_save is not None:
                on_save(snapshot)
        if done:
            break
    bar.close()
    heads.eval()
    save_heads(heads, out, save_dtype)
    if on_save is not None:
        on_save(out)
    (out / "train_history.json").write_text(json.dumps(state["history"]))
    return state


def train_step(heads: HydraHeads, model, tokens: torch.Tensor, mask: torch.Tensor, teacher: Teacher,
               vocab: torch.Tensor | None, cfg: TrainConfig, optimizer, scheduler) -> tuple[torch.Tensor, list[float]]:
    """One optimizer step on a batch; returns the per-head losses (detached) and top-1 agreement."""
    losses, accuracy, _ = head_losses(heads, model, tokens, mask, cfg.dropout, cfg.bf16, teacher, vocab)
    optimizer.zero_grad(set_to_none=True)
    losses.sum().backward()
    torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], 1.0)  # the trained parameters
    optimizer.step()
    scheduler.step()
    return losses.detach(), accuracy


def new_optimizer(heads: HydraHeads, cfg: TrainConfig):
    """AdamW (no weight decay) and the warm-up + cosine schedule of `cfg`."""
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))


def _resumable(cfg: TrainConfig) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint: all but the limits (a new
    --steps stretches the cosine schedule from where it is, the way to extend a finished run)."""
    return cfg.model_dump(exclude={"steps", "max_minutes", "checkpoint_every", "snapshot_every"})


def _batch_stream(lengths: list[int], cfg: TrainConfig, start_step: int) -> Iterator[list[int]]:
    """Batches epoch after epoch, from the one `start_step` would train on (so resume sees the same order)."""
    per_epoch = len(batches(lengths, cfg.batch_tokens, cfg.seed, 0))
    epoch, position = divmod(start_step, per_epoch)
    while True:
        yield from batches(lengths, cfg.batch_tokens, cfg.seed, epoch)[position:]
        epoch, position = epoch + 1, 0


def _save_checkpoint(path: Path, heads, optimizer, scheduler, state, cfg: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "state": state, "rng": torch.get_rng_state(), "config": _resumable(cfg)}, tmp)
    tmp.replace(path)  # atomic: a kill mid-save leaves the previous checkpoint


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train heads", unit="step")
