"""What the on-policy modes (grpo, distill) share: prompt sets, their resumable order, sampling
from the live policy, the training rows of prompt + completion, and the held-out greedy check.

Rows are laid out as the sampler lays them out (trex.rollout.sampling.left_pad): right-aligned,
the padding its own document, so the trainer's forward sees each completion in the same context
the sampler did. ``mask[b, t]`` marks positions t whose next token ``input_ids[b, t+1]`` is a
completion token the engine sampled (a multi-turn row's tool outputs are not): the positions whose
log-probabilities the losses use.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from trex.data.chat import RecordError, render_prompt
from trex.data.loader import Batch
from trex.data.packing import IGNORE_INDEX
from trex.data.records import BadRecordError, iter_records
from trex.data.tokenizer import Tokenizer
from trex.logs import plural
from trex.models.registry import shardable_length
from trex.parallel.mesh import Parallel
from trex.posttrain.objective import reshard
from trex.posttrain.rewards import Completion, exact_match
from trex.recipe import check_choices
from trex.rollout import Samples, SamplingParams, sample
from trex.rollout.engine import InProcessEngine, ServerEngine, SyncError, check_parity, parity_probe
from trex.rollout.sampling import left_pad


@dataclass
class SamplingSection:
    """How on-policy modes (grpo, distill) sample completions (trex.rollout.SamplingParams)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 64
    """Longest completion; one cut here is "truncated" (no stop token)."""
    batch_size: int = 64
    """Prompts per generation batch."""
    engine: Literal["in_process", "server", "vllm"] = "in_process"
    """What samples (trex.rollout.engine): in_process (trex's sampler on the training model) | server (the
    same sampler in a process of its own, its weights synced from the trainer before each batch, the
    stand-in for an inference engine: the out-of-process path, its digests and parity gate) | vllm (a
    vLLM server at ``vllm_url``, trex.rollout.vllm_engine; docs/post_training.md)."""
    vllm_url: str = "http://127.0.0.1:8000"
    """The vLLM server (engine = "vllm"), started with VLLM_SERVER_DEV_MODE=1: http://HOST:PORT (or https://);
    a bare HOST:PORT is taken as http:// and recorded so."""
    vllm_transport: Literal["disk", "files", "broadcast"] = "disk"
    """How weights reach vLLM: disk (a checkpoint in the released layout in ``vllm_sync_dir``, reloaded in
    place) | files (vLLM's weight-transfer API with trex's ``trex_files`` engine: buckets of
    ``sync_bucket_mb`` as files in ``vllm_sync_dir``, e.g. /dev/shm on one host) | broadcast (vLLM's
    weight-transfer API with its collective backend, rank 0 broadcasting; CUDA). docs/rollout_engines.md."""
    vllm_sync_dir: str = ""
    """A directory the trainer's rank 0 and the vLLM server both see (the disk transport)."""
    engine_device: str = ""
    """The engine process's device (cpu, cuda:1 ...); empty: the trainer's device."""
    engine_dtype: str = ""
    """The engine's weights' dtype (float32, bfloat16); empty: the trainer's compute dtype."""
    sync_bucket_mb: int = 64
    """Weight-sync bucket size: tensors sent per message (MiB)."""
    sync_quantize: Literal["none", "fp8", "fp8+fp4experts"] = "none"
    """Re-quantise what a sync sends to the served FP8 (block-scaled linears) and FP4 routed experts, by the
    export's codec (as NeMo RL refits vLLM's FP8 weights); the engine then serves the rounded weights and
    the parity probe measures the rounding (set ``parity_bound`` for it)."""
    parity_bound: float = 1e-3
    """The gate after each weight sync: the engine's and the trainer's log-probs of a fixed probe batch (the
    first ``probe_rows`` prompts) may differ by at most this mean k3 KL, else the run stops naming the step."""
    probe_rows: int = 4
    """Prompts in the parity probe."""
    asynchronous: bool = False
    """Off-policy by a bounded lag (grpo; the server or vllm engine): while step k trains, the engine samples the next
    ``max_staleness`` batches in a rollout thread, each with the weights it holds when the batch starts; each
    batch records its weight-version lag (``engine/lag``) and the decoupled correction weighs the lag's policy
    change. With an [environment] a trajectory in flight across a weight sync goes on under the new weights
    (each token keeps its version). A resumed run samples its first batch anew."""
    max_staleness: int = 1
    """Asynchronous: the most optimizer steps a sample may train after the weights that sampled its first
    token; staler samples are dropped (no loss) and counted (``rollout/stale_dropped``, summary.json)."""

    def __post_init__(self) -> None:
        check_choices(self, "sampling")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("sampling: expected temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1, "
                             "batch_size >= 1")
        if self.max_staleness < 1:
            raise ValueError(f"sampling.max_staleness must be >= 1 (an asynchronous sample is at least one step "
                             f"stale), got {self.max_staleness}")
        if self.max_staleness != 1 and not self.asynchronous:
            raise ValueError(f"sampling.max_staleness = {self.max_staleness} bounds asynchronous rollouts only; "
                             "expected sampling.asynchronous = true with it")
        if self.sync_bucket_mb < 1 or self.probe_rows < 1 or self.parity_bound < 0:
            raise ValueError("sampling: expected sync_bucket_mb >= 1, probe_rows >= 1 and parity_bound >= 0")
        from trex.rollout.vllm_engine import server_url

        self.vllm_url = server_url(self.vllm_url)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    """The rendered generation prompt in the recipe's ``data.chat_format``, tokenized (V4: ends with
    <｜Assistant｜></think>, or <think> when thinking; V3: <｜Assistant｜>, or R1's <think> and a newline)."""
    record: dict
    """The JSONL record it came from (``answer`` and anything a reward needs)."""


