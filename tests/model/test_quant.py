"""Weight-only quantization (--quantize int8 / int4): the kernels compute what their stored bits stand for, a row
rounds the same at every row count (which is what lets trees, one-token steps and batches of requests agree), and
greedy decoding through every tree and policy gives the tokens greedy AR decoding of the same quantized model
gives: exactly on the tiny fp32 model, up to the float-tie rule on the real SmolLM2 in bf16 (docs/design.md §7)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from entmtp_ray.bench.compare import continuation_logits
from entmtp_ray.calibrate.bank import Hardware
from entmtp_ray.config import DecodingConfig, ModelConfig
from entmtp_ray.decode.acceptance import greedy_up_to_tie
from entmtp_ray.decode.batch import BatchDecoder, Job
from entmtp_ray.decode.loop import SpecDecoder
from entmtp_ray.decode.policy import FixedTree
from entmtp_ray.decode.tree import load_topology, make_topology
from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model.kernels import LayerShapes, prepare, quantization_problem, quantize_model
from entmtp_ray.model.loading import EMBEDDED_SHAPES, LoadedModel, check_quantization, load_model, resolve_model_path
from entmtp_ray.model.quant import INT4_GROUP, quantize, quantize_int4
from entmtp_ray.pipeline.assemble import load_stack, resolve
from helpers.oracle import BRANCHY_PATHS, MAX_NEW, PROMPT, OracleDrafter, rotating, tree_of
from helpers.tiny import make_tiny_llama

SCHEMES = ["int8", "int4"]


def dequantize_int4(values: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] of `quantize_int4`'s output, in the kernels' convention w = (value - 8) * scale + zero."""
    out_features, in_features = values.shape
    scale = scales_zeros[..., 0].float().t()[..., None]  # [out, in / group, 1]
    zero = scales_zeros[..., 1].float().t()[..., None]
    w = (values.float().reshape(out_features, scales_zeros.shape[0], -1) - 8) * scale + zero
    return w.reshape(out_features, in_features)


def reference_weight(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The fp32 weight the scheme's bits stand for, computed independently of the kernels' packing."""
    w = weight.float()
    if scheme == "int8":
        scales = (w.abs().amax(1) / 127).to(weight.dtype).float()
        return torch.round(w / scales[:, None]).clamp(-128, 127) * scales[:, None]
    return dequantize_int4(*quantize_int4(w, INT4_GROUP, weight.dtype))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_product_is_the_product_with_the_weight_its_bits_stand_for(scheme, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(96, 128, generator=gen)).to(dtype)
    x = torch.randn(7, 128, generator=gen).to(dtype)
    got = quantize(weight, scheme)(x).float()
    want = x.float() @ reference_weight(weight, scheme).t()
    # fp32: reduction order only; bf16: the output's own rounding (8 bits) on values of about 1
    torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    # and the quantization is real: far from the unquantized product, further for int4
    error = (x.float() @ weight.float().t() - want).abs().mean()
    assert error > (1e-3 if scheme == "int8" else 1e-2)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_rounds_the_same_at_every_row_count(scheme, dtype):
    """What lets a tree's rows, a one-token step's row and other requests' rows share one product (§7)."""
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in [(960, 576), (3072, 576), (576, 1536)]:  # SmolLM2's fused shapes
        weight = (0.05 * torch.randn(out_features, in_features, generator=gen)).to(dtype)
        product = quantize(weight, scheme)
        x = torch.randn(40, in_features, generator=gen).to(dtype)
        full = product(x)
        for rows in [1, 2, 3, 4, 5, 8, 16, 33]:
            assert torch.equal(product(x[:rows]), full[:rows]), (out_features, in_features, rows)
            assert torch.equal(product(x[rows - 1:rows]), full[rows - 1:rows])


def test_a_shape_the_int4_kernel_cannot_take_is_an_error_naming_why():
    with pytest.raises(ValueError, match="not a multiple of the int4 group"):
        quantize(torch.randn(32, 48), "int4")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.randn(8, 64), "int4")
    with pytest.raises(ValueError, match="choose one of"):
        quantize(torch.randn(32, 64), "int3")


def quantized_tiny(scheme: str) -> LoadedModel:
    model = make_tiny_llama()
    quantize_model(model, scheme)
    return LoadedModel(name="tiny", model=model, tokenizer=SimpleNamespace(decode=lambda ids, **_: ""), chat_format="raw", dtype=torch.float32,
                       device=torch.device("cpu"), eos_token_ids=frozenset(), quantize=scheme)


