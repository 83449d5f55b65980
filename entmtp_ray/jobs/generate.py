"""Batch generation job: prompts (any dataset on any filesystem, streamed) -> Ray Data actor pool -> Parquet.

    python jobs/generate.py --task humaneval --limit 8 --output runs/humaneval
    python jobs/generate.py --dataset s3://bucket/prompts/ --prompt-column question --output s3://bucket/labels/
    ray job submit --working-dir . -- python jobs/generate.py --task gsm8k --address auto --output s3://bucket/gsm8k/

A thin CLI over entmtp_ray.build_processor (pipeline/processor.py) and the job's data plane
(pipeline/dataplane.py). Config errors exit with status 2 before Ray starts; what only the cluster can tell
(an --output on one node's disk of a multi-node cluster, no usable GPU where the actors run) exits 2 after
joining it, before any row is generated or anything is written. A `--bank auto` calibration that fails
still has every row decoded (with its fallback) and written, then exits with status 3 and a line on stderr
saying why, unless --allow-bank-fallback accepts the fallback. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pydantic import ValidationError

from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import (CalibrationConfig, DecodingConfig, InputConfig, JobConfig, ModelConfig, PoolConfig,
                               ProcessorConfig)
from entmtp_ray.pipeline.dataplane import connect, joined, run_job, shutdown
from entmtp_ray.pipeline.manifest import check_or_write, run_settings
from entmtp_ray.pipeline.outputs import check_output
from entmtp_ray.pipeline.autobank import calibration_problem
from entmtp_ray.pipeline.processor import build_processor
from entmtp_ray.pipeline.sources import Location
from entmtp_ray.pipeline.tasks import open_prompts, prompt_spec

CONFIGS = (InputConfig, JobConfig, PoolConfig, ModelConfig, DecodingConfig, CalibrationConfig)
CONFIG_ERROR, CALIBRATION_FAILED = 2, 3  # exit statuses


def main(argv=None, actor: type | None = None) -> int:
    """The job of `argv`; `actor`: the pool's callable class in place of GenerateActor (a subclass: the tests inject
    faults through one)."""
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for config in CONFIGS:
        add_config_args(parser, config)
    args = parser.parse_args(argv)
    quiet_logging()
    # a caller that had joined Ray already (a notebook, a test session) stays joined; Ray this job joins, it leaves
    leave = shutdown if not joined() else (lambda: None)
    try:
        source, job, pool = (config_from_args(c, args) for c in (InputConfig, JobConfig, PoolConfig))
        model_cfg, decoding = config_from_args(ModelConfig, args), config_from_args(DecodingConfig, args)
        processor = build_processor(ProcessorConfig(model=model_cfg, decoding=decoding, pool=pool,
                                                    calibration=config_from_args(CalibrationConfig, args)),
                                    **({"actor": actor} if actor is not None else {}))
        location = Location.of(job.output)
        spec = prompt_spec(decoding.task, source.dataset, source.split, source.prompt_column, source.id_column,
                           source.messages_column)
        files = open_prompts(spec)  # lists files (or reaches the hub) and checks columns: no rows read
        timeline = {"configs": time.time()}  # the job's start-up, as the summary gives it
        connect(job, processor, location, timeline)  # joins Ray; nothing is written before its checks pass
        check_output(location, job.resume)
        settings, sources = run_settings(model_cfg, processor.plan.requested, source, processor.plan.needs_heads,
                                         processor.plan.bank_path, pool.concurrent_requests)
        check_or_write(location, settings, job.resume, sources)
    except (ValueError, ValidationError, FileNotFoundError, ConnectionError) as exc:  # ConnectionError: --address
        print(f"error: {exc}", file=sys.stderr)
        leave()  # a local Ray the job started goes with it
        return CONFIG_ERROR
    summary = run_job(spec, job, processor, source.limit, decoding.seed, started, files, timeline)
    bank = processor.plan.bank
    summary.update(policy=processor.plan.decoding.policy, bank=processor.plan.bank_label,  # what ran, and why
                   bank_source=processor.plan.source,
                   bank_selection=bank.selection.reason if bank is not None and bank.selection else None)
    leave()  # Ray forwards autoscaler and worker logs to stdout until the driver disconnects
    print(json.dumps(summary), flush=True)
    problem = calibration_problem(summary.get("calibration"))
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return CALIBRATION_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