def load_prompts(paths: list[str], tokenizer: Tokenizer, thinking: bool, limit: int = 0,
                 chat_format: str = "deepseek-v4") -> list[Prompt]:
    """Prompts of JSONL/Parquet records ``{"prompt": str}`` (one user turn) or ``{"messages": [...]}``
    (a conversation ending with a user or tool message), each as :func:`record_prompt` renders it; at most
    ``limit`` (0: all)."""
    prompts = []
    for rec in iter_records(paths):
        prompts.append(record_prompt(rec, tokenizer, thinking, chat_format))
        if limit and len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"prompt files {paths} hold no records")
    return prompts


def record_prompt(rec, tokenizer: Tokenizer, thinking: bool, chat_format: str = "deepseek-v4") -> Prompt:
    """One record (trex.data.records.Record) as a prompt, the one home of every prompt option's format:
    ``{"prompt": str}`` (one user turn) or ``{"messages": [...]}`` (a conversation ending with a user or tool
    message), rendered as ``chat_format``'s generation prompt (trex.data.chat: deepseek-v4, deepseek-v3,
    deepseek-v3.1), as the SFT data of that format renders the turns the model learnt to continue.

    An SFT record (messages ending with an assistant turn) is a prompt too: the conversation before
    that turn, with the turn's content as the ``answer`` unless the record has one. BadRecordError
    (``path:line``) for a record that is none of these."""
    data = rec.data
    if isinstance(data, RecordError):
        raise BadRecordError(rec.path, rec.line, data.reason, data.detail)
    if isinstance(data.get("messages"), list):
        messages = data["messages"]
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            data = {"answer": messages[-1].get("content"), **data}
            messages = messages[:-1]
    elif isinstance(data.get("prompt"), str):
        messages = [{"role": "user", "content": data["prompt"]}]
    else:
        raise BadRecordError(rec.path, rec.line, "no_prompt",
                             'expected a "prompt" string or a "messages" list ending with a user message')
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") not in ("user", "tool"):
        raise BadRecordError(rec.path, rec.line, "no_prompt",
                             "messages must end with a user or tool message (or one assistant turn after it)")
    try:
        text = render_prompt(messages, thinking=thinking, chat_format=chat_format)
    except RecordError as e:
        raise BadRecordError(rec.path, rec.line, e.reason, e.detail) from None
    return Prompt(tokenizer.encode(text).tolist(), data)


