"""Configuration dataclasses: the source of truth for every key of ``conf/``.

YAML files under ``conf/`` only pick values; these dataclasses say which keys exist and
their types. Hydra composes the YAML over the registered schema in struct mode, so a
misspelt key fails naming the key (``Key 'dtyp' not in 'ModelConfig'``). Library code
receives the dataclasses (``to_dataclass``), never a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from schemafill.contract.response_format import FORMATS, ResponseFormat

STAGES = ("requests", "target", "continuations", "head", "eval")
BACKENDS = ("auto", "eager", "batch_invariant", "compiled", "cuda_graphs")  # runtime/backends: what runs a target


@dataclass
class ModelConfig:
    name: str = MISSING  # short name; artifact folders are keyed by it
    source: str = MISSING  # hub id or local path; for a PyPI-shipped GGUF, the package name
    gguf_file: str | None = None  # GGUF file inside `source` (built-in target only)
    revision: str | None = None
    # auto: bf16 on CUDA; on a CPU a timed probe picks for data generation, fp32 verifies drafts;
    # or float32 / bfloat16 / float16 everywhere
    dtype: str = "auto"
    # what executes the target's calls (schemafill/runtime/backends): auto = CUDA graphs on a GPU, a
    # CPU's bf16 on the batch-invariant kernels, else eager or compiled by a timed probe; or one of
    # eager | batch_invariant | compiled | cuda_graphs
    backend: str = "auto"
    # EAGLE-3 inputs: HF `hidden_states[i]`, i.e. the *input* of decoder layer i (SGLang counts one lower)
    aux_layer_ids: list[int] = MISSING
    # plain | chat (our instructions in the target's chat template) | tools (the catalog as tools= to
    # the target's chat template, as its users prompt it; ours for a ChatML target without one)
    prompt_style: str = "plain"
    paper_prompt_style: str = "plain"  # the prompt style of the paper's setting (experiment=paper)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. Qwen3: {enable_thinking: false}
    max_context: int = 8192  # requests whose prompt + response cap exceed this are rejected, not truncated
    finetune: bool = False  # the `target` stage fine-tunes this model into a tool caller (built-in target)
    # how the target writes its calls (schemafill/response_format.py): json = the paper's
    # {"tool_calls": [...]}; hermes = <tool_call> blocks, as Qwen2.5/Qwen3 answer; hermes3 = the
    # same, "arguments" before "name" (Hermes-3); mistral = [TOOL_CALLS] [...] (Mistral v0.3)
    response_format: str = "json"

    @property
    def fmt(self) -> ResponseFormat:
        """The response format object ``response_format`` names."""
        return FORMATS[self.response_format]

    def __post_init__(self) -> None:
        if self.response_format not in FORMATS:
            raise ValueError(f"model.response_format must be one of {sorted(FORMATS)}, got {self.response_format!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"model.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.prompt_style == "tools" and self.response_format == "json":
            raise ValueError("model.prompt_style=tools prompts with the target's own tool format; the json format is "
                             "ours and asked for in prompt_style plain or chat (or set model.response_format=hermes)")


@dataclass
class ContinuationsConfig:
    """The target's own responses to the training pool (stage `continuations`)."""

    batch_size: int = 8  # requests per left-padded generation batch
    shard_size: int = 64  # requests per resumable shard
    compositions: float = 0.25  # multi-call compositions added, as a share of the pool size
    # structured-output variants added (a referenced request answered as one object under its
    # first call's tool schema, generated under that grammar), as a share of the pool size
    structured: float = 0.15
    max_requests: int = 0  # use only the first N training requests (0 = all)
    max_prompt_tokens: int = 0  # skip (and count) longer prompts; 0 = only the context limit applies
    # a time budget (0 = none): past it no new shard starts, the ones under way finish, and the
    # stage keeps what it has (shards are random draws of the pool; a larger budget resumes)
    max_minutes: float = 0.0
    # keep the target's features of every generated row (aux, final hidden state, argmax) for
    # the head stage's feature cache, so the target never reruns over the rows: ~5 KB a token
    # for a 135M target, ~28 KB for a 7B one (on a CPU the rerun is most of the head stage)
    features: bool = False


