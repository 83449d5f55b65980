"""Stop strings and stop token ids (vLLM's `stop`, `stop_token_ids`) in the decode loop, on the tiny random Llama
whose drafts the oracle makes accepted (tests/helpers/oracle.py), so that a step commits several tokens at once past the
stop. A fake tokenizer gives each token a text the way real ones do at their awkward edges: sentencepiece's dropped
leading space, byte-fallback tokens that are half a UTF-8 character, special tokens that decode to nothing."""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from entmtp_ray.config import DecodingConfig
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.stop import StopStrings
from entmtp_ray.decode.tree import load_topology
from entmtp_ray.model.loading import LoadedModel
from helpers.jobs import run_here
from helpers.oracle import MAX_NEW, PROMPT, OracleDrafter, assert_cache_holds_the_committed_prefix, rotating, tree_of

CHAIN = 5  # chain4 accepts 5 tokens a step after the prefill's one: step j emits output[5j-4 .. 5j]


def piece(token: int) -> bytes:
    """Token `token`'s bytes: special (none), half of 'é' (byte fallback), or letters, some after a space."""
    if token % 13 == 0:
        return b""
    if token % 13 in (3, 4):  # both halves occur in the tiny model's greedy output, in turn and alone
        return "é".encode()[token % 13 - 3:token % 13 - 2]
    letters = chr(97 + token % 26) + chr(97 + token * 7 % 26) * (1 + token % 2)
    return (" " if token % 4 == 0 else "").encode() + letters.encode()


def fake_decode(ids, skip_special_tokens=True) -> str:
    """As sentencepiece decodes: the bytes joined, invalid UTF-8 as U+FFFD, the first leading space dropped."""
    return b"".join(piece(t) for t in ids).decode("utf-8", errors="replace").removeprefix(" ")


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return LoadedModel(name="tiny", model=tiny_llama, tokenizer=SimpleNamespace(decode=fake_decode),
                       chat_format="raw", dtype=torch.float32, device=torch.device("cpu"), eos_token_ids=frozenset())


@pytest.fixture(scope="module")
def reference(loaded) -> list[int]:
    """Plain greedy decoding of PROMPT without stops (test_decode_oracle checks it against transformers)."""
    return generate(loaded, None, "ar").output_token_ids


def generate(loaded, reference, tree: str, plan=None, **cfg):
    """PROMPT decoded through a fixed `tree` (the oracle drafting `reference`), greedy, fp32."""
    drafter = OracleDrafter(reference or [], len(PROMPT), loaded.model.config.vocab_size,
                            **({"plan": plan} if plan else {}))
    topology = load_topology("ar") if tree == "ar" else tree_of(tree)
    decoder = SpecDecoder(loaded, drafter, FixedTree("fixed", topology))
    result = decoder.generate(PROMPT, DecodingConfig(**{"policy": "fixed", "max_new_tokens": MAX_NEW, **cfg}))
    result.decoder = decoder
    return result


def brute_force(reference: list[int], stops: list[str]) -> tuple[list[int], str, str]:
    """(tokens, text, finish) by the definition: the shortest output whose whole text holds a stop string, and that
    text cut before the stop string that ends first (of several ending there, the longest)."""
    for k in range(1, len(reference) + 1):
        text = fake_decode(reference[:k])
        for end in range(1, len(text) + 1):
            ending = [s for s in stops if text[:end].endswith(s)]
            if ending:
                return reference[:k], text[:end - max(map(len, ending))], "stop"
    return reference, fake_decode(reference), "length"


def spanning_stop(reference: list[int], fits) -> tuple[int, str]:
    """(k, s): the first k passing `fits(k)` where s, the last letter of token k's text and the first of token
    k+1's, first occurs in the output text exactly there (so token k+1 completes it)."""
    text = fake_decode(reference)
    for k in range(1, len(reference) - 1):
        left, right = piece(reference[k]).decode("latin-1"), piece(reference[k + 1]).decode("latin-1")
        if not (fits(k) and (left + right).isascii() and left.isalpha() and right.isalpha()):
            continue
        s = left[-1] + right[0]
        if text.find(s) == len(fake_decode(reference[:k + 1])) - 1:
            return k, s
    raise AssertionError("no stop string spans two tokens where the test needs one; change the fake tokenizer")