def load_eval_sets(paths: list[str], tokenizer: Tokenizer, thinking: bool, limit: int, world_size: int,
                   where: str, chat_format: str = "deepseek-v4") -> dict[str, list[Prompt]]:
    """Held-out prompts per file, keyed by the file's stem (``_<index>`` added on a repeat), at most
    ``limit`` in all (0: all); each set must give every rank at least one prompt."""
    sets: dict[str, list[Prompt]] = {}
    left = limit
    for path in paths:
        if limit and left <= 0:
            break
        prompts = load_prompts([path], tokenizer, thinking, left if limit else 0, chat_format)
        left -= len(prompts)
        name = os.path.splitext(os.path.basename(path))[0]
        name = f"{name}_{len(sets)}" if name in sets else name
        if len(prompts) < world_size:
            raise ValueError(f"{where}.eval_prompts: {path} gives {plural(len(prompts), 'prompt')} for "
                             f"{plural(world_size, 'rank')}")
        sets[name] = prompts
    return sets


class PromptOrder:
    """Each epoch a permutation of the prompts seeded with (seed, epoch); every step takes the next
    ``per_step`` of it (the remainder of an epoch is dropped) and rank r gets the r-th equal block.
    The position is all that resume needs."""

    def __init__(self, n_prompts: int, per_step: int, par: Parallel, seed: int, where: str):
        if per_step % par.data_world:
            raise ValueError(f"{where}.prompts_per_step = {per_step} is not divisible by the {par.data_world} "
                             "data-parallel ranks")
        if per_step > n_prompts:
            raise ValueError(f"{where}.prompts_per_step = {per_step} exceeds the {n_prompts} prompts")
        self.n, self.per_step, self.par, self.seed = n_prompts, per_step, par, seed
        self.epoch, self.pos = 0, 0

    def next(self) -> list[int]:
        """This rank's prompt indices for the next step."""
        if self.pos + self.per_step > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        step = order[self.pos:self.pos + self.per_step]
        self.pos += self.per_step
        share = self.per_step // self.par.data_world
        return step[self.par.data_rank * share:(self.par.data_rank + 1) * share].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def generator_state(g: torch.Generator) -> str:
    """A CPU generator's state as text (objective state is JSON)."""
    return base64.b64encode(g.get_state().numpy().tobytes()).decode("ascii")