@dataclass
class DataConfig:
    bfcl_dir: str | None = None  # default: the data folder of the installed nvidia-bfcl wheel
    glaive: str | None = None  # hub id or local path of Glaive function calling; null = not used
    glaive_split: str = "train"
    glaive_eval_size: int = 650
    glaive_limit: int | None = None  # read at most this many Glaive conversations
    extra_requests: list[str] = field(default_factory=list)  # users' own ToolRequest JSONL files → training pool
    strict: bool = False  # a malformed record is fatal instead of reported and skipped
    seed: int = 0
    continuations: ContinuationsConfig = field(default_factory=ContinuationsConfig)


@dataclass
class DrafterConfig:
    draft_vocab_size: int = 16384  # reduced draft vocabulary (paper: 14,136 for Qwen2.5-7B)
    horizons: int = 2  # training-time-test steps (paper: 2; EAGLE-3 uses 7)
    loss_decay: float = 0.8  # loss = sum_i decay^i * L_i


@dataclass
class NgramConfig:
    """Prompt-lookup decoding (method ``ngram``), with vLLM's knob names."""

    # vLLM's SpeculativeConfig sets both to 5 when neither is given (its field docs still say 1)
    prompt_lookup_min: int = 5  # shortest trailing n-gram matched
    prompt_lookup_max: int = 5  # longest, tried first
    num_speculative_tokens: int = 5  # tokens copied after the match (vLLM requires it; 5 as in its docs' example)

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max or self.num_speculative_tokens < 1:
            raise ValueError("decode.ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max and "
                             f"num_speculative_tokens >= 1, got {self}")


@dataclass
class SuffixConfig:
    """Suffix decoding (method ``suffix``), with vLLM's knobs and defaults."""

    max_tree_depth: int = 24  # suffixes stored up to this many tokens (match + draft fit in it)
    max_cached_requests: int = 10000  # earlier responses in the global tree, oldest evicted (0: prompt tree only)
    max_spec_factor: float = 1.0  # a match of m tokens may draft m * factor + offset tokens (paper: alpha * p)
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # no drafted token less likely than this (counts ratio along its path)
    num_speculative_tokens: int = 24  # the cap on one draft
    tree: bool = True  # the paper's best-first tree; false: vLLM's single path of most frequent tokens


@dataclass
class ToolSpecConfig:
    """ToolSpec (method ``toolspec``) with its authors' budgets (hemingkx/ToolSpec)."""

    recycling_topk: int = 8  # token recycling: next-token candidates per token (table [V, k])
    retrieve: int = 10  # earlier outputs retrieved per request, most similar first
    ngram_max: int = 7  # retrieval n-grams tried from this length ...
    ngram_min: int = 5  # ... down to this one
    candidates: list[int] = field(default_factory=lambda: [32, 16, 8, 8])  # retrieved chains and their lengths


SELECT_MODES = ("cost", "fixed")
CONSTRAIN_MODES = ("none", "schema", "prune")
ABLATIONS = ("A", "B", "C", "D")  # SchemaFill's stages (paper Table 2)


