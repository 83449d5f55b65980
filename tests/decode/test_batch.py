"""Throughput mode (--concurrent-requests): several requests decoded at once, their trees verified in one forward.

Each request must come out as it does alone: the same tokens (fp32 here, so exactly), the same steps, trees and
accepted lengths, the same sampled tokens from its row generator; requests of every length leave and enter
mid-run (continuous batching); one request's failure is its own. The tiny-model tests run in seconds; the
embedded model checks bf16 bit for bit while a step's rows stay within the products' row-independent range.
"""

from __future__ import annotations

import json
import threading

import pytest

from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.batch import BatchDecoder, Job
from entmtp_ray.decode.acceptance import row_generator
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree, HysteresisPolicy, make_signal
from entmtp_ray.decode.tree import chain_topology, load_topology, make_topology
from helpers.engines import make_engine
from helpers.oracle import BRANCHY_PATHS, PROMPT, OracleDrafter, rotating  # loaded, reference: decode/conftest.py


class FreshOracle(OracleDrafter):
    """The oracle, its plan's call count restarting with each request (a lane's drafter serves many in turn)."""

    def begin(self, base_hidden, positions, capacity):
        self.drafts = []
        super().begin(base_hidden, positions, capacity)


def switching_policy() -> HysteresisPolicy:
    """Switches between a 9-node branchy tree and a 5-node chain on the accepted-length signal (whose value is
    minus the running mean accepted length)."""
    branchy, chain = make_topology(BRANCHY_PATHS, "branchy"), chain_topology(4)
    return HysteresisPolicy("switch", conservative=chain, aggressive=branchy, tau_on=-3.6, tau_off=-2.8,
                            signal=make_signal("accepted", beta=0.5), start_aggressive=True)


def step_figures(result) -> list[tuple[str, int]]:
    return [(s.tree, s.accepted_length) for s in result.steps]


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_each_request_decodes_in_a_batch_as_it_does_alone(loaded, reference, slots):
    """Oracle drafts with paths through later siblings (non-contiguous kept rows), a switching policy whose lanes
    take their own trees, and token limits that end requests at different steps, so lanes empty and refill."""
    limits = [48, 7, 30, 1, 19, 2, 40]
    drafter = FreshOracle(reference, len(PROMPT), loaded.model.config.vocab_size, plan=rotating)
    decoder = SpecDecoder(loaded, drafter, switching_policy())
    jobs = [Job(k, PROMPT, DecodingConfig(policy="fixed", max_new_tokens=m)) for k, m in enumerate(limits)]
    alone = {}
    for job in jobs:
        lone = SpecDecoder(loaded, FreshOracle(reference, len(PROMPT), loaded.model.config.vocab_size,
                                                 plan=rotating), switching_policy())
        alone[job.tag] = lone.generate(job.prompt_ids, job.cfg)
    batch = BatchDecoder(decoder, slots)
    finished = list(batch.run(iter(jobs)))
    assert sorted(job.tag for job, _ in finished) == list(range(len(jobs)))  # each once
    for job, result in finished:
        want = alone[job.tag]
        assert result.output_token_ids == reference[:limits[job.tag]] == want.output_token_ids
        assert result.finish_reason == "length"
        assert step_figures(result) == step_figures(want)  # its own steps, trees and accepted lengths
    trees = {s.tree for _, r in finished for s in r.steps}
    assert trees == {"branchy", "chain4"} and max(r.mean_accepted_length for _, r in finished) > 2
    assert batch.running == 0 and batch.steps > 0
    if slots > 1:  # steps were shared: fewer batched steps than the requests' steps together
        assert batch.steps < sum(len(r.steps) for _, r in finished)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dirs):
    model_dir, heads_dir = tiny_model_dirs
    return make_engine(ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu"),
                  DecodingConfig(policy="hydra", max_new_tokens=24))


PROMPTS = ["Name a colour.", "Write item number 3 of a list, then explain why it is there.", "Count to five.",
           "What is two plus two?", "Say something about rivers and the sea, at length.", "Hello.", "A haiku."]


@pytest.mark.parametrize("decoding", [
    {"policy": "hydra"},
    {"policy": "ar", "max_new_tokens": 9},
    {"policy": "hydra", "temperature": 0.8, "acceptance": "exact"},  # the row's generator: the same draws
    {"policy": "hydra", "temperature": 0.8, "acceptance": "typical", "stop": ["e"]},
])
def test_requests_with_their_own_prompts_and_generators_come_out_as_alone(tiny_engine, decoding):
    cfg = tiny_engine.decoding.model_copy(update=decoding)
    decoder = tiny_engine.stack.decoder(tiny_engine.decoder.policy if cfg.policy == "hydra" else
                                        FixedTree("ar", load_topology("ar")))
    ids = [tiny_engine.encode(p) for p in PROMPTS]
    gen = lambda k: row_generator(cfg.seed, f"r{k}", "cpu")  # noqa: E731
    alone = [decoder.generate(i, cfg, gen(k)) for k, i in enumerate(ids)]
    batch = BatchDecoder(decoder, 3)
    got = {job.tag: result for job, result in batch.run(Job(k, i, cfg, gen(k)) for k, i in enumerate(ids))}
    for k, want in enumerate(alone):
        assert got[k].output_token_ids == want.output_token_ids, f"prompt {k}"
        assert got[k].output_text == want.output_text and got[k].finish_reason == want.finish_reason
        assert step_figures(got[k]) == step_figures(want)
        assert got[k].prefill_s > 0 and got[k].decode_s > 0  # its own time in flight


