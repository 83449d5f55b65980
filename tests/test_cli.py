"""The one-machine CLI on the embedded model: bad rows become error rows, broken configs fail at start."""

from __future__ import annotations

import json

import pytest

from helpers.jobs import run_main


def run_cli(*args):
    """`entmtp generate ARGS` (python -m entmtp_ray generate), its main run in this process: the embedded model's
    load is the cost, not a second interpreter's imports; tests/test_install.py runs the installed command."""
    from entmtp_ray.cli import main

    return run_main(main, ["generate", *args])


@pytest.mark.slow
def test_bad_rows_become_error_rows_and_good_rows_still_run(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"id": "good", "prompt": "What is the capital of France?"}),
        json.dumps({"id": "empty", "prompt": "   "}),
        json.dumps({"id": "long", "prompt": "tell me " * 80}),
        json.dumps({"id": "number", "prompt": 42}),
        "{not json",
        json.dumps({"id": "good2", "prompt": "Name a colour."}),
    ]
    prompts.write_text("\n".join(lines) + "\n")
    proc = run_cli("--prompts-file", str(prompts), "--policy", "hydra", "--heads", "untrained",
                   "--max-new-tokens", "8", "--max-input-tokens", "100")
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert list(rows) == ["good", "empty", "long", "number", "prompts.jsonl:line-5", "good2"]
    for good in ("good", "good2"):
        row = rows[good]
        assert row["error"] is None and row["num_output_tokens"] > 0 and row["output_text"]
        assert row["steps"] > 0 and row["mean_accepted_length"] >= 1.0 and row["tree_usage"] == {"hydra": row["steps"]}
        assert len(row["accepted_per_position"]) == 4 and row["tokens_per_s"] > 0
        assert row["total_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])
    assert "empty prompt" in rows["empty"]["error"]
    assert "--max-input-tokens 100" in rows["long"]["error"]
    assert "must be a string" in rows["number"]["error"]
    assert "not valid JSON" in rows["prompts.jsonl:line-5"]["error"]
    assert all(rows[k]["output_text"] is None for k in ("empty", "long", "number", "prompts.jsonl:line-5"))


@pytest.mark.slow
def test_concurrent_requests_print_the_one_at_a_time_rows_in_input_order(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["What is the capital of France?", "Name a colour.", "   ", "Count to three.", "Write a haiku."]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    common = ("--prompts-file", str(prompts), "--policy", "entmtp-star", "--task", "gsm8k", "--dtype", "fp32",
              "--max-new-tokens", "12")
    one, three = run_cli(*common), run_cli(*common, "--concurrent-requests", "3")
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    rows_one, rows_three = (list(map(json.loads, p.stdout.splitlines())) for p in (one, three))
    assert [r["id"] for r in rows_three] == [f"p{i}" for i in range(5)]
    assert [r["output_token_ids"] for r in rows_three] == [r["output_token_ids"] for r in rows_one]
    assert "empty prompt" in rows_three[2]["error"]


def test_sampling_uses_exact_acceptance_unless_typical_is_asked_for():
    from pydantic import ValidationError

    from entmtp_ray.config import DecodingConfig

    assert DecodingConfig().acceptance == "greedy"
    assert DecodingConfig(temperature=0.7).acceptance == "exact"  # --temperature alone just works
    assert DecodingConfig(temperature=0.7, acceptance="typical").acceptance == "typical"
    assert DecodingConfig(acceptance="exact").acceptance == "exact"  # equals greedy at T=0
    with pytest.raises(ValidationError, match="--acceptance greedy needs --temperature 0"):
        DecodingConfig(temperature=0.7, acceptance="greedy")


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--policy", "nope"], "unknown policy 'nope'; choose one of"),
    (["--policy", "fixed", "--tree", "no-such-tree"], "unknown tree 'no-such-tree'"),
    (["--policy", "fixed"], "--policy fixed needs --tree"),
    (["--policy", "hydra", "--temperature", "0.7", "--acceptance", "greedy"],
     "--acceptance greedy needs --temperature 0"),
])
def test_broken_config_fails_before_loading(args, message):
    proc = run_cli("--prompt", "hi", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_malformed_tree_file_fails_at_start(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [0, 0], [2]]")  # rank 2 at the root without rank 1
    proc = run_cli("--prompt", "hi", "--policy", "fixed", "--tree", str(bad))
    assert proc.returncode == 2
    assert "path [2] skips rank 1" in proc.stderr
    bad.write_text("{oops")
    proc = run_cli("--prompt", "hi", "--policy", "fixed", "--tree", str(bad))
    assert proc.returncode == 2 and "is not valid JSON" in proc.stderr


@pytest.mark.slow
def test_tree_deeper_than_heads_fails_at_start(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps([[0] * d for d in range(1, 6)]))
    proc = run_cli("--prompt", "hi", "--policy", "fixed", "--tree", str(deep), "--heads", "untrained")
    assert proc.returncode == 2
    assert "depth 5 but the heads draft at most 4" in proc.stderr and "--heads" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_missing_heads_directory_names_the_flag(tmp_path):
    proc = run_cli("--prompt", "hi", "--policy", "hydra", "--heads", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "--heads" in proc.stderr


# ---- command lines generated from the configs -------------------------------------------------------

def test_flags_come_from_the_config_fields_with_their_types_choices_and_defaults():
    import argparse

    from pydantic import ValidationError

    from entmtp_ray.cli import add_config_args, config_from_args
    from entmtp_ray.config import DecodingConfig, JobConfig, ModelConfig

    parser = argparse.ArgumentParser()
    for config in (ModelConfig, DecodingConfig, JobConfig):
        add_config_args(parser, config)
    args = parser.parse_args(["--output", "out", "--dtype", "bf16", "--max-new-tokens", "7", "--trace-signal",
                              "--draft-vocab", "0", "--temperature", "0.5", "--acceptance", "exact"])
    decoding = config_from_args(DecodingConfig, args)
    assert (decoding.max_new_tokens, decoding.trace_signal, decoding.temperature) == (7, True, 0.5)
    assert config_from_args(ModelConfig, args).dtype == "bf16" and config_from_args(ModelConfig, args).draft_vocab == 0
    assert config_from_args(JobConfig, args).output == "out"
    assert config_from_args(DecodingConfig, parser.parse_args(["--output", "o"])) == DecodingConfig()
    for bad in (["--dtype", "fp8"], ["--acceptance", "maybe"], ["--max-new-tokens", "x"], []):  # [] lacks --output
        with pytest.raises(SystemExit):
            parser.parse_args(["--output", "o", *bad] if bad else bad)
    with pytest.raises(ValidationError, match="needs --temperature 0"):  # the config's own checks still run
        config_from_args(DecodingConfig,
                         parser.parse_args(["--output", "o", "--temperature", "0.7", "--acceptance", "greedy"]))
    some = argparse.ArgumentParser()
    add_config_args(some, DecodingConfig, only=("seed", "max_new_tokens"), defaults={"max_new_tokens": 128})
    assert vars(some.parse_args([])) == {"seed": 123, "max_new_tokens": 128}


def test_the_readme_flag_tables_are_the_generated_ones():
    from pathlib import Path

    from entmtp_ray.cli import flag_tables, readme_flag_tables

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert readme_flag_tables(readme) == flag_tables().strip(), "README.md's flags are stale: run `make docs`"
    assert "| `--max-new-tokens` | `256` |" in flag_tables() and "`vicuna_v1.1`" in flag_tables()


def test_a_misspelt_setting_fails_instead_of_vanishing():
    from pydantic import ValidationError

    from entmtp_ray.config import DecodingConfig, JobConfig

    with pytest.raises(ValidationError, match="dataset"):
        JobConfig(output="o", dataset="my.jsonl")  # an input setting: InputConfig's
    with pytest.raises(ValidationError, match="max_new_token"):
        DecodingConfig(max_new_token=5)


def test_every_entmtp_command_runs_its_modules_main(capsys):
    """`entmtp <command> --help` reaches each command's own parser (train-heads' recipe steps included); an unknown
    command exits 2 naming the commands."""
    from entmtp_ray.commands import COMMANDS, TRAIN_STEPS, main

    for argv in [[name] for name in COMMANDS] + [["train-heads", step] for step in TRAIN_STEPS]:
        try:
            main([*argv, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, argv
        out = capsys.readouterr().out
        assert out.startswith("usage: entmtp"), (argv, out[:200])
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