@dataclass
class DecodeConfig:
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling (infer/rounds/sampling.py)
    top_p: float = 1.0  # nucleus of the target's distribution when sampling (1 = off)
    seed: int = 0
    max_new_tokens: int = 512
    topk: int = 3  # draft tree branching
    depth: int = 2  # MAIN draft depth (EAGLE-3 tree depth)
    total_tokens: int = 8  # draft tokens per verification
    side_depth: int = 1  # head-drafted tokens per SIDE branch and round (paper: 1; 0 = the target's token only)
    pack_provisional: bool = True  # also pack a value's unclosed SIDE prefix (beyond the paper; infer/slots/packer.py)
    side_optional: bool = True  # SIDE branches for optional schema keys too, after the predicted ones
    # none | schema: MAIN's choices obey the response grammar of the request's tools | prune: the
    # target stays free, drafts that grammar forbids are dropped before verification
    constrain: str = "none"
    close_margin: int = 64  # constrained: this many tokens before max_new_tokens, close whatever may close (0 = off)
    copy_len: int = 4  # SchemaFill's MAIN chains copied from the prompt and the response (0 = off; beyond the paper)
    chain_head_depth: int = 0  # SchemaFill: the head tree's depth in rounds with a packed chain (0 = depth)
    guess_ends: bool = False  # SchemaFill's packer guesses where open values and the response end (beyond the paper)
    # SchemaFill's packer chains through this many guesses of an unprepared value (0 = off; beyond the paper)
    value_guesses: int = 0
    forecast_budget: int = 3  # B: forecast call groups
    ablation: str = "D"  # A: EAGLE-3 only, B: + schema-guided MAIN and copies, C: + SIDE drafting, D: + packing
    # cost: each round verifies the candidates worth their measured cost on this hardware
    # (infer/pricing/budget.py); fixed: every candidate the budget above drafts (the paper's)
    select: str = "cost"
    cost_context: int = 512  # committed positions the start-up cost measurement attends to
    cost_cache: str = ""  # folder of measured cost curves ("" = $XDG_CACHE_HOME/schemafill/cost)
    # a round's host-side milliseconds as selection prices them: null = measured as the launch
    # goes (the default); a number fixes it, so the nodes kept no longer depend on timing and
    # two launches verify the same trees (infer/eval/behaviour.py)
    host_ms: float | None = None
    # the training-free peers' own settings
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    toolspec: ToolSpecConfig = field(default_factory=ToolSpecConfig)

    def __post_init__(self) -> None:
        if self.constrain not in CONSTRAIN_MODES:
            raise ValueError(f"decode.constrain must be one of {CONSTRAIN_MODES}, got {self.constrain!r}")
        if self.ablation not in ABLATIONS:
            raise ValueError(f"decode.ablation must be one of {ABLATIONS}, got {self.ablation!r}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"decode.select must be one of {SELECT_MODES}, got {self.select!r}")
        if self.host_ms is not None and self.host_ms < 0:
            raise ValueError(f"decode.host_ms must be null (measured) or >= 0, got {self.host_ms}")
        if self.value_guesses < 0:
            raise ValueError(f"decode.value_guesses must be 0 (off) or more, got {self.value_guesses}")
        if self.chain_head_depth < 0:
            raise ValueError(f"decode.chain_head_depth must be 0 (the tree's depth) or more, "
                             f"got {self.chain_head_depth}")


@dataclass
class TargetTrainConfig:
    """Fine-tuning the built-in target into a tool caller (stage `target`)."""

    max_minutes: float = 18.0  # wall-time budget of the fine-tune
    max_steps: int = 2000
    lr: float = 2e-4
    warmup_steps: int = 5
    batch_tokens: int = 4096  # padded tokens per batch (sequences per batch follow from their length)
    max_seq_len: int = 1024  # longer examples are skipped and counted, never truncated
    compositions: float = 1.0  # multi-call compositions per referenced request
    call_mix: list[float] = field(default_factory=lambda: [0.15, 0.25, 0.3, 0.3])  # shares of 1, 2, 3, 4+ calls
    compose_max_catalog: int = 2  # compose only requests with at most this many tools (after max_catalog's trim)
    # train on catalogs of at most this many tools: the called ones plus distractors drawn at
    # random (0 = the corpus' own). Evaluation catalogs hold 1-4 tools; the training pool's
    # average 8, which makes its prompts twice as long as the ones the target will serve
    max_catalog: int = 0
    freeze_embeddings: bool = True
    trainable_layers: int = 0  # train only the top N decoder layers (0 = all)
    # with frozen embeddings and trainable_layers > 0: run the frozen lower layers once per
    # example and train the top ones on their stored output (exact; later epochs cost less)
    cache_frozen: bool = True
    # false runs each prompt through the trained layers without grad (only the response
    # positions backpropagate): the same loss, a gradient without the prompt's K/V path
    context_grad: bool = True
    max_examples: int = 0  # fine-tune on at most this many examples, call_mix kept (0 = all)
    # the response tokens that close or continue a container (another key or call, or not)
    # count this many times in the loss: the target's failures are loops there (docs/builtin-target.md:
    # weighting them did not help the built-in target)
    decision_weight: float = 1.0
    # bf16 autocast on CPU: auto = where a timed probe of the fine-tune's shapes finds it faster
    # than fp32 (schemafill/precision.py), true / false force it. CUDA always uses bf16.
    bf16_autocast_cpu: str = "auto"
    checkpoint_minutes: float = 2.0  # resumable fine-tune state every this many minutes, and at the end
    quality_requests: int = 90  # BFCL450 requests (stratified by category) decoded for quality.json; 0 = all
    # which stratified subset: fixed apart from the training seed, so seeds and recipes are
    # compared on the same requests
    quality_seed: int = 0
    quality_batch_size: int = 8
    # the quality gate: below these the stage stops the pipeline (its training state is kept,
    # and a rerun with a larger budget continues it); the bar they sit under is 0.95 / 0.90 / 25%
    min_valid_json: float = 0.9
    min_tool_name_accuracy: float = 0.85
    max_calls_error: float = 0.3  # |mean calls - reference mean| / reference mean
    allow_low_quality: bool = False  # go on with a target below the floors anyway


@dataclass
class HeadTrainConfig:
    """Training the EAGLE-3 head (stage `head`)."""

    epochs: int = 6
    lr: float = 8e-5
    batch_size: int = 4
    grad_accum: int = 2
    warmup_ratio: float = 0.02
    max_grad_norm: float = 0.5
    max_seq_len: int = 2048
    save_every: int = 500  # optimizer steps between resumable checkpoints
    heldout_fraction: float = 0.05
    feature_cache: bool = False  # run the target once and train every epoch on stored features
    # a time budget (0 = none): the cosine schedule follows whichever of steps and minutes is
    # further along, and training ends when either runs out
    max_minutes: float = 0.0
    # on a CPU: auto = bf16 autocast where the train probe finds it faster (schemafill/precision.py)
    bf16_autocast_cpu: str = "auto"


@dataclass
class TrainConfig:
    target: TargetTrainConfig = field(default_factory=TargetTrainConfig)
    head: HeadTrainConfig = field(default_factory=HeadTrainConfig)


@dataclass
class EvalConfig:
    """Stage `eval`: every method on the evaluation sets, side by side, and the report."""

    # absent sets are skipped
    datasets: list[str] = field(default_factory=lambda: ["bfcl450", "bfcl450_structured", "glaive650"])
    methods: list[str] = field(default_factory=lambda: ["ar", "eagle3", "toolspec", "ngram", "suffix",
                                                        "parallel_fill", "schemafill"])
    ablations: bool = True  # Table 2: SchemaFill stages A-C too, on bfcl450 (schemafill itself is D)
    limit: int = 0  # requests per dataset, evenly spread over the file (categories stay balanced); 0 = all
    repeats: int = 1  # timed launches per dataset; TPS is reported as mean ± sample std when > 1
    warmup: int = 1  # untimed requests per method and launch (a GPU's kernels and allocator warm up)
    temperature: float = 1.0  # one more launch of the sampled methods at it (Table 6); 0 = none
    sampled_methods: list[str] = field(default_factory=lambda: ["ar", "eagle3", "toolspec", "ngram", "suffix",
                                                                "schemafill"])
    constrained_methods: list[str] = field(default_factory=lambda: ["ar", "eagle3", "schemafill"])  # one more
    # launch with decode.constrain=schema (Table 7: what constraining costs or gains); [] = none


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # wandb | none
    project: str = "schemafill"
    entity: str | None = None
    mode: str = "auto"  # auto = online when an API key is configured, else offline; online | offline | disabled
    dir: str = "."  # W&B writes its run folders under <dir>/wandb
    tags: list[str] = field(default_factory=list)
    # runs of one group are compared together in the W&B UI; a `--multirun` sweep that leaves
    # this unset groups its runs by the sweep's folder (train/run.py)
    group: str | None = None


@dataclass
class PathsConfig:
    artifacts: str = "artifacts"  # every stage's outputs, keyed by stage and target


@dataclass
class PipelineConfig:
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    seed: int = 0
    # recipe tag: continuations, head and eval of one target live side by side in
    # <artifacts>/<stage>/<model>-<tag> (the target itself is shared by every recipe)
    tag: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)

    @property
    def run_name(self) -> str:
        """Folder name of this recipe's continuations, head and eval."""
        return f"{self.model.name}-{self.tag}" if self.tag else self.model.name

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; the stages are {list(STAGES)}")


