"""Command-line flags shared by the entry points, and the one-machine CLI
(`entmtp generate ...`, one JSON object per prompt on stdout)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError
from transformers.utils import logging as transformers_logging

from entmtp_ray.config import DecodingConfig, ModelConfig, PoolConfig
from entmtp_ray.pipeline.assemble import resolve
from entmtp_ray.pipeline.engine import Engine, RowRequest
from entmtp_ray.pipeline.sources import LINE_ERROR, LINE_ID, POS, open_file, read_file, resolve_filesystem
from entmtp_ray.pipeline.sampling import SAMPLING_COLUMN, check_row

ConfigT = typing.TypeVar("ConfigT", bound=BaseModel)


# ---- command lines generated from the configs --------------------------------------------------
# Each config field becomes `--field-name` with the field's type, default, choices (a Literal) and
# description as help, so a setting is declared once, in config.py.

# how a list field's flag takes its values: nargs="+" as vLLM's list flags (--served-model-name a b), and repeatable
LIST_NOTE = "a list: several values after one flag, as vLLM's list flags take them, or the flag repeated"

def _flag_kind(annotation) -> tuple[type, list | None, bool]:
    """(argparse type, choices, whether the flag takes a list) of a field's annotation: T, T | None,
    Literal[...] or list[T]."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), list(args), False
    if typing.get_origin(annotation) is list:
        kind, choices, _ = _flag_kind(args[0])
        return kind, choices, True
    if args:  # Optional[T] or Optional[Literal[...]]
        return _flag_kind(args[0])
    return annotation, None, False


def add_config_args(parser: argparse.ArgumentParser, config: type[BaseModel], only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """One flag per field of `config` (or of the fields in `only`), in a group named after the config;
    `defaults` overrides a field's default for this command."""
    group = parser.add_argument_group(config.__name__.removesuffix("Config").lower(), config.__doc__)
    for name, field in config.model_fields.items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        kind, choices, many = _flag_kind(field.annotation)
        default = (defaults or {}).get(name, field.default)
        help_text = (field.description or "").replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif many:
            # several values after the flag, as vLLM's list flags take them, and the flag repeated adds more;
            # argparse extends a default list rather than replacing it, so list fields default to None
            assert not default, f"{name}: a list field's default must be None or empty"
            group.add_argument(flag, type=kind, choices=choices, nargs="+", action="extend", default=default,
                               metavar=kind.__name__.upper(), help=f"{help_text} ({LIST_NOTE}; default: %(default)s)")
        elif field.is_required() and name not in (defaults or {}):
            group.add_argument(flag, type=kind, choices=choices, required=True, help=help_text)
        else:
            group.add_argument(flag, type=kind, choices=choices, default=default,
                               help=f"{help_text} (default: %(default)s)")


def config_from_args(config: type[ConfigT], args: argparse.Namespace, **fixed) -> ConfigT:
    """The config from the parsed flags of its fields (those the command has), plus `fixed` values."""
    values = {name: getattr(args, name) for name in config.model_fields if hasattr(args, name)}
    return config.model_validate({**values, **fixed})


def flag_table(config: type[BaseModel]) -> str:
    """The config's flags as a Markdown table (README.md's flag tables are these: `make docs`)."""
    lines = ["| flag | default | what it does |", "|---|---|---|"]
    for name, field in config.model_fields.items():
        kind, choices, many = _flag_kind(field.annotation)
        default = "required" if field.is_required() else f"`{field.default}`"
        text = (field.description or "").replace("|", "\\|").replace("\n", " ")
        if choices:
            text += " (" + " \\| ".join(f"`{c}`" for c in choices) + ")"
        if many:
            text += f" ({LIST_NOTE})"
        lines.append(f"| `--{name.replace('_', '-')}` | {default} | {text} |")
    return "\n".join(lines)


def read_prompts(args) -> list[tuple[str, object, str | None, object]]:
    """(id, prompt, error, sampling_params) rows; a malformed line is kept, with its error, so it gets an
    output row."""
    if args.prompt is not None:
        return [("prompt-0", args.prompt, None, None)]
    fs, path = resolve_filesystem(args.prompts_file)
    if not path.endswith((".jsonl", ".json", ".jsonl.gz")):
        raise ValueError(f"--prompts-file {args.prompts_file}: expected a JSON lines file (.jsonl)")
    triples = []
    with open_file(fs, path) as f:
        for chunk in read_file(f, path, text_columns=("prompt",)):
            for row in chunk.to_pylist():
                row_id = row.get("id") if row.get("id") is not None else row.get(LINE_ID) or f"row-{row[POS]:07d}"
                triples.append((str(row_id), row.get("prompt"), row.get(LINE_ERROR), row.get(SAMPLING_COLUMN)))
    return triples


def cmd_generate(args) -> int:
    try:
        concurrency = config_from_args(PoolConfig, args).concurrent_requests
        model_cfg = config_from_args(ModelConfig, args)
        engine = Engine(model_cfg, resolve(model_cfg, config_from_args(DecodingConfig, args)), concurrency=concurrency)
        prompts = read_prompts(args)
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine.warm_up()
    samples = []  # one line per sample, as the job writes one row per sample
    for row_id, prompt, error, params in prompts:
        overrides, n, problem = check_row(engine.decoding, params) if not error else ({}, 1, None)
        samples += [(row_id, prompt, error or problem, overrides, index) for index in range(n)]

    # --concurrent-requests K: K samples in flight (Engine.run_many); lines print in input order as they complete
    lines: dict[int, dict] = {}
    good = []
    for i, (row_id, prompt, problem, _, index) in enumerate(samples):
        if problem:
            lines[i] = engine.error_row(row_id, prompt, problem, index)
        else:
            good.append(i)
    printed = 0
    for k, line in engine.run_many(RowRequest(samples[i][0], samples[i][1], None, samples[i][4], samples[i][3])
                                   for i in good):
        lines[good[k]] = line
        while printed in lines:
            print(json.dumps(lines.pop(printed)), flush=True)
            printed += 1
    for i in sorted(lines):  # error rows after the last decoded one
        print(json.dumps(lines[i]), flush=True)
    return 0


def cmd_eval_heads(args) -> int:
    from entmtp_ray.train.evaluation import eval_heads, format_report
    from entmtp_ray.pipeline.tasks import TASKS

    unknown = sorted(set(args.tasks) - TASKS)
    if unknown:
        print(f"error: unknown task(s) {unknown}; choose from {sorted(TASKS)}", file=sys.stderr)
        return 2
    try:
        report = eval_heads(config_from_args(ModelConfig, args), args.tasks, args.limit, args.tree, args.temperatures, args.max_new_tokens,
                            args.heldout, args.seed, {"gsm8k": args.gsm8k_data})
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report), file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def flag_tables() -> str:
    from entmtp_ray.config import CalibrationConfig, InputConfig, JobConfig, PoolConfig

    return "\n\n".join(f"**{c.__name__}** ({c.__doc__})\n\n{flag_table(c)}"
                       for c in (ModelConfig, DecodingConfig, InputConfig, JobConfig, PoolConfig, CalibrationConfig))