def ar(loaded: LoadedModel, prompt: list[int] = PROMPT, max_new: int = MAX_NEW) -> list[int]:
    decoder = SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar")))
    return decoder.generate(prompt, DecodingConfig(policy="ar", max_new_tokens=max_new)).output_token_ids


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantizing_swaps_every_decoder_projection_and_the_lm_head(scheme):
    loaded = quantized_tiny(scheme)
    embedding = loaded.model.model.embed_tokens.weight.clone()
    plan = prepare(loaded.model)
    for layer in plan.layers:
        assert {p.scheme for p in (layer.qkv, layer.gate_up, layer.o, layer.down)} == {scheme}
    # the lm_head too where the kernel takes it: int4 on CPU takes no vocabulary of 97 (out % 16), and a shape the
    # lm_head's kernel refuses keeps it unquantized rather than refusing the model
    assert plan.lm_head.scheme == ("none" if scheme == "int4" else scheme) and plan.row_invariant
    assert torch.equal(loaded.model.model.embed_tokens.weight, embedding)  # a tied embedding keeps its values
    # the quantized model is another model: its greedy output leaves the unquantized one's
    unquantized = ar(quantized_tiny("none"))
    assert ar(loaded) != unquantized
    quantize_model(loaded.model, "none")  # and marks can be taken back
    assert ar(loaded) == unquantized


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tree, plan", [("chain4", None), ("branchy", rotating), ("hydra", rotating)])
def test_trees_give_exactly_the_quantized_models_ar_tokens(scheme, tree, plan):
    loaded = quantized_tiny(scheme)
    reference = ar(loaded)
    drafter = OracleDrafter(reference, len(PROMPT), loaded.model.config.vocab_size,
                            **({"plan": plan} if plan else {}))
    result = SpecDecoder(loaded, drafter, FixedTree("fixed", tree_of(tree))).generate(
        PROMPT, DecodingConfig(policy="fixed", max_new_tokens=MAX_NEW))
    assert result.output_token_ids == reference
    assert result.mean_accepted_length > 1.5  # the trees really committed multi-token paths


@pytest.mark.parametrize("scheme", SCHEMES)
def test_requests_verified_together_give_each_ones_quantized_ar_tokens(scheme):
    loaded = quantized_tiny(scheme)
    prompts = [PROMPT, [5, 9, 2, 77, 31], [40, 41, 42]]
    references = [ar(loaded, p, 24) for p in prompts]
    lanes = [OracleDrafter(r, len(p), loaded.model.config.vocab_size, plan=rotating)
             for p, r in zip(prompts, references)]
    tree = make_topology(BRANCHY_PATHS, "branchy")
    cfg = DecodingConfig(policy="fixed", max_new_tokens=24)
    for drafter, prompt, reference in zip(lanes, prompts, references):
        alone = SpecDecoder(loaded, drafter, FixedTree("fixed", tree)).generate(prompt, cfg)
        assert alone.output_token_ids == reference
    # one-token steps of three requests in one forward: each runs as copies, its products on the token alone
    batch = BatchDecoder(SpecDecoder(loaded, None, FixedTree("ar", load_topology("ar"))), 3)
    done = batch.run([Job(k, p, DecodingConfig(policy="ar", max_new_tokens=24), None) for k, p in enumerate(prompts)])
    assert {job.tag: r.output_token_ids for job, r in done} == dict(enumerate(references))


def test_the_bank_hardware_key_names_the_quantization():
    plain = Hardware(device="cpu", threads=2, dtype="bfloat16")
    int4 = plain.model_copy(update={"quantize": "int4"})
    assert not plain.same_as(int4) and plain.same_as(Hardware(device="cpu", threads=2, dtype="bfloat16"))
    assert "int4 weights" in int4.describe() and "weights" not in plain.describe()


def test_an_unknown_scheme_fails_before_loading():
    with pytest.raises(ValueError, match="quantize"):
        ModelConfig(quantize="int3")


# --- shapes a kernel cannot take, refused from the config before any weight loads ---

VICUNA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32}  # its config.json's sizes