def test_a_stop_string_across_two_tokens_inside_one_step_ends_the_row_at_the_token_that_completed_it(loaded,
                                                                                                      reference):
    k, stop = spanning_stop(reference, lambda k: k % CHAIN in (1, 2, 3))  # tokens k and k+1 in one step, not its last
    plain = generate(loaded, reference, "chain4")
    assert plain.output_token_ids == reference
    step = (k + 1 + CHAIN - 1) // CHAIN - 1  # the step that emitted token k+1
    assert plain.step_accepted_lengths()[step] == CHAIN, "without --stop that step commits past the stop string"

    result = generate(loaded, reference, "chain4", stop=[stop])
    text = fake_decode(reference)
    assert result.finish_reason == "stop"
    assert result.output_token_ids == reference[:k + 2]  # up to and including the token that completed it
    assert result.output_text == text[:text.find(stop)] and stop not in result.output_text
    assert sum(result.step_accepted_lengths()) == result.num_output_tokens - 1 == k + 1  # the prefill's is no step's
    assert result.step_accepted_lengths() == [CHAIN] * step + [(k + 1) % CHAIN]
    # vLLM's accepted drafts: each full step's less its bonus; the cut step's are all drafts
    assert [s.accepted_drafts for s in result.steps] == [CHAIN - 1] * step + [(k + 1) % CHAIN]
    assert result.mean_accepted_length == (k + 1) / (step + 1)
    assert_cache_holds_the_committed_prefix(loaded, result.decoder, result)
    ar = generate(loaded, None, "ar", stop=[stop])  # greedy equals AR up to the stop point, and stops there too
    assert (ar.output_token_ids, ar.output_text, ar.finish_reason) == (result.output_token_ids, result.output_text,
                                                                        "stop")


def test_a_stop_token_id_inside_a_run_ends_the_row_as_eos_does(loaded, reference):
    k = next(i for i in range(6, MAX_NEW) if reference[i] not in reference[:i] and i % CHAIN in (2, 3, 4))
    result = generate(loaded, reference, "chain4", stop_token_ids=[reference[k], 96])
    assert result.finish_reason == "stop" and result.output_token_ids == reference[:k + 1]  # the id is kept
    assert result.output_text == fake_decode(reference[:k + 1])  # decoded as any output (special tokens skipped)
    assert result.step_accepted_lengths()[-1] == k % CHAIN and sum(result.step_accepted_lengths()) == k
    assert result.steps[-1].accepted_drafts == k % CHAIN  # cut before its bonus token: every token kept was drafted
    ar = generate(loaded, None, "ar", stop_token_ids=[reference[k]])
    assert ar.output_token_ids == result.output_token_ids


def test_of_several_stop_strings_the_earliest_in_the_text_wins_whatever_their_order(loaded, reference):
    k, early = spanning_stop(reference, lambda k: k >= 3)
    _, late = spanning_stop(reference, lambda j: j > k + 1)  # first occurs after `early` ends
    for stops in ([late, early], [early, late]):
        result = generate(loaded, reference, "branchy", rotating, stop=stops)
        assert result.output_token_ids == reference[:k + 2] and result.finish_reason == "stop"
        assert late not in result.output_text and early not in result.output_text


def test_stop_strings_the_output_never_completes_leave_it_unchanged(loaded, reference):
    prompt_text, text = fake_decode(PROMPT), fake_decode(reference)
    in_prompt = next(p for p in (fake_decode([t]) for t in PROMPT) if len(p) >= 2 and p not in text)
    assert in_prompt in prompt_text
    plain = generate(loaded, reference, "branchy", rotating)
    for stops in ([in_prompt], ["QQ", "zé!"]):  # the prompt's text is no output; these never occur
        result = generate(loaded, reference, "branchy", rotating, stop=stops)
        assert (result.output_token_ids, result.output_text, result.finish_reason) == (reference, text, "length")
        assert result.step_accepted_lengths() == plain.step_accepted_lengths()