def set_generator_state(g: torch.Generator, text: str) -> None:
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def rank_generator(seed: int, par: Parallel) -> torch.Generator:
    """The sampler's CPU generator: seeded per data-parallel rank, so those draw different samples (and the
    ranks of a context-parallel group, which share their rows, the same)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + par.data_rank)


def rank_uniforms(generator: torch.Generator, rows: int, max_new_tokens: int, par: Parallel) -> torch.Tensor:
    """The sampler's draws for one step: ``[rows, max_new_tokens]`` uniforms for the step's rows over
    all ranks, drawn alike on every rank from a ``generator`` seeded alike, of which this rank keeps
    its equal block of rows (``[rows / data_world, max_new_tokens]``). A row's completion then
    depends only on its place in the step, not on how the step is split over ranks."""
    every = torch.rand(rows, max_new_tokens, generator=generator)
    share = rows // par.data_world
    return every[par.data_rank * share:(par.data_rank + 1) * share]


@dataclass
class Rollouts:
    """Prompt + completion rows of one step on one rank (B rows, L tokens)."""
    input_ids: torch.Tensor    # long [B, L], right-aligned, padding is document 0
    doc_ids: torch.Tensor      # long [B, L]
    mask: torch.Tensor         # bool [B, L]: the next token is a completion token the engine sampled (not
    # a tool output a multi-turn rollout appended): the positions that carry loss
    sampler_logp: torch.Tensor  # fp32 [B, L]: the sampler's log p of that next token (0 off the mask)
    finished: torch.Tensor     # bool [B]: a stop token ended the completion
    texts: list[str]           # decoded completions (special tokens included)
    routes: dict[str, torch.Tensor] | None = None  # per MoE layer long [B, L, k]: the sampler's experts of
    # each input token (routing replay); -1 where it fed none (padding, the last token)
    version: int = -1  # the weight version that sampled the rows (a rollout engine's)
    versions: torch.Tensor | None = None  # multi-turn: long [B, L], the weight version that sampled the next
    # token (-1 off the mask: tool tokens, the prompt, padding)

    def token_versions(self) -> torch.Tensor:
        """long [B, L]: the weight version that sampled each position's next token (``versions``, or
        ``version`` on the mask of a single-turn batch), -1 off the mask."""
        if self.versions is not None:
            return self.versions
        return torch.where(self.mask, self.version, -1)

    def first_versions(self) -> torch.Tensor:
        """long [B]: the weight version of each row's first sampled token (``version`` for a row with none)."""
        versions = self.token_versions()
        first = (self.mask.cumsum(dim=1) == 1) & self.mask
        return torch.where(self.mask.any(dim=1), (versions * first).sum(dim=1), self.version)

    def routes_of(self, rows: slice) -> dict[str, torch.Tensor] | None:
        """The routes of ``rows``, for a training forward's ``routes`` (None without routing replay)."""
        return None if self.routes is None else {k: v[rows] for k, v in self.routes.items()}

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def micro_batches(self, size: int) -> list[slice]:
        """Row slices of at most ``size`` rows (every rank has the same number of rows, so the same
        number of micro-batches: FSDP's collectives stay in step)."""
        return [slice(i, i + size) for i in range(0, self.input_ids.shape[0], size)]


def sampling_params(section, tokenizer: Tokenizer, greedy: bool = False) -> SamplingParams:
    """The [sampling] section as SamplingParams (EOS stops); ``greedy``: temperature 0."""
    return SamplingParams(temperature=0.0 if greedy else section.temperature, top_p=section.top_p,
                          max_new_tokens=section.max_new_tokens, stop_ids=(tokenizer.eos_id,))


def roll_out(model, prompts: list[list[int]], params: SamplingParams, tokenizer: Tokenizer,
             generator: torch.Generator | None, batch_size: int, device: torch.device,
             uniforms: torch.Tensor | None = None, engine=None, record_routes: bool = False) -> Rollouts:
    """Sample a completion per prompt from the live ``model``, or from ``engine`` (a trex.rollout.engine
    engine; ``uniforms``: see trex.rollout.sample), and lay the rows out for training; ``record_routes``:
    with the sampler's experts of every token (routing replay)."""
    samples: Samples = (engine.generate(prompts, params, uniforms, batch_size, record_routes) if engine is not None
                        else sample(model, prompts, params, tokenizer.pad_id, generator=generator,
                                    batch_size=batch_size, uniforms=uniforms, record_routes=record_routes))
    return lay_out(model, samples, tokenizer, device)