def model_dir(tmp_path, **sizes) -> str:
    """A model directory holding only a config.json: all a config check reads."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **sizes}))
    return str(tmp_path)


def test_the_shapes_listed_are_the_weights_quantize_model_builds():
    model = make_tiny_llama()  # 4 query heads, 2 kv heads: the fused q/k/v is not square
    layer = prepare(model).layers[0]
    built = {name: tuple(getattr(layer, name).weight.shape) for name in ("qkv", "gate_up", "o", "down")}
    assert LayerShapes.of_config(model.config.to_dict()).projections() == built
    # a config without kv heads or head_dim (Vicuna's) takes transformers' defaults
    assert LayerShapes.of_config(VICUNA_7B) == LayerShapes(4096, 11008, 32, 32, 128)


def test_the_embedded_models_shapes_are_its_converted_configs():
    config = json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text())
    assert LayerShapes.of_config(config) == EMBEDDED_SHAPES


def test_int4_on_cuda_refuses_the_embedded_model_at_plan_time():
    assert "does not tile for CUDA's int4 kernel" in quantization_problem(EMBEDDED_SHAPES, "int4", "cuda",
                                                                          torch.bfloat16)
    with pytest.raises(ValueError, match=r"the qkv weight \[960, 576\].*does not tile.*or run --quantize none"):
        resolve(ModelConfig(quantize="int4", device="cuda"), DecodingConfig(policy="ar"))
    with pytest.raises(ValueError, match="bf16 activations only: run --dtype bf16"):
        check_quantization(EMBEDDED_MODEL, "int4", "cuda:0", "fp16")


def test_int8_on_cuda_is_refused_with_the_kernels_reason_and_the_fixes():
    with pytest.raises(ValueError, match=r"_weight_int8pack_mm.*--quantize none.*--quantize int4 --dtype bf16.*"
                                         r"gpu_check.py's quantized stage"):
        resolve(ModelConfig(quantize="int8", device="cuda"), DecodingConfig(policy="ar"))
    assert "_weight_int8pack_mm" in quantization_problem(LayerShapes.of_config(VICUNA_7B), "int8", "cuda",
                                                         torch.float16)
    # the weights themselves still build on any device: the GPU check times int8 beside fp16 with them
    assert quantize(torch.randn(16, 64), "int8").scheme == "int8"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_embedded_model_is_accepted_on_cpu_and_auto(scheme):
    for device in ("cpu", "auto"):  # auto: only what no device could run is refused before placement
        check_quantization(EMBEDDED_MODEL, scheme, device, "auto")
        resolve(ModelConfig(quantize=scheme, device=device), DecodingConfig(policy="ar"))


def test_vicuna_7b_int4_in_bf16_on_cuda_is_accepted(tmp_path):
    vicuna = LayerShapes.of_config(VICUNA_7B)
    assert quantization_problem(vicuna, "int4", "cuda", torch.bfloat16) is None
    check_quantization(model_dir(tmp_path, **VICUNA_7B), "int4", "cuda", "auto")  # auto: bf16 for int4 on CUDA
    assert "bf16" in quantization_problem(vicuna, "int4", "cuda", torch.float16)


def test_a_cpu_shape_the_int4_kernel_cannot_take_fails_in_plan_and_before_load_model_reads_weights(tmp_path,
                                                                                                   monkeypatch):
    import transformers

    path = model_dir(tmp_path, hidden_size=48, intermediate_size=128, num_attention_heads=4)
    with pytest.raises(ValueError, match=rf"int4 of --model {path} on cpu.*input size 48 is not a multiple of the "
                                         r"int4 group \(32\)"):
        resolve(ModelConfig(model=path, quantize="int4", device="cpu"), DecodingConfig(policy="ar"))
    with pytest.raises(ValueError, match="on cpu in .*; and --quantize int4 .* on cuda in bf16"):  # no device can
        resolve(ModelConfig(model=path, quantize="int4"), DecodingConfig(policy="ar"))
    resolve(ModelConfig(model=path, quantize="int8", device="cpu"), DecodingConfig(policy="ar"))  # int8 takes any shape
    for loader in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(loader, "from_pretrained", lambda *a, **k: pytest.fail("read files before the check"))
    with pytest.raises(ValueError, match="not a multiple of the int4 group"):
        load_model(path, device="cpu", quantize="int4")


def test_device_auto_is_checked_again_once_placement_puts_the_actors_on_a_gpu(monkeypatch):
    from entmtp_ray.config import ProcessorConfig
    from entmtp_ray.pipeline import processor as stage

    processor = stage.Processor(ProcessorConfig(model=ModelConfig(quantize="int8"), decoding=DecodingConfig(
        policy="ar")))  # auto: a CPU could run int8, so the config passes
    monkeypatch.setattr(stage.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(stage.ray, "cluster_resources", lambda: {"GPU": 1.0})
    with pytest.raises(ValueError, match="on cuda.*_weight_int8pack_mm"):
        processor.plan  # resolved for the placed actors: on a GPU
    assert processor.placement.device == "cuda" and processor._plan is None  # no plan to run


# --- the real embedded model ---

POLICIES = ["ar", "hydra", "entmtp-star", "entmtp-ladder", "entmtp-tau"]
QUANT_NEW = 24  # two dozen tokens: several multi-token verify steps per policy, at emulated bf16's cost
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


@pytest.mark.slow  # the real embedded model, quantized twice
@pytest.mark.parametrize("scheme", SCHEMES)
def test_smollm2_every_policy_decodes_the_quantized_models_greedy_tokens(scheme):
    model_cfg = ModelConfig(quantize=scheme, dtype="bf16")
    stack = load_stack(model_cfg, with_heads=True)
    loaded = stack.loaded
    assert loaded.quantize == scheme and prepare(loaded.model).layers[0].qkv.scheme == scheme
    ids = loaded.encode_prompt(QUESTION)
    outputs = {}
    for name in POLICIES:
        cfg = DecodingConfig(policy=name, task="gsm8k", max_new_tokens=QUANT_NEW)
        resolved = resolve(model_cfg, cfg)
        result = stack.decoder(resolved.policy).generate(ids, resolved.decoding)
        outputs[name] = result.output_token_ids
        logits = continuation_logits(loaded, ids, result.output_token_ids).float()
        ok = greedy_up_to_tie(logits, torch.tensor(result.output_token_ids), loaded.dtype)
        assert bool(ok.all()), f"{name}: token {int((~ok).nonzero()[0])} is not the quantized model's argmax"
    assert len(outputs["ar"]) == QUANT_NEW
    drafting = [n for n in POLICIES if n != "ar"]
    assert any(outputs[n] == outputs["ar"] for n in drafting)  # ties are rare: most outputs are AR's outright


def test_the_quality_job_scores_the_same_text_under_every_scheme(tiny_model_dirs, tmp_path, capsys):
    """tools/quant_quality.py on a tiny model: the unquantized model's AR text, scored by each scheme."""

    import quant_quality  # tools/

    out = tmp_path / "quality.json"
    assert quant_quality.main(["--model", str(tiny_model_dirs[0]), "--dtype", "fp32", "--tasks", "humaneval",
                               "--limit", "2", "--max-new-tokens", "6", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in report["rows"]}
    assert set(rows) == {"none", "int8", "int4"} and len({r["tokens"] for r in rows.values()}) == 1
    # greedy text scored by the model that wrote it: every token its argmax, and no change from itself
    assert rows["none"]["argmax_agrees"] == 1.0 and rows["none"]["nll_change"] == 0.0
    assert rows["int4"]["nll"] != rows["none"]["nll"] and rows["int4"]["nll_change"] is not None
    assert "| humaneval | int4 |" in capsys.readouterr().out


@pytest.mark.parametrize("native, row_products", [(False, False), (True, False), (False, True)])
def test_quantized_weights_on_a_cpu_without_native_bf16_warn_that_they_run_slower(tiny_model_dirs, monkeypatch,
                                                                                 caplog, native, row_products):
    """ATen's weight-only kernels lose to fp32 at every tree size on an AVX2-only CPU (docs/measurements.md): the
    load says so there, and only there, where the row products (products.py) cannot be built to serve instead."""
    from entmtp_ray.model import loading

    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(loading.products, "native_ready", lambda: row_products)
    model_dir, _ = tiny_model_dirs
    loaded = load_model(str(model_dir), dtype="fp32", device="cpu", quantize="int8")
    assert loaded.quantize == "int8"
    warned = [r.getMessage() for r in caplog.records
              if "--quantize int8 on a CPU without AVX512-BF16" in r.getMessage()]
    assert len(warned) == (0 if native or row_products else 1) and all("3.4x slower than fp32" in w for w in warned)
