"""`[train] mode = "grpo"`: group-relative policy optimisation with verifiable rewards.

One optimizer step (every ``ppo_epochs`` steps a new batch is sampled; the steps in between reuse
it, and the clipped ratio keeps them near the policy that sampled it):

    take prompts_per_step prompts (each rank an equal share); sample G completions of each from
        the live weights (trex.rollout; each row's random draws depend on its place in the step,
        not on the rank it lands on, so any number of ranks samples the same completions); score
        them with the reward plug-ins; advantages normalised within each group of G; with
        kl_coef > 0, the frozen reference's log-probs
    for each micro-batch of completions: forward; log-probs of the sampled tokens (fp32);
        old log-probs = these, detached, on the batch's first step (ratio 1), or the sampler's
        (``correction = "bypass"``); the off-policy correction's importance weights and masks against
        the sampler's log-probs; clipped surrogate + kl_coef * k3 KL, aggregated by token_weights over
        the whole step; backward
    metrics: reward mean/std (and per reward), KL, clip fraction, response length, entropy and the
        trainer-vs-sampler log-prob difference on the sampled tokens

With an ``[environment]`` each completion is a multi-turn, tool-using trajectory
(trex.posttrain.environment): the loss reads the model's tokens only, the rewards the whole trajectory.

With ``sampling.asynchronous`` the next ``max_staleness`` batches are sampled in a rollout thread while
steps train (:meth:`GRPOObjective._fill`); a sample whose first token's weights are more than
``max_staleness`` steps old carries no loss and is counted (on_policy.bound_staleness).

The math is in trex.posttrain.grpo_loss; prompts, sampling and rows in trex.posttrain.on_policy.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from trex import logs
from trex.data.loader import Batch
from trex.models.common.heads import Model
from trex.recipe import check_choices, require_positive
from trex.posttrain.grpo_loss import (Aggregation, Correction, ISLevel, group_advantages, policy_loss,
                                      rollout_correction, token_entropy, token_weights)
from trex.posttrain.environment import MultiTurn
from trex.posttrain.objective import (Objective, StepResult, TrainContext, backward_micro_batches, load_frozen,
                                      next_token_logprobs,
                                      token_logprobs)
from trex.posttrain.on_policy import (PromptOrder, Rollouts, bound_staleness, completions, exact_match_by_set,
                                      generator_state, lay_out, load_eval_sets, load_prompts, make_engine,
                                      probe_batch, rank_uniforms, sampling_params, set_generator_state, sync_engine)
from trex.posttrain.rewards import RewardSet
from trex.posttrain.rollout_parity import N_MAXIMA, N_SUMS, parity_metrics, parity_sums


@dataclass
class GRPOSection:
    """GRPO with verifiable rewards (trex.posttrain.grpo)."""
    prompts: list[str] = field(default_factory=list)
    """Prompt files: JSONL records {"prompt": str | "messages": [...], "answer": ...}."""
    eval_prompts: list[str] = field(default_factory=list)
    """Held-out prompt files (same format): greedy exact match and reward at each evaluation."""
    eval_limit: int = 0
    """Held-out prompts evaluated (0: all)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step over all ranks (each rank takes an equal share)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are normalised within each group."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions: built-in names, trex.rewards entry points or module:function paths."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (empty: all 1)."""
    scale_by_std: bool = True
    """Divide advantages by the group's reward std (False: Dr. GRPO)."""
    eps_low: float = 0.2
    """Lower clip of the policy ratio: 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip of the policy ratio: 1 + eps_high (DAPO raises it, e.g. 0.28)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference model (0: no reference is loaded)."""
    reference: str = ""
    """Reference checkpoint directory; empty: a frozen copy of the initial policy."""
    aggregation: Aggregation = "token"
    """token (mean over all tokens) | sequence (mean per completion, then over completions) |
    constant (sum / (max_new_tokens x completions), no length bias)."""
    mask_truncated: bool = False
    """Completions cut at max_new_tokens contribute no loss (they still count in the metrics)."""
    ppo_epochs: int = 1
    """Optimizer steps per sampled batch (> 1: later steps reuse the batch with the clipped ratio)."""
    micro_batch_size: int = 32
    """Completions per training forward."""
    seed: int = 0
    """Seeds the prompt order and the sampler."""
    routing: Literal["recompute", "replay"] = "recompute"
    """MoE routing of the training forward: recompute (the trainer's routers choose) | replay (every token
    takes the experts the sampler chose for it, in every MoE layer, hash layers included: R3; the routing
    weights are still the trainer's router's scores of them)."""
    correction: Correction | Literal["auto"] = "auto"
    """Off-policy correction for the rollout engine's policy (trex.posttrain.grpo_loss): decoupled (the
    trainer's recompute is pi_old, truncated importance weights pi_old / pi_rollout) | bypass (the
    engine's log-probs are pi_old) | none (assume pi_old = pi_rollout) | auto: none with the in-process
    sampler (the trainer's own weights and code: its log-probs differ from the recompute by rounding
    only, which importance weights would turn into gradient noise), decoupled with any other engine."""
    is_level: ISLevel = "token"
    """Importance weights and masks per token, or per completion (sequence: the product of the token
    ratios is truncated, their geometric mean is masked)."""
    is_cap: float = 2.0
    """Truncation C of the decoupled importance weights: min(rho, C)."""
    is_mask_low: float = 0.0
    """Masked IS (IcePop): tokens (completions) whose ratio is below this carry no loss (0: off)."""
    is_mask_high: float = 0.0
    """Masked IS: tokens (completions) whose ratio is above this carry no loss (0: off)."""

    def __post_init__(self) -> None:
        check_choices(self, "grpo")
        require_positive(self, "grpo", ("prompts_per_step", "ppo_epochs", "micro_batch_size", "is_cap"))
        if self.is_mask_low < 0 or self.is_mask_high < 0 or (self.is_mask_high and self.is_mask_high < 1)\
                or self.is_mask_low > 1:
            raise ValueError(f"grpo: is_mask_low must be in [0, 1] and is_mask_high 0 (off) or >= 1, got "
                             f"{self.is_mask_low} and {self.is_mask_high}")
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2, got {self.group_size}")
        if self.eps_low < 0 or self.eps_high < 0 or self.kl_coef < 0:
            raise ValueError("grpo: eps_low, eps_high and kl_coef must be >= 0")