def lay_out(model, samples: Samples, tokenizer: Tokenizer, device: torch.device) -> Rollouts:
    """Sampled completions as training rows (the sampler's layout, padded to a length that splits)."""
    reshard(model)  # FSDP2 leaves the root gathered after no-grad forwards; the next backward needs it sharded
    rows = [p + c for p, c in zip(samples.prompt_ids, samples.completion_ids)]
    # under context parallelism the rows must split into the group's shards: padded to such a length
    shard = getattr(model, "sequence_shard", None)
    width = shardable_length(model.cfg, max(map(len, rows)), shard.size if shard is not None else 1)
    ids, docs = left_pad(rows, tokenizer.pad_id, device, width)
    width = ids.shape[1]
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    sampler_logp = torch.zeros(ids.shape, dtype=torch.float32)
    versions = None if samples.token_versions is None else torch.full(ids.shape, -1, dtype=torch.long)
    for i, (c, lp) in enumerate(zip(samples.completion_ids, samples.logprobs)):
        if c:
            span = slice(width - 1 - len(c), width - 1)
            mask[i, span] = True if samples.sampled is None else torch.tensor(samples.sampled[i], dtype=torch.bool)
            sampler_logp[i, span] = torch.tensor(lp, dtype=torch.float32)
            if versions is not None:
                versions[i, span] = torch.tensor(samples.token_versions[i], dtype=torch.long)
    texts = [tokenizer.decode(c) for c in samples.completion_ids]
    routes = None
    if samples.routes is not None:  # right-aligned as the rows: row i's fed tokens end one before its last
        routes = {}
        for name in samples.routes[0]:
            k = samples.routes[0][name].shape[-1]
            laid = torch.full((len(rows), width, k), -1, dtype=torch.long)
            for i, (row, r) in enumerate(zip(rows, samples.routes)):
                laid[i, width - len(row):width - 1] = r[name]
            routes[name] = laid.to(device)
    return Rollouts(ids, docs, mask.to(device), sampler_logp.to(device),
                    torch.tensor(samples.finished, dtype=torch.bool, device=device), texts, routes, samples.version,
                    None if versions is None else versions.to(device))


def make_engine(section: SamplingSection, model, dev, policy):
    """The rollout engine ``section.engine`` names, for the trainer's ``model`` on ``dev`` (an in-process one
    reads the live weights; a server gets them from :func:`sync_engine`)."""
    if section.engine == "in_process":
        return InProcessEngine(model)
    quantize = None if section.sync_quantize == "none" else section.sync_quantize
    if section.engine == "vllm":
        from trex.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(section.vllm_url, section.vllm_transport, section.vllm_sync_dir, quantize,
                            bucket_bytes=section.sync_bucket_mb << 20)
        engine.check(model)  # reachable, and serving the trainer's architecture
        return engine
    hasher = getattr(model, "engram_hasher", None)
    token_map = None if hasher is None else (hasher.token_map.tolist(), hasher.compressed_vocab)
    dtype = section.engine_dtype or str(policy.compute_dtype).removeprefix("torch.")
    return ServerEngine(model.cfg.to_hf_dict(), dtype=dtype, device=section.engine_device or str(dev.torch_device),
                        bucket_bytes=section.sync_bucket_mb << 20, engram_token_map=token_map,
                        quantize=quantize)


def sync_engine(engine, model, version: int, probe: list[list[int]], section: SamplingSection, par: Parallel,
                step: int) -> dict[str, float]:
    """Bring the trainer's weights to ``engine`` as ``version`` and gate on the parity probe (every rank its
    own engine, every rank the same verdict: a failure on one stops all, in one line); the probe's
    measures as metrics. An in-process engine only takes the version."""
    if isinstance(engine, InProcessEngine):
        engine.sync(model, version)
        return {}
    error = ""
    try:
        engine.sync(model, version)
    except SyncError as e:
        error = str(e)
    device = model.embed.weight.device
    failed = par.all_reduce_sum(torch.tensor([float(bool(error))], dtype=torch.float64, device=device)).item()
    if failed:
        raise SyncError(f"step {step}: {error}" if error else f"step {step}: weight sync v{version} failed on "
                        f"{int(failed)} other rank(s)' rollout engine")
    measures = parity_probe(engine, model, probe).to(device)
    if par.distributed:
        torch.distributed.all_reduce(measures, op=torch.distributed.ReduceOp.MAX)
    reshard(model)
    return {**check_parity(measures.tolist(), section.parity_bound, step, version), "engine/version": float(version)}


