"""`entmtp <command> [flags]`, or `python -m entmtp_ray <command> [flags]`: every command a user runs, behind one
entry point as `ray` and `vllm` have theirs. Each command is its module's `main(argv)`; `entmtp <command> --help`
lists its flags. This module imports nothing heavy: only the chosen command's module is loaded."""

from __future__ import annotations

import importlib
import sys

# name -> (module whose main(argv) runs it, one line for `entmtp --help`)
COMMANDS = {
    "batch": ("entmtp_ray.jobs.generate", "the batch job on Ray: a dataset or --task -> Parquet "
                                          "(as jobs/generate.py, or under `ray job submit`)"),
    "generate": ("entmtp_ray.cli", "one machine, no Ray: --prompt or --prompts-file -> one JSON row per prompt"),
    "show": ("entmtp_ray.jobs.show", "a run's output as a short table"),
    "report": ("entmtp_ray.jobs.report", "throughput report of runs: Markdown, JSON and plots"),
    "bench": ("entmtp_ray.jobs.bench", "side-by-side benchmark of the policies, AR and other systems"),
    "build-bank": ("entmtp_ray.jobs.build_bank", "a topology bank for a model, heads and task, on this hardware"),
    "train-heads": ("entmtp_ray.jobs.train_heads", "train Hydra++ heads (its recipe's steps: `entmtp train-heads "
                                                   "distill-data|draft-vocab ...`)"),
    "signal-power": ("entmtp_ray.jobs.signal_power", "which scheduling signal predicts acceptance on your prompts"),
    "eval-heads": ("entmtp_ray.cli", "per-head top-1 and tau per task with a tree"),
    "flags": ("entmtp_ray.cli", "every config's flags as Markdown tables"),
}
# the heads' recipe steps, run as `entmtp train-heads <step> [flags]`
TRAIN_STEPS = {"distill-data": "entmtp_ray.jobs.distill_data", "draft-vocab": "entmtp_ray.jobs.draft_vocab"}
# commands of the one-machine CLI (cli.py), whose own parser takes the command's name
CLI = "entmtp_ray.cli"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: entmtp <command> [flags]   (entmtp <command> --help for its flags)\n\ncommands:\n" + \
        "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"entmtp: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    if name == "train-heads" and rest and rest[0] in TRAIN_STEPS:
        name, module, rest = f"{name} {rest[0]}", TRAIN_STEPS[rest[0]], rest[1:]
    if module == CLI:
        rest = [name, *rest]
    sys.argv[0] = f"entmtp {name}"  # argparse's prog in the command's usage line
    return importlib.import_module(module).main(rest)