def test_a_stop_string_in_the_first_token_ends_the_row_before_any_step(loaded, reference):
    first = fake_decode(reference[:1])
    assert first.isalpha(), "the test needs a first token with text"
    result = generate(loaded, reference, "chain4", stop=[first[-1]])
    assert result.output_token_ids == reference[:1] and result.steps == [] and result.finish_reason == "stop"
    assert result.output_text == first[:first.index(first[-1])] and result.mean_accepted_length == 0.0


@pytest.mark.parametrize("tree, plan", [("ar", None), ("chain4", None), ("branchy", rotating), ("hydra", rotating)])
def test_stops_agree_with_their_definition_on_any_tree(loaded, reference, tree, plan):
    """Random stop strings from the output's own text (spanning tokens, across half-characters and special tokens,
    several at once) against a brute force that decodes every prefix whole: same tokens, text and finish, and the
    greedy tokens are AR's up to the stop."""
    text = fake_decode(reference)
    rng = random.Random(7)
    for _ in range(8):
        stops = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 5)].replace("\ufffd", "é"))  # no half a character
        if rng.random() < 0.3:
            stops.append("never")
        tokens, want_text, finish = brute_force(reference, stops)
        result = generate(loaded, reference, tree, plan, stop=stops)
        assert (result.output_token_ids, result.output_text, result.finish_reason) == (tokens, want_text, finish), stops
        assert sum(result.step_accepted_lengths()) == len(tokens) - 1


def test_the_tail_window_finds_what_decoding_the_whole_output_finds():
    """Random outputs over awkward tokens (special, a lone space, a space-led piece, the three bytes of '€'), fed
    in steps of 1-5 tokens: each stop is found at the first token whose prefix, decoded whole, holds one."""
    pieces = [b"", b" ", b"a", b"b", b" a", b"ab", *("€".encode()[i:i + 1] for i in range(3))]

    def decode(ids):
        return b"".join(pieces[t] for t in ids).decode("utf-8", errors="replace").removeprefix(" ")

    rng = random.Random(3)
    found = 0
    for _ in range(1500):
        output = []
        while len(output) < 24:
            output += [6, 7, 8] if rng.random() < 0.2 else [rng.randrange(len(pieces))]
        text = decode(output)
        stops = [text[i:i + rng.randint(1, 12)].replace("\ufffd", "€") for i in rng.sample(range(len(text)), 2)]
        stops.append("§")  # a short one never produced: the window must fit the longest
        want = next((k for k in range(1, len(output) + 1) if any(s in decode(output[:k]) for s in stops)), None)
        checker, got, new = StopStrings(stops, decode), None, 0
        while got is None and new < len(output):
            end = min(len(output), new + rng.randint(1, 5))
            got, new = checker.completed(output[:end], new), end
        assert got == want, (output, stops)
        found += want is not None and want < len(output)
    assert found > 500


def test_the_window_widens_over_tokens_without_text():
    """A stop string whose characters lie either side of a run of special tokens (no text) longer than the window."""
    pieces = {1: "ab", 2: "", 3: "cd", 4: "x"}
    stops = StopStrings(["bc"], lambda ids: "".join(pieces[t] for t in ids))
    output = [4] * 10 + [1] + [2] * 30 + [3, 4]
    assert stops.completed(output, 41) == 42 and stops.completed(output[:41], 11) is None
    assert stops.cut("xxabcdx") == "xxa" and stops.cut("bcd") == "" and StopStrings(["a"], str).cut("ab") == ""


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_the_stop_string_that_ends_first_wins_and_of_those_the_longest(order):
    stops = StopStrings([["cd", "bc", "abc"][i] for i in order], str)
    assert stops.first("xxabcd") == (2, 5) and stops.cut("xxabcd") == "xx"
    assert stops.first("xbcabc", after=3) == (3, 6)  # only those ending past character 3
    assert stops.first("xbcabc", after=6) is None


