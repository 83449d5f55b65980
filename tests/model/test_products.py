"""The row products (entmtp_ray/model/products.py): each kind's values against torch's own product of the same
(dequantized) weight, and every row bitwise the same at every row count and thread count (design §7)."""

import pytest
import torch

from entmtp_ray.model import products
from entmtp_ray.model.quant import quantized_values
from helpers import tiny

pytestmark = pytest.mark.skipif(not products.native_ready(), reason="no C++ compiler: the row products are not built")


def _dequantized(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight the kernel multiplies by, in fp64: what its product should equal up to fp32 rounding."""
    if scheme == "none":
        return weight.double()
    values, scales = quantized_values(weight, scheme)
    if scheme == "int8":
        return values.double() * scales.double()[:, None]
    scale, zero = scales[..., 0].double().t(), scales[..., 1].double().t()  # [out, in / 32]
    groups = values.double().reshape(weight.shape[0], -1, 32)
    return ((groups - 8) * scale[..., None] + zero[..., None]).reshape(weight.shape)


@pytest.mark.parametrize("dtype,scheme", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                          (torch.float32, "int8"), (torch.float32, "int4"),
                                          (torch.bfloat16, "int4")])
@pytest.mark.parametrize("outputs", [80, 97])  # 97: the last block of 4 outputs filled with zero rows
def test_each_kind_computes_x_w_transposed_and_every_row_rounds_alike_at_any_row_count(dtype, scheme, outputs):
    if scheme == "int4" and outputs % 16:
        pytest.skip("int4 on CPU takes out % 16 (quant.unsupported: ATen's kernel, where the row products are off)")
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(outputs, 96, generator=g) * 0.2).to(dtype)
    bias = torch.randn(outputs, generator=g).to(dtype)
    x = torch.randn(9, 96, generator=g).to(dtype)
    native = products.NativeWeight.of(weight, scheme)
    assert native.filled == (outputs % 4 != 0)
    out = native(x, bias)
    assert out.dtype == dtype and out.shape == (9, outputs)
    expected = x.double() @ _dequantized(weight, scheme).t() + bias.double()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance)
    for rows in (1, 2, 3, 8):  # any row alone, or among others, at any thread count: the same bits
        assert torch.equal(native(x[rows - 1:rows + 3][:rows], bias), out[rows - 1:rows + 3][:rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(native(x, bias), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("blocks,kind", [("q4_1", "int4"), ("q8_0", "q8_0")])
def test_fp32_weights_that_are_gguf_blocks_are_kept_as_them_and_multiply_bitwise_as_the_fp32_weight(blocks, kind):
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(40, 96, generator=g) * 0.1
    raw[3, 32:64] = 0.25  # a group of one value: d = 0
    weight = (tiny.gguf_q4_1 if blocks == "q4_1" else tiny.gguf_q8_0)(raw)
    held = products.NativeWeight.of(weight, "none")
    assert held.kind == products.KINDS[kind] and held.scheme == "none"
    fp32 = products.NativeWeight(weight, products.KINDS[torch.float32, "none"], torch.empty(0), 40, "none")
    x = torch.randn(17, 96, generator=g)
    for rows in (*range(1, 10), 17):  # each row count the kernel widens for (1-8), and chunks of 8 past that
        assert torch.equal(held(x[:rows]), fp32(x[:rows])), rows
    nudged = weight.clone()
    nudged[7, 50] = torch.nextafter(nudged[7, 50], torch.tensor(1.0))  # one value off its block: kept in fp32
    assert products.exact_blocks(nudged) is None
    assert products.exact_blocks(raw) is None and products.NativeWeight.of(raw, "none").kind == fp32.kind


def test_int4_bytes_hold_consecutive_values_low_nibble_first():
    values = torch.arange(64, dtype=torch.int32).remainder(16).reshape(1, 64)
    packed = products.pack_int4(values)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    # byte k: value 2k in the low nibble, value 2k + 1 in the high one; a little-endian word, 8 values lowest first
    assert [int(b) for b in packed[0, :3]] == [0 | 1 << 4, 2 | 3 << 4, 4 | 5 << 4]
    word = int.from_bytes(bytes(packed[0, 4:8].tolist()), "little")
    assert [(word >> (4 * j)) & 15 for j in range(8)] == list(range(8, 16))


def test_a_projection_on_cpu_takes_the_row_products_and_training_keeps_autograd():
    from entmtp_ray.model.kernels import Projection

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 64, generator=g, requires_grad=True)
    projection = Projection.of(weight, None)
    assert projection.native is not None and projection.row_invariant
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        assert torch.allclose(projection(x), x @ weight.t(), atol=1e-5)
    out = projection(x)  # grad enabled: torch's product, which has a backward
    out.sum().backward()
    assert weight.grad is not None


def _int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T with x rounded as the integer products round it (per row and group of 32: dx = max |x| / 127, q =
    x * (127 / max |x|) to the nearest, ties to even), summed in fp64 against the weight's exact values."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inverse)
    return ((q.double() * (amax.double() / 127)).reshape(x.shape)) @ weight.double().t()


@pytest.mark.parametrize("blocks,inputs", [("q4_1", 96), ("q4_1", 128), ("q8_0", 96), ("q8_0", 128)])
def test_int8_activations_sum_integers_and_round_every_row_alike_at_any_row_count(blocks, inputs):
    # 96 inputs: three groups, the last without a pair (the kernel's second half zero)
    g = torch.Generator().manual_seed(6)
    weight = (tiny.gguf_q4_1 if blocks == "q4_1" else tiny.gguf_q8_0)(torch.randn(40, inputs, generator=g) * 0.1)
    held = products.NativeWeight.of(weight, "none", "int8")
    assert held.kind == products.KINDS["int4" if blocks == "q4_1" else "q8_0", "int8"]
    x = torch.randn(17, inputs, generator=g)
    x[2, :32] = 0.0  # a group of zeros: dx = 0
    x[5, 40] = 30.0  # an outlier: the rest of its group rounds to few levels
    out = held(x)
    expected = _int8_reference(x, weight)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the rounding of the inputs is the whole difference from the fp32 product: about 1% at most here
    assert (out.double() - x.double() @ weight.double().t()).abs().max() < 0.05 * expected.abs().max()
    for rows in (*range(1, 10), 17):  # any row alone or among others: the same bits
        assert torch.equal(held(x[:rows]), out[:rows]), rows
    assert torch.equal(held(x[9:12]), out[9:12])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(held(x), out)
    finally:
        torch.set_num_threads(threads)


def test_only_4_bit_and_q8_0_blocks_take_int8_activations():
    g = torch.Generator().manual_seed(7)
    raw = torch.randn(16, 64, generator=g)
    # fp32 weights and per-channel int8 keep float inputs
    assert products.NativeWeight.of(raw, "none", "int8").kind == products.KINDS[torch.float32, "none"]
    assert products.NativeWeight.of(raw, "int8", "int8").kind == products.KINDS["int8"]
    assert products.NativeWeight.of(raw, "int4", "int8").kind == products.KINDS["int4", "int8"]
    assert products.q8_0(raw, "int8").kind == products.KINDS["q8_0", "int8"]
    with pytest.raises(ValueError, match="choose one of"):
        products.NativeWeight.of(raw, "int4", "int16")
