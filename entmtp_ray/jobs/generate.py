"""Batch generation job: prompts -> Ray Data actor pool -> Parquet.

    python jobs/generate.py --task humaneval --limit 8 --output runs/humaneval
    ray job submit --working-dir . -- python jobs/generate.py --task gsm8k --address auto --output /data/gsm8k

Config errors exit with status 2 before Ray starts; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


from pydantic import ValidationError

from entmtp_ray.cli import add_config_args, config_from_args, quiet_logging
from entmtp_ray.config import DecodingConfig, InputConfig, JobConfig, ModelConfig
from entmtp_ray.pipeline.assemble import plan
from entmtp_ray.pipeline.manifest import check_or_write, run_settings
from entmtp_ray.pipeline.ray_stage import check_output, run_pipeline, shutdown
from entmtp_ray.pipeline.tasks import load_prompts


def main(argv=None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for config in (InputConfig, JobConfig, ModelConfig, DecodingConfig):
        add_config_args(parser, config)
    args = parser.parse_args(argv)
    quiet_logging()
    try:
        source, job = config_from_args(InputConfig, args), config_from_args(JobConfig, args)
        model_cfg, decoding = config_from_args(ModelConfig, args), config_from_args(DecodingConfig, args)
        resolved = plan(model_cfg, decoding)
        check_output(job.output, job.resume)
        table = load_prompts(decoding.task, source.dataset, source.split, source.prompt_column, source.id_column,
                             source.messages_column, source.limit, decoding.seed)
        settings, sources = run_settings(model_cfg, decoding, source, resolved.needs_heads, resolved.bank_path)
        check_or_write(job.output, settings, job.resume, sources)
    except (ValueError, ValidationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = run_pipeline(table, job, model_cfg, decoding, started)
    shutdown()  # Ray forwards autoscaler and worker logs to stdout until the driver disconnects
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
