"""What `--dtype auto` picks on each kind of CPU (loading.pick_dtype), told from /proc/cpuinfo's flags."""

from __future__ import annotations

import pytest
import torch

from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model import loading

CPU = torch.device("cpu")
AVX2 = {"avx2", "fma"}
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags, model, quantize, kernels, expected", [
    (AVX2, EMBEDDED_MODEL, "none", True, torch.float32),  # emulated bf16: fp32 for every model
    (AVX2, "lmsys/vicuna-7b-v1.3", "none", True, torch.float32),
    # native bf16 without AMX: the embedded model's GGUF blocks on the native step in fp32, where its kernels serve
    (AVX512_BF16, EMBEDDED_MODEL, "none", True, torch.float32),
    (AVX512_BF16, EMBEDDED_MODEL, "none", False, torch.bfloat16),  # no compiler: the Python layers, faster in bf16
    (AVX512_BF16, EMBEDDED_MODEL, "int4", True, torch.bfloat16),  # a scheme's own weights, not the GGUF's blocks
    (AVX512_BF16, "lmsys/vicuna-7b-v1.3", "none", True, torch.bfloat16),  # fp16 safetensors: half the bytes in bf16
    (AVX512_BF16, None, "none", True, torch.bfloat16),  # no model named: as before
    (AMX, EMBEDDED_MODEL, "none", True, torch.bfloat16),  # AMX: oneDNN's bf16 rows cost next to nothing
])
def test_auto_dtype_on_a_cpu_follows_its_flags_and_the_model(monkeypatch, flags, model, quantize, kernels, expected):
    monkeypatch.setattr(loading, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(loading.products, "native_expected", lambda: kernels)
    assert loading.pick_dtype("auto", CPU, quantize, model) == expected
    assert loading.pick_dtype("bf16", CPU, quantize, model) == torch.bfloat16  # an explicit dtype is kept
    assert loading.pick_dtype("auto", torch.device("cuda"), "none", model) == torch.float16


def test_the_kernels_count_as_serving_without_being_built_when_a_compiler_is_there(monkeypatch, tmp_path):
    """pick_dtype runs before a model loads, on a driver that may never build the kernels: it asks whether they are
    built or buildable, and building is not what it does."""
    from entmtp_ray.model import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here
    monkeypatch.setattr(native, "kernel", lambda: pytest.fail("pick_dtype built the kernels"))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not native.buildable()
    name = native.extension().name
    (native.build_folder(name)).mkdir(parents=True)
    (native.build_folder(name) / f"{name}.so").write_bytes(b"")
    assert native.buildable()  # built on this machine: no compiler needed
    monkeypatch.setattr(loading, "_cpu_flags", lambda: AVX512_BF16)
    assert loading.pick_dtype("auto", CPU, "none", EMBEDDED_MODEL) == torch.float32


@pytest.mark.parametrize("flags, model, quantize, kernels, expected", [
    (AVX2, EMBEDDED_MODEL, "none", True, "int8"),  # fp32 on the native step: its blocks on int8 inputs
    (AVX512_BF16, EMBEDDED_MODEL, "none", True, "int8"),
    (AVX512_BF16, EMBEDDED_MODEL, "none", False, "float"),  # no compiler: bf16 Python layers
    (AMX, EMBEDDED_MODEL, "none", True, "float"),  # bf16 on oneDNN: no blocks
    (AVX2, "lmsys/vicuna-7b-v1.3", "none", True, "float"),  # fp32 weights: no blocks
    (AVX2, EMBEDDED_MODEL, "int4", True, "float"),  # a scheme asked for: its products as they were
])
def test_auto_activations_are_int8_where_auto_runs_gguf_blocks_on_the_native_step(monkeypatch, flags, model, quantize,
                                                                                   kernels, expected):
    monkeypatch.setattr(loading, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(loading.products, "native_expected", lambda: kernels)
    assert loading.pick_activations("auto", "auto", CPU, quantize, model) == expected
    # an explicit --dtype fp32 keeps the weights' own values exactly; a GPU has no row products
    assert loading.pick_activations("auto", "fp32", CPU, quantize, model) == "float"
    assert loading.pick_activations("auto", "auto", torch.device("cuda"), quantize, model) == "float"


def test_int8_activations_asked_for_where_nothing_takes_them_fail_naming_what_does(monkeypatch):
    monkeypatch.setattr(loading, "_cpu_flags", lambda: AVX512_BF16)
    monkeypatch.setattr(loading.products, "native_expected", lambda: True)
    assert loading.pick_activations("int8", "fp32", CPU, "none", EMBEDDED_MODEL) == "int8"
    assert loading.pick_activations("int8", "bf16", CPU, "int4", "lmsys/vicuna-7b-v1.3") == "int8"
    with pytest.raises(ValueError, match="the embedded model in fp32 .* or --quantize int4"):
        loading.pick_activations("int8", "bf16", CPU, "none", EMBEDDED_MODEL)
    with pytest.raises(ValueError, match="on CPU"):
        loading.pick_activations("int8", "auto", torch.device("cuda"), "int4", EMBEDDED_MODEL)
    with pytest.raises(ValueError, match="choose one of"):
        loading.pick_activations("int4", "auto", CPU, "none", EMBEDDED_MODEL)
    monkeypatch.setattr(loading.products, "native_expected", lambda: False)
    with pytest.raises(ValueError, match="C\\+\\+ row products"):
        loading.pick_activations("int8", "fp32", CPU, "none", EMBEDDED_MODEL)