def bound_staleness(rollouts: Rollouts, version: int, max_staleness: int, par: Parallel,
                    device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """The hard staleness bound on rows about to train at weight ``version``: a row's staleness is
    ``version`` minus the version of its first sampled token; rows staler than ``max_staleness`` are
    dropped. Returns keep (bool [B]) and, over all ranks, the histogram ``rollout/staleness_<k>`` (rows of
    staleness k = 0 .. max_staleness), ``rollout/stale_dropped`` (rows dropped) and
    ``rollout/older_token_share`` (of the kept rows' sampled tokens, the share sampled by a version older
    than ``version``: 1 for a one-step-stale single-turn batch, less where a trajectory went on under newer
    weights)."""
    staleness = version - rollouts.first_versions()
    keep = staleness <= max_staleness
    tokens = rollouts.mask & keep[:, None]
    older = tokens & (rollouts.token_versions() < version)
    hist = [(staleness == k).sum() for k in range(max_staleness + 1)]
    sums = torch.stack([*hist, (~keep).sum(), older.sum(), tokens.sum()]).double().to(device)
    *counts, dropped, n_older, n_tokens = par.all_reduce_sum(sums).tolist()
    return keep, {**{f"rollout/staleness_{k}": c for k, c in enumerate(counts)}, "rollout/stale_dropped": dropped,
                  "rollout/older_token_share": n_older / max(n_tokens, 1.0)}


def completions(rollouts: Rollouts, prompts: list[Prompt], thinking: bool) -> list[Completion]:
    """The rows as reward inputs (prompts[i] is row i's prompt)."""
    return [Completion(text, p.record, thinking, bool(f))
            for text, p, f in zip(rollouts.texts, prompts, rollouts.finished.tolist())]


def greedy_exact_match(model, prompts: list[Prompt], tokenizer: Tokenizer, thinking: bool, section,
                       par: Parallel, device: torch.device) -> float:
    """Fraction of held-out prompts (every rank a share) whose greedy answer equals ``answer``."""
    mine = prompts[par.data_rank::par.data_world]  # non-empty: the objectives check len(prompts) >= data_world
    rolled = roll_out(model, [p.ids for p in mine], sampling_params(section, tokenizer, greedy=True), tokenizer,
                      None, section.batch_size, device)
    correct = sum(exact_match(c) for c in completions(rolled, mine, thinking))
    totals = par.all_reduce_sum(torch.tensor([correct, float(len(mine))], dtype=torch.float64, device=device))
    return float(totals[0] / totals[1].clamp(min=1))


def exact_match_by_set(model, sets: dict[str, list[Prompt]], tokenizer: Tokenizer, thinking: bool, section,
                       par: Parallel, device: torch.device) -> dict[str, float]:
    """``eval_exact_match`` over all held-out prompts and, with several files,
    ``eval_exact_match/<name>`` per file (`greedy_exact_match` of each)."""
    per = {name: greedy_exact_match(model, prompts, tokenizer, thinking, section, par, device)
           for name, prompts in sets.items()}
    total = sum(len(p) for p in sets.values())
    metrics = {"eval_exact_match": sum(per[n] * len(p) for n, p in sets.items()) / max(total, 1)}
    if len(sets) > 1:
        metrics.update({f"eval_exact_match/{name}": v for name, v in per.items()})
    return metrics


def probe_batch(prompts: list[Prompt], rows: int, seq_len: int, pad_id: int) -> Batch:
    """The fidelity probe of an on-policy run: the first ``rows`` prompts, cut or padded to
    ``seq_len``, with next-token labels on the prompt tokens."""
    ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    docs = torch.zeros((rows, seq_len), dtype=torch.long)
    for i, p in enumerate(prompts[:rows]):
        n = min(len(p.ids), seq_len)
        ids[i, :n] = labels[i, :n] = torch.tensor(p.ids[:n])
        docs[i, :n] = 1
    n_loss = int(((labels[:, 1:] != IGNORE_INDEX) & (docs[:, 1:] == docs[:, :-1])).sum())
    return Batch(ids, labels, docs, n_loss, int((docs != 0).sum()), docs != 0)