FLAGS_BEGIN, FLAGS_END = "<!-- flags:begin -->", "<!-- flags:end -->"


def readme_flag_tables(text: str) -> str:
    """The generated part of a README: the text between the flags markers, stripped."""
    if FLAGS_BEGIN not in text or FLAGS_END not in text:
        raise ValueError(f"no {FLAGS_BEGIN} ... {FLAGS_END} section")
    return text.split(FLAGS_BEGIN, 1)[1].split(FLAGS_END, 1)[0].strip()


def write_flag_tables(readme: Path) -> None:
    text = readme.read_text()
    old = readme_flag_tables(text)
    readme.write_text(text.replace(old, flag_tables(), 1))


def quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers_logging.disable_progress_bar()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="entmtp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for one prompt or a JSONL file of prompts")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts-file", help='JSONL with {"id", "prompt"} per line, and optionally "sampling_params" (README: per-row settings)')
    add_config_args(gen, ModelConfig)
    add_config_args(gen, DecodingConfig)
    add_config_args(gen, PoolConfig, only=("concurrent_requests",))
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ev = sub.add_parser("eval-heads", help="per-head top-1 on held-out text and tau per task with a tree")
    add_config_args(ev, ModelConfig)
    ev.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "sharegpt"])
    ev.add_argument("--gsm8k-data", default=None, help="local copy of GSM8K's train.jsonl (default: the hub, "
                    "openai/gsm8k); only its eval subset is used")
    ev.add_argument("--limit", type=int, default=20, help="eval prompts per task")
    ev.add_argument("--tree", default="hydra", help="built-in tree name or JSON file of paths")
    ev.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                    help="0 = greedy acceptance, >0 = typical acceptance")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--heldout", type=int, default=50, help="held-out ShareGPT conversations for per-head "
                    "top-1 (0 = skip)")
    ev.add_argument("--seed", type=int, default=123)
    ev.add_argument("--output", default=None, help="also write the JSON report here")
    ev.add_argument("--threads", type=int, default=None)
    flags = sub.add_parser("flags", help="print the flag tables of every config (Markdown, as in README.md)")
    flags.add_argument("--readme", default=None, help="rewrite the tables between the flags markers of this file")
    args = parser.parse_args(argv)
    if args.command == "flags":
        if args.readme:
            write_flag_tables(Path(args.readme))
        else:
            print(flag_tables())
        return 0
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"generate": cmd_generate, "eval-heads": cmd_eval_heads}[args.command](args)