@dataclass
class InFlight:
    """A batch the rollout thread is sampling (asynchronous)."""
    prompts: list                # its prompts, each G times
    result: Future               # -> Samples, or a list of Trajectory with an [environment]
    before: dict                 # the prompt order and generator before it was drawn (a resume draws it again)


@dataclass
class GroupBatch:
    """The sampled batch of one rank and what every step that uses it needs."""
    rollouts: Rollouts
    advantages: torch.Tensor        # fp32 [B]
    loss_mask: torch.Tensor         # bool [B, L]: rollouts.mask without truncated rows if mask_truncated
    ref_logp: torch.Tensor | None   # fp32 [B, L] or None
    old_logp: torch.Tensor          # fp32 [B, L]: filled on the batch's first step (bypass: the engine's)
    is_weights: torch.Tensor | None  # fp32 [B, L]: decoupled importance weights, filled on the first step
    keep: torch.Tensor | None       # bool [B, L]: loss_mask without the masked-IS tokens, filled on the first step
    metrics: dict[str, float]       # reward statistics (global)
    counts: tuple[int, int]         # (completions, tokens) carrying loss over all ranks


class GRPOObjective(Objective):
    def __init__(self, ctx: TrainContext):
        recipe, par = ctx.recipe, ctx.par
        self.ctx, self.cfg, self.sampling = ctx, recipe.grpo, recipe.sampling
        self.thinking = recipe.data.thinking
        if not self.cfg.prompts:
            raise ValueError("grpo.prompts is empty; expected JSONL files of {\"prompt\" | \"messages\", \"answer\"}")
        chat_format = recipe.data.chat_format  # the prompts rendered as the policy's SFT data is
        self.prompts = load_prompts(self.cfg.prompts, ctx.tokenizer, self.thinking, chat_format=chat_format)
        self.eval_sets = load_eval_sets(self.cfg.eval_prompts, ctx.tokenizer, self.thinking, self.cfg.eval_limit,
                                        par.data_world, "grpo", chat_format)
        self.rewards = RewardSet.load(self.cfg.rewards, self.cfg.reward_weights)
        self.order = PromptOrder(len(self.prompts), self.cfg.prompts_per_step, par, self.cfg.seed, "grpo")
        self.generator = torch.Generator().manual_seed(self.cfg.seed)  # alike on every rank: rank_uniforms
        self.reference = load_frozen(self.cfg.reference or ctx.model, ctx) if self.cfg.kl_coef > 0 else None
        self.batch: GroupBatch | None = None
        self.engine = None  # started at the first batch
        if self.sampling.asynchronous and (self.sampling.engine == "in_process" or self.cfg.ppo_epochs != 1):
            raise ValueError('sampling.asynchronous = true needs sampling.engine = "server" or "vllm" and '
                             "grpo.ppo_epochs = 1 (it samples the next batches in the engine's process while this "
                             "one trains)")
        self.inflight: deque[InFlight] = deque()  # asynchronous: the batches being sampled, oldest first
        self.pool: ThreadPoolExecutor | None = None  # their thread: one batch at a time, in order
        self.correction = self.cfg.correction if self.cfg.correction != "auto" else (
            "none" if self.sampling.engine == "in_process" else "decoupled")
        self.signal = [0, 0]  # steps, and steps with a learning signal (a group whose rewards differ)
        self.dropped = 0  # samples dropped as staler than sampling.max_staleness
        self.multiturn = (MultiTurn(recipe.environment, chat_format, self.thinking, ctx.tokenizer, "grpo")
                          if recipe.environment.name else None)

    # ---- sampling and scoring ------------------------------------------------------------------------
    def _collect(self, model: Model, step: int) -> GroupBatch:
        ctx, cfg, G = self.ctx, self.cfg, self.cfg.group_size
        device = ctx.dev.torch_device
        if self.engine is None:
            self.engine = make_engine(self.sampling, model, ctx.dev, ctx.policy)
        probe = [p.ids for p in self.prompts[:self.sampling.probe_rows]]
        params = sampling_params(self.sampling, ctx.tokenizer)
        if self.inflight:  # asynchronous: the oldest batch in flight, sampled while earlier steps trained
            flight = self.inflight.popleft()
            chosen = flight.prompts
            if self.multiturn is None:  # one generate call: the sync comes after it
                samples = flight.result.result()
            # trajectories still going take the sync between two rounds and go on under the new weights
            engine_metrics = sync_engine(self.engine, model, step, probe, self.sampling, ctx.par, step + 1)
            if self.multiturn is not None:
                trajs = flight.result.result()
                rollouts = self.multiturn.lay_out(model, trajs, device)
        else:
            engine_metrics = sync_engine(self.engine, model, step, probe, self.sampling, ctx.par, step + 1)
            chosen, uniforms = self._draw()
            if self.multiturn is not None:
                rollouts, trajs = self.multiturn.roll_out(model, self.engine, chosen, params, uniforms,
                                                          self.sampling.batch_size, device, cfg.routing == "replay")
            else:
                samples = self.engine.generate([p.ids for p in chosen], params, uniforms, self.sampling.batch_size,
                                               cfg.routing == "replay")
        if self.sampling.asynchronous:
            self._fill(params, step, device)
        if self.multiturn is None:
            rollouts = lay_out(model, samples, ctx.tokenizer, device)
            scored = [self.rewards.score(c) for c in completions(rollouts, chosen, self.thinking)]
        else:
            scored = [self.rewards.score(c) for c in self.multiturn.completions(trajs)]
            engine_metrics.update(self.multiturn.metrics(trajs, ctx.par, device))
        engine_metrics["engine/lag"] = float(step - rollouts.version)
        # the hard bound: a sample staler than max_staleness (by its first token's version) is never trained
        fresh, staleness = bound_staleness(rollouts, step, self.sampling.max_staleness, ctx.par, device)
        engine_metrics.update(staleness)
        self.dropped += int(staleness["rollout/stale_dropped"])
        rewards = torch.tensor([total for total, _ in scored], dtype=torch.float32)
        advantages = group_advantages(rewards, G, cfg.scale_by_std).to(device)
        loss_mask = rollouts.mask & rollouts.finished[:, None] if cfg.mask_truncated else rollouts.mask
        loss_mask = loss_mask & fresh[:, None]
        ref_logp = None
        if self.reference is not None:
            ref_logp = torch.zeros(rollouts.mask.shape, dtype=torch.float32, device=device)
            with torch.no_grad():
                for s in rollouts.micro_batches(cfg.micro_batch_size):
                    ids, docs = rollouts.input_ids[s], rollouts.doc_ids[s]
                    ref_logp[s] = token_logprobs(self.reference, ids, docs)
        parts = {n: torch.tensor([p[n] for _, p in scored]) for n in self.rewards.names}
        zero_std = rewards.view(-1, G).std(dim=1) == 0
        sums = torch.stack([
            torch.tensor(float(len(rewards))), rewards.sum(), (rewards ** 2).sum(), zero_std.float().sum(),
            torch.tensor(float(len(zero_std))), (loss_mask.any(dim=1)).sum().cpu().float(),
            loss_mask.sum().cpu().float(), *[v.sum() for v in parts.values()]]).double().to(device)
        sums = ctx.par.all_reduce_sum(sums).tolist()
        n, r_sum, r_sq, zero, groups, n_seq, n_tok = sums[:7]
        mean = r_sum / n
        metrics = {"reward_mean": mean, "reward_std": max(r_sq / n - mean * mean, 0.0) ** 0.5,
                   "zero_std_group_frac": zero / groups, **engine_metrics,
                   **{f"reward/{name}": v / n for name, v in zip(parts, sums[7:])}}
        old_logp = (rollouts.sampler_logp.clone() if self.correction == "bypass"
                    else torch.zeros_like(rollouts.sampler_logp))
        is_weights = torch.zeros_like(old_logp) if self.correction == "decoupled" else None
        keep = loss_mask.clone() if self.correction != "none" else None
        return GroupBatch(rollouts, advantages, loss_mask, ref_logp, old_logp, is_weights, keep, metrics,
                          (int(n_seq), int(n_tok)))

    def _fill(self, params, step: int, device: torch.device) -> None:
        """Asynchronous: keep ``max_staleness`` batches in flight (fewer near the last step), each drawn now and
        sampled in the rollout thread while the trainer goes on. The engine is thread-safe (ServerEngine):
        a batch starts under the weights the engine holds then; the one taken at step s trains at step
        s + max_staleness at the latest, so its staleness stays within the bound unless the engine falls
        behind the syncs. A multi-turn batch's later rounds sample under whatever weights the trainer has
        synced meanwhile."""
        replay, size = self.cfg.routing == "replay", self.sampling.batch_size
        self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="trex-rollout")
        while (len(self.inflight) < self.sampling.max_staleness
               and step + 1 + len(self.inflight) < self.ctx.recipe.train.steps):
            before = self._position()
            prompts, uniforms = self._draw()
            result = (self.pool.submit(self.engine.generate, [p.ids for p in prompts], params, uniforms, size, replay)
                      if self.multiturn is None else
                      self.pool.submit(self.multiturn.trajectories, self.engine, prompts, params, uniforms, size,
                                       device, replay))
            self.inflight.append(InFlight(prompts, result, before))

    def _position(self) -> dict:
        """Where the prompt order and the sampler's generator stand (what a resume restores)."""
        return {"order": self.order.state_dict(), "generator": generator_state(self.generator)}

    def _draw(self) -> tuple[list, torch.Tensor]:
        """The next batch's prompts (each G times, prompt-major) and its sampler uniforms."""
        cfg, G = self.cfg, self.cfg.group_size
        chosen = [self.prompts[i] for i in self.order.next() for _ in range(G)]
        if self.multiturn is not None:  # a draw per row, turn and token
            return chosen, self.multiturn.uniforms(self.generator, cfg.prompts_per_step * G,
                                                   self.sampling.max_new_tokens, self.ctx.par)
        return chosen, rank_uniforms(self.generator, cfg.prompts_per_step * G, self.sampling.max_new_tokens, self.ctx.par)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self, model: Model, step: int, scaler) -> StepResult:
        ctx, cfg = self.ctx, self.cfg
        first_use = step % cfg.ppo_epochs == 0
        if first_use:
            self.batch = self._collect(model, step)
        elif self.batch is None:
            raise RuntimeError(f"grpo: step {step} reuses a sampled batch (ppo_epochs = {cfg.ppo_epochs}) "
                               "but none was sampled or restored")
        batch = self.batch
        self.signal[0] += 1
        self.signal[1] += batch.metrics["zero_std_group_frac"] < 1  # read on the host when the batch was scored
        r = batch.rollouts
        device = ctx.dev.torch_device
        n_seq, n_tok = batch.counts
        slices = r.micro_batches(cfg.micro_batch_size)
        sums = torch.zeros(9, dtype=torch.float64, device=device)
        parity = torch.zeros(N_SUMS, dtype=torch.float64, device=device)
        maxima = torch.zeros(N_MAXIMA, dtype=torch.float64, device=device)

        def loss_of(s):
            ids, docs, mask = r.input_ids[s], r.doc_ids[s], r.mask[s]
            out = model(ids, doc_ids=docs, token_mask=docs != 0, routes=r.routes_of(s))  # left padding: document 0
            logp = next_token_logprobs(out.logits, ids, docs)
            if first_use:
                self._first_use(batch, s, logp.detach())
            loss_mask = batch.loss_mask[s] if batch.keep is None else batch.keep[s]
            weights = token_weights(batch.loss_mask[s], cfg.aggregation, n_seq, n_tok, self._max_len())
            is_weights = None if batch.is_weights is None else batch.is_weights[s]
            pl = policy_loss(logp, batch.old_logp[s], batch.advantages[s], weights, loss_mask, cfg.eps_low,
                             cfg.eps_high, batch.ref_logp[s] if batch.ref_logp is not None else None, cfg.kl_coef,
                             is_weights)
            counted = batch.loss_mask[s]
            is_sum = (is_weights * counted).sum() if is_weights is not None else counted.sum()
            capped = ((is_weights >= cfg.is_cap) & counted).sum() if is_weights is not None else is_sum * 0
            sums.add_(torch.stack([pl.loss.detach(), pl.kl_sum, pl.clipped, token_entropy(out.logits[mask]).sum(),
                                   mask.sum(), (docs != 0).sum(), is_sum, capped,
                                   (counted & ~loss_mask).sum()]).double())
            part, most = parity_sums(logp, r.sampler_logp[s], mask)
            parity.add_(part)
            torch.maximum(maxima, most, out=maxima)
            return pl.loss, out

        aux = backward_micro_batches(model, slices, loss_of, scaler, ctx.recipe.train,
                                       ctx.par.summed_ranks)
        sums = ctx.par.all_reduce_sum(torch.cat([sums, parity]))
        if ctx.par.distributed:
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
        totals = sums.tolist()
        loss, kl, clipped, entropy, tokens, seen, is_sum, capped, masked = totals[:9]
        rows = ctx.par.all_reduce_sum(torch.tensor([float(r.input_ids.shape[0]), float((~r.finished).sum())],
                                                   dtype=torch.float64, device=device)).tolist()
        metrics = {**batch.metrics, "kl": kl / max(tokens, 1), "clip_frac": clipped / max(tokens, 1),
                   "entropy": entropy / max(tokens, 1), "response_length": tokens / rows[0],
                   "truncated_frac": rows[1] / rows[0], **parity_metrics(totals[9:], maxima.tolist()),
                   "rollout_corr/is_mean": is_sum / max(n_tok, 1), "rollout_corr/is_capped_frac": capped / max(n_tok, 1),
                   "rollout_corr/masked_frac": masked / max(n_tok, 1),
                   "ppo_epoch": float(step % cfg.ppo_epochs)}
        return StepResult(loss=sums.new_tensor(loss).float(), tokens=int(seen), metrics=metrics, moe_stats=aux.moe_stats,
                          indexer_loss=aux.indexer_loss)

    def _max_len(self) -> int:
        """The longest completion (``constant`` aggregation's length): a trajectory's token budget with an
        environment."""
        return self.ctx.recipe.environment.max_tokens if self.multiturn is not None else self.sampling.max_new_tokens

    def _first_use(self, batch: GroupBatch, s: slice, logp: torch.Tensor) -> None:
        """On the batch's first step: the trainer's log-probs of rows ``s`` fill old_logp (not in bypass,
        where the engine's are pi_old), the decoupled importance weights and the masked-IS keep mask."""
        cfg = self.cfg
        if self.correction != "bypass":
            batch.old_logp[s] = logp
        if self.correction == "none":
            return
        weights, keep = rollout_correction(logp, batch.rollouts.sampler_logp[s], batch.loss_mask[s], cfg.is_level,
                                           cfg.is_cap, cfg.is_mask_low, cfg.is_mask_high or float("inf"))
        batch.keep[s] = keep
        if batch.is_weights is not None:
            batch.is_weights[s] = weights

    # ---- evaluation, resume --------------------------------------------------------------------------
    def evaluate(self, model: Model) -> dict[str, float]:
        ctx = self.ctx
        return exact_match_by_set(model, self.eval_sets, ctx.tokenizer, self.thinking, self.sampling, ctx.par,
                                  ctx.dev.torch_device) if self.eval_sets else {}

    def state_dict(self) -> dict:
        if self.inflight:  # the batches in flight are drawn again on resume
            return {**self.inflight[0].before, "signal": list(self.signal), "dropped": self.dropped}
        return {**self._position(),
                "batch": _batch_state(self.batch) if self.batch is not None and self.cfg.ppo_epochs > 1 else None,
                "signal": list(self.signal), "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state["order"])
        self.signal = list(state.get("signal", [0, 0]))  # checkpoints before the count: from the resume on
        self.dropped = int(state.get("dropped", 0))
        set_generator_state(self.generator, state["generator"])
        if state.get("batch") is not None:
            self.batch = _batch_from_state(state["batch"], self.ctx.dev.torch_device)

    def close(self) -> None:
        if self.pool is not None:  # a rollout in flight ends before its engine does
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()

    def _n_eval(self) -> int:
        return sum(len(p) for p in self.eval_sets.values())

    def preflight(self) -> dict:
        return {"prompts": len(self.prompts), "eval_prompts": self._n_eval(), "rewards": self.rewards.names}

    def summary(self) -> dict:
        return {"prompts": len(self.prompts), "eval_prompts": self._n_eval(), "rewards": self.rewards.names,
                "environment": self.ctx.recipe.environment.name or None,
                "prompt_epoch": self.order.epoch, "steps_with_learning_signal": self.signal[1],
                "stale_dropped": self.dropped}

    def warnings(self) -> list[str]:
        steps, with_signal = self.signal
        stale = [] if not self.dropped else [
            f"grpo: {logs.plural(self.dropped, 'sample')} dropped untrained, staler than sampling.max_staleness = "
            f"{self.sampling.max_staleness} (rollout/stale_dropped in metrics.jsonl): the rollout engine fell "
            "behind the trainer; raise max_staleness or give the engine more devices"]
        if not steps or with_signal:
            return stale
        G = self.cfg.group_size
        return [f"grpo: no step had a learning signal: in all {logs.plural(steps, 'step')} every group of {G} "
                "completions got equal rewards (zero_std_group_frac 1 in metrics.jsonl), so every advantage was 0 "
                f"and the rewards taught nothing; check the reward function ({', '.join(self.rewards.names)}) on "
                f"a few completions, or make rewards differ within a group: raise grpo.group_size (now {G}) or "
                f"sampling.temperature (now {self.sampling.temperature:g}), or use prompts the model sometimes "
                "but not always solves", *stale]

    def probe_batch(self, rows: int) -> Batch:
        return probe_batch(self.prompts, rows, self.ctx.recipe.data.seq_len, self.ctx.tokenizer.pad_id)


_TENSORS = ("advantages", "loss_mask", "ref_logp", "old_logp", "is_weights", "keep")
_ROLLOUT_TENSORS = ("input_ids", "doc_ids", "mask", "sampler_logp", "finished")


def _batch_state(b: GroupBatch) -> dict:
    """A batch reused by later ppo epochs, as JSON (restored when resuming mid-cycle)."""
    def enc(t):
        return None if t is None else {"dtype": str(t.dtype).removeprefix("torch."), "data": t.tolist()}
    routes = b.rollouts.routes
    return {**{k: enc(getattr(b, k)) for k in _TENSORS}, **{k: enc(getattr(b.rollouts, k)) for k in _ROLLOUT_TENSORS},
            "routes": None if routes is None else {k: enc(v) for k, v in routes.items()},
            "versions": enc(b.rollouts.versions),
            "texts": b.rollouts.texts, "metrics": b.metrics, "counts": list(b.counts)}


def _batch_from_state(d: dict, device: torch.device) -> GroupBatch:
    def dec(v):
        return None if v is None else torch.tensor(v["data"], dtype=getattr(torch, v["dtype"]), device=device)
    routes = d.get("routes")
    rollouts = Rollouts(*[dec(d[k]) for k in _ROLLOUT_TENSORS], texts=d["texts"],
                        routes=None if routes is None else {k: dec(v) for k, v in routes.items()},
                        versions=dec(d.get("versions")))
    return GroupBatch(rollouts, *[dec(d.get(k)) for k in _TENSORS], metrics=d["metrics"], counts=tuple(d["counts"]))


def build(ctx: TrainContext) -> GRPOObjective:
    return GRPOObjective(ctx)
