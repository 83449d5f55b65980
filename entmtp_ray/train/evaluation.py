"""How good are a model's heads? Per-head top-1 agreement with the base model on held-out text, and
the mean accepted length (tau) a tree reaches on each task's held-out (`eval`) prompts.

`python -m entmtp_ray eval-heads` runs both and prints one JSON report; no Ray here.
"""

from __future__ import annotations

import time

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine
from entmtp_ray.pipeline.tasks import load_prompts


def tau_on_prompts(engine: Engine, prompts: list[tuple[str, str]], decoding: DecodingConfig) -> dict:
    """Decode `prompts` [(id, prompt)] with `decoding` and pool their steps.

    tau = all output tokens after the prefill / all draft-verify steps (bonus token included), so
    long rows weigh by their steps, as throughput does.
    """
    engine.decoding = decoding
    tokens = steps = 0
    per_position = None
    rows_tau, errors = [], []
    started = time.perf_counter()
    for row_id, prompt in prompts:
        row = engine.run(row_id, prompt)
        if row["error"]:
            errors.append(f"{row_id}: {row['error']}")
            continue
        n = row["steps"]
        tokens += row["num_output_tokens"] - 1  # every token after the prefill's came from a step
        steps += n
        rows_tau.append(row["mean_accepted_length"])
        counts = [p * n for p in row["accepted_per_position"]]
        per_position = counts if per_position is None else [a + b for a, b in zip(per_position, counts)]
    seconds = time.perf_counter() - started
    return {
        "temperature": decoding.temperature,
        "acceptance": decoding.acceptance,
        "prompts": len(rows_tau),
        "steps": steps,
        "tau": tokens / steps if steps else None,
        "tau_row_median": sorted(rows_tau)[len(rows_tau) // 2] if rows_tau else None,
        "accepted_per_position": [c / steps for c in per_position] if steps and per_position else None,
        "seconds": seconds,
        "errors": errors,
    }


def heldout_top1(engine: Engine, conversations: int, batch_tokens: int = 1024, max_len: int = 512) -> dict:
    """Per-head top-1 agreement and soft cross-entropy on held-out ShareGPT text (the eval subset), the
    heads' argmax over the draft vocabulary the engine drafts with."""
    from entmtp_ray.train.trainer import chat_sequence, evaluate, sharegpt_conversations

    loaded = engine.loaded
    sequences = [s for s in (chat_sequence(loaded, c, max_len) for c in sharegpt_conversations(conversations, "eval"))
                 if s is not None]
    pad_id = loaded.tokenizer.pad_token_id or 0
    drafter = engine.decoder.drafter  # the heads' argmax over the vocabulary drafting projects onto
    scores = evaluate(drafter.heads, loaded.model, sequences, batch_tokens, pad_id, drafter.vocab_ids)
    return {"conversations": len(sequences), **scores}


def eval_heads(model_cfg: ModelConfig, tasks: list[str], limit: int, tree: str, temperatures: list[float],
               max_new_tokens: int, heldout: int, seed: int = 123, datasets: dict | None = None) -> dict:
    """The full report: held-out per-head top-1 and, per task and temperature, tau with `tree`."""
    base = DecodingConfig(policy="fixed", tree=tree, max_new_tokens=max_new_tokens, seed=seed)
    engine = Engine(model_cfg, resolve(model_cfg, base))
    engine.warm_up()
    report = {"model": model_cfg.model, "heads": engine.heads_label, "tree": tree,
              "max_new_tokens": max_new_tokens, "subset": "eval", "tau": []}
    if heldout:
        report["heldout"] = heldout_top1(engine, heldout)
    for task in tasks:
        dataset = (datasets or {}).get(task)  # None: the task's own source (the hub for GSM8K)
        table = load_prompts(task, dataset, split="train" if dataset else "test", limit=limit, seed=seed,
                             subset="eval")
        prompts = list(zip(table.column("id").to_pylist(), table.column("prompt").to_pylist()))
        for temperature in temperatures:
            decoding = base.model_copy(update={"temperature": temperature,
                                               "acceptance": "greedy" if temperature == 0 else "typical"})
            report["tau"].append({"task": task, **tau_on_prompts(engine, prompts, decoding)})
    return report


def format_report(report: dict) -> str:
    """A short human-readable table of an eval_heads report."""
    lines = [f"heads {report['heads']}  tree {report['tree']}  {report['max_new_tokens']} new tokens, eval prompts"]
    if "heldout" in report:
        top1 = " ".join(f"{a:.3f}" if a is not None else "-" for a in report["heldout"]["top1"])
        lines.append(f"held-out top-1 per head ({report['heldout']['conversations']} conversations): {top1}")
    lines.append(f"{'task':<10} {'T':>4} {'prompts':>7} {'tau':>6} {'per-position acceptance'}")
    for r in report["tau"]:
        pos = " ".join(f"{p:.2f}" for p in r["accepted_per_position"] or [])
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        lines.append(f"{r['task']:<10} {r['temperature']:>4} {r['prompts']:>7} {tau:>6} {pos}")
    return "\n".join(lines)