@dataclass
class InferConfig:
    """``python infer/run.py``: decode one requests file with several methods, side by side."""

    requests: str = MISSING  # a ToolRequest JSONL file (e.g. artifacts/requests/bfcl450.jsonl)
    methods: list[str] = field(default_factory=lambda: ["ar", "eagle3"])
    out: str = MISSING  # folder for metrics.json and outputs/<method>.jsonl
    head: str | None = None  # exported EAGLE-3 head; default: <artifacts>/heads/<model>
    limit: int = 0  # decode only N requests (0 = all)
    sample: str = "spread"  # which N: spread (evenly over the file, so every category shows) | first
    warmup: int = 1  # requests decoded (untimed) per method before timing
    samples: int = 1  # decodes per request, each with its own seed (for temperature > 0)
    repeats: int = 1  # timed passes over the requests (each starts the learning methods afresh), pooled
    interleave: bool = True  # every method decodes a request before the next one (rotating order)
    # requests decoded together, one target forward per round (continuous batching), method by
    # method; TPS is then over the wall time. 1: one request at a time, methods interleaved
    concurrency: int = 1
    device: str = "auto"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)

    def __post_init__(self) -> None:
        # the method names are the registry's (infer/decoders), checked there before any model loads
        if self.samples > 1 and self.decode.temperature == 0:
            raise ValueError("samples > 1 repeats identical greedy decodes: set decode.temperature > 0")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.sample not in ("spread", "first"):
            raise ValueError(f"sample must be spread or first, got {self.sample!r}")


