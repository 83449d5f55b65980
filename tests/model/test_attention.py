"""The fixed-order attention (model/attention.py): each row a function of its own keys alone, bit for bit, whatever
the call's other rows and masked keys; close to SDPA; and with it a tree's rows are the one-token steps' bit for bit
in bf16 on the embedded model (greedy through every tree equal to AR's tokens: decode/test_greedy_exact.py).
Skipped, with the reason, where the kernel cannot be built (no C++ compiler)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entmtp_ray.model.attention import fixed_order_attention, fixed_order_ready, uses_fixed_order

pytestmark = pytest.mark.skipif(not fixed_order_ready(), reason="the fixed-order attention kernel could not be built")


def _qkv(dtype, rows=12, keys=40, kv=3, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kv, n, hd, generator=g).to(dtype) for n in (rows, keys, keys)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_is_a_function_of_its_own_keys_whatever_else_the_call_holds(dtype):
    q, k, v = _qkv(dtype)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(12, 40, generator=g) < 0.6
    mask[:, 0] = True
    together = fixed_order_attention(q, k, v, mask, 0.125)  # [kv, 12, hd]
    for r in range(12):
        own = mask[r].nonzero()[:, 0]
        alone = fixed_order_attention(q[:, r:r + 1], k[:, own], v[:, own], None, 0.125)  # its keys only, no mask
        assert torch.equal(alone[:, 0], together[:, r])
        padded = fixed_order_attention(q[:, r:r + 1].expand(-1, 5, -1), k, v, mask[r].expand(5, -1), 0.125)
        assert torch.equal(padded[:, 0], together[:, r])


@pytest.mark.parametrize("rows, keys, hd", [(7, 37, 48), (1, 16, 64), (5, 200, 80)])
def test_neither_the_thread_count_nor_the_blocking_changes_a_bit(rows, keys, hd):
    """Rows, keys and head sizes off the kernel's blocks (4 rows, 16 keys, 16 lanes of d): each row equals itself
    computed alone, and 1 thread equals 2 (the passes split across threads by blocks)."""
    q, k, v = _qkv(torch.bfloat16, rows=rows, keys=keys, hd=hd, seed=2)
    k[:, 3] *= 40  # a key whose score dwarfs the others: the rest of its row's weights underflow
    mask = torch.rand(rows, keys, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[:, 0] = True
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed_order_attention(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = fixed_order_attention(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for r in range(rows):
        own = mask[r].nonzero()[:, 0]
        assert torch.equal(fixed_order_attention(q[:, r:r + 1], k[:, own], v[:, own], None, 0.125)[:, 0], one[:, r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_it_computes_what_sdpa_computes(dtype):
    q, k, v = _qkv(dtype)
    mask = torch.ones(12, 40, dtype=torch.bool).tril(diagonal=28)
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float(), attn_mask=m,
                                              scale=0.125)[0]
        got = fixed_order_attention(q, k, v, m, 0.125).float()
        assert torch.allclose(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_the_forward_takes_it_for_fp32_bf16_and_fp16_on_cpu_without_autograd_only():
    x = torch.zeros(2, dtype=torch.bfloat16)
    with torch.no_grad():  # fp32 too: its products are row-invariant with the row products (products.py)
        assert uses_fixed_order(x) and uses_fixed_order(x.half()) and uses_fixed_order(x.float())
        assert not uses_fixed_order(x.to(torch.float64))
    assert not uses_fixed_order(x.requires_grad_())  # training keeps SDPA, which has a backward


@pytest.mark.parametrize("prompt", ["Write a function that sums the digits of a number.",
                                    "Continue: the band signed its first professional conductor, Mr William Rimmer"])
def test_a_trees_rows_are_the_one_token_steps_bit_for_bit_in_bf16(prompt):
    """tools/first_parting.py on the embedded model: every chain row of a 16-node tree (a prefix of Hydra's, within
    the 32 rows oneDNN's packed products round alike) equals the one-token step at its position, every operation,
    its kept k/v and its logits."""
    from entmtp_ray.decode.tree import load_topology, make_topology
    from first_parting import find_partings, summary
    from entmtp_ray.model.loading import load_model

    loaded = load_model(dtype="bf16", device="cpu")
    tree = make_topology(load_topology("hydra").paths[:15], "hydra16")
    result = summary(find_partings(loaded, loaded.encode_prompt(prompt), tree, 6))
    assert result["rows_bitwise"] == result["rows"] > 6, result


def random_tree(rng, nodes: int, depth: int = 4):
    """A random valid draft tree of `nodes` nodes: each new node the next rank under a random node above depth."""
    from entmtp_ray.decode.tree import make_topology

    paths, children = [], {(): 0}
    while len(paths) + 1 < nodes:
        parent = rng.choice([p for p in children if len(p) < depth])
        child = (*parent, children[parent])
        children[parent] += 1
        children[child] = 0
        paths.append(child)
    return make_topology(paths, f"random{nodes}")


@pytest.mark.slow
def test_random_trees_rows_are_the_one_token_steps_bit_for_bit_on_random_prompts_in_bf16():
    """The property behind greedy = AR without a tie rule (issue 39): for random trees (up to 32 nodes, the rows
    oneDNN's packed products round alike on any host) and random prompts, every accepted-path row of a tree's
    verify (the rank-0 chain holding the greedy continuation) equals the one-token step at its position in every
    operation, its kept k/v and its logits, bit for bit."""
    import random

    from first_parting import find_partings, summary
    from entmtp_ray.model.loading import load_model

    loaded = load_model(dtype="bf16", device="cpu")
    rng = random.Random(39)
    words = ("river", "prime", "def", "sum", "(", ")", "list", "the", "band", "signed", "return", "7", "+", "=",
             "why", "explain", "sort", "Mr", "conductor", "digits", "\n", ":", "of", "a")
    for case in range(4):
        tree = random_tree(rng, rng.randint(2, 32))
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        result = summary(find_partings(loaded, loaded.encode_prompt(prompt), tree, 3))
        assert result["rows_bitwise"] == result["rows"] > 0, (case, tree.paths, prompt, result)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path):
    import os
    import threading
    import time

    from entmtp_ray.model.native import wait_for_build_lock

    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 700, time.time() - 700))
    wait_for_build_lock(lock, stale_s=600)  # torch's loader would wait on it forever
    assert not lock.exists()

    lock.touch()  # a build in progress: waited for until it ends
    threading.Timer(0.3, lock.unlink).start()
    started = time.monotonic()
    wait_for_build_lock(lock, stale_s=600, poll_s=0.05)
    assert 0.25 < time.monotonic() - started < 5

    lock.touch()  # a build that dies holding it: removed once it is older than stale_s
    started = time.monotonic()
    wait_for_build_lock(lock, stale_s=0.3, poll_s=0.05)
    assert not lock.exists() and time.monotonic() - started >= 0.25



def test_a_built_kernel_loads_at_once_past_a_lock_left_behind():
    """A process killed while torch's loader held the build folder's lock (a Ray actor at its job's end) left it
    behind; a later process loads the built kernel without waiting on it (it waited up to STALE_BUILD_LOCK_S)."""
    import subprocess
    import sys
    from pathlib import Path

    from entmtp_ray.model import native

    built = native.kernel()
    if built is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    lock = Path(built.__file__).parent / "lock"
    lock.touch()
    try:
        code = "from entmtp_ray.model import native; assert native.kernel() is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    finally:
        lock.unlink(missing_ok=True)

SERIAL_BUILD = """
import hashlib, logging, sys
import torch
from entmtp_ray.model import attention, native
logging.basicConfig(level=logging.WARNING)
native.BUILDS = (("", ["-fopenmp", "-fentmtp-no-such-flag"]), ("_serial", []))  # a compiler refusing -fopenmp
assert attention.fixed_order_ready()
g = torch.Generator().manual_seed(0)
q, k, v = [torch.randn(3, n, 64, generator=g).to(torch.bfloat16) for n in (9, 70, 70)]
out = attention.fixed_order_attention(q, k, v, None, 0.125)
print(hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow  # a second build of the kernel, about 40 s
def test_a_compiler_without_openmp_builds_the_kernel_for_one_thread_with_the_same_bits(tmp_path):
    import hashlib
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", SERIAL_BUILD], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built without OpenMP" in done.stderr and "on one thread" in done.stderr
    assert list(tmp_path.glob("*_serial-torch*/*.so")), "the serial build, in a folder of its own"
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(3, n, 64, generator=g).to(torch.bfloat16) for n in (9, 70, 70)]
    ours = fixed_order_attention(q, k, v, None, 0.125)  # the OpenMP build's
    assert done.stdout.split()[-1] == hashlib.sha256(ours.view(torch.int16).numpy().tobytes()).hexdigest()
