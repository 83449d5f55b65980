"""--model and --heads by hub id, offline (conftest sets HF_HUB_OFFLINE=1): a hub cache laid out by hand
(models--owner--name/refs/main holding a commit, snapshots/<commit>/<files>) resolves to its snapshot, which
loads; checks before loading (the driver's) ask the hub for JSON files only; an id in no cache says how to get it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch

from entmtp_ray.config import DecodingConfig, ModelConfig, PoolConfig, ProcessorConfig
from entmtp_ray.model import hub
from entmtp_ray.model.heads import init_heads, load_heads, save_heads
from entmtp_ray.model.loading import available_depth, draft_vocab_for, resolve_heads_path, resolve_model_path

from helpers import raytools
from helpers.checkpoints import NUM_HEADS, make_sentencepiece_vicuna, published_state, write_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Put the files of `source` into `cache` as the hub would have stored repo `repo_id` at `commit`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache of this test's own, offline (huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when
    it is imported, which in tools/mutate.py's runner is before conftest.py sets the environment; the module
    attributes are what each download reads)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def fetches(monkeypatch):
    """The allow_patterns of every snapshot the code asks huggingface_hub for."""
    calls = []
    real = hub.snapshot_download

    def spy(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("allow_patterns")))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(hub, "snapshot_download", spy)
    return calls


def test_published_hydra_heads_by_hub_id_resolve_to_the_snapshot_and_load(hub_cache, fetches, tmp_path, tiny_llama):
    source = write_checkpoint(tmp_path / "ckpt", published_state())
    snapshot = cache_repo(hub_cache, "ankner/hydra-tiny", source)
    assert resolve_heads_path("any-model", "ankner/hydra-tiny") == snapshot
    heads = load_heads(resolve_heads_path("any-model", "ankner/hydra-tiny"), tiny_llama)
    assert heads.config.num_heads == NUM_HEADS
    assert hub.snapshot_label(snapshot) == f"ankner/hydra-tiny@{COMMIT}"
    assert fetches == [("ankner/hydra-tiny", None), ("ankner/hydra-tiny", None)]


def test_checks_before_loading_fetch_the_heads_configs_only(hub_cache, fetches, tmp_path):
    """What the driver runs while planning needs config.json (and draft_vocab.json), never the weights: here
    the cache holds no hydra_lm_head.pt at all, as after the driver's own config-only download."""
    source = tmp_path / "configs"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"hydra_num_heads": 4, "hydra_num_layers": 4,
                                                    "hydra_head_arch": "prefix-mlp", "grounded_heads": True}))
    cache_repo(hub_cache, "ankner/hydra-vicuna-7b-v1.3", source)
    assert available_depth("lmsys/vicuna-7b-v1.3", "ankner/hydra-vicuna-7b-v1.3") == 4
    assert draft_vocab_for("lmsys/vicuna-7b-v1.3", "ankner/hydra-vicuna-7b-v1.3", None) is None
    assert fetches and all(patterns == hub.CONFIG_FILES for _, patterns in fetches)


def test_a_vicuna_shaped_model_and_its_heads_by_hub_id_decode_a_row(hub_cache, fetches, tmp_path):
    """--model and --heads as hub ids through the whole engine: the model loads from its snapshot (as
    lmsys/vicuna-7b-v1.3 ships: a sentencepiece tokenizer.model only), takes the Vicuna chat format from its
    name, and rows name the heads by id and commit, the same on every node."""
    from helpers.engines import make_engine

    model_dir = make_sentencepiece_vicuna(tmp_path)
    heads_dir = tmp_path / "heads"
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    heads = init_heads(LlamaForCausalLM.from_pretrained(model_dir), num_heads=4, shared_lm_head=False, seed=1,
                       base_name="lmsys-test/tiny-vicuna")
    save_heads(heads, heads_dir)
    model_snapshot = cache_repo(hub_cache, "lmsys-test/tiny-vicuna", model_dir)
    cache_repo(hub_cache, "owner/tiny-heads", heads_dir, commit="f" * 40)
    assert resolve_model_path("lmsys-test/tiny-vicuna") == str(model_snapshot)

    engine = make_engine(ModelConfig(model="lmsys-test/tiny-vicuna", heads="owner/tiny-heads", dtype="fp32",
                                device="cpu"), DecodingConfig(policy="hydra", max_new_tokens=8))
    assert engine.loaded.chat_format == "vicuna_v1.1"
    row = engine.run("r1", "What is 2+3?")
    assert row["error"] is None and row["num_output_tokens"] > 0
    assert row["model"] == "lmsys-test/tiny-vicuna" and row["heads"] == "owner/tiny-heads@" + "f" * 40