@dataclass
class ServeConfig:
    """``python infer/serve.py``: an OpenAI-compatible chat-completions endpoint."""

    method: str = "schemafill"  # served as model "<model.name>" and "<model.name>:<method>"
    methods: list[str] = field(default_factory=list)  # more methods, each served as "<model.name>:<method>"
    head: str | None = None  # exported EAGLE-3 head; default: <artifacts>/heads/<model>
    host: str = "127.0.0.1"
    port: int = 8000
    # requests decoded together, one target forward per round for all of them (continuous
    # batching: they join and leave between rounds); 8 on 2 CPU cores (docs/benchmarks.md)
    max_batch: int = 8
    # this many more may wait for a place, and a request beyond them is answered 503 at once
    queue_size: int = 8
    # prompt tokens a round may carry while others decode: a long prompt joins in pieces
    prefill_tokens: int = 256
    # MiB of prompt KV kept for later prompts that start the same (system prompt, tool catalog,
    # an agent's earlier turns): they copy it instead of prefilling it again; 0: none kept
    prefix_cache_mb: int = 1024
    warmup: bool = True  # decode one small request per method before accepting any (untimed start-up costs)
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)

    def __post_init__(self) -> None:
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be 0 or more, got {self.queue_size}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be 0 or more, got {self.prefix_cache_mb}")
        if self.max_batch < 1 or self.prefill_tokens < 1:
            raise ValueError(f"max_batch and prefill_tokens must be at least 1, got {self.max_batch} and "
                             f"{self.prefill_tokens}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0-65535, got {self.port}")


def register_configs() -> None:
    """Register the schemas Hydra validates ``conf/config.yaml`` and ``conf/infer.yaml`` against."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)
    ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def to_dataclass(cfg: DictConfig | Any, schema: type = PipelineConfig) -> Any:
    """The composed config as dataclasses (what library code receives)."""
    if isinstance(cfg, schema):
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, schema):  # composed without the schema: validate now
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))
    return obj


def compose_config(config_name: str, overrides: list[str], schema: type) -> Any:
    """``conf/<config_name>.yaml`` with ``overrides``, as its Hydra app would read them, as
    ``schema`` dataclasses: for scripts that drive an entry point without being its Hydra app
    (benchmarks, device checks, behaviour records)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return to_dataclass(compose(config_name=config_name, overrides=overrides), schema)


def to_dict(cfg: Any) -> dict:
    """A plain, JSON-able dict of a dataclass config (for tracking and fingerprints)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
