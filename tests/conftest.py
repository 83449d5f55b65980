"""Fixtures every folder of the suite shares: the tiny random Llama (helpers/tiny.py), as a model, as a
local model directory with heads, and with heads drafting for it. The suite never reaches
the network: the hub and datasets libraries run offline (set before they are imported, and
inherited by every job and Ray worker a test starts), so a test that needs the hub fails at once."""

from __future__ import annotations

import os
import tempfile

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
# every Ray the suite starts or joins, in this process and the jobs it runs, without token auth: a ~/.ray/auth_token
# left by any local ray.init() would otherwise turn it on for a `ray start` head and refuse clients without it
os.environ["RAY_AUTH_MODE"] = "disabled"
# step costs the suite's decoders measure (decode/costs.py) go to a folder of this run's, not the machine's cost
# tables: timed beside another test, they are not what a job alone would see
os.environ["ENTMTP_COSTS"] = tempfile.mkdtemp(prefix="entmtp-costs-")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from helpers import alone  # noqa: E402
from helpers.tiny import make_tiny_llama, tiny_with_heads  # noqa: E402

NEIGHBOURS = alone.install()  # reads of a folder beside the checkout fail from here on (helpers/alone.py)

# `make test` runs two tests at once (xdist): each worker takes its share of the cores, since torch's default (every
# core per process) oversubscribes them and OpenMP's spinning threads then wait on each other (a real-model test
# ran 5x slower beside another than alone). A test compares outputs computed in its own process, at one thread count.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, len(os.sched_getaffinity(0)) // WORKERS)
torch.set_num_threads(THREADS)


def pytest_sessionfinish(session, exitstatus):
    if alone.READ:  # a read that some code caught and survived still fails the run
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nread beside the checkout (helpers/alone.py): {sorted(set(alone.READ))[:10]}")


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """(model_dir, heads_dir): a tiny random Llama saved as a local model directory named
    `tiny-vicuna` (so it takes the Vicuna chat format) with the embedded model's tokenizer, and
    4 prefix-mlp heads with their own vocab projections, as the production path has."""
    from transformers import AutoTokenizer

    from entmtp_ray.model.heads import init_heads, save_heads
    from entmtp_ray.model.loading import resolve_model_path

    root = tmp_path_factory.mktemp("local")
    model_dir, heads_dir = root / "tiny-vicuna", root / "heads"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(model_dir)
    heads = init_heads(model, num_heads=4, shared_lm_head=False, seed=1, base_name=str(model_dir))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_heads(heads, heads_dir)
    return model_dir, heads_dir


@pytest.fixture(scope="module")
def tiny():
    """(loaded, drafter): a fresh tiny Llama in fp32 and 3 random one-layer Hydra heads drafting for it.
    (A module that needs another `tiny` defines its own, which takes its place there.)"""
    return tiny_with_heads()


@pytest.fixture(scope="session")
def _shared_ray_head():
    """One Ray head per test process (per xdist worker), started once: `ray start --head` in its own directory,
    stopped at the session's end, exactly its processes (helpers/raytools.py). Its workers, which the jobs of every
    test reuse, inherit this process's environment; no worker is prestarted (they start as tasks ask)."""
    from helpers import raytools

    with raytools.ray_head("--num-cpus=8", "--include-dashboard=false", prefix="rs-",
                           env={**os.environ, "RAY_prestart_worker_first_driver": "0"}) as head:
        yield head
        import ray

        ray.shutdown()  # leave it before it stops


@pytest.fixture
def ray_cluster(_shared_ray_head):
    """This process joined to the session's shared Ray (joined again if a test before left it): a job run here
    (helpers.jobs.run_here) uses it and leaves it joined. A test that needs a cluster of its own (node loss, a
    killed driver, autoscaling) starts one instead, after `ray.shutdown()`."""
    import ray

    if not ray.is_initialized():
        ray.init(address=_shared_ray_head.address, log_to_driver=True)
    yield _shared_ray_head