def test_the_processor_plans_on_configs_alone(hub_cache, fetches, tmp_path):
    """build_processor (the driver's checks) touches the hub for JSON files only, model and heads alike."""
    from entmtp_ray.pipeline.processor import build_processor

    source = write_checkpoint(tmp_path / "ckpt", published_state(), hydra_num_heads=4)  # Hydra's tree: 4 deep
    cache_repo(hub_cache, "ankner/hydra-tiny", source)
    model_source = tmp_path / "model"
    model_source.mkdir()
    (model_source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cache_repo(hub_cache, "lmsys/vicuna-7b-v1.3", model_source)
    build_processor(ProcessorConfig(model=ModelConfig(model="lmsys/vicuna-7b-v1.3", heads="ankner/hydra-tiny"),
                                    decoding=DecodingConfig(policy="hydra"), pool=PoolConfig()))
    assert {repo for repo, _ in fetches} == {"lmsys/vicuna-7b-v1.3", "ankner/hydra-tiny"}
    assert all(patterns == hub.CONFIG_FILES for _, patterns in fetches)


@pytest.mark.parametrize("flag", ["--model", "--heads"])
def test_an_id_in_no_cache_offline_names_the_ways_to_get_it(hub_cache, flag):
    with pytest.raises(FileNotFoundError) as caught:
        if flag == "--model":
            resolve_model_path("nobody/no-such-model")
        else:
            available_depth("any-model", "nobody/no-such-model")
    message = str(caught.value)
    assert message.startswith(f"{flag} nobody/no-such-model: not in this node's hub cache")
    for fix in ("HF_HUB_OFFLINE=0", "hf download nobody/no-such-model", "huggingface-cli download", "local directory"):
        assert fix in message


def test_local_paths_are_never_taken_for_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("lmsys/vicuna-7b-v1.3") and hub.is_hub_id("ankner/hydra-vicuna-7b-v1.3")
    (tmp_path / "runs" / "heads").mkdir(parents=True)
    assert not hub.is_hub_id("runs/heads")  # exists here: a local directory
    for path in ("/abs/heads", "./heads", "~/heads", "a/b/c", "heads"):
        assert not hub.is_hub_id(path)
    with pytest.raises(FileNotFoundError, match="--heads /abs/heads: no such directory"):
        resolve_heads_path("m", "/abs/heads")
    with pytest.raises(FileNotFoundError, match="--model ./missing: no such local directory"):
        resolve_model_path("./missing")
    assert hub.snapshot_label(tmp_path) is None


@pytest.mark.slow
def test_the_job_takes_model_and_heads_by_hub_id(tmp_path):
    """jobs/generate.py on local Ray with both ids: the driver plans on their configs, every actor loads the
    snapshots from the node's cache (HF_HUB_CACHE, inherited), and the manifest names the heads by commit."""
    from transformers import LlamaForCausalLM

    from helpers.jobs import JOB, read_output, run_job, write_prompts

    cache = tmp_path / "hub"
    model_dir = make_sentencepiece_vicuna(tmp_path)
    heads_dir = tmp_path / "heads"
    save_heads(init_heads(LlamaForCausalLM.from_pretrained(model_dir), num_heads=4, shared_lm_head=False, seed=1),
               heads_dir)
    cache_repo(cache, "lmsys-test/tiny-vicuna", model_dir)
    cache_repo(cache, "owner/tiny-heads", heads_dir)
    data = write_prompts(tmp_path / "prompts.jsonl", 3)
    with raytools.own_ray_dir("rh-") as ray_dir:
        proc = run_job([*JOB, "--dataset", str(data), "--prompt-column", "text", "--id-column", "uid",
                        "--model", "lmsys-test/tiny-vicuna", "--heads", "owner/tiny-heads", "--policy", "hydra",
                        "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "8", "--output", str(tmp_path / "out")],
                       env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": ray_dir,
                            raytools.MARKER_ENV: ray_dir})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(tmp_path / "out")
    assert len(rows) == 3 and all(r["error"] is None and r["num_output_tokens"] > 0 for r in rows)
    assert {r["heads"] for r in rows} == {f"owner/tiny-heads@{COMMIT}"}
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["settings"]["heads_sha256"] == manifest["sources"]["heads"] == f"owner/tiny-heads@{COMMIT}"