def test_a_request_that_cannot_run_fails_alone_and_the_others_finish(tiny_engine):
    cfg = tiny_engine.decoding
    ids = [tiny_engine.encode(p) for p in PROMPTS[:3]]
    too_long = list(range(5, 5 + 600))  # over the tiny model's 512 positions
    jobs = [Job("a", ids[0], cfg), Job("long", too_long, cfg), Job("b", ids[1], cfg), Job("c", ids[2], cfg)]
    out = dict((job.tag, result) for job, result in BatchDecoder(tiny_engine.decoder, 2).run(jobs))
    assert isinstance(out["long"], ValueError) and "context" in str(out["long"])
    for tag, i in zip("abc", ids):
        assert out[tag].output_token_ids == tiny_engine.decoder.generate(i, cfg).output_token_ids


def test_an_engine_with_concurrency_serves_callers_on_threads_as_one_batch(tiny_model_dirs, tiny_engine):
    """The Ray actor's case: K calls at once (threads), each blocking on its row; rows equal the one-at-a-time
    engine's, and more callers than lanes wait their turn."""
    model_dir, heads_dir = tiny_model_dirs
    engine = make_engine(tiny_engine.model_cfg, tiny_engine.decoding, stack=tiny_engine.stack, concurrency=3)
    rows: dict[str, dict] = {}

    def call(k: int):
        rows[f"r{k}"] = engine.run(f"r{k}", PROMPTS[k])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(rows) == len(PROMPTS)
    for k, prompt in enumerate(PROMPTS):
        want = tiny_engine.run(f"r{k}", prompt)
        assert rows[f"r{k}"]["error"] is None and rows[f"r{k}"]["output_token_ids"] == want["output_token_ids"]
    assert engine.batcher.batch.steps > 0 and engine.batcher.batch.rows > engine.batcher.batch.steps
    bad = engine.run("empty", "")  # a bad row is still its own error row
    assert "empty prompt" in bad["error"]


def test_a_bank_built_at_a_concurrency_records_it_and_times_its_trees_batched(tiny_model_dirs, tmp_path):
    from entmtp_ray.calibrate.bank import Bank
    from entmtp_ray.pipeline.autobank import calibrate_on_worker

    model_dir, heads_dir = tiny_model_dirs
    model = ModelConfig(model=str(model_dir), heads=str(heads_dir), dtype="fp32", device="cpu").model_dump()
    job = DecodingConfig(policy="entmtp-tau", bank="auto", max_new_tokens=10).model_dump()
    rows = [{"id": f"c{i}", "prompt": p, "messages": None} for i, p in enumerate(PROMPTS[:4])]
    result = calibrate_on_worker(model, job, 1, rows, str(tmp_path / "work"), "tiny-auto", 8, "tiny", 2)
    assert result["error"] is None, result["error"]
    bank = Bank.model_validate_json(result["bank"])
    assert bank.hardware.concurrency == 2 and "2 concurrent requests" in bank.hardware.describe()
    timing = json.loads(next((tmp_path / "work" / "bank").glob("step_seconds-k2.json")).read_text())
    assert set(timing["steps"]) >= {t.name for t in bank.trees} and all(v > 0 for v in timing["steps"].values())
    ar = make_engine(ModelConfig(**model), DecodingConfig(policy="ar", max_new_tokens=10))
    for row, record in zip(rows, result["records"]):  # rollouts decoded two at a time are still the AR rows
        assert record["output_token_ids"] == ar.generate(row["id"], row["prompt"]).output_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("policy, slots", [("entmtp-star", 2), ("ar", 4)])
def test_the_embedded_model_in_bf16_batches_bit_for_bit_within_32_rows(policy, slots):
    """bf16 on packed oneDNN weights: a row's products round alike at every row count up to 32 (docs/design.md §7);
    two requests on the GSM8K bank's star tree, or four AR requests (4 rows each), stay within that, so the batch
    is bit for bit the lone decoding."""
    # the star tree itself (--no-adapt): which tree an adapting lane runs is its own test (test_decode_oracle.py)
    engine = make_engine(ModelConfig(dtype="bf16", device="cpu"),
                    DecodingConfig(policy=policy, task="gsm8k", max_new_tokens=24, adapt=False))
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
               "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
               "How much did she earn?", "What is 17 times 23?", "Write a limerick about a cat.", "Name a river."]
    # more prompts than slots, so a finished request's slot is refilled mid-batch; the star tree's rows are
    # several times AR's, so it takes three prompts on 2 slots, AR five on 4
    ids = [engine.encode(p) for p in prompts[:slots + 1]]
    alone = [engine.decoder.generate(i, engine.decoding) for i in ids]
    got = {job.tag: r for job, r in BatchDecoder(engine.decoder, slots).run(Job(k, i, engine.decoding)
                                                                             for k, i in enumerate(ids))}
    assert max(s.nodes for r in alone for s in r.steps) * slots <= 32 or policy == "ar"
    for k, want in enumerate(alone):
        assert got[k].output_token_ids == want.output_token_ids, f"prompt {k}"
        assert step_figures(got[k]) == step_figures(want)