def test_stop_settings_are_checked_and_normalised():
    assert DecodingConfig(stop="\n").stop == ["\n"]  # one string, as vLLM's SamplingParams take it
    assert DecodingConfig(stop=[], stop_token_ids=[]) == DecodingConfig()  # none: the manifest of a run without
    with pytest.raises(ValidationError, match="empty stop string would end every generation"):
        DecodingConfig(stop=["###", ""])
    with pytest.raises(ValidationError, match=r"non-negative, got \[-1\]"):
        DecodingConfig(stop_token_ids=[2, -1])


def test_stop_flags_take_lists_as_vllm_does_and_are_repeatable():
    from entmtp_ray.cli import add_config_args, config_from_args, flag_table

    parser = argparse.ArgumentParser()
    add_config_args(parser, DecodingConfig)
    args = parser.parse_args(["--stop", "###", "User:", "--stop=-x", "--stop-token-ids", "2", "13",
                              "--stop-token-ids", "7"])
    decoding = config_from_args(DecodingConfig, args)
    assert decoding.stop == ["###", "User:", "-x"] and decoding.stop_token_ids == [2, 13, 7]
    assert config_from_args(DecodingConfig, parser.parse_args([])).stop is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--stop-token-ids", "two"])
    table = flag_table(DecodingConfig)
    assert "| `--stop` | `None` |" in table and "| `--stop-token-ids` | `None` |" in table
    assert table.count("several values after one flag") == 2


@pytest.mark.slow
def test_a_job_with_a_stop_string_ends_each_row_at_it_on_the_embedded_model(tmp_path, ray_cluster):
    """jobs/generate.py with --stop on SmolLM2 and its real tokenizer: each row ends at the first newline of the
    output the same decoder gives without --stop, even where a Hydra step committed tokens past it."""
    import pyarrow.dataset as pads

    from entmtp_ray.config import ModelConfig
    from helpers.engines import make_engine

    # prompts where, with the shipped heads, one row's newline lands inside a Hydra step ('fruits': step 3 of 2-1-3)
    prompts = {"colours": "List three colours, one per line.", "fruits": "Name four fruits, one per line."}
    settings = dict(policy="hydra", max_new_tokens=24)
    engine = make_engine(ModelConfig(dtype="fp32", device="cpu"), DecodingConfig(**settings))
    plain = {key: engine.generate(key, prompt) for key, prompt in prompts.items()}
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n"
                                                    for k, v in prompts.items()))
    output = tmp_path / "out"
    proc = run_here(["--dataset", str(tmp_path / "prompts.jsonl"), "--id-column", "id", "--policy", "hydra",
                     "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "24", "--max-actors", "1",
                     "--stop", "\n", "--output", str(output)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["id"]: r for r in pads.dataset(str(output), format="parquet").to_table().to_pylist()}
    cut_inside_a_step = False
    for key, want in plain.items():
        row, ids = rows[key], want.output_token_ids
        keep = next(k for k in range(1, len(ids) + 1) if "\n" in engine.loaded.decode(ids[:k]))
        assert keep < len(ids), f"{key}: the plain output should go on past its first line"
        assert row["error"] is None and row["finish_reason"] == "stop"
        assert row["output_token_ids"] == ids[:keep] and row["num_output_tokens"] == keep
        assert row["output_text"] == want.output_text.split("\n")[0] and "\n" not in row["output_text"]
        lengths = row["step_accepted_lengths"]
        assert sum(lengths) == keep - 1 and row["steps"] == len(lengths)
        cut = want.step_accepted_lengths()[len(lengths) - 1] > lengths[-1]  # the stop fell inside the last step
        # accepted drafts: each step's tokens less its bonus, but a step cut before its bonus kept only drafts
        assert row["num_accepted_tokens"] == sum(n - 1 for n in lengths[:-1]) + lengths[-1] - (not cut)
        cut_inside_a_step |= cut
    assert cut_inside_a_step, "some row's stop string should land inside a step that committed past it"
    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["settings"]["decoding"]["stop"] == ["\n"]
